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

Buffers `<param>_sogns_upegsqnorm` = [sum_i SOGNS ||g_i / B||^2, count], read by
    MeasurementTracker.from_model(model, suffix=SOGNS_SUFFIX)
and logged under their own prefix (train.py: `train/sogns/<param>/norm`, `/pegn`,
`/batch_size`), so a run can log exact and approximate norms side by side;
`norm` there is the exact batch-gradient norm, `pegn` the approximation.

Layer classes (layer_config.py, `--linearclass=`):
    sogns       nn.Linear + SOGNS norms only (nearly free)
    gns+sogns   the exact `gns` Linear + SOGNS norms, to compare the two on one run
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from buffered import (BUFFER_SUFFIX, PEGradNormLinear, PESqNormBuffersMixin, _per_example, accumulate_pe_sqnorm,
                      autocast_inputs, norm_dtype)

# ends in BUFFER_SUFFIX: zeroed by zero_sqgradnorm_buffers and kept float32 like the exact buffers,
# but never mistaken for them (the exact tracker looks for `<param>_upegsqnorm` exactly)
SOGNS_SUFFIX = "_sogns" + BUFFER_SUFFIX


def input_scale(x):
    """K sigma_i^2 = (1 / T) sum_{t,k} x_tk^2 per example: (N,) in float32 (float64 for float64 input)."""
    xs = _per_example(x.detach()).to(norm_dtype(x))  # (N, T, K)
    return xs.pow(2).sum(dim=(1, 2)) / xs.shape[1]


def sogns_pe_sqnorm(input_scale, grad_out, has_bias=True):
    """SOGNS per-example squared norms of a Linear layer's weight (approximate) and bias (exact).

    Args:
        input_scale: (N,) from `input_scale(x)`.
        grad_out: output gradient (N, ..., L).
    Returns:
        (weight_sq (N,), bias_sq (N,) or None).
    """
    summed = _per_example(grad_out).to(input_scale.dtype).sum(dim=1)  # (N, L): sum_t g_t
    out_sq = summed.pow(2).sum(dim=1)
    return input_scale * out_sq, (out_sq if has_bias else None)


class _SOGNSShim(torch.autograd.Function):
    """Identity on the layer output whose backward adds the SOGNS norms to the buffers."""

    @staticmethod
    def forward(ctx, out, scale, weight_buffer, bias_buffer):
        ctx.save_for_backward(scale)
        ctx.buffers = (weight_buffer, bias_buffer)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (scale,) = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        weight_sq, bias_sq = sogns_pe_sqnorm(scale, grad_out, has_bias=bias_buffer is not None)
        accumulate_pe_sqnorm(weight_buffer, weight_sq)
        accumulate_pe_sqnorm(bias_buffer, bias_sq)
        return grad_out, None, None, None


def _register_sogns_buffers(module):
    for name in ("weight", "bias"):
        if getattr(module, name, None) is not None:
            module.register_buffer(name + SOGNS_SUFFIX, torch.zeros(2, device=getattr(module, name).device), persistent=False)


def _record_sogns(module, x, out):
    buffers = module._buffers
    return _SOGNSShim.apply(out, input_scale(x), buffers.get("weight" + SOGNS_SUFFIX), buffers.get("bias" + SOGNS_SUFFIX))


class SOGNSLinear(PESqNormBuffersMixin, nn.Linear):
    """nn.Linear that records SOGNS (approximate) per-example norms only."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _register_sogns_buffers(self)

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        return _record_sogns(self, x, F.linear(x, weight, bias))


class ExactAndSOGNSLinear(PEGradNormLinear):
    """The exact `gns` Linear that also records SOGNS norms: both methods on the same steps."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _register_sogns_buffers(self)

    def forward(self, x):
        return _record_sogns(self, x, super().forward(x))

