"""
The fused variant's glue: Triton kernels (nanogns/kernels/) compute the parameter
gradients and the exact per-example squared gradient norms in one backward pass.
The fused layer classes are declared by their kinds (kinds/layernorm.py, rmsnorm.py,
linear.py, conv1d.py), each a gns layer whose forward asks `kernel_input` first:

    FusedLayerNorm(ndim, bias=True, eps=1e-5)   forward + backward kernels
    FusedRMSNorm(ndim, eps=1e-6, weight_offset=0.0)   same kernels, no mean, no bias
    FusedLinear(in_features, out_features, bias=True, device=None, dtype=None)
        forward is F.linear, dX is a matmul, dW + its per-example norms come from one
        kernel (or from the gns Linear's torch strategies (kinds/linear.py) where they are faster), db in torch
    FusedConv1D(nf, nx, bias=True)             transformers' Conv1D (weight (in, out)), same kernel

They have the parameters, `<param>_pe_sqnorm` buffers and semantics of
the gns layers' classes (they subclass them), and the autograd functions are
exposed as `fused_layer_norm`, `fused_rms_norm` and `fused_linear`.

Launch configurations are pure functions of shapes, dtype and the GPU's
capability and SM count (`norm_launch_config`, `linear_candidates`,
`linear_default_config`), so bench/compile_gate.py can compile every one of
them for sm_80 and sm_90 without a GPU and check registers, spills and shared
memory. The fused Linear picks, once per shape on a GPU, the fastest of the
kernel's candidate tile configurations and the two torch strategies of
the gns Linear (all exact) by timing each, as Triton's autotuner does (a
candidate that fails or runs out of memory is skipped); on the CPU the choice
is `_interpreter_linear_config`. Which tiles one program owns and which are
split into chunks of examples is `linear_split`, a cost model of the GPU's
waves (whole rows of tiles owned up to a full wave, the rest split).

The kernels' glue runs inside torch custom ops (nanogns::norm_fwd, norm_bwd,
linear_dw_db, linear_dw): torch.compile keeps each as one node of its graph and
runs it eagerly, so the timed choice and Triton's interpreter work under
torch.compile too. A backward launches two kernels (norms) or a matmul, the
weight-gradient kernel, a bias reduction and one finishing kernel (Linear):
kernels/finish.py does the per-example sums, squares and buffer updates.

Where the kernel can run is decided per call (`kernel_unavailable_reason`):
a CUDA tensor with Triton installed on a GPU it supports, or a CPU tensor while
Triton's interpreter is active (TRITON_INTERPRET=1 set before triton is first
imported; this is how the tests run the kernels on CPU). Which of the two Triton
chose is read from Triton itself: its jitted functions are then interpreter
functions.
Anywhere else a layer falls back to the gns layers' torch computation (the same
numbers) and warns once per process per reason. Shapes the kernels cannot take
raise RuntimeError here, before any kernel is launched.
"""

from nanogns.variants.fused import linear, norms, runtime
from nanogns.variants.fused.linear import fused_linear
from nanogns.variants.fused.norms import fused_layer_norm, fused_rms_norm
from nanogns.variants.fused.runtime import HAS_TRITON, kernel_unavailable_reason, kernels_interpreted

__all__ = [
    "HAS_TRITON",
    "fused_layer_norm",
    "fused_linear",
    "fused_rms_norm",
    "kernel_input",
    "kernel_unavailable_reason",
    "kernels_interpreted",
    "linear",
    "norms",
    "runtime",
]


# -----------------------------------------------------------------------------
# what a fused layer's forward asks first


def kernel_input(layer, x, *roles):
    """(x viewed with its examples on dim 0 for the kernels, (buffers)), or None when the torch path must run:
    the kernel cannot run here, or x's rows are not whole examples in order (packed, routed, not mapped)."""
    if not runtime._use_kernel(layer, x):
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
