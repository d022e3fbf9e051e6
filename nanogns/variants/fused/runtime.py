"""
Where the fused kernels can run, and what every launch shares: Triton found once (HAS_TRITON), the
interpreter's state, the fallback's warning, rows laid out for a kernel (16-byte aligned, ragged widths
masked or zero-padded), launches on the tensors' device, the torch custom ops the glue runs inside, and the
GPU's SM count.
"""

import contextlib
import warnings

import torch

from nanogns.errors import CallNotValid

try:
    import triton

    HAS_TRITON = True
except ImportError:  # the layers still work, through the torch fallback (kernel_unavailable_reason says why)
    triton = None
    HAS_TRITON = False

if HAS_TRITON:
    # kernels are looked up as kernels.<module>.<kernel> at each call
    from nanogns import kernels
else:
    kernels = None  # never launched: every call takes the torch fallback first

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
    ours when nanogns.kernels is imported, Triton's when triton is, so they are read once, here, at import:
    under torch.compile a layer's forward reads the constant (Dynamo cannot trace isinstance() on a compiled
    Triton kernel, and a graph break there cost every fused layer its place in the graph on a GPU)."""
    if not HAS_TRITON:
        return (False, False)
    from triton.runtime.interpreter import InterpretedFunction

    return (
        isinstance(kernels.layernorm._ln_fwd, InterpretedFunction),
        isinstance(triton.language.sum, InterpretedFunction),
    )


_INTERPRETED = _interpreted_flags()


def kernels_interpreted():
    """True when the kernels run in Triton's interpreter (on CPU tensors)."""
    return HAS_TRITON and all(_INTERPRETED)


def kernel_unavailable_reason(x):
    """None when the Triton kernels can run on tensor `x`, else why not (for the fallback warning)."""
    if not HAS_TRITON:
        return "Triton is not installed; `pip install triton` on a machine with a supported GPU"
    if x.dtype not in KERNEL_DTYPES:
        return f"the kernels take {[str(d) for d in KERNEL_DTYPES]}, got {x.dtype}; cast the model to one of them"
    ours, triton_own = _INTERPRETED
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
        # (get_device_properties, not get_device_capability: Dynamo folds the former into a constant)
        properties = torch.cuda.get_device_properties(x.device)
        major, minor = properties.major, properties.minor
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
            f"{type(layer).__name__}: Triton kernel not used ({reason}); falling back to the gns layer's "
            f"torch computation, which gives the same numbers more slowly.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _check_input(x, features, what):
    if x.dim() < 2:
        raise CallNotValid(
            f"{what} needs input (N, ..., {features}) with examples along dim 0, got shape "
            f"{tuple(x.shape)}; add an example dim, e.g. x.unsqueeze(0)"
        )
    if x.shape[-1] != features:
        raise CallNotValid(f"{what} expects {features} features in the last dim, got shape {tuple(x.shape)}")


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


# The kernels' glue runs as torch custom ops (nanogns::*): torch.compile keeps each as one opaque node of its
# graph, run eagerly (so Triton's interpreter works under torch.compile too, and the timed choice still times);
# the autograd Functions around them are traced. Each op has a fake implementation giving its outputs' shapes.
CUSTOM_OPS = {}  # "nanogns::<name>" -> its Python implementation (bench/launch_counts.py counts inside them)


def _custom_op(name, mutates_args=()):
    def register(fn):
        CUSTOM_OPS[name] = fn
        return torch.library.custom_op(name, mutates_args=mutates_args)(fn)

    return register
