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
from typing import Dict, Iterator

from nanogns.core import registry
from nanogns.errors import SettingNotValid


class LayerConfig:
    """The class model.py builds each layer kind with: one attribute per registered kind built by its class
    (config.Linear, config.Embedding, config.LayerNorm, config.RMSNorm, config.Conv1D, ...), each the kind's plain
    torch layer unless set. A third-party plain layer (transformers' Conv1D) is imported only when asked for."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("_") or name not in constructible_kinds():
            raise AttributeError(f"no layer kind {name!r}; choose from {constructible_kinds()}")
        return registry.get(name).layer_class("nn")

    def __repr__(self) -> str:
        chosen = {name: vars(self).get(name) for name in constructible_kinds()}
        return "LayerConfig(" + ", ".join(f"{k}={v.__name__ if v else 'nn'}" for k, v in chosen.items()) + ")"


def constructible_kinds() -> list:
    """The kinds a model builds by class (not the experts, which convert() recognises by their structure)."""
    return [name for name, kind in registry.KINDS.items() if kind.matches is None]


config = LayerConfig()


def get_layer_class(kind: str, name: str) -> type:
    """The class registered as variant `name` ('nn', 'shim', 'gns', 'fused', ...) of layer kind `kind`."""
    return registry.get(kind).layer_class(name)


def layer_classes(linearclass: str = "nn", embeddingclass: str = "nn", lnclass: str = "nn") -> Dict[str, type]:
    """Keyword arguments for `set_contextual_config` from the three config names (nanoGPT's three layer kinds)."""
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
    unknown = set(classes) - set(constructible_kinds())
    if unknown:
        raise SettingNotValid(f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(constructible_kinds())}")
    previous = {kind: vars(config).get(kind) for kind in classes}  # None: the kind's plain layer
    vars(config).update(classes)
    try:
        yield config
    finally:
        for kind, cls in previous.items():
            if cls is None:
                vars(config).pop(kind, None)
            else:
                vars(config)[kind] = cls
