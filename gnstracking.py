"""
Measurements of gradient norms and per-example gradient norms, and the gradient
noise scale (GNS) estimator built from them.

One optimizer step gives, for each tracked parameter p,
    norm = ||p.grad||                    the batch gradient's norm
    pegn = sqrt(mean_i ||g_i||^2)        from the layer's `<p>_upegsqnorm` buffer
    batch_size = B                       examples in the step (all micro-batches, all ranks)
(see buffered.py for how the buffers are filled). `unbiased_stats` turns the
squared norms, summed over the parameters of interest, into unbiased estimates
of |G|^2 and tr(Sigma); GNS = EMA(tr(Sigma)) / EMA(|G|^2). gns-analysis.py and
the running estimate in train.py's status line both use these functions.

Usage in a training loop:

    accumulate = AccumulateMeasurements(prefix="train/gns/")
    tracker = MeasurementTracker.from_model(model, callback=accumulate)
    ...backward of every micro-batch...
    tracker.step(batch_size=B)        # before clipping and before scaler.step
    zero_sqgradnorm_buffers(model)
    log(accumulate.get_msg())         # {"train/gns/<name>/norm": ..., "/pegn": ..., "/batch_size": ...}
"""

import dataclasses
import math
import warnings
from typing import Any, Dict

import numpy as np
import torch

from buffered import BUFFER_SUFFIX, norm_dtype
from tied import link_tied_parameters


def unbiased_stats(sq_norm, pe_sqnorm, batch_size):
    """Unbiased |G|^2 and tr(Sigma) from one step's squared norms.

    McCandlish et al. 2018 (arXiv 1812.06162) eq. A.2 with B_small = 1, i.e. the
    Bessel-corrected sample statistics of the per-example gradients:
        |G|^2     = (B * |g_B|^2 - mean_i |g_i|^2) / (B - 1)
        tr(Sigma) = (mean_i |g_i|^2 - |g_B|^2) / (1 - 1/B)

    Args:
        sq_norm: squared norm of the batch-mean gradient |g_B|^2.
        pe_sqnorm: mean over examples of the squared per-example gradient norm.
        batch_size: B. Works on floats, numpy arrays and pandas Series alike.
    Returns:
        (gtg, trsigma). Both are NaN where B <= 1: one example gives no
        estimate of the noise, so the GNS is undefined there.
    """
    batch_size = np.asarray(batch_size, dtype=np.float64) if not np.isscalar(batch_size) else float(batch_size)
    valid = batch_size > 1
    safe_b = np.where(valid, batch_size, 2.0)
    gtg = np.where(valid, (safe_b * sq_norm - pe_sqnorm) / (safe_b - 1.0), np.nan)
    trsigma = np.where(valid, (pe_sqnorm - sq_norm) / (1.0 - 1.0 / safe_b), np.nan)
    if np.ndim(gtg) == 0:
        return float(gtg), float(trsigma)
    if hasattr(sq_norm, "index"):  # keep a pandas Series a Series
        return type(sq_norm)(gtg, index=sq_norm.index), type(sq_norm)(trsigma, index=sq_norm.index)
    return gtg, trsigma


def gns_from_emas(gtg_ema, trsigma_ema):
    """GNS = EMA(tr(Sigma)) / EMA(|G|^2); NaN where the |G|^2 EMA is not positive.

    (The paper's script clips the denominator at 1e-6 instead, which turns a
    noise-dominated estimate into a huge but plausible-looking number.)
    """
    gtg_ema = np.asarray(gtg_ema, dtype=np.float64)
    gns = np.where(gtg_ema > 0, np.asarray(trsigma_ema, dtype=np.float64) / np.where(gtg_ema > 0, gtg_ema, 1.0), np.nan)
    return float(gns) if gns.ndim == 0 else gns


class EMA:
    """Exponential moving average that skips non-finite values (as pandas'
    `ewm(alpha=1 - decay, adjust=False, ignore_na=True)` does for NaN), so one bad step does not
    poison it. `value` is NaN until the first finite update."""

    def __init__(self, decay):
        self.decay = decay
        self.value = math.nan

    def update(self, x):
        if not math.isfinite(x):
            return self.value
        self.value = x if math.isnan(self.value) else self.decay * self.value + (1 - self.decay) * x
        return self.value


class RunningGNS:
    """Running GNS over steps: EMAs of |G|^2 and tr(Sigma) kept separately.

    Feed it the summed squared norms of each step; `gns` is the current estimate
    (NaN until a step with B > 1 and a positive |G|^2 EMA)."""

    def __init__(self, decay=0.95):
        self.gtg = EMA(decay)
        self.trsigma = EMA(decay)

    def update(self, sq_norm, pe_sqnorm, batch_size):
        gtg, trsigma = unbiased_stats(sq_norm, pe_sqnorm, batch_size)
        if math.isfinite(gtg) and math.isfinite(trsigma):
            self.gtg.update(gtg)
            self.trsigma.update(trsigma)
        return self.gns

    @property
    def gns(self):
        return gns_from_emas(self.gtg.value, self.trsigma.value)


# -----------------------------------------------------------------------------
# measurements

