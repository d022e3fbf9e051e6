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
sharded after the monitor was made (FSDP2) is read correctly, and the monitor follows
the model (following.py): a head attached, an embedding resized, a block unfrozen or
frozen after it was made are noticed at the next step, measured or listed with the reason.

A step is read in a handful of ops whatever the model's size (StepReader): every
buffer is a view of one flat tensor (BufferTable), the gradients' norms come from
one torch._foreach_norm, the ranks' sums from one all-reduce, and the numbers reach
the host in one sync. Under data parallelism (DDP, FSDP2, HSDP) each rank's backward
gives its examples' parts of the gradient, which the engine averages over the world:
example i's gradient g_i is B / world times its local part, whatever each rank's
share of the B examples (so unequal shares are exact).
"""

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Set, Union

import numpy as np
import torch
import torch.nn as nn

from nanogns.core.layout import install
from nanogns.core.module_state import state_of
from nanogns.errors import NotSupported, StepNotMeasured
from nanogns.estimator import RunningGNS
from nanogns.kinds import batchnorm
from nanogns.monitor.following import ModelShape, changes, describe_changes
from nanogns.monitor.mixing import MixingCheck
from nanogns.monitor.reader import StepReader, buffer_table, world_size
from nanogns.monitor.tracked import (
    Measurement,
    describe_tracked,
    find_tracked_parameters,
    shared_tensors,
    summed_squares,
)
from nanogns.runlog.record import write_parameter_record
from nanogns.runlog.writer import LogWrapper
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
        check_mixing: at the first step in each training mode, check that no example's outputs depend on another
            example's inputs (monitor/mixing.py: one more forward and two backward passes, once), and refuse the
            steps of a forward that mixes them, as a BatchNorm's.
        converter: converter(model, [(path, module, parent)]) -> {path: why not}, converting layers attached after
            the monitor was made (convert() passes its choices); without one they are listed in `untracked`.
    The monitor follows the model (`follow`, monitor/following.py): parameters added, removed, resized, frozen or
    unfrozen later are noticed at the next step, measured or listed in `untracked`, and named in one warning.
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
        check_mixing: bool = True,
        converter: Optional[Callable[[nn.Module, list], Dict[str, str]]] = None,
    ):
        self._warned = set()  # parameters warned about (once each)
        self.row_map = install(model)  # each forward's examples, read by every layer (core/layout.py)
        self.model, self.log, self.scaler, self.prefix = model, log, scaler, prefix
        self.unconverted = dict(unconverted or {})
        self.converter = converter  # convert()'s choices, applied to layers attached later (follow)
        self.untracked = {}
        self._track()
        if expect_tracked and not self.tracked and not self.approx_tracked:
            raise NotSupported(
                f"GNSMonitor: no parameter of {type(model).__name__} has a per-example norm layer; convert "
                "it first (nanogns.convert(model)) or build it with per-example norm layer classes"
            )
        self.shape = ModelShape(model)  # the parameters as last looked at (follow)
        self.mixing = MixingCheck() if check_mixing else None  # the first step's check, per training mode
        self.row_map.watch_steps(self)  # at_step_start at the first forward of every step
        self.running = RunningGNS(decay=ema_decay)
        self.measurements = []  # the last step's exact Measurements (e.g. for a GNS over some of the parameters)
        self.approx_measurements = []  # and its SOGNS ones
        self.step_count = self.scaler_skipped_steps = self.nonfinite_steps = 0
        self._logged = None  # (the log, its step_count) when step() last logged a row: log.step() must follow
        self.record_path = None
        self._counts = {}  # {logged name: the count of examples its buffer recorded} of the last step read
        self.write_record(out_dir if out_dir is not None else getattr(log, "out_dir", None))

    def _track(self):
        """What is measured, found from the model as it is now: the tracked tensors and the reasons of the others
        (those found used twice per forward keep theirs), the tensors several modules record, the step's reader."""
        model = self.model
        batchnorm.watch(model, self.row_map)  # a forward normalising with the batch's statistics is refused
        dropped = {name: reason for name, reason in self.untracked.items() if reason.startswith("used")}
        self.tracked, self.untracked = find_tracked_parameters(model)
        names = {entry.name for entry in self.tracked}
        self.untracked.update({name: reason for name, reason in dropped.items() if name in names})
        self.row_map.shared = shared_tensors(self.tracked)  # tensors several modules record (core/uses.py)
        self.approx_tracked, _ = find_tracked_parameters(model, SOGNS_SUFFIX)
        self._warn_once({name: reason for name, reason in self.untracked.items() if reason.startswith("tied")})
        self.table = buffer_table(model)  # (after tied.py's buffers; rebuilt now, before a forward notes any address)
        if not self.table.current():
            self.table.build()
        tracked_ids = {id(entry.ref.get()) for entry in self.tracked}
        others = lambda: [p.grad for p in model.parameters() if id(p) not in tracked_ids and p.grad is not None]  # noqa: E731
        self.reader = StepReader(self.table, self.tracked + self.approx_tracked, others)

    def follow(self) -> None:
        """Measure the model as it is now (monitor/following.py): when parameters were added, removed, resized,
        frozen or unfrozen since the monitor last looked, the layers attached since are converted (by a monitor that
        convert() made, with its choices), what is measured is found again, and one warning says what changed and
        whether each parameter is measured; `untracked` gives the reason of every one that is not. A check in C
        when nothing changed; at the first forward of each step and at each read."""
        if self.shape.same():
            return
        attached = self.shape.added_modules()
        if attached and self.converter is not None:  # converted before their first forward runs
            self.unconverted.update(self.converter(self.model, attached))
        before = self.shape.parameters
        self._track()
        self.shape.take()
        paths = {path for path, _ in self.model.named_modules()}
        self.unconverted = {path: why for path, why in self.unconverted.items() if path in paths}
        found = changes(before, self.shape.parameters)
        if not found:  # the same names and shapes (an engine's new parameter objects, FSDP2's)
            return
        step = self.step_count
        for name in found.added:
            if name in self.untracked:
                self.untracked[name] = f"attached after step {step}: {self.untracked[name]}"
        warnings.warn(describe_changes(found, {entry.name for entry in self.tracked}, self.untracked, step))
        if self.record_path:  # what each parameter is, the ones measured from now on added
            self.write_record(os.path.dirname(self.record_path))

    def at_step_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Called by the root's pre-hook at the first forward of each step (core/mapper.py:RowMapper.start_step):
        the monitor follows the model before its layers run, and the first step keeps the forward's inputs for the
        mixing check (monitor/mixing.py). A model the monitor cannot measure as it now is (sharded by tensor
        parallelism after the monitor was made) is refused when the step is read, where the caller expects it, not
        in the middle of the model's forward: follow() runs again there and raises the same refusal."""
        try:
            self.follow()
        except ValueError:
            pass
        if self.mixing is not None:
            self.mixing.note_inputs(module, args, kwargs)
            self.row_map.later_forwards_watched = self.mixing.pending is not None

    def at_later_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Called by the root's pre-hook at a later forward with gradients of a step whose first forward the mixing
        check holds: a forward of one example tells nothing, so the check takes the step's first of more
        (micro-batches of 1 and 3 examples are checked on the 3)."""
        if self.mixing is not None:
            self.row_map.later_forwards_watched = self.mixing.note_later(module, args, kwargs, self.row_map.layouts)

    def write_record(self, out_dir: Optional[str]) -> None:
        """Write out_dir/PARAMETERS_JSON, what each tracked parameter is (nothing when out_dir is None); a
        parameter measured earlier in the run stays in it."""
        if out_dir:
            self._recorded = {**getattr(self, "_recorded", {}), **self.describe()}
            self.record_path = write_parameter_record(out_dir, self._recorded)

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

    def explain(self) -> Dict[str, str]:
        """{module path: how its parameters are measured, and why} for every module that owns a trainable parameter:
        the path of convert() that measures it (conversion/convert.py's PATHS, most specific first: a kind's layer by
        its class or structure, found by a probe, its own forward with its parameters' uses followed, replayed per
        example) and why that path, the layer class it was built with, the module whose path measures it as part of
        its subtree, or why it is not measured."""
        modules = dict(self.model.named_modules())
        found = {}
        for path, module in modules.items():
            noted = state_of(module).measured_by
            if noted is None and not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            label = path or "(the model itself)"
            if path in self.unconverted:
                found[label] = f"not measured: {self.unconverted[path]}"
            elif noted is not None:
                found[label] = "{}: {}; {}".format(*noted)
            elif getattr(module, "pe_kind", None):
                found[label] = f"the {module.pe_kind} kind's {type(module).__name__}, which the model was built with"
            else:
                found[label] = self._explain_unnoted(path, module, modules)
        return found

    def _explain_unnoted(self, path, module, modules):
        """A module with trainable parameters that no path converted: measured with an ancestor's subtree, or why
        its parameters are not measured."""
        parts = path.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = ".".join(parts[:depth])
            noted = state_of(modules[ancestor]).measured_by
            if noted is not None:
                return f"measured with {ancestor or '(the model itself)'} ({noted[0]}: {noted[1]})"
        names = [f"{path}.{n}" if path else n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        reasons = sorted({self.untracked[n] for n in names if n in self.untracked})
        return "not measured: " + ("; ".join(reasons) if reasons else "no layer records its parameters")

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
        self.follow()  # parameters added, removed, resized, frozen or unfrozen since the last look
        self.row_map.finish()  # what the last forward's uses left pending (core/uses.py)
        if self.mixing is not None:  # the first step in a training mode: examples mixed by an op of the forward
            self.mixing.run(self.row_map, self.table)
            self.mixing.note(self.row_map)
        if self.row_map.mixing:  # every rank's model mixes alike: each refuses here, before the all-reduce
            (layer, why), *others = self.row_map.mixing.items()
            raise StepNotMeasured(
                f"GNS: this step is not measured: {layer} mixes the examples of the batch: {why}"
                + (f" (and {len(others)} more such layers)" if others else "")
            )
        scaler_on = self._scaler_on()
        values, finite, no_grad = self.reader.read(scaler_on)
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
        scale = self.scaler.get_scale() if scaler_on else 1.0
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
        if exact:
            self._counts = dict(zip(names, counts.tolist()))  # what a count error says the layers recorded
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
                tracked[i], grad_sq[i], counts[i], batch_size, no_grad, some_counted_batch_size, exact, sums[i]
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

    def _usable(self, entry, grad_sq, count, batch_size, no_grad, some_counted_batch_size, exact, total=math.nan):
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
        if name in no_grad and total == 0:
            return False  # not used by the step's forwards: a module replayed per example with its subtree (replay.py)
            # records a zero gradient for each of its parameters, a bias its code leaves out included
        if name in no_grad:
            raise StepNotMeasured(
                f"GNS: {name}: its layer recorded {count:.0f} examples in this step but the parameter has no "
                f"gradient (.grad is None), so there is no batch gradient to compare them with. Call step() "
                f"after the last backward and before optimizer.zero_grad()"
            )
        if exact and name in self.untracked:
            return False  # stopped being measured at an earlier step
        if count != batch_size and count % batch_size == 0 and some_counted_batch_size and exact:
            uses = self._uses_per_forward(entry)
            if uses == 1:  # used once per forward: its forward's input holds several rows per example
                raise self._count_error(entry, count, batch_size)
            how = (
                f"used {uses} times in the last forward" if uses else "its uses per forward not counted (torch.compile)"
            )
            reason = (
                f"counted {count / batch_size:.0f} x {batch_size} examples, {how}, and those uses' per-example "
                "gradients were not summed (they are in an eager backward, core/uses.py; not in a backward compiled by "
                f"torch.compile, nor for a layer kind that hands over no per-example factors); not measured since step "
                f"{self.step_count - 1}"
            )
            self._warn_once({name: reason})
            self.untracked[name] = reason
            return False
        if 0 < count < batch_size and some_counted_batch_size and exact and self._missed_forwards(batch_size):
            return True  # its layer's backward ran for some of the step's forwards only (LayerDrop skipped it, or the
            # loss did not reach it): the examples of the others have a zero gradient of it, which the sums hold
        if count != batch_size:
            raise self._count_error(entry, count, batch_size)
        return True

    def _missed_forwards(self, batch_size):
        """True when this process's forwards with gradients read exactly the step's batch_size examples (one
        process only: under DDP the other ranks' forwards are not seen here)."""
        read = sum(found.examples for found in self.row_map.layouts if found is not None)
        return world_size() == 1 and read == batch_size and all(found is not None for found in self.row_map.layouts)

    def _uses_per_forward(self, entry):
        """How many times the last forward used the entry's tensor (its layers' note_uses), 0 when not counted."""
        last = self.row_map.last_pass
        if last is None:
            return 0
        found = [last.uses.get(module._buffers[buffer_name].data_ptr(), 0) for module, buffer_name, _ in entry.terms]
        return max(found, default=0)

    def _observed(self):
        """What this step's forwards and layers showed, in words: the forwards, their examples and token grids, and
        the counts the tracked parameters recorded (each count with how many parameters and one of them)."""
        layouts = [found for found in self.row_map.layouts if found is not None]
        forwards = self.row_map.forwards
        parts = [f"{forwards} forward{'s' * (forwards != 1)} of the converted model with gradients"]
        if layouts:
            shapes = []
            for found in layouts:
                grids = "/".join(
                    f"({found.examples * k}, {T})" for T in found.lengths[:1] for k in (found.groups or (1,))
                )
                shapes.append(f"{found.examples}" + (f" ({grids} token grid)" if grids else ""))
            parts.append("reading " + ", ".join(shapes) + " examples (dim 0 of their inputs)")
        by_count = {}
        for name, counted in self._counts.items():
            if not math.isnan(counted):
                by_count.setdefault(counted, []).append(name)
        if by_count:
            parts.append(
                "the tracked parameters counted "
                + "; ".join(
                    f"{c:.0f} ({len(names)} of them, e.g. {names[0]})"
                    for c, names in sorted(by_count.items(), key=lambda item: -len(item[1]))
                )
            )
        return ", ".join(parts)

    def _count_error(self, entry, count, batch_size):
        """The StepNotMeasured for a buffer that counted `count` examples in a step of `batch_size` (NaN: refused): what
        was observed, and the remedies that fit it (never a guessed cause)."""
        if math.isnan(count):
            reasons = {
                reason
                for module, buffer_name, _ in entry.terms
                for reason in self.row_map.reasons(module._buffers[buffer_name])
            }
            why = "; ".join(sorted(reasons)) or "on another rank, a layer's input rows could not be mapped"
            remedy = (
                "to leave the tower untracked, convert(model, exclude=[its path])"
                if "whose images cannot be told apart" in why
                else "see nanogns/core/rowmaps.py for the rows that can be mapped; for a layout of your own, pass "
                "nanogns.core.layout.install(model, layout_of=...); to leave the layer untracked, convert(model, exclude=[its path])"
            )
            return StepNotMeasured(
                f"GNS: {entry.name}: this step is not measured: no example's own gradient can be told apart ({why}). "
                + remedy[0].upper()
                + remedy[1:]
            )
        if self.row_map.forwards == 0:
            return StepNotMeasured(
                f"GNS: {entry.name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}), and no "
                f"forward of the converted model ran this step: its layers were called by other code (a submodule "
                f"called directly, such as model.transformer(...)), so no layer was told which rows are whose; call "
                f"the converted model itself, or convert the module your code calls"
            )
        read = sum(found.examples for found in self.row_map.layouts if found is not None)
        remedies = []
        if read and read != batch_size and read == count:
            remedies.append(f"if the step's examples are the {read} its forwards read, pass batch_size={read}")
        if count > batch_size and count % batch_size == 0:
            k = int(count // batch_size)
            remedies.append(
                f"if each example is {k} rows of its forward's input, one after the other (a chosen and a rejected "
                f"answer, {k} text queries for one image), say so before convert(model): "
                f"nanogns.core.layout.install(model, layout_of=nanogns.core.layout.grouped({k}))"
            )
        forwards = [found for found in self.row_map.layouts if found is not None]
        if len(forwards) > 1 and count > batch_size:
            remedies.append(
                "if some of these forwards ran on the same examples again (a SAM step's second pass), measure one "
                "pass: nanogns.zero_pe_sqnorm_buffers(model) between the passes (docs/integrations.md, SAM)"
            )
        if count < batch_size:
            remedies.append(
                "if one row of the input holds several examples (packed sequences separated by a block mask), pass "
                "position_ids restarting at 0 at each sequence (or cu_seq_lens_q), or "
                "layout.install(model, layout_of=...) giving layout.Layout(examples, packed=layout.ragged(example_of_row, "
                "examples))"
            )
        remedies.append("to leave the layer untracked, convert(model, exclude=[its path])")
        return StepNotMeasured(
            f"GNS: {entry.name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}) says the step "
            f"had {batch_size}. Observed this step: {self._observed()}. A forward counts the rows of its "
            f"input's dim 0 as its examples. Remedies: " + "; ".join(remedies)
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
        self.emit(row)
        if self.log is not None:
            self._logged = (self.log, written) if written is not None else None
        return row

    def emit(self, row: Dict[str, float]) -> None:
        """Hand the step's row to `log`: a LogWrapper keeps it until the caller's LogWrapper.step writes it
        (runlog/writer.py), another object with a `log(dict)` method (LogSink) or a callable (wandb's run.log)
        takes it now."""
        log = self.log
        if log is None:
            return
        if isinstance(log, LogWrapper) or hasattr(log, "log"):  # runlog/writer.py:LogWrapper.log, or a LogSink's
            log.log(row)
        else:
            log(row)

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
