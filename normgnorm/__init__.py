"""
The reference implementation's `normgnorm` package, kept as a face over the nanogns package: the Triton
kernels (nanogns/kernels/; importing them needs Triton).
"""

from nanogns.kernels import _linear_bwd_dw_pesq, _ln_bwd_dx_pesq, _ln_fwd, _pe_sqnorm_finish  # noqa: F401
