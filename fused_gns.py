"""
Fused layers: Triton kernels (normgnorm/) compute the parameter gradients and
the exact per-example squared gradient norms in one backward pass.

    PEGradNormFusedLayerNorm(ndim, bias=True, eps=1e-5)   forward + backward kernels
    PEGradNormFusedRMSNorm(ndim, eps=1e-6, weight_offset=0.0)   same kernels, no mean, no bias
    PEGradNormFusedLinear(in_features, out_features, bias=True, device=None, dtype=None)
        forward is F.linear, dX is a matmul, dW + db + norms come from one kernel
    PEGradNormFusedConv1D(nf, nx, bias=True)             transformers' Conv1D (weight (in, out)), same kernel

They have the parameters, `<param>_upegsqnorm` buffers and semantics of
buffered.py's classes (they subclass them), and the autograd functions are
exposed as `fused_layer_norm`, `fused_rms_norm` and `fused_linear`.

Where the kernel can run is decided per call (`kernel_unavailable_reason`):
a CUDA tensor with Triton installed on a GPU it supports, or a CPU tensor while
Triton's interpreter is active (TRITON_INTERPRET=1 set before triton is first
imported; this is how the tests run the kernels on CPU) and torch.compile is not
tracing (Dynamo cannot trace the interpreter). Which of the two Triton
chose is read from Triton itself: its jitted functions are then interpreter
functions.
Anywhere else a layer falls back to the buffered.py torch computation (the same
numbers) and warns once per process per reason. Shapes the kernels cannot take
raise RuntimeError here, before any kernel is launched.
"""

import warnings

import torch

from buffered import (PEGradNormConv1D, PEGradNormLayerNorm, PEGradNormLinear, PEGradNormRMSNorm, _LinearFunction,
                      accumulate_pe_sqnorm, autocast_inputs)

try:
    import triton

    HAS_TRITON = True
except ImportError:  # the layers still work, through the torch fallback
    triton = None
    HAS_TRITON = False

if HAS_TRITON:
    # kernels are looked up as normgnorm.<module>.<kernel> at each call
    import normgnorm.layernorm
    import normgnorm.linear

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ROW_BYTES = 65536  # a norm row is held in one block, as in Triton's layer-norm tutorial
_warned_reasons = set()


# -----------------------------------------------------------------------------
# can the kernel run here?

def _interpreted_flags():
    """(our kernels interpreted?, Triton's own tl.* helpers interpreted?): both are fixed when decorated,
    ours when normgnorm is imported, Triton's when triton is."""
    from triton.runtime.interpreter import InterpretedFunction

    return (isinstance(normgnorm.layernorm._ln_fwd, InterpretedFunction),
            isinstance(triton.language.sum, InterpretedFunction))


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
        return ("TRITON_INTERPRET changed between importing triton and importing fused_gns, so Triton's "
                "interpreter is half active; set it (or not) before anything imports triton")
    if ours:
        if torch.compiler.is_compiling():  # Dynamo would trace into the interpreter's numpy code and fail
            return "Triton's interpreter (TRITON_INTERPRET=1) cannot run inside torch.compile"
        if x.device.type == "cpu":
            return None
        return (f"Triton's interpreter is active (TRITON_INTERPRET=1) and runs the kernels on CPU tensors only, "
                f"got a {x.device.type} tensor; unset TRITON_INTERPRET to compile them for the GPU")
    if x.device.type != "cuda":
        return (f"the kernels need a CUDA tensor, got a {x.device.type} tensor; run on a GPU, or set "
                f"TRITON_INTERPRET=1 before starting Python to run them (slowly) on the CPU")
    if torch.version.cuda is not None:  # NVIDIA; ROCm builds report torch.version.hip instead
        major, minor = torch.cuda.get_device_capability(x.device)
        if (major, minor) < (7, 0) or (x.dtype == torch.bfloat16 and major < 8):
            return (f"GPU capability {major}.{minor} is too old for the kernels with {x.dtype} "
                    f"(they need sm_70, sm_80 for bfloat16)")
    return None


def _use_kernel(layer, x):
    """True when the Triton kernel can run on x; otherwise warn once per reason and return False."""
    reason = kernel_unavailable_reason(x)
    if reason is None:
        return True
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(f"{type(layer).__name__}: Triton kernel not used ({reason}); falling back to buffered.py's "
                      f"torch computation, which gives the same numbers more slowly.", RuntimeWarning, stacklevel=3)
    return False


def _check_input(x, features, what):
    if x.dim() < 2:
        raise RuntimeError(f"{what} needs input (N, ..., {features}) with examples along dim 0, got shape "
                           f"{tuple(x.shape)}; add an example dim, e.g. x.unsqueeze(0)")
    if x.shape[-1] != features:
        raise RuntimeError(f"{what} expects {features} features in the last dim, got shape {tuple(x.shape)}")


