"""
The measurements of a training step: for each tracked parameter p,
    norm = ||p.grad||                        the batch gradient's norm (the log's `norm` column)
    rms_pe_norm = sqrt(mean_i ||g_i||^2)     from the layer's `<p>_pe_sqnorm` buffer (the log's `pegn` column)
    batch_size = B                           examples in the step (all micro-batches, all ranks)
(see core/buffers.py for how the buffers are filled, estimator.py for the GNS made of them).

One object does it all in a training loop, GNSMonitor:

    monitor = GNSMonitor(model, log=log)     # or monitor = nanogns.convert(model, log=log)
    ...backward of every micro-batch...
    monitor.step(batch_size=B)               # before clipping, scaler.step and zero_grad: measure, zero, log

Which parameters are tracked: every trainable one whose layer keeps a
`<name>_pe_sqnorm` buffer (find_tracked_parameters). The others are listed in
`monitor.untracked` with the reason; frozen parameters (requires_grad=False) are never
measurements. Parameters are looked up on their modules at every read, so a model
sharded after the monitor was made (FSDP2) is read correctly.

A step is read in a handful of ops whatever the model's size (StepReader): every
buffer is a view of one flat tensor (BufferTable), the gradients' norms come from
one torch._foreach_norm, the ranks' sums from one all-reduce, and the numbers reach
the host in one sync. Under data parallelism (DDP, FSDP2, HSDP) each rank's backward
gives its examples' parts of the gradient, which the engine averages over the world:
example i's gradient g_i is B / world times its local part, whatever each rank's
share of the B examples (so unequal shares are exact).
"""

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Set, Union

import numpy as np
import torch
import torch.nn as nn

from nanogns.core import layout
from nanogns.errors import NotSupported, StepNotMeasured
from nanogns.estimator import RunningGNS
from nanogns.kinds import batchnorm
from nanogns.monitor.reader import StepReader, buffer_table, world_size
from nanogns.monitor.tracked import (
    Measurement,
    describe_tracked,
    find_tracked_parameters,
    shared_tensors,
    summed_squares,
)
from nanogns.runlog.record import write_parameter_record
from nanogns.variants.sogns import SOGNS_SUFFIX

if TYPE_CHECKING:
    import pandas

APPROX_PREFIX = "train/sogns/"  # log columns of approximate (SOGNS) norms
# mean_i ||g_i||^2 >= ||mean_i g_i||^2 for any examples (Jensen): a measurement further below than rounding (bf16
# gradients, float32 buffers) can reach is no measurement, and its step is refused naming the parameter
IMPOSSIBLE_TOLERANCE = 2e-2
NUMERICALLY_ZERO = 1e-30  # a squared gradient norm below it is zero (its per-example sums underflow in float32)


class LogSink(Protocol):
    """What `log` may be besides a callable: an object with a `log(dict)` method (runlog.LogWrapper)."""

    def log(self, values: Dict[str, Any]) -> Any: ...


# -----------------------------------------------------------------------------
# everything a training loop adds, in one object


