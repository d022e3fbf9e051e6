"""
The reference implementation's `normgnorm` package, kept as a face over the nanogns package: the Triton
kernels (nanogns/kernels/; importing them needs Triton), under the names this project gave them first.
"""

from nanogns.kernels import _linear_bwd_dw_pe_sqnorm as _linear_bwd_dw_pesq  # noqa: F401
from nanogns.kernels import _ln_bwd_dx_pe_sqnorm as _ln_bwd_dx_pesq  # noqa: F401
from nanogns.kernels import _ln_fwd, _pe_sqnorm_finish  # noqa: F401
