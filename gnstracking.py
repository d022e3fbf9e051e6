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


def find_tracked_parameters(model):
    """Split `model`'s parameters by whether their per-example norms can be read.

    Returns:
        tracked: [(name, parameter, buffer)] in `named_parameters()` order, for
            parameters whose owning module has a `<name>_upegsqnorm` buffer.
        skipped: {name: reason} for every other parameter.
    A tied parameter (one tensor registered under several names, such as
    nanoGPT's wte/lm_head) is skipped: each use's buffer only holds that use's
    per-example norms, and the exact norm of their sum needs the cross term.
    """
    buffers = dict(model.named_buffers())
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tracked, skipped = [], {}
    for name, param in model.named_parameters():
        buffer = buffers.get(name + BUFFER_SUFFIX)
        names = aliases[id(param)]
        if buffer is None:
            skipped[name] = "its layer records no per-example norms (a plain torch layer)"
        elif len(names) > 1:
            skipped[name] = f"tied to {', '.join(n for n in names if n != name)}: exact per-example norm of a shared tensor needs the cross term"
        else:
            tracked.append((name, param, buffer))
    return tracked, skipped


class MeasurementTracker:
    """Reads every per-example norm buffer of a model once per optimizer step.

    Args:
        tracked: [(name, parameter, buffer)], see `find_tracked_parameters`.
        callback: a callable, or a list of callables, given each Measurement.
        scaler: the GradScaler of fp16 training, or None; its scale is divided out.
    Call `step(batch_size=B)` after the last micro-batch's backward and before
    gradient clipping / `scaler.unscale_` / `scaler.step`, then
    `zero_sqgradnorm_buffers(model)`.
    """

    def __init__(self, tracked, callback=None, scaler=None, skipped=None):
        self.tracked = tracked
        if callback is None:
            callback = []
        self.callbacks = list(callback) if isinstance(callback, (list, tuple)) else [callback]
        self.scaler = scaler
        self.skipped = dict(skipped or {})
        self.step_count = 0

    @classmethod
    def from_model(cls, model, callback=None, scaler=None):
        tracked, skipped = find_tracked_parameters(model)
        for name, reason in skipped.items():
            if reason.startswith("tied"):
                warnings.warn(f"GNS: not tracking {name}: {reason}")
        return cls(tracked, callback=callback, scaler=scaler, skipped=skipped)

    def read(self):
        """Per tracked parameter: (||grad||^2, sum_i ||g_i||^2, examples counted), in one host sync.

        The buffer holds [sum_i ||g_i / n||^2, n] for the n examples this process
        saw, so sum_i ||g_i||^2 = buffer[0] * n^2. Under torch.distributed the sums
        and counts of all ranks are added (one small all-reduce), so the mean
        covers every example of the global batch; p.grad is already all-reduced.
        """
        rows = []
        for _, param, buffer in self.tracked:
            grad_sq = torch.linalg.vector_norm(param.grad, dtype=norm_dtype(param.grad)).double() ** 2 if param.grad is not None else torch.zeros((), device=buffer.device)
            sums = buffer.double()
            rows.append(torch.stack([grad_sq.to(buffer.device, torch.float64), sums[0] * sums[1] ** 2, sums[1]]))
        if not rows:
            return torch.zeros(0, 3, dtype=torch.float64)
        values = torch.stack(rows)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
            if world_size > 1:
                sums = values[:, 1:].clone()
                torch.distributed.all_reduce(sums)
                values = torch.cat([values[:, :1], sums], dim=1)
        return values.cpu()

    def step(self, batch_size, step=None):
        """Emit one Measurement per tracked parameter that took part in this step; returns them."""
        values = self.read()
        scale = self.scaler.get_scale() if self.scaler is not None and self.scaler.is_enabled() else 1.0
        measurements = []
        for (name, _, _), (grad_sq, pe_sqnorm_sum, count) in zip(self.tracked, values.tolist()):
            if count == 0:
                continue  # the layer was not used in this step
            if count != batch_size:
                raise ValueError(f"GNS: {name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}); "
                                 f"pass the number of examples of the whole step (micro-batch size x accumulation steps x ranks)")
            # GradScaler multiplies every gradient by scale, so squared norms by scale^2
            measurement = Measurement(
                big_batch_norm=math.sqrt(grad_sq) / scale,
                small_batch_norm=math.sqrt(pe_sqnorm_sum / count) / scale,
                big_batch_size=batch_size,
                small_batch_size=1,
                metadata={"name": name, "step": self.step_count if step is None else step},
            )
            for callback in self.callbacks:
                callback(measurement)
            measurements.append(measurement)
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