class GNSMonitor:
    """What a training loop adds for the GNS: make it once, call `step` once per optimizer step.

        monitor = GNSMonitor(model, log=log)  # after convert(model), or a model built with per-example norm layers
        for ...:
            ...forward/backward of every micro-batch...
            monitor.step(batch_size=B)        # after the last backward, before clipping and optimizer.step()
            optimizer.step(); optimizer.zero_grad()

    `step` reads every per-example norm buffer and gradient norm (a handful of ops, one host sync), zeroes the
    buffers, updates the running GNS and hands the row {`<prefix><param>/norm`, `/pegn`, `/batch_size`, ...,
    "gns"} to `log` (a tracker.LogWrapper, or any callable taking a dict, e.g. wandb's run.log); it returns the
    row. `measure` reads without zeroing, logging or updating (the Measurements). Approximate SOGNS norms, where
    a layer records them, go under "train/sogns/". When `log` writes files (a LogWrapper with an out_dir, or
    out_dir=...), what each tracked parameter is (layer kind, block, names) is written there as PARAMETERS_JSON
    for gns-analysis.py.

    What it knows, each said once (as warnings, and here): `unconverted` {module path: why} from
    convert(); `untracked` {parameter: why} for every trainable parameter it does not measure (and
    those it stops measuring during the run, with the step); `tracked`, the Tracked entries it logs.

    Args:
        model: the model (unwrapped: not the DDP wrapper; FSDP2-sharded is fine).
        log: a LogWrapper, a callable, or None.
        scaler: the fp16 GradScaler, or None: its scale is divided out, and a step it will skip (an inf/nan
            gradient) is not a measurement.
        ema_decay: decay of the running GNS's EMAs (gns-analysis.py's --alpha).
        out_dir: where to write the record when `log` has no out_dir.
        expect_tracked: raise when no parameter records per-example norms (convert() passes False: it says why).
        unconverted: {module path: why} of the modules convert() left as they were (its report).
    Under torch.distributed every rank must call `step` (it all-reduces once).
    `state_dict()` / `load_state_dict()` carry the running GNS and the counters across a resume.
    """

    def __init__(
        self,
        model: nn.Module,
        log: Union[None, LogSink, Callable[[Dict[str, Any]], Any]] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        ema_decay: float = 0.95,
        prefix: str = "train/gns/",
        out_dir: Optional[str] = None,
        expect_tracked: bool = True,
        unconverted: Optional[Dict[str, str]] = None,
    ):
        self._warned = set()  # parameters warned about (once each)
        self.row_map = layout.install(model)  # each forward's examples, read by every layer (layout.py)
        batchnorm.watch(model, self.row_map)  # a forward normalising with the batch's statistics is refused
        self.model, self.log, self.scaler, self.prefix = model, log, scaler, prefix
        self.tracked, self.untracked = find_tracked_parameters(model)
        self.row_map.shared = shared_tensors(self.tracked)  # tensors several modules record (core/uses.py)
        self.approx_tracked, _ = find_tracked_parameters(model, SOGNS_SUFFIX)
        self.unconverted = dict(unconverted or {})
        if expect_tracked and not self.tracked and not self.approx_tracked:
            raise NotSupported(
                f"GNSMonitor: no parameter of {type(model).__name__} has a per-example norm layer; convert "
                "it first (nanogns.convert(model)) or build it with per-example norm layer classes"
            )
        self._warn_once({name: reason for name, reason in self.untracked.items() if reason.startswith("tied")})
        self.table = buffer_table(model)
        tracked_ids = {id(entry.ref.get()) for entry in self.tracked}
        others = lambda: [p.grad for p in model.parameters() if id(p) not in tracked_ids and p.grad is not None]  # noqa: E731
        self.reader = StepReader(self.table, self.tracked + self.approx_tracked, others)
        self.running = RunningGNS(decay=ema_decay)
        self.measurements = []  # the last step's exact Measurements (e.g. for a GNS over some of the parameters)
        self.approx_measurements = []  # and its SOGNS ones
        self.step_count = self.scaler_skipped_steps = self.nonfinite_steps = 0
        self._logged = None  # (the log, its step_count) when step() last logged a row: log.step() must follow
        self.record_path = None
        self.write_record(out_dir if out_dir is not None else getattr(log, "out_dir", None))

    def write_record(self, out_dir: Optional[str]) -> None:
        """Write out_dir/PARAMETERS_JSON, what each tracked parameter is (nothing when out_dir is None)."""
        if out_dir:
            self.record_path = write_parameter_record(out_dir, self.describe())

    def _warn_once(self, reasons):
        """Warn about each parameter once."""
        for name, reason in reasons.items():
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"GNS: not tracking {name}: {reason}")

    @property
    def gns(self) -> float:
        """The running GNS (NaN until a step with B > 1 and a positive |G|^2 EMA)."""
        return self.running.gns

    @property
    def dropped(self) -> Set[str]:
        """The parameters no longer measured since a step found them used more than once per forward."""
        return {name for name, reason in self.untracked.items() if reason.startswith("used")}

    def describe(self) -> Dict[str, Dict[str, Any]]:
        """{logged name: layer kind, class, block, names, elements} (see describe_tracked)."""
        return describe_tracked(self.model, self.tracked)

    def _scaler_on(self):
        return self.scaler is not None and self.scaler.is_enabled()

    def measure(self, batch_size: Optional[int] = None, gradients_unscaled: bool = False) -> List[Measurement]:
        """The exact Measurements of this step (B = batch_size examples over all micro-batches and ranks), without
        zeroing the buffers or logging ([] for a step the GradScaler will skip); the SOGNS ones, where layers record
        them, go to `approx_measurements`.

        Args:
            batch_size: B; None takes the examples the layers counted (the count most tracked tensors report, as a
                layer used twice per forward counts 2 B), for trainers that do not say (integrations.py).
            gradients_unscaled: the GradScaler has unscaled the gradients already (Lightning does before its
                hook); the per-example norms, made in backward, still carry the scale.
        Raises ValueError when a buffer's count of examples is not batch_size (or a forward's rows could not be
        mapped to its examples), when a parameter whose layer recorded examples has no gradient, and when one
        with a gradient had no example recorded."""
        if self.row_map.mixing:  # every rank's model mixes alike: each refuses here, before the all-reduce
            (layer, why), *others = self.row_map.mixing.items()
            raise StepNotMeasured(
                f"GNS: this step is not measured: {layer} mixes the examples of the batch: {why}"
                + (f" (and {len(others)} more such layers)" if others else "")
            )
        self.row_map.finish()  # what the last forward's uses left pending (core/uses.py)
        values, finite, no_grad = self.reader.read(self._scaler_on())
        self.step_count += 1
        self.measurements, self.approx_measurements = [], []
        if not finite:
            self.scaler_skipped_steps += 1
            return []
        if len(values) and not np.any(values[:, 2] != 0):  # nan counts a refused forward, not an absent one
            raise StepNotMeasured(
                f"GNS: step() found no example in any of the {len(values)} tracked layers' buffers (no backward of a "
                "converted model since the last step): call monitor.step() after the step's last loss.backward(), "
                "once per optimizer step, before optimizer.zero_grad()"
            )
        if batch_size is None:  # the count most tracked tensors report (a layer shared across depth counts k B)
            counted = [c for c in values[:, 2].tolist() if c > 0 and not math.isnan(c)]
            batch_size = int(min(set(counted), key=lambda c: (-counted.count(c), c))) if counted else 0
        if batch_size == 1 and "batch of one" not in self._warned:  # the norms are measured; the GNS is undefined
            self._warned.add("batch of one")
            warnings.warn(
                "GNS: step(batch_size=1): the norms are measured, but the GNS compares each example's gradient with "
                "their mean, which one example cannot give (|G|^2 and tr(Sigma) divide by B - 1): it stays nan; use 2 "
                "or more examples per optimizer step (micro-batch size x accumulation steps x ranks)"
            )
        scale = self.scaler.get_scale() if self._scaler_on() else 1.0
        scales = (1.0 if gradients_unscaled else scale, scale)  # (of the batch gradient, of the per-example parts)
        n_exact = len(self.tracked)
        exact = self._measurements(self.tracked, values[:n_exact], no_grad, batch_size, scales)
        approx = self._measurements(self.approx_tracked, values[n_exact:], no_grad, batch_size, scales, False)
        if exact and not np.isfinite([(m.norm, m.rms_pe_norm) for m in exact]).all():
            self.nonfinite_steps += 1
        self.measurements, self.approx_measurements = exact, approx
        return exact

    def _measurements(self, tracked, values, no_grad, batch_size, scales, exact=True):
        """Measurements from the read values (an (n, 3) array: ||grad||^2, summed buffer sums, counts) of the
        tracked entries. The numbers are formed for all entries at once; only an entry whose count is not the batch
        size, or that has no gradient or was dropped earlier, is looked at on its own (`_usable`)."""
        world = world_size()  # DDP and FSDP2 average the ranks' gradients: each example's part is divided by it
        grad_sq, sums, counts = values[:, 0], values[:, 1], values[:, 2]
        # each example's part of the averaged gradient is (local contribution) / world and equals g_i / B, so
        # mean_i ||g_i||^2 = (B / world)^2 * (sum of the contributions' squared norms) / B. GradScaler multiplies
        # every gradient by scale. nan stays nan; a sum pushed below 0 by rounding (tied cross term) is nan too
        pe_sqnorm = sums * batch_size / world**2
        with np.errstate(invalid="ignore"):  # the square roots of negative numbers are replaced by nan
            norms = np.where(grad_sq >= 0, np.sqrt(grad_sq), math.nan) / scales[0]
            rms_pe_norms = np.where(pe_sqnorm >= 0, np.sqrt(pe_sqnorm), math.nan) / scales[1]
        names = [entry.name for entry in tracked]
        usable = counts == batch_size
        flagged = set(no_grad).union(self.untracked if exact else ())
        looked_at = np.flatnonzero(~usable).tolist()
        if flagged:
            looked_at = sorted(set(looked_at).union(i for i, name in enumerate(names) if name in flagged))
        # a count of k x B means k uses per example only beside parameters that counted B; when none did,
        # batch_size itself is wrong (e.g. the micro-batch size, or one rank's share), which is an error
        some_counted_batch_size = bool(usable.any())
        for i in looked_at:
            usable[i] = self._usable(
                tracked[i], grad_sq[i], counts[i], batch_size, no_grad, some_counted_batch_size, exact
            )
        if exact:
            self._check_possible(names, usable, grad_sq / scales[0] ** 2, pe_sqnorm / scales[1] ** 2)
        step = self.step_count - 1
        return [
            Measurement(
                norm=norm, rms_pe_norm=rms_pe_norm, batch_size=batch_size, metadata={"name": name, "step": step}
            )
            for name, norm, rms_pe_norm, measured in zip(names, norms.tolist(), rms_pe_norms.tolist(), usable.tolist())
            if measured
        ]

    def _check_possible(self, names, measured, norm_sq, pe_sqnorm):
        """Refuse the step, naming the parameter, when a measurement has mean_i ||g_i||^2 below ||mean_i g_i||^2,
        which no examples can give (Jensen): part of its gradient came from a use its layer did not record."""
        with np.errstate(invalid="ignore"):
            impossible = (
                measured
                & (pe_sqnorm < (1 - IMPOSSIBLE_TOLERANCE) * norm_sq)
                & (norm_sq >= NUMERICALLY_ZERO)  # (a key projection's bias: its float32 sums underflow)
                & np.isfinite(norm_sq)
                & np.isfinite(pe_sqnorm)
            )
        if impossible.any():
            i = int(np.flatnonzero(impossible)[0])
            raise StepNotMeasured(
                f"GNS: {names[i]}: this step is not measured: its per-example norms give mean_i ||g_i||^2 = "
                f"{pe_sqnorm[i]:.4g}, below ||mean_i g_i||^2 = {norm_sq[i]:.4g}, which no examples can give: its "
                "gradient comes in part from a use its layer did not record (code outside the module's forward "
                "reading the parameter, a hook changing the gradient). Leave it out of convert() (exclude=[its "
                "module]) or call functional.py's per-example functions where it is used"
            )

    def _usable(self, entry, grad_sq, count, batch_size, no_grad, some_counted_batch_size, exact):
        """Whether an entry whose count is not batch_size, or that has no gradient or was dropped, is measured this
        step: False for a layer unused this step or a tensor dropped (now or earlier); raises for a count that
        cannot be this step's."""
        name = entry.name
        if math.isnan(count):
            raise self._count_error(entry, count, batch_size)
        if count == 0:
            if exact and grad_sq > 0 and name not in no_grad:
                raise StepNotMeasured(
                    f"GNS: {name} has a gradient (norm {math.sqrt(grad_sq):.3g}) but its layer recorded no "
                    f"example in this step: the parameter was used by code other than its layer's forward (e.g. "
                    f"a parent module reading its weight), so its per-example norms are unknown. Call "
                    f"functional.py's per-example functions where it is used, or leave it out of convert()"
                )
            return False  # the layer was not used in this step
        if name in no_grad:
            raise StepNotMeasured(
                f"GNS: {name}: its layer recorded {count:.0f} examples in this step but the parameter has no "
                f"gradient (.grad is None), so there is no batch gradient to compare them with. Call step() "
                f"after the last backward and before optimizer.zero_grad(); if the parameter was frozen after "
                f"the monitor was made, make the monitor again (frozen parameters are not tracked)"
            )
        if exact and name in self.untracked:
            return False  # stopped being measured at an earlier step
        if count != batch_size and count % batch_size == 0 and some_counted_batch_size and exact:
            reason = (
                f"used {count / batch_size:.0f} times per example (a module or bank slice used more than "
                "once per forward, e.g. shared across depth) and its uses' per-example gradients were not summed "
                "(they are in an eager backward, core/uses.py; not in a backward compiled by torch.compile, nor "
                f"for a layer kind that hands over no per-example factors); not measured since step {self.step_count - 1}"
            )
            self._warn_once({name: reason})
            self.untracked[name] = reason
            return False
        if count != batch_size:
            raise self._count_error(entry, count, batch_size)
        return True

    def _count_error(self, entry, count, batch_size):
        """The StepNotMeasured for a buffer that counted `count` examples in a step of `batch_size` (NaN: refused)."""
        if math.isnan(count):
            reasons = {
                reason
                for module, buffer_name, _ in entry.terms
                for reason in self.row_map.reasons(module._buffers[buffer_name])
            }
            why = "; ".join(sorted(reasons)) or "on another rank, a layer's input rows could not be mapped"
            return StepNotMeasured(
                f"GNS: {entry.name}: this step is not measured: no example's own gradient can be told apart ({why}). "
                f"See layout.py for the rows that can be mapped; for a layout of your own, pass "
                f"layout.install(model, layout_of=...); to leave the layer untracked, convert(model, exclude=[its path])"
            )
        if self.row_map.forwards == 0:
            return StepNotMeasured(
                f"GNS: {entry.name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}), and no "
                f"forward of the converted model ran this step: its layers were called by other code (a submodule "
                f"called directly, such as model.transformer(...)), so no layer was told which rows are whose; call "
                f"the converted model itself, or convert the module your code calls"
            )
        return StepNotMeasured(
            f"GNS: {entry.name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}); "
            f"pass the number of examples of the whole step (micro-batch size x accumulation steps x "
            f"ranks, or the number of packed sequences); if {batch_size} is that number, the model's forward ran "
            f"more than once for the same examples (each forward's rows count as examples of their own), and a loss "
            f"that combines several forwards per example (chosen and rejected, as in DPO) has no per-example "
            f"gradient this monitor can measure: do not pass the larger count"
        )

    def step(self, batch_size: Optional[int] = None, gradients_unscaled: bool = False) -> Dict[str, float]:
        """Measure this step (B = batch_size examples over all micro-batches and ranks; see `measure`), zero the
        buffers, update the running GNS and log the row; returns the row.

        Raises StepNotMeasured (see `measure`), and when the log (a LogWrapper) has not written the row of the
        previous step: log.step() was not called since, so every step's row would overwrite the last one's."""
        written = getattr(self.log, "step_count", None)
        if self._logged is not None and self._logged[0] is self.log and self._logged[1] == written:
            self.table.zero()
            self.row_map.clear()
            raise StepNotMeasured(
                f"GNS: step() again before the log wrote the previous step's row (log.step() was not called since "
                f"step {written}): every row would overwrite the last and the log would hold the whole run as one "
                "row; call log.step() once per optimizer step, after monitor.step() and your own log.log(...)"
            )
        try:
            exact = self.measure(batch_size, gradients_unscaled)
        finally:
            self.table.zero()  # whatever happened, the next step starts from zero
            self.row_map.clear()
        approx = self.approx_measurements
        row = {
            prefix + m.metadata["name"] + suffix: value
            for prefix, found in ((self.prefix, exact), (APPROX_PREFIX, approx))
            for m in found
            for suffix, value in (("/norm", m.norm), ("/pegn", m.rms_pe_norm), ("/batch_size", m.batch_size))
        }
        row["gns"] = self.running.update(*summed_squares(exact or approx))  # the exact GNS when there is one
        if self.log is not None:
            (self.log.log if hasattr(self.log, "log") else self.log)(row)
            self._logged = (self.log, written) if written is not None else None
        return row

    def replay(self, frame: "pandas.DataFrame") -> float:
        """Rebuild the running GNS from logged rows (a load_csv DataFrame of this model's earlier steps, oldest
        first) as step() built it, each row's exact norms or else its approximate ones: for a resumed run whose
        checkpoint does not hold state_dict() (a trainer's). Returns the running GNS."""
        columns = {
            prefix: [c[: -len("/norm")] for c in frame.columns if c.startswith(prefix) and c.endswith("/norm")]
            for prefix in (self.prefix, APPROX_PREFIX)
        }
        for _, row in frame.iterrows():
            for prefix in (self.prefix, APPROX_PREFIX):
                measured = [name for name in columns[prefix] if not math.isnan(row[name + "/norm"])]
                if measured:
                    self.running.update(
                        sum(row[name + "/norm"] ** 2 for name in measured),
                        sum(row[name + "/pegn"] ** 2 for name in measured),
                        row[measured[0] + "/batch_size"],
                    )
                    break
        return self.gns

    def state_dict(self) -> Dict[str, Any]:
        return {
            "running": self.running.state_dict(),
            "step_count": self.step_count,
            "scaler_skipped_steps": self.scaler_skipped_steps,
            "nonfinite_steps": self.nonfinite_steps,
            "dropped": {name: self.untracked[name] for name in sorted(self.dropped)},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.running.load_state_dict(state["running"])
        self.step_count = state["step_count"]
        self.scaler_skipped_steps = state["scaler_skipped_steps"]
        self.nonfinite_steps = state["nonfinite_steps"]
        self.untracked.update(state["dropped"])
