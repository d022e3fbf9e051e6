"""
Which Linear, Embedding and LayerNorm classes a model is built with.

model.py reads `config.Linear`, `config.Embedding` and `config.LayerNorm` when a
module is constructed, so wrapping construction in `set_contextual_config` swaps
every layer of that kind:

    with set_contextual_config(**layer_classes(linearclass='gns', lnclass='shim')):
        model = GPT(GPTConfig(...))

LAYER_CLASSES is the one registry from the names users type (`--linearclass=gns`)
to classes; train.py, the tests and the benchmarks all look names up through
`layer_classes`. Entries are "module:Class" strings resolved on first use, so
importing this file imports neither buffered.py nor Triton.
"""

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass
class LayerConfig:
    Linear: Any = nn.Linear
    Embedding: Any = nn.Embedding
    LayerNorm: Any = nn.LayerNorm
    RMSNorm: Any = nn.RMSNorm


config = LayerConfig()

LAYER_CLASSES = {
    "Linear": {
        "nn": "torch.nn:Linear",
        "shim": "buffered:PEGradNormShimLinear",
        "gns": "buffered:PEGradNormLinear",
        "fused": "fused_gns:PEGradNormFusedLinear",
        "sogns": "sogns:SOGNSLinear",  # approximate norms only (sogns.py), logged under train/sogns/
        "gns+sogns": "sogns:ExactAndSOGNSLinear",  # exact and approximate on the same steps
    },
    "Embedding": {
        "nn": "torch.nn:Embedding",
        "shim": "buffered:PEGradNormShimEmbedding",
        "gns": "buffered:PEGradNormEmbedding",
        "fused": "buffered:PEGradNormEmbedding",  # no kernel: embedding grads are a scatter-add already
    },
    "LayerNorm": {
        "nn": "torch.nn:LayerNorm",
        "shim": "buffered:PEGradNormSeparatedLayerNorm",
        "gns": "buffered:PEGradNormLayerNorm",
        "fused": "fused_gns:PEGradNormFusedLayerNorm",
    },
    "RMSNorm": {  # not built by model.py; `convert` swaps torch.nn.RMSNorm (with a weight) by lnclass
        "nn": "torch.nn:RMSNorm",
        "shim": "buffered:PEGradNormRMSNorm",
        "gns": "buffered:PEGradNormRMSNorm",
        "fused": "fused_gns:PEGradNormFusedRMSNorm",
    },
}
# the config key users set for each kind (train.py's --linearclass etc.)
CONFIG_KEYS = {"Linear": "linearclass", "Embedding": "embeddingclass", "LayerNorm": "lnclass", "RMSNorm": "lnclass"}