@dataclasses.dataclass
class Measurement:
    """One parameter's norms for one step: the batch gradient's norm (big batch,
    B examples) and the root mean squared per-example gradient norm (small
    batch of 1). `metadata["name"]` is the name in `model.named_parameters()`."""

    big_batch_norm: float
    small_batch_norm: float
    big_batch_size: int
    small_batch_size: int = 1
    metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def msg(self, prefix=""):
        """The scalar fields as a flat dict, for a logger."""
        return {prefix + k: v for k, v in dataclasses.asdict(self).items() if k != "metadata"}


def summed_sqnorms(measurements):
    """(sum of norm^2, sum of pegn^2, batch size) over measurements of one step."""
    if not measurements:
        return math.nan, math.nan, 0
    sq_norm = sum(m.big_batch_norm ** 2 for m in measurements)
    pe_sqnorm = sum(m.small_batch_norm ** 2 for m in measurements)
    return sq_norm, pe_sqnorm, measurements[0].big_batch_size


def find_tracked_parameters(model, suffix=BUFFER_SUFFIX):
    """Split `model`'s parameters by whether their per-example norms can be read.

    Args:
        suffix: the buffer suffix to look for (BUFFER_SUFFIX for exact norms;
            another suffix reads another method's buffers, e.g. sogns.SOGNS_SUFFIX).
    Returns:
        tracked: [(name, parameter, terms)] in `named_parameters()` order, where
            terms = [(module, buffer name, coefficient)] whose buffers' weighted sum is the parameter's
            [sum_i ||g_i / B||^2, count]: one buffer for an ordinary parameter;
            three for a tensor tied between an Embedding and a Linear (each use's
            buffer and twice the cross term, see tied.py), logged under its names
            joined by "+".
        skipped: {name: reason} for every other parameter.
    """
    buffers = {name for name, _ in model.named_buffers()}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied = link_tied_parameters(model) if suffix == BUFFER_SUFFIX else {}
    tracked, skipped = [], {}
    for name, param in model.named_parameters():
        names = aliases[id(param)]
        if id(param) in tied:
            tracked.append(("+".join(tied[id(param)].names), param, tied[id(param)].terms))
            continue
        # one module registered under several paths (a shared module) has one owner and one exact buffer, as
        # long as it runs once per example (step() stops tracking it, with a warning, if it counts more)
        owners = {id(model.get_submodule(n.rpartition(".")[0])) for n in names}
        if len(owners) > 1 and any(n + suffix in buffers for n in names):
            skipped[name] = (f"tied to {', '.join(n for n in names if n != name)}: the exact per-example norm of a "
                             "shared tensor is recorded only for one Embedding and one Linear that both record "
                             "per-example norms (e.g. --embeddingclass=gns --linearclass=gns)")
        elif name + suffix not in buffers:
            skipped[name] = "its layer records no per-example norms (a plain torch layer)"
        else:
            module_name, _, param_name = name.rpartition(".")
            tracked.append((name, param, [(model.get_submodule(module_name), param_name + suffix, 1.0)]))
    return tracked, skipped


