"""
Fused layers: Triton kernels (normgnorm/) compute the parameter gradients and
the exact per-example squared gradient norms in one backward pass.

    PEGradNormFusedLayerNorm(ndim, bias=True, eps=1e-5)   forward + backward kernels
    PEGradNormFusedRMSNorm(ndim, eps=1e-6, weight_offset=0.0)   same kernels, no mean, no bias
    PEGradNormFusedLinear(in_features, out_features, bias=True, device=None, dtype=None)
        forward is F.linear, dX is a matmul, dW + its per-example norms come from one
        kernel (or from buffered.py's torch strategies where they are faster), db in torch
    PEGradNormFusedConv1D(nf, nx, bias=True)             transformers' Conv1D (weight (in, out)), same kernel

They have the parameters, `<param>_upegsqnorm` buffers and semantics of
buffered.py's classes (they subclass them), and the autograd functions are
exposed as `fused_layer_norm`, `fused_rms_norm` and `fused_linear`.

Launch configurations are pure functions of shapes, dtype and the GPU's
capability and SM count (`norm_launch_config`, `linear_candidates`,
`linear_default_config`), so bench/compile_gate.py can compile every one of
them for sm_80 and sm_90 without a GPU and check registers, spills and shared
memory. The fused Linear picks, once per shape on a GPU, the fastest of the
kernel's candidate tile configurations and the two torch strategies of
buffered.py (all exact) by timing each, as Triton's autotuner does (a
candidate that fails or runs out of memory is skipped); on the CPU the choice
is `_interpreter_linear_config`. Which tiles one program owns and which are
split into chunks of examples is `linear_split`, a cost model of the GPU's
waves (whole rows of tiles owned up to a full wave, the rest split).

The kernels' glue runs inside torch custom ops (nanogns::norm_fwd, norm_bwd,
linear_dw_db, linear_dw): torch.compile keeps each as one node of its graph and
runs it eagerly, so the timed choice and Triton's interpreter work under
torch.compile too. A backward launches two kernels (norms) or a matmul, the
weight-gradient kernel, a bias reduction and one finishing kernel (Linear):
normgnorm/finish.py does the per-example sums, squares and buffer updates.

Where the kernel can run is decided per call (`kernel_unavailable_reason`):
a CUDA tensor with Triton installed on a GPU it supports, or a CPU tensor while
Triton's interpreter is active (TRITON_INTERPRET=1 set before triton is first
imported; this is how the tests run the kernels on CPU). Which of the two Triton
chose is read from Triton itself: its jitted functions are then interpreter
functions.
Anywhere else a layer falls back to the buffered.py torch computation (the same
numbers) and warns once per process per reason. Shapes the kernels cannot take
raise RuntimeError here, before any kernel is launched.
"""

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from nanogns.layers import layout
from nanogns.layers.buffers import autocast_inputs
from nanogns.layers.conv1d import PEGradNormConv1D
from nanogns.layers.layernorm import PEGradNormLayerNorm, torch_layer_norm
from nanogns.layers.linear import (
    LinearFunction,
    PEGradNormLinear,
    bias_pe_grads,
    linear_weight_grad_and_pe_sqnorm,
    simultaneous_uses_gram,
)
from nanogns.layers.registry import add_variant
from nanogns.layers.rmsnorm import PEGradNormRMSNorm, torch_rms_norm
from nanogns.layers.tied import note_head

try:
    import triton

    HAS_TRITON = True
except ImportError:  # the layers still work, through the torch fallback
    triton = None
    HAS_TRITON = False

if HAS_TRITON:
    # kernels are looked up as kernels.<module>.<kernel> at each call
    from nanogns import kernels

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a norm row is held in registers by one program, as in Triton's layer-norm tutorial; past 8192 features the
# backward kernel spills (bench/compile_gate.py), so wider rows are refused
MAX_NORM_FEATURES = 8192
NORM_RAGGED_MAX = 4096  # a ragged norm width up to this is masked in the kernels, unpadded (_masked_rows)
_warned_reasons = set()


# -----------------------------------------------------------------------------
# can the kernel run here?


def _interpreted_flags():
    """(our kernels interpreted?, Triton's own tl.* helpers interpreted?): both are fixed when decorated,
    ours when normgnorm is imported, Triton's when triton is."""
    from triton.runtime.interpreter import InterpretedFunction

    return (
        isinstance(kernels.layernorm._ln_fwd, InterpretedFunction),
        isinstance(triton.language.sum, InterpretedFunction),
    )


def kernels_interpreted():
    """True when the kernels run in Triton's interpreter (on CPU tensors)."""
    return HAS_TRITON and all(_interpreted_flags())


