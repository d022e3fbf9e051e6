"""
Triton kernels that compute gradients together with exact per-example squared
gradient norms. Kernels only: the autograd glue and the layers using them live
in nanogns/variants/fused/, which imports this package only when Triton is installed.

    layernorm.py  _ln_fwd, _ln_bwd_dx_pe_sqnorm      LayerNorm / RMSNorm
    linear.py     _linear_bwd_dw_pe_sqnorm           Linear weight gradient
    finish.py     _pe_sqnorm_finish             per-example norms, gradients and buffer updates
                                                from the partials of either

bench/compile_gate.py compiles every kernel at every launch configuration the
glue can choose for sm_80 and sm_90 and checks registers, spills and shared memory.
"""

from nanogns.kernels.finish import _pe_sqnorm_finish
from nanogns.kernels.layernorm import _ln_bwd_dx_pe_sqnorm, _ln_fwd
from nanogns.kernels.linear import _linear_bwd_dw_pe_sqnorm

__all__ = ["_ln_fwd", "_ln_bwd_dx_pe_sqnorm", "_linear_bwd_dw_pe_sqnorm", "_pe_sqnorm_finish"]