class MeasurementTracker:
    """Reads every per-example norm buffer of a model once per optimizer step.

    Args:
        tracked: [(name, parameter, terms)], see `find_tracked_parameters`.
        callback: a callable, or a list of callables, given each Measurement.
        scaler: the GradScaler of fp16 training, or None; its scale is divided out,
            and a step it will skip (an inf/nan gradient) is not a measurement.
        skipped: {name: reason} of the parameters not tracked.
        other_params: the model's untracked parameters, whose gradients are also
            checked for inf/nan when a scaler is on (GradScaler skips the step if
            any gradient is non-finite).
    Call `step(batch_size=B)` after the last micro-batch's backward and before
    gradient clipping / `scaler.unscale_` / `scaler.step`, then
    `zero_sqgradnorm_buffers(model)`.

    Counters: `scaler_skipped_steps` (steps not measured because the scaler
    skips them) and `nonfinite_steps` (measured steps with an inf/nan norm;
    those are passed on as inf/nan, never replaced by a number).
    """

    def __init__(self, tracked, callback=None, scaler=None, skipped=None, other_params=()):
        self.tracked = tracked
        if callback is None:
            callback = []
        self.callbacks = list(callback) if isinstance(callback, (list, tuple)) else [callback]
        self.scaler = scaler
        self.skipped = dict(skipped or {})
        self.other_params = list(other_params)
        self.step_count = 0
        self.scaler_skipped_steps = 0
        self.nonfinite_steps = 0
        self.dropped = set()  # parameters found used several times per example (see step)

    @classmethod
    def from_model(cls, model, callback=None, scaler=None, suffix=BUFFER_SUFFIX):
        """A tracker of every parameter of `model` whose layer records per-example norms.

        Links tied Embedding/Linear tensors (tied.link_tied_parameters) so that
        they are logged exactly; warns about tied tensors it cannot log exactly.
        """
        tracked, skipped = find_tracked_parameters(model, suffix)
        for name, reason in skipped.items():
            if reason.startswith("tied"):
                warnings.warn(f"GNS: not tracking {name}: {reason}")
        tracked_ids = {id(p) for _, p, _ in tracked}
        other_params = [p for p in model.parameters() if id(p) not in tracked_ids]
        return cls(tracked, callback=callback, scaler=scaler, skipped=skipped, other_params=other_params)

    def _scaler_on(self):
        return self.scaler is not None and self.scaler.is_enabled()

    def read(self):
        """Per tracked parameter: (||grad||^2, sum_i ||g_i||^2, examples counted), in one host sync.

        Returns:
            (values (n, 3) float64 on the CPU, all_grads_finite: bool). The flag
            covers the untracked parameters too, and is only computed (else True)
            when a GradScaler is on.

        The buffer holds [sum_i ||g_i / n||^2, n] for the n examples this process
        saw, so sum_i ||g_i||^2 = buffer[0] * n^2. Under torch.distributed the sums
        and counts of all ranks are added (one small all-reduce), so the mean
        covers every example of the global batch; p.grad is already all-reduced.
        """
        rows = []
        for _, param, terms in self.tracked:
            # buffers looked up on every read: module.to(device) replaces them
            buffers = [(module._buffers[buffer_name], coefficient) for module, buffer_name, coefficient in terms]
            device = buffers[0][0].device
            grad_sq = torch.linalg.vector_norm(param.grad, dtype=norm_dtype(param.grad)).double() ** 2 if param.grad is not None else torch.zeros((), device=device)
            sums = sum(coefficient * buffer.double() for buffer, coefficient in buffers)
            count = buffers[0][0][1].double()  # every term counts the same examples
            rows.append(torch.stack([grad_sq.to(device, torch.float64), sums[0] * count ** 2, count]))
        values = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)
        if rows and torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
            if world_size > 1:
                sums = values[:, 1:].clone()
                torch.distributed.all_reduce(sums)
                values = torch.cat([values[:, :1], sums], dim=1)
        if not self._scaler_on():
            return values.cpu(), True
        # GradScaler skips the step when any gradient is inf/nan: check them all in the same sync
        grads = [p.grad for p in self.other_params if p.grad is not None]
        other_sq = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).double().sum() if grads else torch.zeros((), dtype=torch.float64)
        flat = torch.cat([values[:, 0].reshape(-1).to(other_sq.device), other_sq.reshape(1)]).cpu()
        return values.cpu(), bool(torch.isfinite(flat).all())

    def step(self, batch_size, step=None):
        """Emit one Measurement per tracked parameter that took part in this step; returns them.

        Returns [] for a step the GradScaler will skip (counted in scaler_skipped_steps)."""
        values, grads_finite = self.read()
        if not grads_finite:
            self.scaler_skipped_steps += 1
            self.step_count += 1
            return []
        scale = self.scaler.get_scale() if self._scaler_on() else 1.0
        measurements = []
        for (name, _, _), (grad_sq, pe_sqnorm_sum, count) in zip(self.tracked, values.tolist()):
            if count == 0:
                continue  # the layer was not used in this step
            if count != batch_size and count % batch_size == 0 and name not in self.dropped:
                warnings.warn(f"GNS: {name} recorded {count / batch_size:.0f} uses per example (a module called more than "
                              "once per forward, e.g. shared across depth); the norm of the summed gradient needs the cross "
                              "terms between uses, so it is no longer tracked")
                self.dropped.add(name)
            if name in self.dropped:
                continue
            if count != batch_size:
                raise ValueError(f"GNS: {name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}); "
                                 f"pass the number of examples of the whole step (micro-batch size x accumulation steps x ranks)")
            # GradScaler multiplies every gradient by scale, so squared norms by scale^2.
            # nan stays nan; a sum pushed below 0 by rounding (tied cross term) is nan too, never a made-up number
            measurement = Measurement(
                big_batch_norm=math.sqrt(grad_sq) / scale if grad_sq >= 0 else math.nan,
                small_batch_norm=math.sqrt(pe_sqnorm_sum / count) / scale if pe_sqnorm_sum >= 0 else math.nan,
                big_batch_size=batch_size,
                small_batch_size=1,
                metadata={"name": name, "step": self.step_count if step is None else step},
            )
            for callback in self.callbacks:
                callback(measurement)
            measurements.append(measurement)
        if any(not (math.isfinite(m.big_batch_norm) and math.isfinite(m.small_batch_norm)) for m in measurements):
            self.nonfinite_steps += 1
        self.step_count += 1
        return measurements


class AccumulateMeasurements:
    """Callback collecting a step's measurements as CSV columns
    `<prefix><name>/norm`, `/pegn`, `/batch_size`; `get_msg()` hands them over and clears."""

    def __init__(self, prefix="train/gns/"):
        self.prefix = prefix
        self.msg = {}

    def __call__(self, measurement):
        key = self.prefix + measurement.metadata["name"]
        self.msg[key + "/norm"] = measurement.big_batch_norm
        self.msg[key + "/pegn"] = measurement.small_batch_norm
        self.msg[key + "/batch_size"] = measurement.big_batch_size

    def get_msg(self):
        msg, self.msg = self.msg, {}
        return msg
