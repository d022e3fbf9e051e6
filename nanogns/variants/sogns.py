"""
Scaled Output GNS (SOGNS): the approximate per-example norms of "Efficient and
Approximate Per-Example Gradient Norms for Gradient Noise Scale" (Gray, Samar,
Hestness, WANT@NeurIPS 2023), beside the exact ones, for Linear layers.

For example i of a Linear layer, with input rows x_t (K features) and output
gradients g_t (L features), t = 1..T:

    exact    ||dW_i||^2 = sum_{s,t} (g_s . g_t)(x_s . x_t)
    SOGNS    ||dW_i||^2 ~ K sigma_i^2 ||sum_t g_t||^2,   sigma_i^2 = (1 / (T K)) sum_{t,k} x_tk^2

i.e. the output gradient summed over the sequence, scaled by the size of the
example's input as if its entries were Gaussian with variance sigma_i^2 and
every row carried the same vector. It is exact for T = 1 (and for inputs
constant over the sequence). The bias gradient needs no approximation:
||db_i||^2 = ||sum_t g_t||^2 is recorded exactly. (The paper's code scales
sigma by a further 1/(T K); that factor cancels in one layer's GNS but not in a
sum over layers of different sizes, so it is left out here.)

Cost: forward reduces x to one number per example (the layer keeps N floats,
not x), backward sums g over the sequence: O(N T (K + L)), no GEMM.

Buffers `<param>_sogns_pe_sqnorm` = [sum_i SOGNS ||g_i / B||^2, count], read by
GNSMonitor beside the exact ones (find_tracked_parameters(model, suffix=SOGNS_SUFFIX))
and logged under their own prefix (train.py: `train/sogns/<param>/norm`, `/pegn`,
`/batch_size`), so a run can log exact and approximate norms side by side;
`norm` there is the exact batch-gradient norm, `pegn` the approximation.

Layer classes (the Linear kind's variants, `--linearclass=`, declared in kinds/linear.py):
    sogns       nn.Linear + SOGNS norms only (nearly free)
    gns+sogns   the exact `gns` Linear + SOGNS norms, to compare the two on one run
"""

import torch

from nanogns.core import layout
from nanogns.core.buffers import (
    BUFFER_SUFFIX,
    accumulate_pe_sqnorm,
    norm_dtype,
    on_output_grad,
    refuse_step,
)

# ends in BUFFER_SUFFIX: zeroed by zero_pe_sqnorm_buffers and kept float32 like the exact buffers,
# but never mistaken for them (the exact GNS monitor looks for `<param>_pe_sqnorm` exactly)
SOGNS_SUFFIX = "_sogns" + BUFFER_SUFFIX


def input_scale(xs):
    """K sigma_i^2 = (1 / T) sum_{t,k} x_tk^2 per example, for xs (N, T, K): (N,) in float32 (float64 for float64)."""
    xs = xs.detach().to(norm_dtype(xs))
    return xs.pow(2).sum(dim=(1, 2)) / xs.shape[1]


def sogns_pe_sqnorm(input_scale, gs, has_bias=True):
    """SOGNS per-example squared norms of a Linear layer's weight (approximate) and bias (exact).

    Args:
        input_scale: (N,) from `input_scale(x)`.
        gs: output gradient per example (N, T, L).
    Returns:
        (weight_pe_sqnorms (N,), bias_pe_sqnorms (N,) or None) in input_scale's dtype.
    """
    summed = gs.to(input_scale.dtype).sum(dim=1)  # (N, L): sum_t g_t
    out_sq = summed.pow(2).sum(dim=1)
    return input_scale * out_sq, (out_sq if has_bias else None)


def register_sogns_buffers(module):
    for name in ("weight", "bias"):
        if getattr(module, name, None) is not None:
            module.register_buffer(
                name + SOGNS_SUFFIX, torch.zeros(2, device=getattr(module, name).device), persistent=False
            )


def record_sogns(module, x, out):
    """Add the SOGNS norms of this forward's examples to the buffers when `out`'s gradient comes."""
    buffers = [
        module._buffers.get(name + SOGNS_SUFFIX)
        if getattr(module, name, None) is not None and getattr(module, name).requires_grad
        else None
        for name in ("weight", "bias")
    ]
    if all(b is None for b in buffers):
        return out
    rows = layout.rows_for(x.shape)
    if isinstance(rows, str) or rows.kind == "ragged":
        refuse_step(
            rows
            if isinstance(rows, str)
            else "SOGNS assumes examples of equal length; packed or routed rows are not that",
            buffers,
        )
        return out
    scale = input_scale(rows.per_example(x))
    weight_buffer, bias_buffer = buffers

    def record(g):
        weight_pe_sqnorms, bias_pe_sqnorms = sogns_pe_sqnorm(
            scale, rows.per_example(g), has_bias=bias_buffer is not None
        )
        accumulate_pe_sqnorm(weight_buffer, weight_pe_sqnorms)
        accumulate_pe_sqnorm(bias_buffer, bias_pe_sqnorms)

    on_output_grad(out, record)
    return out
