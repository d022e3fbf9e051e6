"""
Which Linear, Embedding and LayerNorm classes a model is built with.

model.py reads `config.Linear`, `config.Embedding` and `config.LayerNorm` when a
module is constructed, so wrapping construction in `set_contextual_config` swaps
every layer of that kind:

    with set_contextual_config(**layer_classes(linearclass='gns', lnclass='shim')):
        model = GPT(GPTConfig(...))

The names users type (`--linearclass=gns`) mean the classes registered by the
layer kinds (the one registry, registry.py): train.py, convert(), the tests and
the benchmarks all look them up there.
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator

import torch.nn as nn

from nanogns.layers import registry


@dataclass
class LayerConfig:
    Linear: Any = nn.Linear
    Embedding: Any = nn.Embedding
    LayerNorm: Any = nn.LayerNorm
    RMSNorm: Any = nn.RMSNorm


config = LayerConfig()
CHOICES = ("linearclass", "embeddingclass", "lnclass")  # the user's choices; each kind is picked by one of them


def get_layer_class(kind: str, name: str) -> type:
    """The class registered as variant `name` ('nn', 'shim', 'gns', 'fused', ...) of layer kind `kind`."""
    return registry.get(kind).layer_class(name)


def layer_classes(linearclass: str = "nn", embeddingclass: str = "nn", lnclass: str = "nn") -> Dict[str, type]:
    """Keyword arguments for `set_contextual_config` from the three config names."""
    return dict(
        Linear=get_layer_class("Linear", linearclass),
        Embedding=get_layer_class("Embedding", embeddingclass),
        LayerNorm=get_layer_class("LayerNorm", lnclass),
    )


def tracks_per_example_norms(linearclass: str = "nn", embeddingclass: str = "nn", lnclass: str = "nn") -> bool:
    """True when any of the three choices records per-example norms."""
    return any(name != "nn" for name in (linearclass, embeddingclass, lnclass))


@contextlib.contextmanager
def set_contextual_config(**classes: type) -> Iterator[LayerConfig]:
    """Build modules with these layer classes inside the `with` block, restoring the old ones after."""
    unknown = set(classes) - set(LayerConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(LayerConfig.__dataclass_fields__)}"
        )
    previous = {kind: getattr(config, kind) for kind in classes}
    for kind, cls in classes.items():
        setattr(config, kind, cls)
    try:
        yield config
    finally:
        for kind, cls in previous.items():
            setattr(config, kind, cls)
