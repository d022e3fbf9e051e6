"""
Fused layers: Triton kernels (nanogns/kernels/) compute the parameter gradients and
the exact per-example squared gradient norms in one backward pass.

    PEGradNormFusedLayerNorm(ndim, bias=True, eps=1e-5)   forward + backward kernels
    PEGradNormFusedRMSNorm(ndim, eps=1e-6, weight_offset=0.0)   same kernels, no mean, no bias
    PEGradNormFusedLinear(in_features, out_features, bias=True, device=None, dtype=None)
        forward is F.linear, dX is a matmul, dW + its per-example norms come from one
        kernel (or from the gns Linear's torch strategies (layers/linear.py) where they are faster), db in torch
    PEGradNormFusedConv1D(nf, nx, bias=True)             transformers' Conv1D (weight (in, out)), same kernel

They have the parameters, `<param>_upegsqnorm` buffers and semantics of
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

import torch

from nanogns.layers import layout
from nanogns.layers.buffers import autocast_inputs
from nanogns.layers.conv1d import PEGradNormConv1D
from nanogns.layers.fused import linear, norms, runtime
from nanogns.layers.fused.linear import fused_linear
from nanogns.layers.fused.norms import fused_layer_norm, fused_rms_norm
from nanogns.layers.fused.runtime import HAS_TRITON, kernel_unavailable_reason, kernels_interpreted
from nanogns.layers.layernorm import PEGradNormLayerNorm, torch_layer_norm
from nanogns.layers.linear import PEGradNormLinear
from nanogns.layers.registry import add_variant
from nanogns.layers.rmsnorm import PEGradNormRMSNorm, torch_rms_norm
from nanogns.layers.tied import note_head

__all__ = [
    "HAS_TRITON",
    "PEGradNormFusedConv1D",
    "PEGradNormFusedLayerNorm",
    "PEGradNormFusedLinear",
    "PEGradNormFusedRMSNorm",
    "fused_layer_norm",
    "fused_linear",
    "fused_rms_norm",
    "kernel_unavailable_reason",
    "kernels_interpreted",
]


# -----------------------------------------------------------------------------
# the layers


def _kernel_input(layer, x, *roles):
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


class PEGradNormFusedLayerNorm(PEGradNormLayerNorm):
    """PEGradNormLayerNorm computed by the Triton kernels where they can run."""

    def forward(self, x):
        found = _kernel_input(self, x, "weight", "bias")
        if found is None:
            return super().forward(x)
        xs, buffers = found
        out = norms.fused_layer_norm(xs, self.weight, self.bias, self.eps, *buffers).view(x.shape)
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
        out = norms.fused_rms_norm(xs, self.pe_scale(), eps, weight_buffer).view(x.shape)
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
            out = linear.fused_linear(xs, weight, bias, *buffers)
        out = note_head(buffers[0], xs, layout.Rows("dim0", xs.shape[0]), out)
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
            return linear.fused_linear(xs, weight.t(), bias, *buffers).view(*x.shape[:-1], self.nf)


KERNEL_KINDS = {
    "LayerNorm": PEGradNormFusedLayerNorm,
    "RMSNorm": PEGradNormFusedRMSNorm,
    "Linear": PEGradNormFusedLinear,
    "Conv1D": PEGradNormFusedConv1D,
}  # the kinds whose "fused" variant runs kernels (the other kinds' "fused" is their "gns")
for _kind, _variant in KERNEL_KINDS.items():
    add_variant(_kind, "fused", _variant)
