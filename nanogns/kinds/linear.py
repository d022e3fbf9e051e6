"""
The Linear kind: torch's nn.Linear, in every variant the project offers.

    shim        nn.Linear + a hook on the output's gradient that computes the norms (PyTorch's own gradients)
    gns         one autograd Function (LinearFunction) forms the weight gradient and its per-example norms
                together, by the Gram trick or from each example's materialised dW_i (core/matmul.py)
    fused       the gns Linear whose weight gradient and norms come from one Triton kernel where it can run
                (variants/fused/), else the gns computation
    sogns       nn.Linear + SOGNS's approximate norms only (variants/sogns.py)
    gns+sogns   the exact gns Linear + SOGNS's norms, both on the same steps

The maths (||dW_i||^2 = sum_{s,t} (g_s . g_t)(x_s . x_t), the cost rule between the Gram trick and
materialising) is core/matmul.py's: Conv, Conv1D, the experts and the fused kernels' fallback share it.
Rows are mapped to examples by core/layout.py (flattened (N*T, K) inputs and packed sequences too).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import uses
from nanogns.core.buffers import (
    PerExampleNormLayer,
    add_pe_sqnorm,
    autocast_inputs,
    on_output_grad,
)
from nanogns.core.matmul import bias_pe_grads, linear_forward, linear_pe_sqnorm, linear_weight_grad_and_pe_sqnorm
from nanogns.core.registry import LayerKind, Probe
from nanogns.core.rowmaps import Rows
from nanogns.core.tied import note_head
from nanogns.variants import fused, sogns

# -----------------------------------------------------------------------------
# shim: PyTorch's own gradients, norms from the output gradient


def record_linear_norms(x, rows, weight_buffer, bias_buffer):
    """A hook for the output gradient g that adds the weight's and bias's per-example squared norms to the buffers."""

    def record(g):
        gs = rows.per_example(g)
        if weight_buffer is not None and not uses.hand_over(weight_buffer, lambda: uses.LinearWeightFactor(x, g, rows)):
            add_pe_sqnorm(weight_buffer, linear_pe_sqnorm(rows.per_example(x), gs))
        if bias_buffer is not None and not uses.hand_over(bias_buffer, lambda: uses.RowSumFactor(g, rows)):
            add_pe_sqnorm(bias_buffer, bias_pe_grads(gs).pow(2).sum(dim=1))

    return record


# -----------------------------------------------------------------------------
# gns: parameter gradients and norms from the same per-example work


def linear_backward(ctx, grad_out):
    """Backward of a Linear Function whose forward saved (x or None, weight or None), ctx.rows and ctx.buffers:
    the gradients autograd asks for (ctx.needs_input_grad; a frozen weight or bias gets no gradient and no
    norms), the weight's and its per-example squared norms from linear_weight_grad_and_pe_sqnorm."""
    x, weight = ctx.saved_tensors
    weight_buffer, bias_buffer = ctx.buffers
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    grad_x = grad_out @ weight if needs_x else None
    grad_weight = grad_bias = None
    if ctx.rows is None:  # no norms to record (rows not mapped to examples this step): the plain gradients
        L = grad_out.shape[-1]
        if needs_weight:
            grad_weight = grad_out.reshape(-1, L).t() @ x.reshape(-1, x.shape[-1])
        if needs_bias:
            grad_bias = grad_out.reshape(-1, L).sum(dim=0)
        return grad_x, grad_weight, grad_bias, None
    gs = ctx.rows.per_example(grad_out) if needs_weight or needs_bias else None  # (N, T, L)
    if needs_weight and uses.hand_over(weight_buffer, lambda: uses.LinearWeightFactor(x, grad_out, ctx.rows)):
        L = grad_out.shape[-1]  # a weight used several times per forward: its uses' gradients summed (uses.py)
        grad_weight = grad_out.reshape(-1, L).t() @ x.reshape(-1, x.shape[-1])
    elif needs_weight:
        grad_weight, weight_pe_sqnorms = linear_weight_grad_and_pe_sqnorm(ctx.rows.per_example(x), gs)
        add_pe_sqnorm(weight_buffer, weight_pe_sqnorms, ctx.rows.counted)
    if needs_bias and uses.hand_over(bias_buffer, lambda: uses.RowSumFactor(grad_out, ctx.rows)):
        grad_bias = gs.sum(dim=(0, 1))
    elif needs_bias:
        pe_grad_bias = bias_pe_grads(gs)  # (N, L), float32 (float64 for float64)
        grad_bias = pe_grad_bias.sum(dim=0)
        grad_bias = grad_bias if grad_bias.dtype == grad_out.dtype else grad_bias.to(grad_out.dtype)
        add_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1), ctx.rows.counted)
    return grad_x, grad_weight, grad_bias, None


def linear(x, weight, bias, weight_buffer, bias_buffer, rows):
    """F.linear recording per-example norms (LinearFunction); torch's own F.linear where there is nothing to record
    (frozen parameters, a refused step: also tensor-parallel DTensors, which only torch's ops take)."""
    if weight_buffer is None and bias_buffer is None:
        return F.linear(x, weight, bias)
    return LinearFunction.apply(x, weight, bias, ((weight_buffer, bias_buffer), rows))


class LinearFunction(torch.autograd.Function):
    """LinearFunction.apply(x, weight, bias, ((weight_buffer, bias_buffer), rows)): y = F.linear(x, weight, bias);
    backward forms the weight gradient and its per-example norms together (linear_weight_grad_and_pe_sqnorm), and
    only the gradients autograd asks for. Buffers may be None (then no norms); rows maps x's rows to examples. What
    the backward records into comes as one argument: autograd.Function.apply looks at each argument in Python."""

    @staticmethod
    def forward(ctx, x, weight, bias, recording):
        # x is needed only for the weight gradient, weight only for the input gradient
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.buffers, ctx.rows = recording
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return linear_backward(ctx, grad_out)


