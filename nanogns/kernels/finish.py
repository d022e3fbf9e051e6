"""
The finishing kernel shared by the fused layers' backward: from per-example
partial results it forms, in one launch, what the glue used to assemble from
about fifteen small torch ops (issue 20).

For up to two parameters a, b (LayerNorm: weight and bias; Linear: weight and
bias) it takes, per parameter, either

    vectors   (N * C, W) fp32 rows, C partial gradients per example: the
              example's gradient is g_i = sum_c row_(i,c), and the parameter's
              gradient sum_i g_i is written in the parameter's dtype;
    squares   (N, S) fp32 squared norms of S disjoint pieces of g_i (the Linear
              kernel's per-tile ||dW_i tile||^2): ||g_i||^2 = sum_s piece_(i,s),

and writes ||g_i||^2 (N,) per parameter and adds [sum_i ||g_i||^2, N] to the
parameter's `_pe_sqnorm` buffer. Grid: (column blocks of W, 2 parameters + R):
rows 2 .. 2 + R - 1 sum a Linear weight gradient's fp32 partials over chunks of
examples into the gradient's dtype, when the Linear kernel split examples.
A squared norm spans every column block, so each program stores its blocks'
part and the last program to finish (an atomic counter, reset by that program)
sums the parts and updates the buffers: one launch, no atomics on the numbers,
the same sum order every run.
"""

import triton
import triton.language as tl