def kernel_unavailable_reason(x):
    """None when the Triton kernels can run on tensor `x`, else why not (for the fallback warning)."""
    if not HAS_TRITON:
        return "Triton is not installed; `pip install triton` on a machine with a supported GPU"
    if x.dtype not in KERNEL_DTYPES:
        return f"the kernels take {[str(d) for d in KERNEL_DTYPES]}, got {x.dtype}; cast the model to one of them"
    ours, triton_own = _interpreted_flags()
    if ours != triton_own:
        return (
            "TRITON_INTERPRET changed between importing triton and importing fused_gns, so Triton's "
            "interpreter is half active; set it (or not) before anything imports triton"
        )
    if ours:  # (under torch.compile too: the kernels run inside custom ops, which Dynamo does not trace)
        if x.device.type == "cpu":
            return None
        return (
            f"Triton's interpreter is active (TRITON_INTERPRET=1) and runs the kernels on CPU tensors only, "
            f"got a {x.device.type} tensor; unset TRITON_INTERPRET to compile them for the GPU"
        )
    if x.device.type != "cuda":
        return (
            f"the kernels need a CUDA tensor, got a {x.device.type} tensor; run on a GPU, or set "
            f"TRITON_INTERPRET=1 before starting Python to run them (slowly) on the CPU"
        )
    if torch.version.cuda is not None:  # NVIDIA; ROCm builds report torch.version.hip instead
        major, minor = torch.cuda.get_device_capability(x.device)
        if (major, minor) < (7, 0) or (x.dtype == torch.bfloat16 and major < 8):
            return (
                f"GPU capability {major}.{minor} is too old for the kernels with {x.dtype} "
                f"(they need sm_70, sm_80 for bfloat16)"
            )
    return None


def _use_kernel(layer, x):
    """True when the Triton kernel can run on x; otherwise warn once per reason and return False."""
    reason = kernel_unavailable_reason(x)
    if reason is None:
        return True
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(
            f"{type(layer).__name__}: Triton kernel not used ({reason}); falling back to buffered.py's "
            f"torch computation, which gives the same numbers more slowly.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _check_input(x, features, what):
    if x.dim() < 2:
        raise RuntimeError(
            f"{what} needs input (N, ..., {features}) with examples along dim 0, got shape "
            f"{tuple(x.shape)}; add an example dim, e.g. x.unsqueeze(0)"
        )
    if x.shape[-1] != features:
        raise RuntimeError(f"{what} expects {features} features in the last dim, got shape {tuple(x.shape)}")


def matmul_allows_tf32():
    """True when torch's fp32 matmuls may use TF32, read through the API that set it: after
    torch.backends.fp32_precision or torch.backends.cuda.matmul.fp32_precision was set, reading the legacy
    torch.backends.cuda.matmul.allow_tf32 raises (torch >= 2.9); fp32_precision reflects both APIs."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:  # torch < 2.9: the legacy flag only
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return precision == "tf32"


def _device_guard(device):
    """Triton launches on the current CUDA device: make it the tensors' device (cuda:1 in a one-process run)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kernel, grid, device, *args, **kwargs):
    """Every kernel launch of this module: kernel[grid](*args, **kwargs) on `device` (one place for tests to
    count launches)."""
    with _device_guard(device):
        kernel[grid](*args, **kwargs)


def _aligned(t):
    """t, copied if its data is not 16-byte aligned: the kernels are compiled for aligned pointers. (While
    torch.compile traces there is no data pointer to look at; its buffers are aligned.)"""
    if torch.compiler.is_compiling() or t.data_ptr() % 16 == 0:
        return t
    return t.clone()


def _masked_rows(t, width, widest):
    """(rows, stride) of t as (M, width) rows for a kernel that masks a ragged width (not a multiple of 16): from 16
    to `widest` such a width goes unpadded, rows `width` apart (a 50257 vocabulary: no 1.2 GB copy per step), in the
    unaligned specialisation the compile gate compiles too. Otherwise _kernel_rows' zero-padded rows: below 16
    Triton would specialise a width of 1; above `widest` the unaligned kernel spills."""
    if width % 16 == 0 or not 16 <= width <= widest:
        return _kernel_rows(t, width)
    return _aligned(t.reshape(-1, width).contiguous()), width


def _kernel_rows(t, width):
    """(rows, stride): t as (M, width) rows for a kernel, 16-byte aligned and `stride` elements apart, stride
    the next multiple of 16 (what the kernels are compiled for; bench/compile_gate.py). When width is not
    one, rows are copied into a zero-padded buffer: the kernels read the padding and it must add nothing."""
    rows = t.reshape(-1, width)
    stride = triton.cdiv(width, 16) * 16
    if stride == width:
        return _aligned(rows.contiguous()), stride
    padded = torch.zeros(rows.shape[0], stride, dtype=t.dtype, device=t.device)
    padded[:, :width] = rows
    return padded, stride


# -----------------------------------------------------------------------------
# finishing: per-example norms, gradients and buffer updates in one launch

_counters = {}  # device -> int32 counter of normgnorm.finish (0 between launches; launches on one stream)


def _counter(device):
    if device not in _counters:
        _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[device]


FINISH_WARPS = 4  # bench/compile_gate.py compiles _pe_sqnorm_finish with these


def finish_block_w(W):
    """Columns per program of _pe_sqnorm_finish: about 32 programs per parameter, 64 to 512 columns (1024 with 4
    warps spills on sm_90: bench/compile_gate.py)."""
    return min(512, max(64, triton.next_power_of_2(triton.cdiv(W, 32))))


def _aligned_at(buffer):
    """(a view of buffer's storage starting at the 16-byte aligned address at or before it, buffer's offset in
    it): a buffer re-homed as a view of one flat tensor (gnstracking.BufferTable) may start 8 bytes past one,
    and the kernel is compiled for aligned pointers."""
    at = buffer.data_ptr() % 16 // buffer.element_size()
    if at == 0:
        return buffer, 0
    return buffer.as_strided((at + buffer.numel(),), (1,), buffer.storage_offset() - at), at


def _recorded(buffer, pe_sqnorm):
    """Called with each per-example squared-norm vector (N,) a kernel added to `buffer` (tests observe them)."""


FINISH_SUM_BLOCK = 512  # elements of a split gradient one program of _pe_sqnorm_finish sums (1024 spills, Triton 3.6)


def _finish(a, b, N, C, W, stride, grad_dtype, device, buffers, counts=True, a_squares=False, split=None):
    """_pe_sqnorm_finish on parameter a's and b's partials (None: no gradient): (a's gradient or None, b's
    gradient or None), each (W,) in grad_dtype; a_squares: a is (N, S) squared norms (no gradient formed).
    split: (fp32 partials (chunks, ...), out in grad_dtype): the same launch writes out = partials.sum(0)."""
    a_grad = torch.empty(W, dtype=grad_dtype, device=device) if a is not None and not a_squares else None
    b_grad = torch.empty(W, dtype=grad_dtype, device=device) if b is not None else None
    if N == 0:  # no examples: zero gradients, nothing recorded
        return tuple(t.zero_() if t is not None else None for t in (a_grad, b_grad))
    if b is None and (a is None or a_squares):
        W = 0  # no vectors: one program per parameter
    block_w = finish_block_w(W)
    blocks = triton.cdiv(W, block_w) if W else 1
    parts, out = (
        split
        if split is not None
        else (torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=grad_dtype, device=device))
    )
    sum_programs = triton.cdiv(out.numel(), FINISH_SUM_BLOCK) if split is not None else 0
    sq_part = torch.empty(2, N, blocks, dtype=torch.float32, device=device)
    pesq = torch.empty(2, N, dtype=torch.float32, device=device)
    any_part = a if a is not None else b
    grad_any = (
        a_grad if a_grad is not None else b_grad if b_grad is not None else sq_part.new_empty(0, dtype=grad_dtype)
    )
    a_buf, b_buf = buffers
    (a_base, a_at), (b_base, b_at) = (_aligned_at(buf) if buf is not None else (pesq, 0) for buf in buffers)
    _launch(
        kernels.finish._pe_sqnorm_finish,
        (blocks, 2 + triton.cdiv(sum_programs, blocks)),
        device,
        a if a is not None else any_part,
        b if b is not None else any_part,
        a_grad if a_grad is not None else grad_any,
        b_grad if b_grad is not None else grad_any,
        sq_part,
        pesq,
        a_base,
        b_base,
        _counter(device),
        N,
        C,
        W,
        stride,
        a.shape[-1] if a_squares and a is not None else 0,
        N if counts else 0,
        int(a is not None),
        int(b is not None),
        int(a is not None and a_buf is not None),
        int(b is not None and b_buf is not None),
        a_at,
        b_at,
        parts,
        out,
        out.numel(),
        parts.shape[0] if split else 0,
        A_SQUARES=a_squares,
        BLOCK_W=block_w,
        SUM_BLOCK=FINISH_SUM_BLOCK,
        num_warps=FINISH_WARPS,
    )
    for part, buffer, row in ((a, a_buf, pesq[0]), (b, b_buf, pesq[1])):
        if part is not None and buffer is not None:
            _recorded(buffer, row)
    return a_grad, b_grad


