"""
The reference implementation's `fused_gns` module, kept as a face over the nanogns package under the reference's
names: the layers whose backward runs Triton kernels (their classes are declared by their kinds, nanogns/kinds/,
as FusedLayerNorm, FusedRMSNorm, FusedLinear, FusedConv1D; the glue is nanogns/variants/fused/, the kernels
nanogns/kernels/).
"""

from nanogns.kinds.conv1d import FusedConv1D as PEGradNormFusedConv1D  # noqa: F401
from nanogns.kinds.layernorm import FusedLayerNorm as PEGradNormFusedLayerNorm  # noqa: F401
from nanogns.kinds.linear import FusedLinear as PEGradNormFusedLinear  # noqa: F401
from nanogns.kinds.rmsnorm import FusedRMSNorm as PEGradNormFusedRMSNorm  # noqa: F401
from nanogns.variants.fused import (  # noqa: F401
    HAS_TRITON,
    fused_layer_norm,
    fused_linear,
    fused_rms_norm,
    kernel_unavailable_reason,
    kernels_interpreted,
)
