"""
The LayerNorm kind: torch's nn.LayerNorm over the last dim (with or without a bias).

Its maths is the affine maths every norm kind shares (kinds/affine.py): for xhat_t = (x_t - mean_t) * rstd_t,

    dw_i = sum_t g_t * xhat_t,     db_i = sum_t g_t

over the rows t of example i. LayerNormFunction forms them inside the LayerNorm backward: torch's own kernels for
the forward and the input gradient, xhat * g rebuilt once for the per-example sums (or, on the CPU for long
examples, torch's backward kernel run on each example's rows: `_per_example_kernels`). The Triton kernels
(variants/fused/, kernels/) compute the same. The probe that finds LayerNorm look-alikes is kinds/norm.py's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.buffers import accumulate_pe_sqnorm, norm_dtype, on_output_grad
from nanogns.core.registry import LayerKind, Probe
from nanogns.kinds.affine import record_affine_norms, record_pe_grads
from nanogns.kinds.norm import OUTPUT_DTYPES, NormLayer, eps_values, norm_probe_data
from nanogns.variants import fused

# LayerNorm backward on the CPU: from this many elements per example (T * D) on, torch's kernel run once per example
# (one pass over x and g, about 60 us more per call) beats the batched per-example sums (four passes more, about 2 ns
# per element each on the project's 2-core machine); the crossover is near 30k elements
PER_EXAMPLE_KERNEL_ELEMENTS = 2**15
# ... and only at this many of torch's threads or fewer: each example's kernel is too small to share among threads,
# where the batched sums are split among them (the 4x256 GPT at 2 threads, wall clock: LayerNorm-only 1.04 against
# 1.09 with the kernels, every layer 1.20 against 1.24; bench/RESULTS.md, issue 47)
PER_EXAMPLE_KERNEL_THREADS = 1
_layer_norm_backward_out = torch.ops.aten.native_layer_norm_backward.out


# -----------------------------------------------------------------------------
# the autograd Function


def layer_norm(x, weight, bias, eps, weight_buffer, bias_buffer, rows, out_dtype):
    """LayerNorm over the last dim recording per-example norms (LayerNormFunction); torch's where there is nothing
    to record."""
    if weight_buffer is None and bias_buffer is None:
        return F.layer_norm(x, weight.shape, weight, bias, eps).to(out_dtype)
    return LayerNormFunction.apply(x, weight, bias, (eps, (weight_buffer, bias_buffer), rows, out_dtype))


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
    gradients: on the CPU at one thread (PER_EXAMPLE_KERNEL_THREADS), examples whose rows are one contiguous block (dim 0, or flattened (N*T, D)) of at least
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
        and torch.get_num_threads() <= PER_EXAMPLE_KERNEL_THREADS
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


class SeparatedLayerNorm(NormLayer):
    """LayerNorm split into normalisation and affine parts, the affine norms read from the output gradient (shim)."""

    def forward(self, x):
        xhat = self.pe_normalize(x)
        out = xhat * self.weight + self.bias if self.bias is not None else xhat * self.weight
        out = out.to(self.pe_result_dtype(x, torch_layer_norm, self.weight, self.bias))
        rows, (weight_buffer, bias_buffer) = self.pe_rows_and_buffers(x, "weight", "bias")
        if weight_buffer is not None or bias_buffer is not None:
            on_output_grad(out, record_affine_norms(xhat.detach(), rows, weight_buffer, bias_buffer))
        return out


class PerExampleLayerNorm(NormLayer):
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
# the registration


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


KIND = LayerKind(
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
