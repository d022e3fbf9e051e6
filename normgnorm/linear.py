"""
Triton kernel for a Linear layer's weight gradient together with the squared
norm of every example's weight gradient, in one pass over x and dL/dy. The
autograd glue is in fused_gns.py.

The maths: for y = x W^T + b with x (N, T, K) and g = dL/dy (N, T, L),

    dW_i = sum_t g_{i,t} x_{i,t}^T    (L, K), example i's weight gradient
    dW   = sum_i dW_i
    ||dW_i||^2 = sum over (L, K) tiles of ||tile of dW_i||^2
    db_i = sum_t g_{i,t}              (L,),   ||db_i||^2 likewise per L tile

`_linear_bwd_dw_pesq` runs one program per (tile of dW, chunk of examples). For
each of its examples it forms that example's tile with tl.dot over the
example's T rows, adds the tile's squared Frobenius norm to a per-(example,
tile) partial and the tile itself to the program's dW accumulator; dW_i never
reaches memory. The glue sums the (N, tiles) partials over tiles, and, when
examples were split across programs, the (chunks, L, K) dW partials over chunks.
"""

import triton
import triton.language as tl


@triton.jit
def _linear_bwd_dw_pesq(
    X,  # pointer to the layer input, (N * T, K) rows, contiguous
    G,  # pointer to the upstream gradient dL/dy, (N * T, L) rows, contiguous
    DW_PART,  # pointer to per-chunk weight-grad partials, (chunks, L, K) fp32
    DB_PART,  # pointer to per-chunk bias-grad partials, (chunks, L) fp32 (unused unless HAS_BIAS)
    W_PESQ_PART,  # pointer to per-(example, dW tile) squared norms, (N, TILES_L * TILES_K) fp32
    B_PESQ_PART,  # pointer to per-(example, L tile) squared norms, (N, TILES_L) fp32 (unused unless HAS_BIAS)
    N,  # examples
    T,  # rows per example
    L,  # output features
    K,  # input features
    EXAMPLES_PER_CHUNK,  # examples handled by one program
    TILES_K,  # cdiv(K, BLOCK_K); grid axis 0 enumerates (L tile, K tile) pairs
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 inputs ("ieee" or "tf32")
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit operands before tl.dot (Triton 3.9's interpreter misreads bf16 in dot)
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    tile_l = tile // TILES_K
    tile_k = tile % TILES_K
    tiles = tl.num_programs(0)
    offs_l = tile_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T).to(tl.int64)  # row offsets times L or K can pass 2**31
    mask_l = offs_l < L
    mask_k = offs_k < K
    dw = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
    db = tl.zeros((BLOCK_L,), dtype=tl.float32)
    n_start = chunk * EXAMPLES_PER_CHUNK
    n_end = tl.minimum(n_start + EXAMPLES_PER_CHUNK, N)
    for n in range(n_start, n_end):
        # example n's tile of dW_i (and slice of db_i), accumulated over its rows
        dw_i = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
        db_i = tl.zeros((BLOCK_L,), dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            rows = n * T + t0 + offs_t
            mask_t = (t0 + offs_t) < T
            g = tl.load(G + rows[:, None] * L + offs_l[None, :], mask=mask_t[:, None] & mask_l[None, :], other=0.0)
            x = tl.load(X + rows[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            if DOT_IN_FP32:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            dw_i = tl.dot(tl.trans(g), x, dw_i, input_precision=INPUT_PRECISION)
            if HAS_BIAS:
                db_i += tl.sum(g.to(tl.float32), axis=0)
        # squared norm of this tile of example n's gradient; then fold it into dW
        tl.store(W_PESQ_PART + n * tiles + tile, tl.sum(tl.sum(dw_i * dw_i, axis=1), axis=0))
        dw += dw_i
        if HAS_BIAS:
            # every K tile sees the same db_i slice; only the first one records it
            if tile_k == 0:
                tl.store(B_PESQ_PART + n * (tiles // TILES_K) + tile_l, tl.sum(db_i * db_i, axis=0))
            db += db_i
    out = chunk.to(tl.int64) * L * K + offs_l[:, None] * K + offs_k[None, :]
    tl.store(DW_PART + out, dw, mask=mask_l[:, None] & mask_k[None, :])
    if HAS_BIAS:
        if tile_k == 0:
            tl.store(DB_PART + chunk * L + offs_l, db, mask=mask_l)