# -----------------------------------------------------------------------------
# LayerNorm / RMSNorm

def _split_for_gpu(length, other_programs, programs_per_sm, device):
    """Split `length` items (rows, examples) into chunks so that chunks x other_programs reaches about
    programs_per_sm programs per SM; one chunk on CPU. Returns (chunks, items per chunk)."""
    if device.type != "cuda":
        return 1, length
    target = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    chunks = max(1, min(length, triton.cdiv(target, other_programs)))
    per_chunk = triton.cdiv(length, chunks)
    return triton.cdiv(length, per_chunk), per_chunk


def _norm_chunks(N, T, device):
    """(chunks per example, rows per chunk) for _ln_bwd_dx_pesq: on a GPU about 4 programs per SM
    (more chunks: more parallelism but a larger (N * chunks, D) partial buffer); one chunk on CPU."""
    return _split_for_gpu(T, N, 4, device)


def _norm_forward(ctx, x, weight, bias, eps, is_rms):
    what = "fused RMSNorm" if is_rms else "fused LayerNorm"
    D = weight.numel()
    _check_input(x, D, what)
    if D * x.element_size() > _MAX_ROW_BYTES:
        raise RuntimeError(f"{what}: feature dim {D} of input shape {tuple(x.shape)} exceeds one block "
                           f"({_MAX_ROW_BYTES // x.element_size()} {x.dtype} values); use lnclass='gns' for it")
    x2 = x.reshape(-1, D).contiguous()  # (N * T, D)
    M = x2.shape[0]
    weight = weight.contiguous()
    y = torch.empty_like(x2)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_d = triton.next_power_of_2(D)
    num_warps = min(max(block_d // 256, 1), 8)
    if M > 0:
        normgnorm.layernorm._ln_fwd[(M,)](
            x2, y, weight, bias if bias is not None else weight, mean, rstd, D, eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_D=block_d, num_warps=num_warps)
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.N, ctx.is_rms, ctx.has_bias = x.shape[0], is_rms, bias is not None
    ctx.block_d, ctx.num_warps = block_d, num_warps
    return y.view(x.shape)


def _norm_backward(ctx, grad_out, weight_buffer, bias_buffer):
    """(dx, dw, db or None); adds ||dw_i||^2 and ||db_i||^2 to the buffers."""
    x2, weight, mean, rstd = ctx.saved_tensors
    M, D = x2.shape
    N = ctx.N
    T = M // N if N else 0
    g = grad_out.reshape(M, D).contiguous()
    dx = torch.empty_like(x2)
    chunks, rows = _norm_chunks(N, T, x2.device) if M > 0 else (1, 0)
    alloc = torch.empty if M > 0 else torch.zeros  # the kernel writes every row of the partials
    dw_part = alloc(N * chunks, D, dtype=torch.float32, device=x2.device)
    db_part = alloc(N * chunks, D, dtype=torch.float32, device=x2.device) if ctx.has_bias else dw_part
    if M > 0:
        normgnorm.layernorm._ln_bwd_dx_pesq[(N, chunks)](
            x2, g, dx, weight, mean, rstd, dw_part, db_part, T, D, rows,
            IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK_D=ctx.block_d,
            num_warps=ctx.num_warps)
    # per-example gradients (N, D): sum each example's chunks; then square, and sum over examples
    pe_dw = dw_part.view(N, chunks, D).sum(dim=1)
    accumulate_pe_sqnorm(weight_buffer, pe_dw.pow(2).sum(dim=1))
    dw = pe_dw.sum(dim=0).to(weight.dtype)
    db = None
    if ctx.has_bias:
        pe_db = db_part.view(N, chunks, D).sum(dim=1)
        accumulate_pe_sqnorm(bias_buffer, pe_db.pow(2).sum(dim=1))
        db = pe_db.sum(dim=0).to(weight.dtype)
    return dx.view(grad_out.shape), dw, db


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

def _linear_blocks(T, L, K, dtype, device):
    """(BLOCK_L, BLOCK_K, BLOCK_T, num_warps). tl.dot needs every block >= 16; masks cover the rest."""
    if device.type != "cuda":  # interpreter: larger blocks mean fewer (slow, Python-level) programs
        cap = 128
        return (min(cap, max(16, triton.next_power_of_2(L))), min(cap, max(16, triton.next_power_of_2(K))),
                min(64, max(16, triton.next_power_of_2(T))), 4)
    block_t = 32 if dtype == torch.float32 else 64
    return (min(64, max(16, triton.next_power_of_2(L))), min(64, max(16, triton.next_power_of_2(K))),
            min(block_t, max(16, triton.next_power_of_2(T))), 4)


def _linear_chunks(N, tiles, device):
    """Examples are split over grid axis 1 when there are too few dW tiles to fill the GPU; each
    chunk then writes its own (L, K) dW partial, summed in the glue. Returns (chunks, examples per chunk)."""
    return _split_for_gpu(N, tiles, 2, device)


def _linear_dw_pesq(x, grad_out, has_bias):
    """dW (L, K) fp32, db (L,) fp32 or None, and the per-example squared norms (N,) of both."""
    N, K, L = x.shape[0], x.shape[-1], grad_out.shape[-1]
    xs = x.reshape(-1, K).contiguous()  # (N * T, K)
    gs = grad_out.reshape(-1, L).to(x.dtype).contiguous()  # (N * T, L)
    T = xs.shape[0] // N if N else 0
    block_l, block_k, block_t, num_warps = _linear_blocks(T, L, K, x.dtype, x.device)
    tiles_l, tiles_k = triton.cdiv(L, block_l), triton.cdiv(K, block_k)
    launch = xs.numel() > 0 and gs.numel() > 0
    chunks, per_chunk = _linear_chunks(N, tiles_l * tiles_k, x.device) if launch else (1, N)
    dev = x.device
    alloc = torch.empty if launch else torch.zeros  # the kernel writes every element of the partials
    dw_part = alloc(chunks, L, K, dtype=torch.float32, device=dev)
    db_part = alloc(chunks, L, dtype=torch.float32, device=dev) if has_bias else dw_part
    w_pesq_part = alloc(N, tiles_l * tiles_k, dtype=torch.float32, device=dev)
    b_pesq_part = alloc(N, tiles_l, dtype=torch.float32, device=dev) if has_bias else w_pesq_part
    # fp32 operands: tensor-core tf32 only where torch's own matmuls may use it; ignored for 16-bit operands
    tf32 = x.dtype != torch.float32 or (dev.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    if launch:
        normgnorm.linear._linear_bwd_dw_pesq[(tiles_l * tiles_k, chunks)](
            xs, gs, dw_part, db_part, w_pesq_part, b_pesq_part, N, T, L, K, per_chunk,
            HAS_BIAS=has_bias, TILES_K=tiles_k, INPUT_PRECISION="tf32" if tf32 else "ieee",
            DOT_IN_FP32=x.dtype == torch.bfloat16 and kernels_interpreted(),
            BLOCK_L=block_l, BLOCK_K=block_k, BLOCK_T=block_t, num_warps=num_warps)
    dw = dw_part[0] if chunks == 1 else dw_part.sum(dim=0)
    db = (db_part[0] if chunks == 1 else db_part.sum(dim=0)) if has_bias else None
    b_pesq = b_pesq_part.sum(dim=1) if has_bias else None
    return dw, db, w_pesq_part.sum(dim=1), b_pesq


class FusedLinearFunction(torch.autograd.Function):
    """fused_linear(x (N, ..., K), weight (L, K), bias (L,) or None, weight_buffer, bias_buffer);
    buffers may be None. x, weight and bias share one dtype (PEGradNormFusedLinear casts under autocast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_buffer, bias_buffer):
        _check_input(x, weight.shape[1], "fused Linear")
        return _LinearFunction.forward(ctx, x, weight, bias, weight_buffer, bias_buffer)  # the same saved state

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        dw, db, w_pesq, b_pesq = _linear_dw_pesq(x, grad_out, ctx.has_bias)
        accumulate_pe_sqnorm(weight_buffer, w_pesq)
        accumulate_pe_sqnorm(bias_buffer, b_pesq)
        return grad_x, dw.to(weight.dtype), db.to(weight.dtype) if db is not None else None, None, None


fused_linear = FusedLinearFunction.apply


# -----------------------------------------------------------------------------
# the layers

class PEGradNormFusedLayerNorm(PEGradNormLayerNorm):
    """PEGradNormLayerNorm computed by the Triton kernels where they can run."""

    def forward(self, x):
        if not _use_kernel(self, x):
            return super().forward(x)
        return fused_layer_norm(x, self.weight, self.bias, self.eps, self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormFusedRMSNorm(PEGradNormRMSNorm):
    """RMSNorm y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), with per-example norms of the weight
    gradient; the kernel takes the scale (offset + weight) as its weight and keeps the output in x's dtype."""

    def forward(self, x):
        if not _use_kernel(self, x):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # None: F.rms_norm's default
        return fused_rms_norm(x, self.scale(), eps, self.pe_buffer("weight"))


class PEGradNormFusedLinear(PEGradNormLinear):
    """PEGradNormLinear whose weight gradient and per-example norms come from one Triton kernel."""

    def forward(self, x):
        if not _use_kernel(self, x):
            return super().forward(x)
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return fused_linear(x, weight, bias, self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormFusedConv1D(PEGradNormConv1D):
    """transformers' Conv1D (weight stored (in, out)) through the fused Linear kernel, on weight.t()."""

    def forward(self, x):
        if not _use_kernel(self, x):
            return super().forward(x)
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return fused_linear(x, weight.t(), bias, self.pe_buffer("weight"), self.pe_buffer("bias"))
