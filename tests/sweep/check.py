"""
One architecture through nanogns.convert against the oracle, and its verdict.

A case gives its model (built from a tiny config, random weights), its examples and how a micro-batch of them is
collated, and the model's output per example as a loss. The check converts the model, runs one step of two uneven
micro-batches (example 0, then the rest; each loss a share of the mean over the step's examples), reads the
monitor, and then takes every example's gradient from the same forwards (tests/oracle.py, float64: a backward of
that example's loss alone through the forward that made it) and compares.

Verdicts:
    EXACT           every parameter that got a gradient is measured, each within REL of the oracle
    REFUSED         the step is refused, or some parameters with a gradient are listed unmeasured: the reason
    NOT-BUILDABLE   the tiny model or its inputs could not be made (a fact about the sweep, not the project)
    WRONG           a measured number differs from the oracle (a bug)
    CRASH           convert, the converted model's step or the monitor raised (a bug)
"""

import contextlib
import dataclasses
import math
import signal
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional

import torch
from oracle import loss_sqnorms_from_batched_forward
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import nanogns as lc

REL = 1e-6  # the monitor's buffers are float32: its squared norms are exact to ~1e-7 of their size
# a model that computes part of its forward in float32 (Gemma's norms upcast) gives both the monitor and the oracle
# float32 rounding: they agree to ~1e-5 of the values, and near-zero values to ~1e-5 of the largest one
REL_FLOAT32 = 1e-4
SCALE_FLOOR = 1e-2  # x rel x the largest oracle value of that quantity: the absolute floor of the comparison
VERDICTS = ("EXACT", "REFUSED", "NOT-BUILDABLE", "WRONG", "CRASH")
PROBLEMS = ("WRONG", "CRASH")


@dataclasses.dataclass
class Result:
    verdict: str
    reason: str = ""
    inputs: str = ""  # what the examples were made of (the micro-batches' inputs, in words)
    seconds: float = 0.0


class NotBuildable(Exception):
    """The tiny model, or examples it runs on, could not be made: the reason."""


def checked_losses(loss_of, examples):
    """loss_of, once it gives finite per-example losses on all `examples` and on the micro-batches of 1 and the rest
    (the split the check runs); NotBuildable otherwise."""
    with torch.no_grad():
        for part in (slice(0, examples), slice(0, 1), slice(1, examples)):
            loss = loss_of(part)
            if loss.shape != (part.stop - part.start,):
                raise NotBuildable(f"its outputs give losses of shape {tuple(loss.shape)}")
            if not torch.isfinite(loss).all():
                raise NotBuildable("its tiny model's outputs are not finite")
    return loss_of


