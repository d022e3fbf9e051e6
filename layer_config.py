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
importing this file imports neither buffered.py, Triton nor transformers.

`convert(model)` swaps the layers of a model built elsewhere: torch's classes and
transformers' Conv1D by class (the RMSNorm and Conv1D kinds exist for it), any
other module with parameters after swapcheck.py's probe shows a per-example norm
layer computes the same thing.
"""

import contextlib
import importlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import swapcheck


@dataclass
class LayerConfig:
    Linear: Any = nn.Linear
    Embedding: Any = nn.Embedding
    LayerNorm: Any = nn.LayerNorm
    RMSNorm: Any = nn.RMSNorm
    Conv1D: Any = None  # transformers' Conv1D: only convert() swaps it, and layer_config never imports transformers


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
    "RMSNorm": {  # not built by model.py; `convert` swaps RMSNorms (with a weight) by lnclass
        "nn": "torch.nn:RMSNorm",
        "shim": "buffered:PEGradNormRMSNorm",
        "gns": "buffered:PEGradNormRMSNorm",
        "fused": "fused_gns:PEGradNormFusedRMSNorm",
    },
    "Conv1D": {  # transformers' Conv1D (GPT-2's Linear, weight stored (in, out)); `convert` swaps it by linearclass
        "nn": "transformers.pytorch_utils:Conv1D",
        "shim": "buffered:PEGradNormShimConv1D",
        "gns": "buffered:PEGradNormConv1D",
        "fused": "fused_gns:PEGradNormFusedConv1D",
    },
}
# the config key users set for each kind (train.py's --linearclass etc.)
CONFIG_KEYS = {"Linear": "linearclass", "Embedding": "embeddingclass", "LayerNorm": "lnclass", "RMSNorm": "lnclass",
               "Conv1D": "linearclass"}


def get_layer_class(kind, name):
    """The class registered as `name` for `kind` (a LAYER_CLASSES key: "Linear", "Embedding", "LayerNorm", ...)."""
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

def _known_classes():
    """{class: kind} of the classes convert swaps by their class: torch's four, and transformers' Conv1D when
    transformers is loaded (a model holding one has loaded it; this file never imports transformers)."""
    known = {nn.Linear: "Linear", nn.Embedding: "Embedding", nn.LayerNorm: "LayerNorm", nn.RMSNorm: "RMSNorm"}
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    if getattr(pytorch_utils, "Conv1D", None) is not None:
        known[pytorch_utils.Conv1D] = "Conv1D"
    return known


def _convertible(module, kind):
    """None if `module` (exactly of a known `kind` class) can be swapped, else the reason it cannot."""
    if kind == "Embedding":
        plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
        return None if plain else "nn.Embedding with max_norm, scale_grad_by_freq or sparse"
    if kind in ("LayerNorm", "RMSNorm") and len(module.normalized_shape) != 1:
        return f"{kind} over {len(module.normalized_shape)} dims (per-example norm layers normalise the last dim)"
    return None


def _known_options(module, kind):
    """Constructor options of a known class's module (eps); torch's RMSNorm eps=None means its dtype's epsilon."""
    if kind == "LayerNorm":
        return dict(eps=module.eps)
    if kind == "RMSNorm":
        return dict(eps=module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps)
    if kind == "Embedding":
        return dict(padding_idx=module.padding_idx)
    return {}


def new_layer(cls, kind, params, options=None):
    """A `cls` layer of `kind` holding `params` ({"weight": ..., "bias": ...}, nn.Parameters) themselves, so
    ties, devices, dtypes and optimizer state carry over. options: eps (norms), weight_offset (RMSNorm)."""
    options = options or {}
    weight, has_bias = params["weight"], params.get("bias") is not None
    if kind in ("Linear", "Conv1D"):  # Linear(in, out) with weight (out, in); Conv1D(nf=out, nx=in) with (in, out)
        new = cls(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    elif kind == "Embedding":
        new = cls(*weight.shape, padding_idx=options.get("padding_idx"), device="meta")
    elif kind == "LayerNorm":
        new = cls(weight.shape[0], bias=has_bias, eps=options["eps"], device="meta")
    else:  # RMSNorm
        new = cls(weight.shape[0], device="meta", **options)
    for name, param in params.items():
        setattr(new, name, param)
    for name, buffer in new._buffers.items():  # the per-example norm buffers, made on the meta device above
        new._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=weight.device)
    return new


def _carry_attributes(old, new):
    """Copy `old`'s plain attributes that `new` lacks (variance_epsilon, hidden_size, ...): code reading them
    (e.g. a kernel path reading `norm.variance_epsilon`) keeps working after a probed swap."""
    for name, value in vars(old).items():
        plain = isinstance(value, (bool, int, float, str, type(None)))
        if plain and not name.startswith("_") and not hasattr(new, name):
            setattr(new, name, value)


def _treat_as_entries(treat_as, known):
    """{class: (kind, options)} from convert's `treat_as` argument, checked."""
    entries = {}
    for cls, spec in (treat_as or {}).items():
        label = getattr(cls, "__name__", repr(cls))
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"treat_as keys are nn.Module classes, got {cls!r}")
        if not (isinstance(spec, str) or isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], dict)):
            raise ValueError(f"treat_as[{label}] is a kind or (kind, {{option: value}}), got {spec!r}")
        kind, options = (spec, {}) if isinstance(spec, str) else spec
        if cls in known:
            raise ValueError(f"{label} is converted by its class already; remove it from treat_as")
        if kind not in swapcheck.PROBED_KINDS:
            raise ValueError(f"treat_as[{label}]: unknown kind {kind!r}; choose from {list(swapcheck.PROBED_KINDS)}")
        allowed = {"RMSNorm": {"eps", "weight_offset"}, "LayerNorm": {"eps"}}.get(kind, set())
        if set(options) - allowed:
            raise ValueError(f"treat_as[{label}]: {kind} takes options {sorted(allowed)}, got {sorted(options)}")
        entries[cls] = (kind, dict(options))
    return entries


