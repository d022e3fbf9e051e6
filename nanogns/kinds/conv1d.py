"""
The Conv1D kind: transformers' Conv1D (GPT-2's Linear), weight stored (in, out).

Conv1D(nf, nx) has weight (nx, nf) = (in, out) and bias (nf,), y = x @ weight + bias:
a Linear with weight.t(). A transpose leaves every example's gradient norm
unchanged, so the Linear kind's maths (kinds/linear.py) apply to the weight as
stored. The classes keep transformers' constructor, parameters and attributes
(nf, nx), so checkpoints and code reading them carry over; the record beside the
log calls the layer a Linear.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.buffers import PerExampleNormLayer, autocast_inputs, on_output_grad
from nanogns.core.registry import LayerKind, Probe
from nanogns.kinds.linear import LINEAR_OPTIONS, PerExampleLinear, linear, record_linear_norms
from nanogns.variants import fused


class _Conv1DBase(PerExampleNormLayer, nn.Module):
    """transformers' Conv1D(nf, nx): weight (nx, nf) = (in, out), bias (nf,), y = x @ weight + bias."""

    pe_kind = "Linear"  # the layer kind in the monitor's record of each parameter: a Linear, stored transposed

    def __init__(self, nf, nx, bias=True, device=None, dtype=None):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)  # transformers' initialisation
        self.register_pe_buffers()

    def extra_repr(self):
        return f"nf={self.nf}, nx={self.nx}, bias={self.bias is not None}"


class ShimConv1D(_Conv1DBase):
    """Conv1D whose backward also records per-example norms of weight and bias gradients (shim)."""

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        out = F.linear(x, weight.t(), bias)
        rows, (weight_buffer, bias_buffer) = self.pe_rows_and_buffers(x, "weight", "bias")
        if weight_buffer is not None or bias_buffer is not None:
            on_output_grad(out, record_linear_norms(x.detach(), rows, weight_buffer, bias_buffer))
        return out


class PerExampleConv1D(_Conv1DBase):
    """Conv1D whose backward computes weight/bias gradients and per-example norms together."""

    autocast_promotes = False  # as PerExampleLinear's

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        rows, buffers = self.pe_rows_and_buffers(x, "weight", "bias")
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            out = linear(x, weight.t(), bias, *buffers, rows)
        return PerExampleLinear.pe_promoted(self, out)


class FusedConv1D(PerExampleConv1D):
    """transformers' Conv1D (weight stored (in, out)) through the fused Linear kernel, on weight.t()."""

    def forward(self, x):
        found = fused.kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        xs, weight, bias = autocast_inputs(xs, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return fused.fused_linear(xs, weight.t(), bias, *buffers).view(*x.shape[:-1], self.nf)


def probe_data(module, generator, weight, bias):
    K = weight.shape[0]
    params = {"weight": torch.randn(*weight.shape, generator=generator, dtype=torch.float64) / math.sqrt(K)}
    if bias is not None:
        params["bias"] = 0.5 * torch.randn(*bias.shape, generator=generator, dtype=torch.float64)
    return params, torch.randn(3, 4, K, generator=generator, dtype=torch.float64)


KIND = LayerKind(
    name="Conv1D",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": "transformers.pytorch_utils:Conv1D",
        "shim": ShimConv1D,
        "gns": PerExampleConv1D,
        "fused": FusedConv1D,
    },
    replaces=("transformers.pytorch_utils:Conv1D",),
    probe=Probe(
        fits=lambda weight, bias: weight.dim() == 2 and (bias is None or bias.shape == weight.shape[1:]),
        data=probe_data,
        options=("autocast_promotes",),
        candidates=lambda module, options: (
            [dict(options)] if options else [o for o in LINEAR_OPTIONS if "cast_weight" not in o]
        ),
    ),
)