# -----------------------------------------------------------------------------
# LayerNorm / RMSNorm


def _sm_count(device):
    """Streaming multiprocessors of a CUDA device; None for any other device (no grid to fill)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_for_gpu(length, other_programs, programs_per_sm, sm_count):
    """Split `length` items (rows, examples) into chunks so that chunks x other_programs reaches about
    programs_per_sm programs per SM; one chunk when sm_count is None (CPU). Returns (chunks, items per chunk)."""
    if sm_count is None or length == 0:
        return 1, length
    chunks = max(1, min(length, triton.cdiv(programs_per_sm * sm_count, other_programs)))
    per_chunk = triton.cdiv(length, chunks)
    return triton.cdiv(length, per_chunk), per_chunk


def _norm_chunks(N, T, sm_count):
    """(chunks per example, rows per chunk) for _ln_bwd_dx_pesq: on a GPU about 4 programs per SM
    (more chunks: more parallelism but a larger (N * chunks, D) partial buffer); one chunk on CPU."""
    return _split_for_gpu(T, N, 4, sm_count)


def norm_launch_config(D):
    """(BLOCK_D, num_warps) of both norm kernels for D features (at most MAX_NORM_FEATURES): one row per
    program, BLOCK_D the next power of two >= max(D, 256); 8 elements per thread up to 8 warps, 16 beyond
    (4096: 8 warps; 8192: 16, as 8 warps spill there: bench/compile_gate.py)."""
    block_d = max(256, triton.next_power_of_2(D))
    return block_d, max(min(block_d // 256, 8), block_d // 512)


# The kernels' glue runs as torch custom ops (nanogns::*): torch.compile keeps each as one opaque node of its
# graph, run eagerly (so Triton's interpreter works under torch.compile too, and the timed choice still times);
# the autograd Functions around them are traced. Each op has a fake implementation giving its outputs' shapes.
CUSTOM_OPS = {}  # "nanogns::<name>" -> its Python implementation (bench/launch_counts.py counts inside them)


def _custom_op(name, mutates_args=()):
    def register(fn):
        CUSTOM_OPS[name] = fn
        return torch.library.custom_op(name, mutates_args=mutates_args)(fn)

    return register


@_custom_op("nanogns::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (M, stride) in x2's dtype, mean (M,), rstd (M,) fp32) of the rows x2 (M, stride), D = weight.numel()."""
    x2 = _aligned(x2.contiguous())
    M, stride = x2.shape
    D = weight.numel()
    weight = _aligned(weight.contiguous())
    bias = _aligned(bias.contiguous()) if bias is not None else None
    y = torch.empty(M, stride, dtype=x2.dtype, device=x2.device)
    mean = torch.empty(M, dtype=torch.float32, device=x2.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
    block_d, num_warps = norm_launch_config(D)
    if M > 0:
        _launch(
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


@_custom_op("nanogns::norm_bwd", mutates_args=("weight_buffer", "bias_buffer"))
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
    x2, g = _aligned(x2.contiguous()), _aligned(g.contiguous())
    M, stride = x2.shape
    D = weight.numel()
    T = M // N if N else 0
    block_d, num_warps = norm_launch_config(D)
    dx = torch.empty_like(x2)
    chunks, rows = _norm_chunks(N, T, _sm_count(x2.device)) if M > 0 else (1, 0)
    alloc = torch.empty if M > 0 else torch.zeros  # the kernel writes every row of the partials
    dw_part = alloc(N * chunks, stride, dtype=torch.float32, device=x2.device)
    db_part = alloc(N * chunks, stride, dtype=torch.float32, device=x2.device) if has_bias else dw_part
    if M > 0:
        _launch(
            kernels.layernorm._ln_bwd_dx_pesq,
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
    dw, db = _finish(
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
    _check_input(x, D, what)
    if D > MAX_NORM_FEATURES:
        raise RuntimeError(
            f"{what}: feature dim {D} of input shape {tuple(x.shape)} exceeds the kernels' "
            f"{MAX_NORM_FEATURES} features (one row per program, in registers); "
            f"use lnclass='gns' for it"
        )
    x2, stride = _masked_rows(x, D, NORM_RAGGED_MAX)  # (N * T, D) rows, stride apart
    y, mean, rstd = torch.ops.nanogns.norm_fwd(x2, weight, bias, eps, is_rms)
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.N, ctx.D, ctx.is_rms, ctx.has_bias = x.shape[0], D, is_rms, bias is not None
    return y[:, :D].view(x.shape)


def _norm_backward(ctx, grad_out, weight_buffer, bias_buffer):
    """(dx, dw, db or None); adds ||dw_i||^2 and ||db_i||^2 to the buffers."""
    x2, weight, mean, rstd = ctx.saved_tensors
    g, _ = _masked_rows(grad_out, ctx.D, NORM_RAGGED_MAX)
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


# -----------------------------------------------------------------------------
# Linear


@dataclass(frozen=True)
class LinearConfig:
    """A launch configuration of _linear_bwd_dw_pesq: tile of dW, rows per step, warps, pipeline stages."""

    block_l: int
    block_k: int
    block_t: int
    num_warps: int
    num_stages: int

    def shared_bytes(self, element_size):
        """Shared memory the pipeline's operand buffers take: num_stages x (g and x row blocks)."""
        return self.num_stages * self.block_t * (self.block_l + self.block_k) * element_size


# Autotune candidates by tl.dot flavour, largest tiles first: the tile/warp/stage range of fast Triton matmuls
# on A100/H100 (Triton's matmul tutorial). Each program holds two fp32 (BLOCK_L, BLOCK_K) accumulators, dW_i and
# dW, so a 128 x 128 tile needs 8 warps (64 + 64 registers per thread for them). fp32 "ieee" is a CUDA-core FMA
# dot whose operands also sit in registers: smaller row blocks. Every candidate compiles for sm_80 and sm_90
# with no spills (bench/compile_gate.py, run by tests/test_bench_compile_gate.py).
LINEAR_CANDIDATES = {
    "16-bit": (
        LinearConfig(128, 128, 64, 8, 3),
        LinearConfig(128, 128, 32, 8, 4),
        LinearConfig(128, 64, 64, 8, 4),
        LinearConfig(64, 128, 64, 8, 4),
        LinearConfig(64, 64, 64, 4, 4),
    ),
    "tf32": (
        LinearConfig(128, 128, 32, 8, 3),
        LinearConfig(128, 64, 32, 8, 3),
        LinearConfig(64, 128, 32, 8, 3),
        LinearConfig(64, 64, 32, 4, 3),
    ),
    "ieee": (LinearConfig(128, 128, 16, 8, 2), LinearConfig(64, 64, 32, 4, 3)),
}
# With a ragged width (not a multiple of 16) given unmasked, the rows of the output gradient (L) or of the input
# (K) are not 16-byte aligned, their loads are not vectorised and take more registers: these configurations then
# spill (bench/compile_gate.py, sm_80 or sm_90), so they are not candidates
_RAGGED_ONE_SPILLS = {("16-bit", LinearConfig(128, 128, 64, 8, 3)), ("ieee", LinearConfig(64, 64, 32, 4, 3))}
RAGGED_SPILLS = {
    ("L",): _RAGGED_ONE_SPILLS,
    ("K",): _RAGGED_ONE_SPILLS,
    ("L", "K"): _RAGGED_ONE_SPILLS
    | {
        ("16-bit", LinearConfig(128, 128, 32, 8, 4)),
        ("16-bit", LinearConfig(64, 64, 64, 4, 4)),
        ("tf32", LinearConfig(128, 128, 32, 8, 3)),
    },
}
# largest dynamic shared memory per block (bytes) by compute capability; unknown ones get the smallest listed
_SHARED_MEMORY_LIMIT = {
    (7, 0): 98304,
    (7, 5): 65536,
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
}
FUSED_LINEAR_STRATEGY = None  # None: _linear_choice picks; "kernel", "gram", "materialise" or a LinearConfig forces one
_linear_choices = {}  # (N, T buckets, K, L, dtype, tf32, device) -> "gram", "materialise" or a LinearConfig


def shared_memory_limit(capability):
    return _SHARED_MEMORY_LIMIT.get(tuple(capability), min(_SHARED_MEMORY_LIMIT.values()))


def linear_dot_precision(dtype, allow_tf32):
    """The tl.dot flavour for operands of `dtype`: '16-bit' (tensor cores), 'tf32' or 'ieee' (fp32 FMA)."""
    if dtype != torch.float32:
        return "16-bit"
    return "tf32" if allow_tf32 else "ieee"


def _unspilled(precision, ragged):
    """LINEAR_CANDIDATES of a dot flavour that compile without spills with the widths `ragged` masked."""
    return [c for c in LINEAR_CANDIDATES[precision] if (precision, c) not in RAGGED_SPILLS.get(ragged, ())]


def linear_ragged(L, K, dtype, allow_tf32):
    """The Linear kernel's widths given to it unpadded, masked in the kernel: ("L",), ("K",), ("L", "K") or ().
    A width is ragged when it is not a multiple of 16 (from 16 on: a 50257 vocabulary, no 1.2 GB padded copy per
    step); below 16 it is zero-padded, as is a ragged K should RAGGED_SPILLS leave no candidate with both
    masked."""
    ragged = tuple(name for name, width in (("L", L), ("K", K)) if width >= 16 and width % 16)
    if ragged == ("L", "K") and not _unspilled(linear_dot_precision(dtype, allow_tf32), ragged):
        return ("L",)
    return ragged


def linear_candidates(dtype, capability, allow_tf32, ragged=()):
    """The launch configurations the glue may time for `dtype` on a GPU of `capability` (major, minor):
    LINEAR_CANDIDATES of its dot flavour whose pipeline buffers fit the GPU's shared memory with a 10% margin,
    without those that spill with the widths `ragged` (linear_ragged) masked (RAGGED_SPILLS)."""
    limit = 0.9 * shared_memory_limit(capability)
    candidates = _unspilled(linear_dot_precision(dtype, allow_tf32), tuple(ragged))
    return [c for c in candidates if c.shared_bytes(dtype.itemsize) <= limit] or [candidates[-1]]


def linear_tile_grid(L, K, config):
    """(rows, columns) of dW tiles, L and K padded to multiples of 16 as the kernel sees them (a masked ragged
    width gives the same count)."""
    return triton.cdiv(triton.cdiv(L, 16) * 16, config.block_l), triton.cdiv(triton.cdiv(K, 16) * 16, config.block_k)


def linear_tiles(L, K, config):
    """dW tiles of a (L, K) weight (linear_tile_grid's rows x columns)."""
    tiles_l, tiles_k = linear_tile_grid(L, K, config)
    return tiles_l * tiles_k


def linear_default_config(N, T, K, L, dtype, capability, sm_count, allow_tf32, allow_gram=True):
    """The untimed choice (under torch.compile): 'gram' where buffered.py's rule prefers it on a GPU, else the
    largest-tile candidate whose tiles alone give every SM a program (chunks of examples fill the rest)."""
    if allow_gram and simultaneous_uses_gram(T, K, L, 4, "cuda"):  # torch strategies work in float32
        return "gram"
    candidates = linear_candidates(dtype, capability, allow_tf32, linear_ragged(L, K, dtype, allow_tf32))
    return next((c for c in candidates if linear_tiles(L, K, c) >= sm_count), candidates[-1])


def _interpreter_linear_config(T, L, K):
    """Triton's interpreter (CPU): large blocks mean fewer (slow, Python-level) programs and steps (up to
    512 x 512 tiles: 8x faster than 128 x 128 on a 768 -> 1000 layer); tl.dot needs blocks >= 16."""
    return LinearConfig(
        min(512, max(16, triton.next_power_of_2(L))),
        min(512, max(16, triton.next_power_of_2(K))),
        min(64, max(16, triton.next_power_of_2(T))),
        4,
        1,
    )


# A cost model of the kernel on a GPU, for choosing how to split examples (H100 SXM spec sheet, per SM: dense
# tensor-core FLOP/s by dot flavour; HBM bytes/s); only the ratios matter, and A100's are alike
SM_FLOPS = {"16-bit": 989e12 / 132, "tf32": 494e12 / 132, "ieee": 67e12 / 132}
MEMORY_BYTES_PER_S = 3.35e12
_REGISTERS_PER_SM = 65536


def linear_blocks_per_sm(config, element_size, capability):
    """Programs of `config` one SM holds at once, an estimate: its shared memory (pipeline buffers) and its
    registers (two fp32 accumulator tiles spread over the threads, plus about 64 per thread for the rest,
    at most 255; 128 x 128 tiles on 8 warps: 192 registers, one program per SM)."""
    threads = 32 * config.num_warps
    registers = min(255, 2 * config.block_l * config.block_k // threads + 64)
    by_registers = _REGISTERS_PER_SM // (registers * threads)
    by_shared = int(shared_memory_limit(capability) // max(1, config.shared_bytes(element_size)))
    return max(1, min(by_registers, by_shared))


def wave_efficiency(programs, slots):
    """Share of the GPU's program slots busy over the waves `programs` take (1.0: every wave full)."""
    return programs / (triton.cdiv(programs, slots) * slots) if programs else 1.0


class LinearSplit(NamedTuple):
    """How _linear_bwd_dw_pesq's programs share dW: the first `front_rows` rows of tiles each owned by one program
    (all examples; dW written in its dtype), every tile after them split over `chunks` programs of `per_chunk`
    examples, each writing an fp32 partial that the finishing kernel sums."""

    front_rows: int
    chunks: int
    per_chunk: int


def makespan(programs, slots):
    """Time for `slots` program slots to run `programs`, [(count, duration), ...] in launch order, each slot
    taking the next program when it frees (the GPU's block scheduler as a list schedule)."""
    free = {0.0: slots}  # time -> slots free from then on
    for count, duration in programs:
        while count:
            t = min(free)
            taken = min(free[t], count)
            free[t] -= taken
            if not free[t]:
                del free[t]
            free[t + duration] = free.get(t + duration, 0) + taken
            count -= taken
    return max(free)


def plan_linear_split(N, tiles_l, tiles_k, slots, example_tile_s, row_partial_s):
    """The LinearSplit of N examples over tiles_l x tiles_k dW tiles on `slots` program slots minimising the
    modelled time: the makespan of the programs (an owned tile takes N x example_tile_s, one program's work on
    one example; a split one per_chunk x example_tile_s), plus, per chunk, the fp32 partials of the split rows
    written and read back (row_partial_s per row of tiles). Owned rows are tried up to each full wave
    (w x slots tiles); ties go to fewer chunks, then to more owned rows."""
    tiles = tiles_l * tiles_k
    fronts = {0} | {min(tiles_l, w * slots // tiles_k) for w in range(1, tiles // slots + 1)}
    best = None
    for per_chunk in sorted({triton.cdiv(N, c) for c in range(1, N + 1)}, reverse=True):
        chunks = triton.cdiv(N, per_chunk)
        for front in sorted(f for f in fronts if f < tiles_l) if chunks > 1 else [tiles_l]:
            split_tiles = (tiles_l - front) * tiles_k
            time = makespan(
                [(front * tiles_k, N * example_tile_s), (split_tiles * chunks, per_chunk * example_tile_s)], slots
            )
            time += chunks * (tiles_l - front) * row_partial_s if chunks > 1 else 0.0
            if (
                best is None
                or time < best[0] * (1 - 1e-9)
                or (time <= best[0] * (1 + 1e-9) and best[1].chunks == chunks and front > best[1].front_rows)
            ):
                best = (time, LinearSplit(front, chunks, per_chunk))
    return best[1]


def split_busy_share(N, tiles_l, tiles_k, slots, split):
    """Share of the slots' time busy with work under `split` (1.0: every wave full; partials not counted)."""
    front, chunks, per_chunk = split
    programs = [(front * tiles_k, N), ((tiles_l - front) * tiles_k * chunks, per_chunk)]
    return N * tiles_l * tiles_k / (makespan(programs, slots) * slots) if N and tiles_l * tiles_k else 1.0


@functools.lru_cache(maxsize=1024)
def linear_split(N, T, K, L, config, dtype, allow_tf32, capability, sm_count):
    """The LinearSplit of _linear_bwd_dw_pesq on a GPU of sm_count SMs (plan_linear_split with the cost model
    above); every tile owned on the CPU (sm_count None)."""
    tiles_l, tiles_k = linear_tile_grid(L, K, config)
    if sm_count is None or N == 0:
        return LinearSplit(tiles_l, 1, N)
    slots = sm_count * linear_blocks_per_sm(config, dtype.itemsize, capability)
    example_tile_s = 2 * T * config.block_l * config.block_k / SM_FLOPS[linear_dot_precision(dtype, allow_tf32)]
    row_partial_s = 2 * 4 * config.block_l * K / MEMORY_BYTES_PER_S  # fp32 written by the kernel, read by the sum
    return plan_linear_split(N, tiles_l, tiles_k, slots, example_tile_s, row_partial_s)


def _linear_plan(N, T, K, L, config, dtype, tf32, device):
    """The LinearSplit for this GPU (linear_split, tf32 as the kernel's dots); every tile owned on the CPU."""
    sm_count = _sm_count(device)
    capability = torch.cuda.get_device_capability(device) if sm_count is not None else None
    return linear_split(N, T, K, L, config, dtype, tf32, capability, sm_count)


def _linear_kernel_dw_pesq(x, grad_out, config, sm_count):
    """(dW (L_pad, K_pad) in x's dtype, the squared norms of each example's dW tiles (N, tiles) fp32, and None;
    or, when examples of some rows of tiles were split over programs, (fp32 partials (chunks, rows, K_pad), the
    rows of dW they sum to) from _linear_bwd_dw_pesq."""
    N, K, L = x.shape[0], x.shape[-1], grad_out.shape[-1]
    # fp32 operands: tensor-core tf32 only where torch's own matmuls may use it; ignored for 16-bit operands
    tf32 = x.dtype != torch.float32 or (x.device.type == "cuda" and matmul_allows_tf32())
    ragged = linear_ragged(L, K, x.dtype, tf32)  # widths masked in the kernel; the others zero-padded to 16
    xs, K_pad = _masked_rows(x, K, float("inf")) if "K" in ragged else _kernel_rows(x, K)  # (N * T, K_pad)
    gs, L_pad = _masked_rows(grad_out.to(x.dtype), L, float("inf"))  # (N * T, L_pad), L_pad = L from 16 outputs on
    T = xs.shape[0] // N if N else 0
    tiles_l, tiles_k = linear_tile_grid(L_pad, K_pad, config)
    launch = xs.numel() > 0 and gs.numel() > 0
    front, chunks, per_chunk = (
        _linear_plan(N, T, K_pad, L_pad, config, x.dtype, tf32, x.device) if launch else LinearSplit(tiles_l, 1, N)
    )
    alloc = torch.empty if launch else torch.zeros  # the kernel writes every element it owns
    dw = alloc(L_pad, K_pad, dtype=x.dtype, device=x.device)  # owned tiles: written in x's dtype
    split_rows = L_pad - min(L_pad, front * config.block_l)  # rows of dW summed from fp32 partials per chunk
    dw_part = (
        alloc(chunks, split_rows, K_pad, dtype=torch.float32, device=x.device)
        if split_rows
        else torch.empty(0, dtype=torch.float32, device=x.device)
    )
    w_pesq_part = alloc(N, tiles_l * tiles_k, dtype=torch.float32, device=x.device)
    if launch:
        programs = front * tiles_k + (tiles_l - front) * tiles_k * chunks
        _launch(
            kernels.linear._linear_bwd_dw_pesq,
            (programs,),
            x.device,
            xs,
            gs,
            dw,
            dw_part,
            w_pesq_part,
            N,
            T,
            L_pad,
            K_pad,
            per_chunk,
            front,
            chunks,
            INPUT_PRECISION="tf32" if tf32 else "ieee",
            DOT_IN_FP32=x.dtype == torch.bfloat16 and kernels_interpreted(),
            BLOCK_L=config.block_l,
            BLOCK_K=config.block_k,
            BLOCK_T=config.block_t,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    if split_rows:
        return dw, w_pesq_part, (dw_part, dw[L_pad - split_rows :])
    return dw, w_pesq_part, None


def _trimmed(dw, L, K):
    """dW (L, K) from the kernel's (L_pad, K_pad) one."""
    return dw if dw.shape == (L, K) else dw[:L, :K].contiguous()


def _benchmark_ms(fn):
    """Median milliseconds of fn() on the GPU (Triton's do_bench: CUDA events, L2 flushed between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


# what a candidate may raise while it is timed and still leave the others worth trying
_CANDIDATE_ERRORS = (torch.OutOfMemoryError, RuntimeError)
if HAS_TRITON:
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
            raise RuntimeError(f"fused Linear {key[:4]}: every candidate failed") from error
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
    """'gram', 'materialise' (buffered.py's torch strategies) or the kernel's LinearConfig for this call:
    forced by FUSED_LINEAR_STRATEGY; the interpreter's config on CPU (the kernel is what is under test);
    linear_default_config while torch.compile traces; otherwise the fastest, timed once per shape."""
    N, K, L = x.shape[0], x.shape[-1], grad_out.shape[-1]
    T = x.numel() // (N * K) if N * K else 0
    if FUSED_LINEAR_STRATEGY in ("gram", "materialise") or isinstance(FUSED_LINEAR_STRATEGY, LinearConfig):
        return FUSED_LINEAR_STRATEGY
    if x.device.type != "cuda":
        return _interpreter_linear_config(T, L, K)
    capability, sm_count = torch.cuda.get_device_capability(x.device), _sm_count(x.device)
    tf32 = matmul_allows_tf32()
    if FUSED_LINEAR_STRATEGY == "kernel" or torch.compiler.is_compiling():
        return linear_default_config(
            N, T, K, L, x.dtype, capability, sm_count, tf32, allow_gram=FUSED_LINEAR_STRATEGY != "kernel"
        )
    # the Gram trick's fp32 copies (2.5 GB for GPT-2's lm_head at B = 12) are not tried where they would take
    # more than half the free memory
    gram = ["gram"] if gram_extra_bytes(N, T, K, L) <= _free_bytes(x.device) // 2 else []
    candidates = [
        *gram,
        "materialise",
        *linear_candidates(x.dtype, capability, tf32, linear_ragged(L, K, x.dtype, tf32)),
    ]
    # one timing per power-of-two bucket of N and T: varying batch or sequence lengths do not re-time every step
    key = (triton.next_power_of_2(N), triton.next_power_of_2(T), K, L, x.dtype, tf32, x.device)
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
    dw, w_sq, split = _linear_kernel_dw_pesq(x, grad_out, choice, _sm_count(x.device))
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
    _, grad_bias = _finish(w_sq, pe_db, N, 1, L, L, g.dtype, g.device, buffers, a_squares=True, split=split)
    return grad_weight, grad_bias


def linear_weight_grad_finished(x, g, choice):
    """What a fused Linear's backward runs for dW (returned, (L_pad, K_pad)) and its norms by `choice`, the
    finishing launch included but no buffer updated (the timed choice, bench/kernels.py)."""
    return _linear_finished(x, g, (None, None), choice=choice)[0]


@_custom_op("nanogns::linear_dw_db", mutates_args=("weight_buffer", "bias_buffer"))
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


@_custom_op("nanogns::linear_dw", mutates_args=("weight_buffer",))
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
    buffers may be None. x, weight and bias share one dtype (PEGradNormFusedLinear casts under autocast).
    Forward, the input gradient and the bias are buffered.py's; the weight gradient and its norms come
    from the kernel or a torch strategy (_linear_choice). Frozen parameters get no gradient and no norms."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_buffer, bias_buffer):
        _check_input(x, weight.shape[1], "fused Linear")
        rows = layout.Rows("dim0", x.shape[0])  # the layers pass x with its examples on dim 0
        return LinearFunction.forward(ctx, x, weight, bias, weight_buffer, bias_buffer, rows)  # the same saved state

    @staticmethod
    def backward(ctx, grad_out):
        return *_fused_linear_backward(ctx, grad_out), None, None


fused_linear = FusedLinearFunction.apply


# -----------------------------------------------------------------------------
# the layers


def _kernel_input(layer, x, *roles):
    """(x viewed with its examples on dim 0 for the kernels, (buffers)), or None when the torch path must run:
    the kernel cannot run here, or x's rows are not whole examples in order (packed, routed, not mapped)."""
    if not _use_kernel(layer, x):
        return None
    rows, buffers = layer.pe_rows_and_buffers(x, *roles)
    if rows is None and any(b is not None for b in layer_buffers(layer, roles)):
        return None  # not mapped: the torch path refuses the step the same way
    if rows is not None and rows.kind == "ragged":
        return None
    if rows is not None and rows.kind == "flat":
        x = x.view(rows.examples, rows.positions, x.shape[-1])
    return x, buffers


def layer_buffers(layer, roles):
    return [layer.pe_buffer(role) for role in roles]


class PEGradNormFusedLayerNorm(PEGradNormLayerNorm):
    """PEGradNormLayerNorm computed by the Triton kernels where they can run."""

    def forward(self, x):
        found = _kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        out = fused_layer_norm(xs, self.weight, self.bias, self.eps, *buffers).view(x.shape)
        return out.to(self.pe_result_dtype(x, torch_layer_norm, self.weight, self.bias))


class PEGradNormFusedRMSNorm(PEGradNormRMSNorm):
    """RMSNorm y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), with per-example norms of the weight
    gradient; the kernel takes the scale (offset + weight) as its weight and keeps the output in x's dtype."""

    def forward(self, x):
        found = _kernel_input(self, x, "weight")
        if found is None:
            return super().forward(x)
        xs, (weight_buffer,) = found
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # None: F.rms_norm's default
        out = fused_rms_norm(xs, self.pe_scale(), eps, weight_buffer).view(x.shape)
        return out.to(self.pe_result_dtype(x, torch_rms_norm, self.weight))


class PEGradNormFusedLinear(PEGradNormLinear):
    """PEGradNormLinear whose weight gradient and per-example norms come from one Triton kernel."""

    def forward(self, x):
        found = _kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        xs, weight, bias = autocast_inputs(xs, *self.pe_weight_and_bias(xs))
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            out = fused_linear(xs, weight, bias, *buffers)
        note_head(buffers[0], xs, layout.Rows("dim0", xs.shape[0]), out)
        return self.pe_promoted(out.view(*x.shape[:-1], self.out_features))


class PEGradNormFusedConv1D(PEGradNormConv1D):
    """transformers' Conv1D (weight stored (in, out)) through the fused Linear kernel, on weight.t()."""

    def forward(self, x):
        found = _kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        xs, weight, bias = autocast_inputs(xs, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return fused_linear(xs, weight.t(), bias, *buffers).view(*x.shape[:-1], self.nf)


for _kind, _variant in (
    ("LayerNorm", PEGradNormFusedLayerNorm),
    ("RMSNorm", PEGradNormFusedRMSNorm),
    ("Linear", PEGradNormFusedLinear),
    ("Conv1D", PEGradNormFusedConv1D),
):
    add_variant(_kind, "fused", _variant)