@dataclasses.dataclass
class Prepared:
    """What a case builds: the model (its final dtype, training mode), its step's examples (n of them) and
    loss_of(part) -> the (len(part),) per-example losses of the examples in slice `part`, from one forward."""

    model: torch.nn.Module
    loss_of: Callable[[slice], torch.Tensor]
    n: int
    inputs: str
    rel: float = REL


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """Raise _Timeout in the block after `seconds` (SIGALRM; the main thread only)."""

    def alarm(signum, frame):
        raise _Timeout(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return " ".join(text.split())[:limit]


def where(error: BaseException) -> str:
    """The innermost frame of the traceback, as file:line (function)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.name})"


def check(prepare: Callable[[], Prepared], seconds: int = 600) -> Result:
    """The verdict of one case (see the module's docstring)."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend (with pytest's other worker, too)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(seconds):
                result = _check(prepare)
        except _Timeout as e:
            result = Result("CRASH", f"the check {e}")
        finally:
            torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - start
    return result


def _check(prepare):
    try:
        case = prepare()
    except NotBuildable as e:
        return Result("NOT-BUILDABLE", str(e))
    except _Timeout:
        raise
    except Exception as e:
        return Result("NOT-BUILDABLE", f"the tiny model could not be made ({one_line(e)})")
    model, n = case.model, case.n
    parts = [slice(0, 1), slice(1, n)]
    rel, inputs = case.rel, case.inputs
    if rel == REL and computes_below_float64(lambda: case.loss_of(slice(0, n))):
        rel = REL_FLOAT32
    case = dataclasses.replace(case, rel=rel, inputs=inputs)
    try:
        monitor = lc.convert(model)
    except Exception as e:
        return Result("CRASH", f"convert raised {one_line(e)}{where(e)}", case.inputs)
    losses = []
    try:
        for part in parts:
            loss = case.loss_of(part)
            (loss.sum() / n).backward(retain_graph=True)
            losses.append(loss)
    except Exception as e:
        return Result("CRASH", f"the converted model's step raised {one_line(e)}{where(e)}", case.inputs)
    try:
        measured = {m.metadata["name"]: m for m in monitor.measure(batch_size=n)}
    except ValueError as e:
        return Result("REFUSED", f"step refused: {one_line(e, 600)}", case.inputs)
    except Exception as e:
        return Result("CRASH", f"the monitor raised {one_line(e)}{where(e)}", case.inputs)
    with_gradient = {name for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    try:
        per_example, batch = loss_sqnorms_from_batched_forward(model, losses)
    except Exception as e:
        return Result("CRASH", f"the oracle's backward through the converted model raised {one_line(e)}{where(e)}")
    if not all(math.isfinite(v) for values in (per_example, batch) for v in values.values()):
        return Result(
            "NOT-BUILDABLE", "the tiny model's gradients are not finite (nan or inf in the oracle's)", case.inputs
        )
    wrong = []
    floors = {
        what: SCALE_FLOOR * case.rel * max(values.values(), default=0.0)
        for what, values in (("norm", batch), ("pegn", per_example))
    }
    for name, m in measured.items():
        first = name.split("+")[0]
        for got, want, what in ((m.norm**2, batch[first], "norm"), (m.rms_pe_norm**2, per_example[first], "pegn")):
            if not _close(got, want, case.rel, floors[what]):
                wrong.append(f"{name} {what}^2 {got:.6g} vs oracle {want:.6g}")
    if wrong:
        return Result("WRONG", f"{len(wrong)} numbers differ from the oracle: " + "; ".join(wrong[:3]), case.inputs)
    covered = {part for name in measured for part in name.split("+")}
    missing = sorted(with_gradient - covered)
    if missing:
        return Result(
            "REFUSED",
            f"{len(missing)} of {len(with_gradient)} parameters with a gradient not measured: "
            + _reasons(monitor, missing),
            case.inputs,
        )
    if not measured:
        return Result("REFUSED", "no parameter got a gradient in the step", case.inputs)
    return Result("EXACT", "", case.inputs)


def _close(got, want, rel, floor):
    if math.isnan(got) or math.isnan(want):
        return False
    return abs(got - want) <= rel * abs(want) + floor + 1e-20


class _Dtypes(TorchDispatchMode):
    """Notes the floating dtypes of every op's outputs."""

    def __init__(self):
        super().__init__()
        self.found = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.found.add(t.dtype)
        return out


def computes_below_float64(forward) -> bool:
    """True when `forward()` (a float64 model's forward) makes a floating tensor of lower precision."""
    with torch.no_grad(), _Dtypes() as seen:
        forward()
    return bool(seen.found - {torch.float64})


def _reasons(monitor, missing: List[str]) -> str:
    """Why the monitor does not measure these parameters (each reason once, with how many): convert's reason for the
    module holding one where it left that module unconverted, else the monitor's."""
    found: Dict[str, List[str]] = {}
    for name in missing:
        owner = max(
            (path for path in monitor.unconverted if name.startswith(path + ".") or not path), key=len, default=None
        )
        reason = (
            monitor.unconverted[owner]
            if owner is not None
            else monitor.untracked.get(name, "not tracked, with no reason given")
        )
        found.setdefault(" ".join(reason.split())[:300], []).append(name)
    return "; ".join(
        f"{names[0]}{f' (+{len(names) - 1})' if len(names) > 1 else ''}: {reason}" for reason, names in found.items()
    )


def first_problem(results: Dict[str, Result]) -> Optional[str]:
    return next((f"{k}: {r.verdict} {r.reason}" for k, r in results.items() if r.verdict in PROBLEMS), None)