# -----------------------------------------------------------------------------
# the layers


class ShimLinear(PerExampleNormLayer, nn.Linear):
    """nn.Linear whose backward also records per-example norms of weight and bias gradients."""

    pe_kind = "Linear"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_pe_buffers()

    cast_weight = False  # as PerExampleLinear's

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, *PerExampleLinear.pe_weight_and_bias(self, x))
        out = F.linear(x, weight, bias)
        rows, (weight_buffer, bias_buffer) = self.pe_rows_and_buffers(x, "weight", "bias")
        out = note_head(weight_buffer, x, rows, out)  # first: torch.compile breaks the graph at the hook
        if weight_buffer is not None or bias_buffer is not None:
            on_output_grad(out, record_linear_norms(x.detach(), rows, weight_buffer, bias_buffer))
        return out


class PerExampleLinear(PerExampleNormLayer, nn.Linear):
    """nn.Linear whose backward computes weight/bias gradients and per-example norms together."""

    pe_kind = "Linear"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_pe_buffers()

    cast_weight = False  # True: the weight and bias are cast to the input's dtype first (nanochat's Linear)
    autocast_promotes = False  # True: under autocast the output takes the parameters' dtype (x @ W + b written out)

    def forward(self, x):
        if not torch.is_autocast_enabled(x.device.type):  # no autocast to leave: entering a context costs as much
            weight, bias = self.pe_weight_and_bias(x)  # as the rest of this forward
            rows, buffers = self.pe_rows_and_buffers(x, "weight", "bias")
            return note_head(buffers[0], x, rows, linear(x, weight, bias, *buffers, rows))
        x, weight, bias = autocast_inputs(x, *self.pe_weight_and_bias(x))
        rows, buffers = self.pe_rows_and_buffers(x, "weight", "bias")
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            out = linear(x, weight, bias, *buffers, rows)
        return self.pe_promoted(note_head(buffers[0], x, rows, out))

    def pe_promoted(self, out):
        """out in the dtype a module computing `x @ W + b` by hand returns under autocast (autocast_promotes)."""
        if not self.autocast_promotes or not torch.is_autocast_enabled(out.device.type):
            return out
        return out.to(torch.promote_types(out.dtype, self.weight.dtype))

    def pe_weight_and_bias(self, x):
        """The parameters as the forward uses them: cast to x's dtype when cast_weight (differentiably)."""
        if not self.cast_weight:
            return self.weight, self.bias
        return self.weight.to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None


class FusedLinear(PerExampleLinear):
    """PerExampleLinear whose weight gradient and per-example norms come from one Triton kernel where it can run."""

    def forward(self, x):
        found = fused.kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        xs, weight, bias = autocast_inputs(xs, *self.pe_weight_and_bias(xs))
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            out = fused.fused_linear(xs, weight, bias, *buffers)
        out = note_head(buffers[0], xs, Rows("dim0", xs.shape[0]), out)
        return self.pe_promoted(out.view(*x.shape[:-1], self.out_features))


class SOGNSLinear(PerExampleNormLayer, nn.Linear):
    """nn.Linear that records SOGNS (approximate) per-example norms only."""

    pe_kind = "Linear"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        sogns.register_sogns_buffers(self)

    def pe_adopt(self, options):
        sogns.register_sogns_buffers(self)

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        return sogns.record_sogns(self, x, F.linear(x, weight, bias))


class ExactAndSOGNSLinear(PerExampleLinear):
    """The exact `gns` Linear that also records SOGNS norms: both methods on the same steps."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        sogns.register_sogns_buffers(self)

    def pe_adopt(self, options):
        super().pe_adopt(options)
        sogns.register_sogns_buffers(self)

    def forward(self, x):
        return sogns.record_sogns(self, x, super().forward(x))


# -----------------------------------------------------------------------------
# the registration

# what a probed Linear-like module may do besides F.linear: cast its weight to the input's dtype (nanochat), or
# compute x @ W + b by hand, whose output under autocast takes the bias's dtype
LINEAR_OPTIONS = [{}, {"cast_weight": True}, {"autocast_promotes": True}]


def fits(weight, bias):
    """weight (L, K) stored (out, in), bias (L,) or none."""
    return weight.dim() == 2 and (bias is None or bias.shape == weight.shape[:1])


def probe_data(module, generator, weight, bias):
    K = weight.shape[1]
    params = {"weight": torch.randn(*weight.shape, generator=generator, dtype=torch.float64) / math.sqrt(K)}
    if bias is not None:
        params["bias"] = 0.5 * torch.randn(*bias.shape, generator=generator, dtype=torch.float64)
    return params, torch.randn(3, 4, K, generator=generator, dtype=torch.float64)


KIND = LayerKind(
    name="Linear",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Linear,
        "shim": ShimLinear,
        "gns": PerExampleLinear,
        "fused": FusedLinear,
        "sogns": SOGNSLinear,  # approximate norms only, logged under train/sogns/
        "gns+sogns": ExactAndSOGNSLinear,  # exact and approximate on the same steps
    },
    replaces=(nn.Linear,),
    probe=Probe(
        fits=fits,
        data=probe_data,
        options=("cast_weight", "autocast_promotes"),
        candidates=lambda module, options: [dict(options)] if options else LINEAR_OPTIONS,
    ),
)