def convert(model, linearclass="gns", embeddingclass="gns", lnclass="gns", callback=None, scaler=None, treat_as=None):
    """Swap the layers of an existing model, in place, for per-example norm layers.

    Modules whose class is exactly torch's nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm (with a weight) or
    transformers' Conv1D (GPT-2's Linear, weight stored (in, out); swapped by `linearclass`) become the class
    registered under the given name ('nn' leaves that kind alone). Any other module owning parameters, such as
    transformers' LlamaRMSNorm, GemmaRMSNorm (scale 1 + weight), T5LayerNorm, nanoGPT's LayerNorm or a subclass of
    a torch class with its own forward, is swapped when a probe shows that a per-example norm layer computes the
    same output and gradients (swapcheck.py: the kind is found by what the module computes, not by its name;
    a subclass of a torch class is tried as that class's kind only).

    The new layer holds the very same Parameter objects, so weights, devices, dtypes, tied weights,
    `state_dict` keys and an optimizer built earlier all carry over; a module used in several places is
    swapped once and stays shared. Modules that cannot be swapped, or fail the probe, are left untouched and
    listed with the reason in `tracker.unconverted` and in one warning, and their parameters in
    `tracker.skipped`. Such modules can call functional.py from their forward.

    Args:
        treat_as: {module class: kind} for classes to probe as one kind only ("RMSNorm", "LayerNorm",
            "Linear", "Conv1D" or "Embedding"), or {class: (kind, options)} to fix options the probe would
            otherwise search: eps (RMSNorm, LayerNorm), weight_offset (RMSNorm: 1.0 for a (1 + weight) scale).
            Matched by exact class; the probe still decides.
    Returns:
        gnstracking.MeasurementTracker over the converted model, ready to `.step()`.
    """
    import warnings

    import gnstracking  # imported here: layer_config stays importable without buffered.py's imports

    names = {"Linear": linearclass, "Conv1D": linearclass, "Embedding": embeddingclass, "LayerNorm": lnclass,
             "RMSNorm": lnclass}
    classes = {kind: get_layer_class(kind, name) for kind, name in names.items()  # unknown names raise here
               if name != "nn" and (kind != "Conv1D" or name in LAYER_CLASSES[kind])}
    known = _known_classes()
    if type(model) in known:
        raise ValueError(f"convert() swaps the layers inside a model; got a bare {type(model).__name__}: "
                         "wrap it in a module (e.g. nn.Sequential(layer)) and convert that")
    named = _treat_as_entries(treat_as, known)
    swapped, unconverted = {}, {}

    def owns_untracked_parameters(module):
        """Parameters of its own and no per-example norm buffer (layers built with functional.py have one)."""
        return (any(True for _ in module.parameters(recurse=False))
                and not any(n.endswith(gnstracking.BUFFER_SUFFIX) for n in module._buffers))

    no_conv1d = (f"linearclass={linearclass!r} has no Conv1D layer (transformers' Linear with weight (in, out)); "
                 f"choose from {sorted(LAYER_CLASSES['Conv1D'])}")  # the one kind a valid name may lack

    def known_replacement(module, kind):
        """(new module or the same one, reason it was not swapped or None) for a module of a known class."""
        if names[kind] == "nn" or getattr(module, "weight", None) is None:
            return module, None  # 'nn' chosen, or a norm without affine parameters: nothing to record
        if kind not in classes:
            return module, no_conv1d
        reason = _convertible(module, kind)
        if reason is not None:
            return module, reason
        params = dict(module.named_parameters(recurse=False))
        return new_layer(classes[kind], kind, params, _known_options(module, kind)), None

    def probed_replacement(module):
        """(new module or the same one, reason it was not swapped or None) for any other module with parameters."""
        kind, options = named.get(type(module), (None, {}))
        base = next((k for c, k in known.items() if isinstance(module, c)), None)
        kinds = [kind] if kind else [base] if base else swapcheck.PROBED_KINDS
        problem = swapcheck.structure_problem(module)
        fitting = swapcheck.fitting_kinds(module, kinds) if problem is None else []
        if problem is None and not fitting:
            shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
            problem = f"its parameters {shapes} fit no {' or '.join(kinds)} layer"
        if problem is not None:
            return module, problem
        if all(names[k] == "nn" for k in fitting):
            return module, None  # the user chose not to record these kinds
        if not any(k in classes for k in fitting):
            return module, no_conv1d
        found, reason = swapcheck.find_replacement(module, [k for k in fitting if k in classes], options)
        if found is None:
            return module, reason
        new = new_layer(classes[found.kind], found.kind, dict(module.named_parameters(recurse=False)), found.options)
        _carry_attributes(module, new)
        return new, None

    def replacement(module, path):
        kind = known.get(type(module))
        if kind is None and not owns_untracked_parameters(module):
            return module
        new, reason = known_replacement(module, kind) if kind else probed_replacement(module)
        if reason is not None:
            unconverted[path] = reason if kind else (f"{type(module).__name__} not swapped, {reason}; call "
                                                     "functional.py's per-example norm functions from its forward")
        if new is not module:
            new.train(module.training)  # only the new layer: train() would reset every child's mode
        return new

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
