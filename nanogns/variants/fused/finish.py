"""
The finishing launch shared by the fused norms and the fused Linear: per-example sums of squares, the
parameter gradients and the buffer updates from the kernels' fp32 partials, in one kernel
(nanogns/kernels/finish.py).
"""

import torch

from nanogns.variants.fused import runtime
from nanogns.variants.fused.runtime import kernels, triton

# -----------------------------------------------------------------------------
# finishing: per-example norms, gradients and buffer updates in one launch

_counters = {}  # device -> int32 counter of kernels.finish (0 between launches; launches on one stream)


def _counter(device):
    if device not in _counters:
        _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[device]


FINISH_WARPS = 4  # bench/compile_gate.py compiles _pe_sqnorm_finish with these


def finish_block_w(W):
    """Columns per program of _pe_sqnorm_finish: about 32 programs per parameter, 64 to 512 columns (1024 with 4
    warps spills on sm_90: bench/compile_gate.py)."""
    return min(512, max(64, triton.next_power_of_2(triton.cdiv(W, 32))))


def _aligned_at(buffer):
    """(a view of buffer's storage starting at the 16-byte aligned address at or before it, buffer's offset in
    it): a buffer re-homed as a view of one flat tensor (gnstracking.BufferTable) may start 8 bytes past one,
    and the kernel is compiled for aligned pointers."""
    at = buffer.data_ptr() % 16 // buffer.element_size()
    if at == 0:
        return buffer, 0
    return buffer.as_strided((at + buffer.numel(),), (1,), buffer.storage_offset() - at), at


def _recorded(buffer, pe_sqnorm):
    """Called with each per-example squared-norm vector (N,) a kernel added to `buffer` (tests observe them)."""


FINISH_SUM_BLOCK = 512  # elements of a split gradient one program of _pe_sqnorm_finish sums (1024 spills, Triton 3.6)


def _finish(a, b, N, C, W, stride, grad_dtype, device, buffers, counts=True, a_squares=False, split=None):
    """_pe_sqnorm_finish on parameter a's and b's partials (None: no gradient): (a's gradient or None, b's
    gradient or None), each (W,) in grad_dtype; a_squares: a is (N, S) squared norms (no gradient formed).
    split: (fp32 partials (chunks, ...), out in grad_dtype): the same launch writes out = partials.sum(0)."""
    a_grad = torch.empty(W, dtype=grad_dtype, device=device) if a is not None and not a_squares else None
    b_grad = torch.empty(W, dtype=grad_dtype, device=device) if b is not None else None
    if N == 0:  # no examples: zero gradients, nothing recorded
        return tuple(t.zero_() if t is not None else None for t in (a_grad, b_grad))
    if b is None and (a is None or a_squares):
        W = 0  # no vectors: one program per parameter
    block_w = finish_block_w(W)
    blocks = triton.cdiv(W, block_w) if W else 1
    parts, out = (
        split
        if split is not None
        else (torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=grad_dtype, device=device))
    )
    sum_programs = triton.cdiv(out.numel(), FINISH_SUM_BLOCK) if split is not None else 0
    sq_part = torch.empty(2, N, blocks, dtype=torch.float32, device=device)
    pe_sqnorms = torch.empty(2, N, dtype=torch.float32, device=device)
    any_part = a if a is not None else b
    grad_any = (
        a_grad if a_grad is not None else b_grad if b_grad is not None else sq_part.new_empty(0, dtype=grad_dtype)
    )
    a_buf, b_buf = buffers
    (a_base, a_at), (b_base, b_at) = (_aligned_at(buf) if buf is not None else (pe_sqnorms, 0) for buf in buffers)
    runtime._launch(
        kernels.finish._pe_sqnorm_finish,
        (blocks, 2 + triton.cdiv(sum_programs, blocks)),
        device,
        a if a is not None else any_part,
        b if b is not None else any_part,
        a_grad if a_grad is not None else grad_any,
        b_grad if b_grad is not None else grad_any,
        sq_part,
        pe_sqnorms,
        a_base,
        b_base,
        _counter(device),
        N,
        C,
        W,
        stride,
        a.shape[-1] if a_squares and a is not None else 0,
        N if counts else 0,
        int(a is not None),
        int(b is not None),
        int(a is not None and a_buf is not None),
        int(b is not None and b_buf is not None),
        a_at,
        b_at,
        parts,
        out,
        out.numel(),
        parts.shape[0] if split else 0,
        A_SQUARES=a_squares,
        BLOCK_W=block_w,
        SUM_BLOCK=FINISH_SUM_BLOCK,
        num_warps=FINISH_WARPS,
    )
    for part, buffer, row in ((a, a_buf, pe_sqnorms[0]), (b, b_buf, pe_sqnorms[1])):
        if part is not None and buffer is not None:
            _recorded(buffer, row)
    return a_grad, b_grad