def get_layer_class(kind, name):
    """The class registered as `name` for `kind` ("Linear", "Embedding" or "LayerNorm")."""
    if kind not in LAYER_CLASSES:
        raise ValueError(f"unknown layer kind {kind!r}; choose from {sorted(LAYER_CLASSES)}")
    choices = LAYER_CLASSES[kind]
    if name not in choices:
        raise ValueError(f"unknown {CONFIG_KEYS[kind]} {name!r}; choose from {sorted(choices)}")
    module_name, class_name = choices[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def layer_classes(linearclass="nn", embeddingclass="nn", lnclass="nn"):
    """Keyword arguments for `set_contextual_config` from the three config names."""
    return dict(
        Linear=get_layer_class("Linear", linearclass),
        Embedding=get_layer_class("Embedding", embeddingclass),
        LayerNorm=get_layer_class("LayerNorm", lnclass),
    )


def tracks_per_example_norms(linearclass="nn", embeddingclass="nn", lnclass="nn"):
    """True when any of the three choices records per-example norms."""
    return any(name != "nn" for name in (linearclass, embeddingclass, lnclass))


@contextlib.contextmanager
def set_contextual_config(**classes):
    """Build modules with these layer classes inside the `with` block, restoring the old ones after."""
    unknown = set(classes) - set(LAYER_CLASSES)
    if unknown:
        raise ValueError(f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(LAYER_CLASSES)}")
    previous = {kind: getattr(config, kind) for kind in classes}
    for kind, cls in classes.items():
        setattr(config, kind, cls)
    try:
        yield config
    finally:
        for kind, cls in previous.items():
            setattr(config, kind, cls)


# -----------------------------------------------------------------------------
# converting a model that was built elsewhere

def _convertible(module, kind):
    """None if `module` (exactly of torch's `kind` class) can be swapped, else the reason it cannot."""
    if kind == "Embedding":
        plain = (module.padding_idx is None and module.max_norm is None and not module.scale_grad_by_freq
                 and not module.sparse)
        return None if plain else "nn.Embedding with padding_idx, max_norm, scale_grad_by_freq or sparse"
    if kind in ("LayerNorm", "RMSNorm") and len(module.normalized_shape) != 1:
        return f"{kind} over {len(module.normalized_shape)} dims (per-example norm layers normalise the last dim)"
    return None


def _swap(module, kind, cls):
    """A `cls` layer sharing `module`'s Parameter objects (so ties, devices, dtypes and optimizers carry over)."""
    if kind == "Linear":
        new = cls(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    elif kind == "Embedding":
        new = cls(module.num_embeddings, module.embedding_dim, device="meta")
    elif kind == "LayerNorm":
        new = cls(module.normalized_shape[0], bias=module.bias is not None, eps=module.eps, device="meta")
    else:  # RMSNorm: torch's eps=None means the input dtype's machine epsilon
        eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
        new = cls(module.normalized_shape[0], eps=eps, device="meta")
    for name, param in module.named_parameters(recurse=False):
        setattr(new, name, param)
    device = next(module.parameters()).device
    for name, buffer in new._buffers.items():  # the per-example norm buffers, made on the meta device above
        new._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    new.train(module.training)
    return new


def convert(model, linearclass="gns", embeddingclass="gns", lnclass="gns", callback=None, scaler=None):
    """Swap the torch layers of an existing model, in place, for per-example norm layers.

    Every module whose class is exactly nn.Linear, nn.Embedding, nn.LayerNorm or
    nn.RMSNorm (with a weight) becomes the class registered under the given name
    ('nn' leaves that kind alone). The new layer holds the very same Parameter
    objects, so weights, devices, dtypes, tied weights and an optimizer built
    earlier all carry over; a module used in several places is swapped once and
    stays shared. Subclasses of those classes are not swapped (their own forward
    would be lost): they, and any other module that owns parameters, are listed
    in `tracker.unconverted` and in one warning, and their parameters in
    `tracker.skipped`. Such modules can call functional.py from their forward.

    Returns:
        gnstracking.MeasurementTracker over the converted model, ready to `.step()`.
    """
    import warnings

    import gnstracking  # imported here: layer_config stays importable without buffered.py's imports

    names = {"Linear": linearclass, "Embedding": embeddingclass, "LayerNorm": lnclass, "RMSNorm": lnclass}
    classes = {kind: get_layer_class(kind, name) for kind, name in names.items()}
    torch_classes = {nn.Linear: "Linear", nn.Embedding: "Embedding", nn.LayerNorm: "LayerNorm", nn.RMSNorm: "RMSNorm"}
    if type(model) in torch_classes:
        raise ValueError(f"convert() swaps the layers inside a model; got a bare {type(model).__name__}: "
                         "wrap it in a module (e.g. nn.Sequential(layer)) and convert that")
    swapped, unconverted = {}, {}

    def owns_untracked_parameters(module):
        """Parameters of its own and no per-example norm buffer (layers built with functional.py have one)."""
        return (any(True for _ in module.parameters(recurse=False))
                and not any(n.endswith(gnstracking.BUFFER_SUFFIX) for n in module._buffers))

    def replacement(module, path):
        kind = torch_classes.get(type(module))
        if kind is not None and names[kind] != "nn":
            if getattr(module, "weight", None) is None:
                return module  # a norm without affine parameters: nothing to record
            reason = _convertible(module, kind)
            if reason is None:
                return _swap(module, kind, classes[kind])
            unconverted[path] = reason
        elif kind is None and owns_untracked_parameters(module):
            base = next((c.__name__ for c in torch_classes if isinstance(module, c)), None)
            unconverted[path] = (f"subclass of nn.{base} with its own forward" if base else
                                 f"{type(module).__name__} owns parameters and has no per-example norm class") + \
                                "; call functional.py's per-example norm functions from its forward"
        return module

    def visit(parent, prefix):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = prefix + name
            if id(child) not in swapped:
                swapped[id(child)] = replacement(child, path)
                if swapped[id(child)] is child:
                    visit(child, path + ".")
            parent._modules[name] = swapped[id(child)]

    visit(model, "")
    if owns_untracked_parameters(model):
        unconverted[""] = f"{type(model).__name__} owns parameters directly; call functional.py from its forward"
    tracker = gnstracking.MeasurementTracker.from_model(model, callback=callback, scaler=scaler)
    tracker.unconverted = unconverted
    if unconverted:
        listing = "; ".join(f"{path or '(the model itself)'}: {reason}" for path, reason in unconverted.items())
        warnings.warn(f"convert(): {len(unconverted)} module(s) not converted, their parameters not tracked: {listing}")
    return tracker
