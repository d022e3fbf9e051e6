"""
Which exact computation a layer uses where there are several: one documented context, read at each call.

Every choice gives the same numbers (each is exact); they differ in cost only. By default each layer picks
per call from a cost model of the shapes and the device; tests and benchmarks force one with `forced`:

    from nanogns.core import strategy
    with strategy.forced(linear="gram"):     # the gns Linear forms its norms by the Gram trick
        loss.backward()

Fields (None: the layer's own rule):
    linear        the gns Linear (core/matmul.py): "gram" (plain weight-gradient GEMM + the two Gram
                  matrices) or "materialise" (each example's dW_i, summed into the gradient)
    fused_linear  the fused Linear (variants/fused/linear.py): "gram" or "materialise" (the gns Linear's torch
                  strategies), "kernel" (the Triton kernel at its default tiles), or a launch configuration
                  (variants/fused/linear_plan.LinearConfig)
    cross_term    a tied Embedding/Linear matrix (core/tied.py): "table" (each example's (V, D) table of the
                  head's gradient) or "gather" (the head's gradient at the embedding's ids)

The context is process-wide (not per thread): a layer reads it when its backward runs.
"""

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from nanogns.errors import SettingNotValid

LINEAR_CHOICES = (None, "gram", "materialise")
CROSS_TERM_CHOICES = (None, "table", "gather")
FUSED_LINEAR_NAMES = ("gram", "materialise", "kernel")


@dataclass(frozen=True)
class Strategies:
    linear: Optional[str] = None
    fused_linear: Any = None
    cross_term: Optional[str] = None


class StrategyContext:
    """The strategies in force in this process (CONTEXT): the defaults, or those of the innermost `forced` block."""

    def __init__(self):
        self.current = Strategies()


CONTEXT = StrategyContext()


def current() -> Strategies:
    """The strategies in force (the defaults outside any `forced` block)."""
    return CONTEXT.current


@contextlib.contextmanager
def forced(**choices: Any) -> Iterator[Strategies]:
    """Force strategies inside the `with` block (fields of Strategies), restoring the previous ones after."""
    unknown = set(choices) - {field.name for field in dataclasses.fields(Strategies)}
    if unknown:
        raise SettingNotValid(
            f"unknown strategy field(s) {sorted(unknown)}; choose from linear, fused_linear, cross_term"
        )
    if choices.get("linear") not in LINEAR_CHOICES:
        raise SettingNotValid(f"linear strategy {choices['linear']!r}; choose from {LINEAR_CHOICES}")
    if choices.get("cross_term") not in CROSS_TERM_CHOICES:
        raise SettingNotValid(f"cross_term strategy {choices['cross_term']!r}; choose from {CROSS_TERM_CHOICES}")
    fused = choices.get("fused_linear")
    if isinstance(fused, str) and fused not in FUSED_LINEAR_NAMES:
        raise SettingNotValid(f"fused_linear strategy {fused!r}; choose from {FUSED_LINEAR_NAMES} or a LinearConfig")
    previous = CONTEXT.current
    CONTEXT.current = dataclasses.replace(previous, **choices)
    try:
        yield CONTEXT.current
    finally:
        CONTEXT.current = previous
