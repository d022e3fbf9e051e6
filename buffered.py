"""
The reference implementation's `buffered` module, kept as a face over the nanogns package so that code
written against it (its README's train.py) runs unchanged. New code imports from nanogns.

The per-example norm layers, one module per layer kind, are in nanogns/kinds/; what they share (the
`<param>_upegsqnorm` buffers, their [sum, count] encoding, the vocabulary) is nanogns/core/buffers.py.
"""

from nanogns.core.buffers import (  # noqa: F401
    BUFFER_SUFFIX,
    PESqNormBuffersMixin,
    accumulate_pe_sqnorm,
    register_pe_sqnorm_buffers,
    zero_sqgradnorm_buffers,
)
from nanogns.kinds.embedding import PEGradNormEmbedding, PEGradNormShimEmbedding  # noqa: F401
from nanogns.kinds.layernorm import PEGradNormLayerNorm, PEGradNormSeparatedLayerNorm  # noqa: F401
from nanogns.kinds.linear import PEGradNormLinear, PEGradNormShimLinear  # noqa: F401
from nanogns.kinds.rmsnorm import PEGradNormRMSNorm, PEGradNormShimRMSNorm  # noqa: F401