@triton.jit
def _param_columns(PART, GRAD, SQ_PART, blk, blocks, N, C, W, STRIDE, BLOCK_W: tl.constexpr):
    """One parameter's columns [blk * BLOCK_W, ...): per-example sums over the C partial rows, the gradient
    (sum over examples) stored in GRAD's dtype, each example's squared norm over these columns to SQ_PART."""
    cols = blk * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < W
    grad = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for n in range(0, N):
        pe = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for c in range(0, C):
            pe += tl.load(PART + (n * C + c).to(tl.int64) * STRIDE + cols, mask=mask, other=0.0)
        grad += pe
        tl.store(SQ_PART + n * blocks + blk, tl.sum(pe * pe, axis=0))
    tl.store(GRAD + cols, grad.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def _sum_row(PTR, length):
    """sum of PTR[0:length] (fp32), 128 at a time."""
    total = 0.0
    for s0 in range(0, length, 128):
        offs = s0 + tl.arange(0, 128)
        total += tl.sum(tl.load(PTR + offs, mask=offs < length, other=0.0, cache_modifier=".cg"), axis=0)
    return total


@triton.jit
def _param_norms(SQ, width, PE_SQNORM, BUF, N, COUNT, RECORD):
    """||g_i||^2 = sum of example i's `width` parts in SQ (N rows of `width`), to PE_SQNORM; the buffer update."""
    total = 0.0
    for n in range(0, N):
        sq = _sum_row(SQ + n * width, width)
        tl.store(PE_SQNORM + n, sq)
        total += sq
    if RECORD != 0:
        tl.store(BUF, tl.load(BUF) + total)
        tl.store(BUF + 1, tl.load(BUF + 1) + COUNT)


@triton.jit(
    do_not_specialize=[
        "N",
        "C",
        "W",
        "STRIDE",
        "S",
        "COUNT",
        "A_ON",
        "B_ON",
        "A_RECORD",
        "B_RECORD",
        "A_BUF_AT",
        "B_BUF_AT",
        "SUM_N",
        "SUM_CHUNKS",
    ]
)
def _pe_sqnorm_finish(
    A_PART,  # pointer to parameter a's partials: (N * C, W) fp32 rows STRIDE apart, or (N, S) squares if A_SQUARES
    B_PART,  # pointer to parameter b's partials, (N * C, W) fp32 rows STRIDE apart (unused unless B_ON)
    A_GRAD,  # pointer to a's gradient, (W,) in the parameter dtype (unused if A_SQUARES)
    B_GRAD,  # pointer to b's gradient, (W,), same dtype as A_GRAD
    SQ_PART,  # pointer to scratch, (2, N, column blocks) fp32
    PE_SQNORM,  # pointer to the per-example squared norms, (2, N) fp32: a's, then b's
    A_BUF,  # pointer to a's buffer [sum, count] at A_BUF + A_BUF_AT, (2,) fp32 (unused unless A_RECORD)
    B_BUF,  # pointer to b's buffer at B_BUF + B_BUF_AT, likewise
    COUNTER,  # pointer to an int32 counter, 0 between launches (the last program resets it)
    N,  # examples
    C,  # partial rows per example
    W,  # columns (parameter elements) of the vector partials
    STRIDE,  # elements between partial rows
    S,  # squares per example (A_SQUARES)
    COUNT,  # examples to add to the buffers' counts
    A_ON,
    B_ON,  # 1 when parameter a / b has a gradient to finish
    A_RECORD,
    B_RECORD,  # 1 when its buffer is to be updated
    A_BUF_AT,
    B_BUF_AT,  # elements from the 16-byte aligned pointers to the buffers (views of one flat tensor)
    SUM_PART,  # pointer to fp32 partials of a gradient split over example chunks, (SUM_CHUNKS, SUM_N)
    SUM_OUT,  # pointer to their sum, (SUM_N,), same dtype as A_GRAD (the Linear's dW)
    SUM_N,  # elements of that gradient (0: none)
    SUM_CHUNKS,  # its partials
    A_SQUARES: tl.constexpr,  # a's partials are (N, S) squares
    BLOCK_W: tl.constexpr,  # columns per program
    SUM_BLOCK: tl.constexpr,  # elements of the split gradient per program
):
    blk = tl.program_id(0)
    param = tl.program_id(1)
    blocks = tl.num_programs(0)
    if param >= 2:  # grid rows 2, 3, ...: sum the split gradient's partials, SUM_BLOCK elements per program
        offs = ((param - 2) * blocks + blk).to(tl.int64) * SUM_BLOCK + tl.arange(0, SUM_BLOCK)
        mask = offs < SUM_N
        acc = tl.zeros((SUM_BLOCK,), dtype=tl.float32)
        for c in range(0, SUM_CHUNKS):
            acc += tl.load(SUM_PART + c * SUM_N + offs, mask=mask, other=0.0)
        tl.store(SUM_OUT + offs, acc.to(SUM_OUT.dtype.element_ty), mask=mask)
    else:
        _norms_and_gradients(
            A_PART,
            B_PART,
            A_GRAD,
            B_GRAD,
            SQ_PART,
            PE_SQNORM,
            A_BUF + A_BUF_AT,
            B_BUF + B_BUF_AT,
            COUNTER,
            blk,
            param,
            blocks,
            N,
            C,
            W,
            STRIDE,
            S,
            COUNT,
            A_ON,
            B_ON,
            A_RECORD,
            B_RECORD,
            A_SQUARES,
            BLOCK_W,
        )


@triton.jit
def _norms_and_gradients(
    A_PART,
    B_PART,
    A_GRAD,
    B_GRAD,
    SQ_PART,
    PE_SQNORM,
    A_BUF,
    B_BUF,
    COUNTER,
    blk,
    param,
    blocks,
    N,
    C,
    W,
    STRIDE,
    S,
    COUNT,
    A_ON,
    B_ON,
    A_RECORD,
    B_RECORD,
    A_SQUARES: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid rows 0 (parameter a) and 1 (b): the column work, then the last of these programs the norms."""
    if param == 0:
        if not A_SQUARES:
            if A_ON != 0:
                _param_columns(A_PART, A_GRAD, SQ_PART, blk, blocks, N, C, W, STRIDE, BLOCK_W)
    else:
        if B_ON != 0:
            _param_columns(B_PART, B_GRAD, SQ_PART + N * blocks, blk, blocks, N, C, W, STRIDE, BLOCK_W)
    # the last program to arrive (every program's stores before its increment) sums the parts
    tl.debug_barrier()
    arrived = tl.atomic_add(COUNTER, 1, sem="acq_rel")
    tl.debug_barrier()
    if arrived == blocks * 2 - 1:
        if A_ON != 0:
            if A_SQUARES:
                _param_norms(A_PART, S, PE_SQNORM, A_BUF, N, COUNT, A_RECORD)
            else:
                _param_norms(SQ_PART, blocks, PE_SQNORM, A_BUF, N, COUNT, A_RECORD)
        if B_ON != 0:
            _param_norms(SQ_PART + N * blocks, blocks, PE_SQNORM + N, B_BUF, N, COUNT, B_RECORD)
        tl.atomic_xchg(COUNTER, 0)
