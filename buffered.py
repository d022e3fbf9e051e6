"""
The reference implementation's `buffered` module, kept as a face over the nanogns package so that code
written against it (its README's train.py) runs unchanged, under the reference's names. New code imports from
nanogns, where the same things are named as docs/architecture.md's glossary says (PEGradNormLinear is
nanogns.kinds.linear.PerExampleLinear, zero_sqgradnorm_buffers is zero_pe_sqnorm_buffers, ...).

The per-example norm layers, one module per layer kind, are in nanogns/kinds/; what they share (the
`<param>_pe_sqnorm` buffers, their [sum, count] encoding, the vocabulary) is nanogns/core/buffers.py.
"""

from nanogns.core.buffers import (  # noqa: F401
    BUFFER_SUFFIX,
    accumulate_pe_sqnorm,
    register_pe_sqnorm_buffers,
)
from nanogns.core.buffers import PerExampleNormLayer as PESqNormBuffersMixin  # noqa: F401
from nanogns.core.buffers import zero_pe_sqnorm_buffers as zero_sqgradnorm_buffers  # noqa: F401
from nanogns.kinds.embedding import PerExampleEmbedding as PEGradNormEmbedding  # noqa: F401
from nanogns.kinds.embedding import ShimEmbedding as PEGradNormShimEmbedding  # noqa: F401
from nanogns.kinds.layernorm import PerExampleLayerNorm as PEGradNormLayerNorm  # noqa: F401
from nanogns.kinds.layernorm import SeparatedLayerNorm as PEGradNormSeparatedLayerNorm  # noqa: F401
from nanogns.kinds.linear import PerExampleLinear as PEGradNormLinear  # noqa: F401
from nanogns.kinds.linear import ShimLinear as PEGradNormShimLinear  # noqa: F401
from nanogns.kinds.rmsnorm import PerExampleRMSNorm as PEGradNormRMSNorm  # noqa: F401
from nanogns.kinds.rmsnorm import ShimRMSNorm as PEGradNormShimRMSNorm  # noqa: F401
