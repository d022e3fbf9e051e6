"""
The gradient noise scale (GNS) estimator: unbiased |G|^2 and tr(Sigma) from
squared gradient norms at two batch sizes, their EMAs, and the GNS. Pure maths
(numpy, floats, pandas Series alike), used by the running GNS of a training run
(monitor.GNSMonitor) and by the analysis of its log (analysis/analyze.py), so
both give the same numbers.

McCandlish et al. 2018 (arXiv 1812.06162), appendix A: with B_small = 1, the
per-example gradients' mean squared norm and the batch gradient's squared norm
give |G|^2 = (B |g_B|^2 - |g_1|^2) / (B - 1) and tr(Sigma) = (|g_1|^2 - |g_B|^2) /
(1 - 1/B), and GNS = EMA(tr(Sigma)) / EMA(|G|^2).
"""

import math
from typing import TYPE_CHECKING, Dict, Tuple, Union

import numpy as np

if TYPE_CHECKING:
    import pandas

Number = Union[float, np.ndarray, "pandas.Series"]  # the functions work on each alike


def two_batch_stats(
    sq_norm_small: Number, sq_norm_big: Number, small_batch_size: Number, big_batch_size: Number
) -> Tuple[Number, Number]:
    """Unbiased |G|^2 and tr(Sigma) from the squared norms of a small-batch and a big-batch gradient.

    McCandlish et al. 2018 (arXiv 1812.06162) eq. A.2, with b examples in each small
    batch (|g_b|^2 their mean squared norm) and B in the big one:
        |G|^2     = (B * |g_B|^2 - b * |g_b|^2) / (B - b)
        tr(Sigma) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)
    Works on floats, numpy arrays and pandas Series alike (a Series stays a Series).
    Returns (gtg, trsigma), both NaN where B > b > 0 does not hold.
    """
    b = np.asarray(small_batch_size, dtype=np.float64)
    B = np.asarray(big_batch_size, dtype=np.float64)
    valid = (B > b) & (b > 0)
    b_safe, B_safe = np.where(valid, b, 1.0), np.where(valid, B, 2.0)
    gtg = np.where(valid, (B_safe * sq_norm_big - b_safe * sq_norm_small) / (B_safe - b_safe), np.nan)
    trsigma = np.where(valid, (sq_norm_small - sq_norm_big) / (1.0 / b_safe - 1.0 / B_safe), np.nan)
    if np.ndim(gtg) == 0:
        return float(gtg), float(trsigma)
    for series in (sq_norm_big, sq_norm_small):
        if hasattr(series, "index"):
            return type(series)(gtg, index=series.index), type(series)(trsigma, index=series.index)
    return gtg, trsigma


def unbiased_stats(sq_norm: Number, pe_sqnorm: Number, batch_size: Number) -> Tuple[Number, Number]:
    """Unbiased |G|^2 and tr(Sigma) from one step's squared norms: `two_batch_stats` with small batches
    of one example, i.e. the Bessel-corrected sample statistics of the per-example gradients:
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
    return two_batch_stats(pe_sqnorm, sq_norm, 1, batch_size)


def gns_from_emas(gtg_ema: Number, trsigma_ema: Number) -> Number:
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

    def __init__(self, decay: float):
        self.decay = decay
        self.value = math.nan

    def update(self, x: float) -> float:
        if not math.isfinite(x):
            return self.value
        self.value = x if math.isnan(self.value) else self.decay * self.value + (1 - self.decay) * x
        return self.value


class RunningGNS:
    """Running GNS over steps: EMAs of |G|^2 and tr(Sigma) kept separately.

    Feed it the summed squared norms of each step; `gns` is the current estimate
    (NaN until a step with B > 1 and a positive |G|^2 EMA)."""

    def __init__(self, decay: float = 0.95):
        self.gtg = EMA(decay)
        self.trsigma = EMA(decay)

    def update(self, sq_norm: float, pe_sqnorm: float, batch_size: int) -> float:
        """Add one step of per-example norms: sum of norm^2, sum of rms_pe_norm^2 (= mean pe_sqnorm), B."""
        return self.add(*unbiased_stats(sq_norm, pe_sqnorm, batch_size))

    def add(self, gtg: float, trsigma: float) -> float:
        """Add one step's unbiased |G|^2 and tr(Sigma) (a step where either is not finite is skipped)."""
        if math.isfinite(gtg) and math.isfinite(trsigma):
            self.gtg.update(gtg)
            self.trsigma.update(trsigma)
        return self.gns

    @property
    def gns(self) -> float:
        return gns_from_emas(self.gtg.value, self.trsigma.value)

    def state_dict(self) -> Dict[str, float]:
        return {"decay": self.gtg.decay, "gtg": self.gtg.value, "trsigma": self.trsigma.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.gtg.value, self.trsigma.value = state["gtg"], state["trsigma"]
