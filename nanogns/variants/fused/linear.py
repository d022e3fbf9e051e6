"""
The fused Linear's backward: the weight-gradient kernel with its per-example norms, the choice per shape
between the kernel's candidates and the two torch strategies (timed once per shape on a GPU, as Triton's
autotuner does), the custom ops (nanogns::linear_dw_db, linear_dw) and the autograd Function `fused_linear`.
"""

import warnings
from typing import Optional

import torch

from nanogns.core import strategy
from nanogns.core.matmul import bias_pe_grads, linear_forward, linear_weight_grad_and_pe_sqnorm
from nanogns.core.rowmaps import Rows
from nanogns.errors import CallNotValid
from nanogns.variants.fused import finish, linear_plan, runtime
from nanogns.variants.fused.runtime import kernels, triton

_linear_choices = {}  # (N, T buckets, K, L, dtype, tf32, device) -> "gram", "materialise" or a LinearConfig


def _linear_kernel_dw_pe_sqnorm(x, grad_out, config, sm_count):
    """(dW (L_pad, K_pad) in x's dtype, the squared norms of each example's dW tiles (N, tiles) fp32, and None;
    or, when examples of some rows of tiles were split over programs, (fp32 partials (chunks, rows, K_pad), the
    rows of dW they sum to) from _linear_bwd_dw_pe_sqnorm."""
    N, K, L = x.shape[0], x.shape[-1], grad_out.shape[-1]
    # fp32 operands: tensor-core tf32 only where torch's own matmuls may use it; ignored for 16-bit operands
    tf32 = x.dtype != torch.float32 or (x.device.type == "cuda" and runtime.matmul_allows_tf32())
    ragged = linear_plan.linear_ragged(L, K, x.dtype, tf32)  # widths masked in the kernel; the others zero-padded to 16
    xs, K_pad = (
        runtime._masked_rows(x, K, float("inf")) if "K" in ragged else runtime._kernel_rows(x, K)
    )  # (N * T, K_pad)
    gs, L_pad = runtime._masked_rows(
        grad_out.to(x.dtype), L, float("inf")
    )  # (N * T, L_pad), L_pad = L from 16 outputs on
    T = xs.shape[0] // N if N else 0
    tiles_l, tiles_k = linear_plan.linear_tile_grid(L_pad, K_pad, config)
    launch = xs.numel() > 0 and gs.numel() > 0
    front, chunks, per_chunk = (
        linear_plan._linear_plan(N, T, K_pad, L_pad, config, x.dtype, tf32, x.device)
        if launch
        else linear_plan.LinearSplit(tiles_l, 1, N)
    )
    alloc = torch.empty if launch else torch.zeros  # the kernel writes every element it owns
    dw = alloc(L_pad, K_pad, dtype=x.dtype, device=x.device)  # owned tiles: written in x's dtype
    split_rows = L_pad - min(L_pad, front * config.block_l)  # rows of dW summed from fp32 partials per chunk
    dw_part = (
        alloc(chunks, split_rows, K_pad, dtype=torch.float32, device=x.device)
        if split_rows
        else torch.empty(0, dtype=torch.float32, device=x.device)
    )
    w_pe_sqnorm_part = alloc(N, tiles_l * tiles_k, dtype=torch.float32, device=x.device)
    if launch:
        programs = front * tiles_k + (tiles_l - front) * tiles_k * chunks
        runtime._launch(
            kernels.linear._linear_bwd_dw_pe_sqnorm,
            (programs,),
            x.device,
            xs,
            gs,
            dw,
            dw_part,
            w_pe_sqnorm_part,
            N,
            T,
            L_pad,
            K_pad,
            per_chunk,
            front,
            chunks,
            INPUT_PRECISION="tf32" if tf32 else "ieee",
            DOT_IN_FP32=x.dtype == torch.bfloat16 and runtime.kernels_interpreted(),
            BLOCK_L=config.block_l,
            BLOCK_K=config.block_k,
            BLOCK_T=config.block_t,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    if split_rows:
        return dw, w_pe_sqnorm_part, (dw_part, dw[L_pad - split_rows :])
    return dw, w_pe_sqnorm_part, None


def _trimmed(dw, L, K):
    """dW (L, K) from the kernel's (L_pad, K_pad) one."""
    return dw if dw.shape == (L, K) else dw[:L, :K].contiguous()


def _benchmark_ms(fn):
    """Median milliseconds of fn() on the GPU (Triton's do_bench: CUDA events, L2 flushed between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


# what a candidate may raise while it is timed and still leave the others worth trying
_CANDIDATE_ERRORS = (torch.OutOfMemoryError, RuntimeError)
if runtime.HAS_TRITON:
    from triton.runtime.errors import OutOfResources

    _CANDIDATE_ERRORS += (OutOfResources, triton.CompilationError)


def _fastest(key, candidates, run):
    """The candidate c for which run(c) is fastest, timed once per key and remembered (as Triton's autotuner
    does). run must have no side effects: every candidate computes the same exact result. A candidate that
    fails to compile or runs out of memory is skipped with a warning; if all fail, the last error is raised."""
    if key not in _linear_choices:
        times, error = {}, None
        for c in candidates:
            try:
                times[c] = _benchmark_ms(lambda: run(c))
            except _CANDIDATE_ERRORS as e:
                error = e
                if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                warnings.warn(
                    f"fused Linear {key[:4]}: candidate {c} skipped ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if not times:
            raise CallNotValid(f"fused Linear {key[:4]}: every candidate failed") from error
        _linear_choices[key] = min(times, key=times.get)
    return _linear_choices[key]


def gram_extra_bytes(N, T, K, L):
    """Memory the 'gram' strategy allocates beyond its inputs for 16-bit inputs: fp32 copies of x and of the
    output gradient, and the two (N, T, T) fp32 Gram matrices."""
    return 4 * N * T * (K + L) + 2 * 4 * N * T * T


def _free_bytes(device):
    """Free memory on a CUDA device (the driver's count plus what torch's cache holds unused)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _linear_choice(x, grad_out):
    """'gram', 'materialise' (the gns Linear's torch strategies, core/matmul.py) or the kernel's
    linear_plan.LinearConfig for this call: forced by strategy.forced(fused_linear=...); the interpreter's config on
    CPU (the kernel is what is under test); linear_plan.linear_default_config while torch.compile traces;
    otherwise the fastest, timed once per shape."""
    N, K, L = x.shape[0], x.shape[-1], grad_out.shape[-1]
    T = x.numel() // (N * K) if N * K else 0
    forced = strategy.current().fused_linear
    if forced in ("gram", "materialise") or isinstance(forced, linear_plan.LinearConfig):
        return forced
    if x.device.type != "cuda":
        return linear_plan._interpreter_linear_config(T, L, K)
    capability, sm_count = torch.cuda.get_device_capability(x.device), runtime._sm_count(x.device)
    tf32 = runtime.matmul_allows_tf32()
    if forced == "kernel" or torch.compiler.is_compiling():
        return linear_plan.linear_default_config(
            N, T, K, L, x.dtype, capability, sm_count, tf32, allow_gram=forced != "kernel"
        )
    # one timing per power-of-two bucket of N and T: varying batch or sequence lengths do not re-time every step
    key = (triton.next_power_of_2(N), triton.next_power_of_2(T), K, L, x.dtype, tf32, x.device)
    if key in _linear_choices:  # every call after the first: no candidates listed, no free-memory query (the
        return _linear_choices[key]  # driver's, about 1 ms of host time per call on an H200: bench/RESULTS.md)
    # the Gram trick's fp32 copies (2.5 GB for GPT-2's lm_head at B = 12) are not tried where they would take
    # more than half the free memory
    gram = ["gram"] if gram_extra_bytes(N, T, K, L) <= _free_bytes(x.device) // 2 else []
    candidates = [
        *gram,
        "materialise",
        *linear_plan.linear_candidates(x.dtype, capability, tf32, linear_plan.linear_ragged(L, K, x.dtype, tf32)),
    ]
    return _fastest(key, candidates, lambda c: linear_weight_grad_finished(x, grad_out, c))


def _linear_weight_grad(x, grad_out, choice=None, defer_sum=False):
    """(dW (L, K) in x's dtype, (N, S) fp32: squared norms of S disjoint pieces of each example's dW) by
    `choice` (default: _linear_choice): the kernel's tiles, or one piece from a torch strategy. defer_sum:
    (dW as the kernel holds it, (L_pad, K_pad), the squares, and None or (fp32 partials, the rows of dW they sum
    to) when examples were split): the finishing kernel then sums them into those rows (see _trimmed)."""
    choice = choice or _linear_choice(x, grad_out)
    if isinstance(choice, str):
        dw, w_sq = linear_weight_grad_and_pe_sqnorm(x, grad_out, choice)
        return (dw, w_sq.view(-1, 1), None) if defer_sum else (dw, w_sq.view(-1, 1))
    dw, w_sq, split = _linear_kernel_dw_pe_sqnorm(x, grad_out, choice, runtime._sm_count(x.device))
    if defer_sum:
        return dw, w_sq, split
    if split is not None:
        parts, rows = split
        rows.copy_(parts.sum(dim=0))
    return _trimmed(dw, grad_out.shape[-1], x.shape[-1]), w_sq


def _linear_finished(x, g, buffers, pe_db=None, choice=None):
    """(dW as the kernel holds it, (L_pad, K_pad), or None when x is None (a frozen weight); db (L,) in g's dtype or
    None without pe_db): dW and its per-tile squares by `choice` (default: _linear_choice), then one finishing
    launch for the norms, the sum of a split dW, db and the buffers (weight's, bias's; None: not recorded)."""
    N, L = g.shape[0], g.shape[-1]
    grad_weight = w_sq = split = None
    if x is not None:
        grad_weight, w_sq, split = _linear_weight_grad(x, g, choice, defer_sum=True)
    _, grad_bias = finish._finish(w_sq, pe_db, N, 1, L, L, g.dtype, g.device, buffers, a_squares=True, split=split)
    return grad_weight, grad_bias


def linear_weight_grad_finished(x, g, choice):
    """What a fused Linear's backward runs for dW (returned, (L_pad, K_pad)) and its norms by `choice`, the
    finishing launch included but no buffer updated (the timed choice, bench/kernels.py)."""
    return _linear_finished(x, g, (None, None), choice=choice)[0]


@runtime._custom_op("nanogns::linear_dw_db", mutates_args=("weight_buffer", "bias_buffer"))
def _linear_dw_db_op(
    x: Optional[torch.Tensor],
    g: torch.Tensor,
    weight_buffer: Optional[torch.Tensor],
    bias_buffer: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW (L, K) in x's dtype, or (0,) when x is None (a frozen weight); db (L,) in g's dtype) for x (N, T, K),
    g (N, T, L): dW and its per-tile squares from _linear_weight_grad, the bias's per-example sums one
    reduction, then one finishing launch for the norms, db and both buffers."""
    pe_db = bias_pe_grads(g)  # (N, L) fp32, rows L apart
    grad_weight, grad_bias = _linear_finished(x, g, (weight_buffer, bias_buffer), pe_db)
    return _trimmed(grad_weight, g.shape[-1], x.shape[-1]) if x is not None else g.new_empty(0), grad_bias


@runtime._custom_op("nanogns::linear_dw", mutates_args=("weight_buffer",))
def _linear_dw_op(x: torch.Tensor, g: torch.Tensor, weight_buffer: Optional[torch.Tensor]) -> torch.Tensor:
    """dW (L, K) in x's dtype of a Linear without a bias to differentiate (as linear_dw_db)."""
    grad_weight, _ = _linear_finished(x, g, (weight_buffer, None))
    return _trimmed(grad_weight, g.shape[-1], x.shape[-1])


@_linear_dw_db_op.register_fake
def _(x, g, weight_buffer, bias_buffer):
    L = g.shape[-1]
    return (x.new_empty(L, x.shape[-1]) if x is not None else g.new_empty(0)), g.new_empty(L)


@_linear_dw_op.register_fake
def _(x, g, weight_buffer):
    return x.new_empty(g.shape[-1], x.shape[-1])


def _fused_linear_backward(ctx, grad_out):
    """(dx, dW, db) of a fused Linear (x saved with its examples on dim 0): dx a matmul, the rest one custom op.
    Only what autograd asks for (frozen parameters: no gradient, no norms)."""
    x, weight = ctx.saved_tensors
    weight_buffer, bias_buffer = ctx.buffers
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    grad_x = grad_out @ weight if needs_x else None
    N, L = grad_out.shape[0], grad_out.shape[-1]
    gs = grad_out.reshape(N, -1, L)  # (N, T, L)
    xs = x.reshape(N, -1, x.shape[-1]) if needs_weight else None
    grad_weight = grad_bias = None
    if needs_bias:
        grad_weight, grad_bias = torch.ops.nanogns.linear_dw_db(
            xs, gs, weight_buffer if needs_weight else None, bias_buffer
        )
        grad_weight = grad_weight if needs_weight else None
    elif needs_weight:
        grad_weight = torch.ops.nanogns.linear_dw(xs, gs, weight_buffer)
    return grad_x, grad_weight, grad_bias


class FusedLinearFunction(torch.autograd.Function):
    """fused_linear(x (N, ..., K), weight (L, K), bias (L,) or None, weight_buffer, bias_buffer);
    buffers may be None. x, weight and bias share one dtype (FusedLinear casts under autocast).
    Forward, the input gradient and the bias are the gns Linear's; the weight gradient and its norms come
    from the kernel or a torch strategy (_linear_choice). Frozen parameters get no gradient and no norms."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_buffer, bias_buffer):
        runtime._check_input(x, weight.shape[1], "fused Linear")
        # the gns Linear's saved state (kinds/linear.py's LinearFunction): x only for the weight gradient, weight
        # only for the input gradient; the layers pass x with its examples on dim 0
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.buffers, ctx.rows = (weight_buffer, bias_buffer), Rows("dim0", x.shape[0])
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return *_fused_linear_backward(ctx, grad_out), None, None


fused_linear = FusedLinearFunction.apply
