"""
The reference implementation's `fused_gns` module, kept as a face over the nanogns package: the layers whose
backward runs Triton kernels (nanogns/layers/fused.py; the kernels are nanogns/kernels/).
"""

from nanogns.layers.fused import (  # noqa: F401
    HAS_TRITON,
    PEGradNormFusedConv1D,
    PEGradNormFusedLayerNorm,
    PEGradNormFusedLinear,
    PEGradNormFusedRMSNorm,
    fused_layer_norm,
    fused_linear,
    fused_rms_norm,
    kernel_unavailable_reason,
)
