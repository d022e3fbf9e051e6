"""
The LayerNorm kind: torch's nn.LayerNorm over the last dim (with or without a bias),
and the affine maths the RMSNorm kind shares.

For y_t = xhat_t * w + b over the rows t of example i, xhat_t the normalised row
and g_t = dL/dy_t:

    dw_i = sum_t g_t * xhat_t,     db_i = sum_t g_t

The per-example squared norms are ||dw_i||^2 and ||db_i||^2; the batch gradients
are their sums over examples. The Triton kernels (variants/fused/, kernels/) compute
the same inside the LayerNorm backward.

Probing a module the registry does not know (conversion/probe.py): norm-shaped
parameters are tried with each eps the module stores (`eps`,
`variance_epsilon`, ..., or any float attribute in (0, 1)), then common values.
The probe input has 12 rows (3 examples of 4 positions): zero-mean rows of scale
1 down to 1e-6, so mean(x^2) spans 1 to 1e-12 and any eps in that range
dominates some row, and rows with mean 3, -2 and 1, which LayerNorm subtracts
and RMSNorm does not.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import uses
from nanogns.core.buffers import (
    PerExampleNormLayer,
    accumulate_pe_sqnorm,
    add_pe_sqnorm,
    autocast_result_dtype,
    norm_dtype,
    on_output_grad,
)
from nanogns.core.registry import LayerKind, Probe, register
from nanogns.variants import fused

EPS_ATTRIBUTES = (
    "eps",
    "variance_epsilon",
    "epsilon",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rms_norm_eps",
    "norm_eps",
)
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12, None)  # None: the input dtype's machine epsilon, F.rms_norm's default
ROW_SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 3e-3, 3e-5, 1.0, 1.0, 0.3)
ROW_MEANS = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, -2.0, 1.0)
# LayerNorm backward on the CPU: from this many elements per example (T * D) on, torch's kernel run once per example
# (one pass over x and g, about 60 us more per call) beats the batched per-example sums (four passes more, about 2 ns
# per element each on the project's 2-core machine); the crossover is near 30k elements
PER_EXAMPLE_KERNEL_ELEMENTS = 2**15
_layer_norm_backward_out = torch.ops.aten.native_layer_norm_backward.out


# -----------------------------------------------------------------------------
# the maths


def affine_pe_grads(xhat, g, has_bias=True):
    """Per-example affine gradients (N, D): dw_i = sum_t g_t * xhat_t, db_i = sum_t g_t, for xhat and g per
    example (N, T, D); float32 (float64 for float64)."""
    dtype = norm_dtype(g)
    g = g.to(dtype)
    weight_grads = (g * xhat.to(dtype)).sum(dim=1)
    bias_grads = g.sum(dim=1) if has_bias else None
    return weight_grads, bias_grads


def record_affine_norms(xhat, rows, weight_buffer, bias_buffer):
    """A hook for the output gradient that adds the weight's and bias's per-example squared norms to the buffers."""

    def record(g):
        weight_grads, bias_grads = affine_pe_grads(rows.per_example(xhat), rows.per_example(g), bias_buffer is not None)
        record_pe_grads(weight_buffer, weight_grads)
        if bias_buffer is not None:
            record_pe_grads(bias_buffer, bias_grads)

    return record


def record_pe_grads(buffer, pe_grads):
    """Add the squared norms of per-example gradients (N, D) to the buffer, or hand them over when the forward used
    the tensor more than once (core/uses.py sums its uses)."""
    if not uses.hand_over(buffer, lambda: uses.DenseFactor(pe_grads)):
        add_pe_sqnorm(buffer, pe_grads.pow(2).sum(dim=1))


def affine(xhat, weight, bias, weight_buffer, bias_buffer, rows):
    """xhat * weight (+ bias) recording per-example norms (AffineFunction); torch's ops where there is nothing to
    record."""
    if weight_buffer is None and bias_buffer is None:
        return torch.addcmul(bias, xhat, weight) if bias is not None else xhat * weight
    return AffineFunction.apply(xhat, weight, bias, ((weight_buffer, bias_buffer), rows))


def layer_norm(x, weight, bias, eps, weight_buffer, bias_buffer, rows, out_dtype):
    """LayerNorm over the last dim recording per-example norms (LayerNormFunction); torch's where there is nothing
    to record."""
    if weight_buffer is None and bias_buffer is None:
        return F.layer_norm(x, weight.shape, weight, bias, eps).to(out_dtype)
    return LayerNormFunction.apply(x, weight, bias, (eps, (weight_buffer, bias_buffer), rows, out_dtype))


class AffineFunction(torch.autograd.Function):
    """AffineFunction.apply(xhat, weight, bias, ((weight_buffer, bias_buffer), rows)) = xhat * weight (+ bias): the
    affine half of a norm layer whose normalisation autograd handles; backward records the per-example norms."""

    @staticmethod
    def forward(ctx, xhat, weight, bias, recording):
        ctx.save_for_backward(xhat, weight)
        ctx.buffers, ctx.rows = recording
        ctx.has_bias = bias is not None
        return torch.addcmul(bias, xhat, weight) if bias is not None else xhat * weight

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_xhat = grad_out * weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # else frozen: no gradients, no norms
            rows = ctx.rows
            if rows is None:  # no norms this step (rows not mapped): the plain gradients
                xs, gs = xhat.reshape(1, -1, xhat.shape[-1]), grad_out.reshape(1, -1, grad_out.shape[-1])
            else:
                xs, gs = rows.per_example(xhat), rows.per_example(grad_out)
            pe_grad_weight, pe_grad_bias = affine_pe_grads(xs, gs, ctx.has_bias)  # (N, D) each
            if ctx.needs_input_grad[1]:
                record_pe_grads(weight_buffer, pe_grad_weight)
                grad_weight = pe_grad_weight.sum(dim=0).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                record_pe_grads(bias_buffer, pe_grad_bias)
                grad_bias = pe_grad_bias.sum(dim=0).to(weight.dtype)
        return grad_xhat, grad_weight, grad_bias, None


class LayerNormFunction(torch.autograd.Function):
    """LayerNormFunction.apply(x, weight, bias, (eps, (weight_buffer, bias_buffer), rows, out_dtype)): LayerNorm over
    the last dim whose backward also records the affine per-example norms; the output in out_dtype. What is not a
    tensor autograd differentiates comes as one argument: autograd.Function.apply looks at each argument in Python.

    Forward and the input gradient are PyTorch's own fused kernels; backward then
    rebuilds xhat = (x - mean) * rstd once to form dw_i = sum_t g_t * xhat_t."""

    @staticmethod
    def forward(ctx, x, weight, bias, settings):
        eps, ctx.buffers, ctx.rows, out_dtype = settings
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_out = grad_out.to(x.dtype).contiguous()
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and _per_example_kernels(ctx.rows, x, weight):
            return _backward_per_example(ctx, grad_out, x, weight, bias, mean, rstd)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x, _, _ = torch.ops.aten.native_layer_norm_backward(
                grad_out, x, weight.shape, mean, rstd, weight, bias, [True, False, False]
            )
        dtype = norm_dtype(grad_out)
        per_example = ctx.rows.per_example if ctx.rows is not None else (lambda t: t.reshape(1, -1, t.shape[-1]))
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # else a frozen weight: no gradient, no norms
            xhat_times_g = torch.sub(x, mean).mul_(rstd).mul_(grad_out)  # one temporary, reused in place
            pe_grad_weight = per_example(xhat_times_g).sum(dim=1, dtype=dtype)  # (N, D)
            record_pe_grads(weight_buffer, pe_grad_weight)
            grad_weight = pe_grad_weight.sum(dim=0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            pe_grad_bias = per_example(grad_out).sum(dim=1, dtype=dtype)  # (N, D)
            record_pe_grads(bias_buffer, pe_grad_bias)
            grad_bias = pe_grad_bias.sum(dim=0).to(bias.dtype)
        return grad_x, grad_weight, grad_bias, None


def _per_example_kernels(rows, x, weight):
    """True when torch's own LayerNorm backward, run once per example, is the cheaper way to the per-example affine
    gradients: on the CPU, examples whose rows are one contiguous block (dim 0, or flattened (N*T, D)) of at least
    PER_EXAMPLE_KERNEL_ELEMENTS elements, in float32 or float64 (the kernel sums in the input's dtype); eagerly only.
    Under torch.compile each example's out= call becomes a functional call plus a copy of the whole input gradient
    into which its slice is scattered: N copies of it per layer (630 ms instead of 9 for one LayerNorm of the baby
    GPT at batch 64), where inductor fuses the batched sums into a pass or two."""
    return (
        rows is not None
        and not torch.compiler.is_compiling()
        and rows.kind in ("dim0", "flat")
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and weight.dtype == x.dtype
        and x.numel() >= rows.examples * PER_EXAMPLE_KERNEL_ELEMENTS
    )


def _backward_per_example(ctx, grad_out, x, weight, bias, mean, rstd):
    """LayerNormFunction's backward (input and weight gradients asked for) as torch's kernel run on each example's
    rows: the input gradient and that example's dw_i, db_i come from one pass over its x and g (the kernel's own
    weight gradient is dw_i), where the batched path adds four passes (xhat, xhat * g, the sums). The kernel's
    out= form fills every output (it rejects a masked one), so db_i is formed even without a bias to record."""
    rows, (weight_buffer, bias_buffer) = ctx.rows, ctx.buffers
    N, D = rows.examples, x.shape[-1]
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    pe_grads = x.new_empty(2, N, D)  # dw_i, db_i
    per_example = [rows.per_example(t).unbind(0) for t in (grad_out, x, mean, rstd, grad_x)]  # (T, D), (T, 1)
    like_bias = bias if bias is not None else torch.zeros_like(weight)  # db_i needs one (the backward never reads it)
    for g_i, x_i, mean_i, rstd_i, dx_i, dw_i, db_i in zip(*per_example, pe_grads[0], pe_grads[1]):
        _layer_norm_backward_out(
            g_i, x_i, weight.shape, mean_i, rstd_i, weight, like_bias, [True] * 3, out0=dx_i, out1=dw_i, out2=db_i
        )
    accumulate_pe_sqnorm(weight_buffer, pe_grads[0].pow(2).sum(dim=1))
    grad_weight, grad_bias = pe_grads[0].sum(dim=0), None
    if bias is not None and ctx.needs_input_grad[2]:
        accumulate_pe_sqnorm(bias_buffer, pe_grads[1].pow(2).sum(dim=1))
        grad_bias = pe_grads[1].sum(dim=0)
    return grad_x, grad_weight, grad_bias, None


def torch_layer_norm(x, weight, bias):
    """F.layer_norm over the last dim: what the output dtype of a LayerNorm is compared with."""
    return F.layer_norm(x, x.shape[-1:], weight, bias)


# -----------------------------------------------------------------------------
# the layers


class _LayerNormBase(PerExampleNormLayer, nn.Module):
    """LayerNorm(ndim, bias=True, eps=1e-5) with parameters `weight` (ones) and `bias` (zeros or None)."""

    pe_kind = "LayerNorm"
    # the output's dtype: None as torch's own layer (autocast included); "promote" the promotion of the input's and
    # the weight's dtypes, as norms written out by hand return (Llama's, T5's); "input" the input's (Gemma's)
    output_dtype = None

    def __init__(self, ndim, bias=True, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        assert len(self.normalized_shape) == 1, "per-example norm LayerNorm normalises the last dim only"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype)) if bias else None
        self.register_pe_buffers()

    def pe_adopt(self, options):
        self.normalized_shape = tuple(self.weight.shape)
        super().pe_adopt(options)

    def pe_normalize(self, x):
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)

    def pe_result_dtype(self, x, torch_op, *params):
        """The dtype of the output for input x (output_dtype's rule; torch_op(x, *params) is torch's layer)."""
        if self.output_dtype == "promote":
            return torch.promote_types(x.dtype, self.weight.dtype)
        if self.output_dtype == "input":
            return x.dtype
        return autocast_result_dtype(torch_op, x, *params)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"


class SeparatedLayerNorm(_LayerNormBase):
    """LayerNorm split into normalisation and affine parts, the affine norms read from the output gradient (shim)."""

    def forward(self, x):
        xhat = self.pe_normalize(x)
        out = xhat * self.weight + self.bias if self.bias is not None else xhat * self.weight
        out = out.to(self.pe_result_dtype(x, torch_layer_norm, self.weight, self.bias))
        rows, (weight_buffer, bias_buffer) = self.pe_rows_and_buffers(x, "weight", "bias")
        if weight_buffer is not None or bias_buffer is not None:
            on_output_grad(out, record_affine_norms(xhat.detach(), rows, weight_buffer, bias_buffer))
        return out


class PerExampleLayerNorm(_LayerNormBase):
    """LayerNorm whose backward computes the affine gradients and per-example norms together."""

    def forward(self, x):
        weight, bias = self.weight, self.bias
        out_dtype = self.pe_result_dtype(x, torch_layer_norm, weight, bias)
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast:
            x = x.float()  # computed in float32 under autocast, returned in the dtype torch's LayerNorm returns
        rows, buffers = self.pe_rows_and_buffers(x, "weight", "bias")
        if not autocast:  # no autocast to leave: entering a context costs as much as the rest of this forward
            return layer_norm(x, weight, bias, self.eps, *buffers, rows, out_dtype)
        with torch.autocast(x.device.type, enabled=False):
            return layer_norm(x, weight, bias, self.eps, *buffers, rows, out_dtype)


# -----------------------------------------------------------------------------
# the registration, and the probe the norm kinds share


def eps_values(module):
    """eps values to try: those the module stores, then the common ones."""
    stored = [getattr(module, name) for name in EPS_ATTRIBUTES if hasattr(module, name)]
    stored += [v for v in vars(module).values() if isinstance(v, float) and 0 < v < 1]
    values = []
    for v in stored + list(COMMON_EPS):
        if (v is None or isinstance(v, (int, float)) and not isinstance(v, bool)) and v not in values:
            values.append(v)
    return values


def norm_probe_data(module, generator, weight, bias):
    """Probe parameters (weight, and bias when the module has one) and the 12-row input of the docstring."""
    D = weight.shape[0]
    x = torch.randn(len(ROW_SCALES), D, generator=generator, dtype=torch.float64)
    x = (
        x * torch.tensor(ROW_SCALES, dtype=torch.float64)[:, None]
        + torch.tensor(ROW_MEANS, dtype=torch.float64)[:, None]
    )
    params = {"weight": 1 + 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)}
    if bias is not None:
        params["bias"] = 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)
    return params, x.view(3, 4, D)


OUTPUT_DTYPES = (None, "promote", "input")  # the output dtype rules a probed norm may follow (output_dtype)


def layernorm_candidates(module, options):
    """Each eps (the module's own first) with each output dtype rule, or the options the user fixed."""
    eps_list = [options["eps"]] if "eps" in options else eps_values(module)
    rules = [options["output_dtype"]] if "output_dtype" in options else OUTPUT_DTYPES
    return [dict(eps=eps, output_dtype=rule) for eps in eps_list if eps is not None for rule in rules]


def convertible(module):
    if len(module.normalized_shape) != 1:
        return (
            f"{type(module).__name__} over {len(module.normalized_shape)} dims (per-example norm layers "
            "normalise the last dim)"
        )
    return None


class FusedLayerNorm(PerExampleLayerNorm):
    """PerExampleLayerNorm computed by the Triton kernels where they can run (variants/fused/), else as its base."""

    def forward(self, x):
        found = fused.kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        out = fused.fused_layer_norm(xs, self.weight, self.bias, self.eps, *buffers).view(x.shape)
        return out.to(self.pe_result_dtype(x, torch_layer_norm, self.weight, self.bias))


KIND = register(
    LayerKind(
        name="LayerNorm",
        config_key="lnclass",
        group="LayerNorm",
        variants={
            "nn": nn.LayerNorm,
            "shim": SeparatedLayerNorm,
            "gns": PerExampleLayerNorm,
            "fused": FusedLayerNorm,
        },
        replaces=(nn.LayerNorm,),
        convertible=convertible,
        options=lambda module: dict(eps=module.eps),
        probe=Probe(
            fits=lambda weight, bias: weight.dim() == 1 and (bias is None or bias.shape == weight.shape),
            data=norm_probe_data,
            candidates=layernorm_candidates,
            options=("eps", "output_dtype"),
        ),
    )
)
