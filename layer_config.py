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

import torch.nn as nn


@dataclass
class LayerConfig:
    Linear: Any = nn.Linear
    Embedding: Any = nn.Embedding
    LayerNorm: Any = nn.LayerNorm


config = LayerConfig()

LAYER_CLASSES = {
    "Linear": {
        "nn": "torch.nn:Linear",
        "shim": "buffered:PEGradNormShimLinear",
        "gns": "buffered:PEGradNormLinear",
        "fused": "fused_gns:PEGradNormFusedLinear",
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
}
# the config key users set for each kind (train.py's --linearclass etc.)
CONFIG_KEYS = {"Linear": "linearclass", "Embedding": "embeddingclass", "LayerNorm": "lnclass"}


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
