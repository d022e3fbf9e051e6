"""
Which Linear, Embedding and LayerNorm classes a model is built with.

model.py reads `config.Linear`, `config.Embedding` and `config.LayerNorm` when a
module is constructed, so wrapping construction in `set_contextual_config` swaps
every layer of that kind:

    with set_contextual_config(**layer_classes(linearclass='gns', lnclass='shim')):
        model = GPT(GPTConfig(...))

The names users type (`--linearclass=gns`) mean the classes registered by the
layer kinds (nanogns/kinds/__init__.py's KINDS): train.py, convert(), the tests and
the benchmarks all look them up there.
"""

import contextlib
from typing import ContextManager, Dict, Iterator

from nanogns.errors import SettingNotValid
from nanogns.kinds import KINDS


class LayerConfig:
    """The class model.py builds each layer kind with: one attribute per registered kind built by its class
    (config.Linear, config.Embedding, config.LayerNorm, config.RMSNorm, config.Conv1D, ...), the class chosen by
    the innermost `contextual` block, else the kind's plain torch layer. A third-party plain layer (transformers'
    Conv1D) is imported only when asked for."""

    def __init__(self):
        self.chosen = {}  # {kind name: class} of the `contextual` blocks running now

    def __getattr__(self, name: str) -> type:
        if name.startswith("_") or name == "chosen" or name not in constructible_kinds():
            raise AttributeError(f"no layer kind {name!r}; choose from {constructible_kinds()}")
        return self.chosen.get(name) or KINDS.kind(name).layer_class("nn")

    def __repr__(self) -> str:
        chosen = {name: self.chosen.get(name) for name in constructible_kinds()}
        return "LayerConfig(" + ", ".join(f"{k}={v.__name__ if v else 'nn'}" for k, v in chosen.items()) + ")"

    @contextlib.contextmanager
    def contextual(self, **classes: type) -> Iterator["LayerConfig"]:
        """Build modules with these layer classes inside the `with` block, restoring the old ones after."""
        unknown = set(classes) - set(constructible_kinds())
        if unknown:
            raise SettingNotValid(
                f"unknown layer kind(s) {sorted(unknown)}; choose from {sorted(constructible_kinds())}"
            )
        previous = dict(self.chosen)
        self.chosen.update(classes)
        try:
            yield self
        finally:
            self.chosen = previous


def constructible_kinds() -> list:
    """The kinds a model builds by class (not the experts, which convert() recognises by their structure)."""
    return [name for name, kind in KINDS.items() if kind.matches is None]


config = LayerConfig()


def get_layer_class(kind: str, name: str) -> type:
    """The class registered as variant `name` ('nn', 'shim', 'gns', 'fused', ...) of layer kind `kind`."""
    return KINDS.kind(kind).layer_class(name)


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


def set_contextual_config(**classes: type) -> ContextManager[LayerConfig]:
    """Build modules with these layer classes inside the `with` block, restoring the old ones after (the reference's
    name for `config.contextual`)."""
    return config.contextual(**classes)
