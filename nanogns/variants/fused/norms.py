"""
LayerNorm and RMSNorm through the Triton kernels: the launch configuration, the custom ops (nanogns::norm_fwd,
norm_bwd) and the autograd Functions `fused_layer_norm` and `fused_rms_norm`. The maths is above the kernels
(nanogns/kernels/layernorm.py).
"""

from typing import Optional

import torch

from nanogns.errors import CallNotValid
from nanogns.variants.fused import finish, runtime
from nanogns.variants.fused.runtime import kernels, triton

# -----------------------------------------------------------------------------
# LayerNorm / RMSNorm


def _norm_chunks(N, T, sm_count):
    """(chunks per example, rows per chunk) for _ln_bwd_dx_pe_sqnorm: on a GPU about 4 programs per SM
    (more chunks: more parallelism but a larger (N * chunks, D) partial buffer); one chunk on CPU."""
    return runtime._split_for_gpu(T, N, 4, sm_count)


def norm_launch_config(D):
    """(BLOCK_D, num_warps) of both norm kernels for D features (at most runtime.MAX_NORM_FEATURES): one row per
    program, BLOCK_D the next power of two >= max(D, 256); 8 elements per thread up to 8 warps, 16 beyond
    (4096: 8 warps; 8192: 16, as 8 warps spill there: bench/compile_gate.py)."""
    block_d = max(256, triton.next_power_of_2(D))
    return block_d, max(min(block_d // 256, 8), block_d // 512)


@runtime._custom_op("nanogns::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (M, stride) in x2's dtype, mean (M,), rstd (M,) fp32) of the rows x2 (M, stride), D = weight.numel()."""
    x2 = runtime._aligned(x2.contiguous())
    M, stride = x2.shape
    D = weight.numel()
    weight = runtime._aligned(weight.contiguous())
    bias = runtime._aligned(bias.contiguous()) if bias is not None else None
    y = torch.empty(M, stride, dtype=x2.dtype, device=x2.device)
    mean = torch.empty(M, dtype=torch.float32, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    block_d, num_warps = norm_launch_config(D)
    if M > 0:
        runtime._launch(
            kernels.layernorm._ln_fwd,
            (M,),
            x2.device,
            x2,
            y,
            weight,
            bias if bias is not None else weight,
            mean,
            rstd,
            D,
            stride,
            eps,
            IS_RMS=is_rms,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return y, mean, rstd


@_norm_fwd_op.register_fake
def _(x2, weight, bias, eps, is_rms):
    M = x2.shape[0]
    return x2.new_empty(x2.shape), x2.new_empty(M, dtype=torch.float32), x2.new_empty(M, dtype=torch.float32)


@runtime._custom_op("nanogns::norm_bwd", mutates_args=("weight_buffer", "bias_buffer"))
def _norm_bwd_op(
    x2: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    N: int,
    is_rms: bool,
    has_bias: bool,
    weight_buffer: Optional[torch.Tensor],
    bias_buffer: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (M, stride), dw (D,), db (D,), or (0,) without a bias); adds ||dw_i||^2 and ||db_i||^2 to the buffers."""
    x2, g = runtime._aligned(x2.contiguous()), runtime._aligned(g.contiguous())
    M, stride = x2.shape
    D = weight.numel()
    T = M // N if N else 0
    block_d, num_warps = norm_launch_config(D)
    dx = torch.empty_like(x2)
    chunks, rows = _norm_chunks(N, T, runtime._sm_count(x2.device)) if M > 0 else (1, 0)
    alloc = torch.empty if M > 0 else torch.zeros  # the kernel writes every row of the partials
    dw_part = alloc(N * chunks, stride, dtype=torch.float32, device=x2.device)
    db_part = alloc(N * chunks, stride, dtype=torch.float32, device=x2.device) if has_bias else dw_part
    if M > 0:
        runtime._launch(
            kernels.layernorm._ln_bwd_dx_pe_sqnorm,
            (N, chunks),
            x2.device,
            x2,
            g,
            dx,
            weight,
            mean,
            rstd,
            dw_part,
            db_part,
            T,
            D,
            stride,
            rows,
            IS_RMS=is_rms,
            HAS_BIAS=has_bias,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    # per-example gradients: sum each example's chunks; square; sum over examples; the buffers: one launch
    dw, db = finish._finish(
        dw_part,
        db_part if has_bias else None,
        N,
        chunks,
        D,
        stride,
        weight.dtype,
        x2.device,
        (weight_buffer, bias_buffer),
    )
    return dx, dw, db if db is not None else weight.new_empty(0)


@_norm_bwd_op.register_fake
def _(x2, g, weight, mean, rstd, N, is_rms, has_bias, weight_buffer, bias_buffer):
    D = weight.numel()
    return torch.empty_like(x2), weight.new_empty(D), weight.new_empty(D if has_bias else 0)


def _norm_forward(ctx, x, weight, bias, eps, is_rms):
    what = "fused RMSNorm" if is_rms else "fused LayerNorm"
    D = weight.numel()
    runtime._check_input(x, D, what)
    if D > runtime.MAX_NORM_FEATURES:
        raise CallNotValid(
            f"{what}: feature dim {D} of input shape {tuple(x.shape)} exceeds the kernels' "
            f"{runtime.MAX_NORM_FEATURES} features (one row per program, in registers); "
            f"use lnclass='gns' for it"
        )
    x2, stride = runtime._masked_rows(x, D, runtime.NORM_RAGGED_MAX)  # (N * T, D) rows, stride apart
    y, mean, rstd = torch.ops.nanogns.norm_fwd(x2, weight, bias, eps, is_rms)
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.N, ctx.D, ctx.is_rms, ctx.has_bias = x.shape[0], D, is_rms, bias is not None
    return y[:, :D].view(x.shape)


def _norm_backward(ctx, grad_out, weight_buffer, bias_buffer):
    """(dx, dw, db or None); adds ||dw_i||^2 and ||db_i||^2 to the buffers."""
    x2, weight, mean, rstd = ctx.saved_tensors
    g, _ = runtime._masked_rows(grad_out, ctx.D, runtime.NORM_RAGGED_MAX)
    dx, dw, db = torch.ops.nanogns.norm_bwd(
        x2, g, weight, mean, rstd, ctx.N, ctx.is_rms, ctx.has_bias, weight_buffer, bias_buffer
    )
    return dx[:, : ctx.D].view(grad_out.shape), dw, db if ctx.has_bias else None


class FusedLayerNormFunction(torch.autograd.Function):
    """fused_layer_norm(x (N, ..., D), weight (D,), bias (D,) or None, eps, weight_buffer, bias_buffer);
    buffers may be None. Output in x's dtype, statistics in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, weight_buffer, bias_buffer):
        ctx.buffers = (weight_buffer, bias_buffer)
        return _norm_forward(ctx, x, weight, bias, eps, is_rms=False)

    @staticmethod
    def backward(ctx, grad_out):
        dx, dw, db = _norm_backward(ctx, grad_out, *ctx.buffers)
        return dx, dw, db, None, None, None


class FusedRMSNormFunction(torch.autograd.Function):
    """fused_rms_norm(x (N, ..., D), weight (D,), eps, weight_buffer); the buffer may be None."""

    @staticmethod
    def forward(ctx, x, weight, eps, weight_buffer):
        ctx.weight_buffer = weight_buffer
        return _norm_forward(ctx, x, weight, None, eps, is_rms=True)

    @staticmethod
    def backward(ctx, grad_out):
        dx, dw, _ = _norm_backward(ctx, grad_out, ctx.weight_buffer, None)
        return dx, dw, None, None


fused_layer_norm = FusedLayerNormFunction.apply
fused_rms_norm = FusedRMSNormFunction.apply
