"""
Triton kernel for a Linear layer's weight gradient together with the squared
norm of every example's weight gradient, in one pass over x and dL/dy. The
autograd glue (launch configurations, autotuning, the bias) is in nanogns/variants/fused/.

The maths: for y = x W^T + b with x (N, T, K) and g = dL/dy (N, T, L),

    dW_i = sum_t g_{i,t} x_{i,t}^T    (L, K), example i's weight gradient
    dW   = sum_i dW_i
    ||dW_i||^2 = sum over (L, K) tiles of ||tile of dW_i||^2

`_linear_bwd_dw_pe_sqnorm` is a GEMM dW = G^T X over the N * T rows whose reduction
is cut at example boundaries. One program owns a (BLOCK_L, BLOCK_K) tile of dW
for a chunk of examples and walks their rows BLOCK_T at a time in a single
flattened loop (example, row block), so Triton's software pipeline prefetches
the next example's rows while the current one is multiplied, however short the
sequences. Two fp32 accumulators live in registers: dw_i, the tile of the
current example's gradient, and dw, the tile of the sum. When an example's
last row block is in, its tile's squared Frobenius norm is stored to a
per-(example, tile) partial, dw_i is added to dw and cleared; dW_i never
reaches memory. A program that owns its tile (all N examples) writes dW in the
layer's dtype; where a tile's examples are split over programs, each chunk writes
an fp32 partial of that tile, summed by kernels/finish.py, which also sums the
(N, tiles) squares per example. The glue owns whole rows of tiles up to a full
last wave of the GPU and splits only the rows after them (fused_gns.linear_split).
"""

import triton
import triton.language as tl


# A width that is a multiple of 16 carries Triton's divisibility hint, so loads are 16-byte asynchronous copies
# the software pipeline can prefetch. A ragged one (not a multiple of 16: a 50257 vocabulary as L, an odd input
# width as K) is masked here rather than copied into a zero-padded buffer every step: a second specialisation
# per ragged width, which the compile gate also compiles (fused_gns.linear_ragged says which the glue passes
# unpadded; widths below 16, and K where both masked would spill, are zero-padded). N, T and the chunk size are
# not specialised: one compiled kernel per launch configuration (and alignment), the ones bench/compile_gate.py
# compiles.
@triton.jit(do_not_specialize=["N", "T", "EXAMPLES_PER_CHUNK", "FRONT_ROWS", "CHUNKS"])
def _linear_bwd_dw_pe_sqnorm(
    X,  # pointer to the layer input, (N * T, K) rows, contiguous (zero columns where the glue padded K)
    G,  # pointer to the upstream gradient dL/dy, (N * T, L) rows, likewise, same dtype as X
    DW,  # pointer to the weight gradient, (L, K) in X's dtype, written for the tiles one program owns
    DW_PART,  # pointer to per-chunk weight-grad partials of the split rows, (CHUNKS, L - FRONT_ROWS * BLOCK_L, K) fp32
    W_PE_SQNORM_PART,  # pointer to per-(example, dW tile) squared norms, (N, tiles) fp32
    N,  # examples
    T,  # rows per example
    L,  # output features (rows of G are L apart), >= 16
    K,  # input features (rows of X are K apart), >= 16
    EXAMPLES_PER_CHUNK,  # examples handled by one program of a split row (CHUNKS programs per tile)
    FRONT_ROWS,  # rows of tiles (BLOCK_L rows of dW each) whose tiles one program owns, over all N examples
    CHUNKS,  # programs per tile in the rows after them: chunks of examples, each writing an fp32 partial
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 inputs ("ieee" or "tf32")
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit operands before tl.dot (Triton 3.9's interpreter misreads bf16 in dot)
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Grid: one axis, the owned tiles first (FRONT_ROWS * tiles_k programs), then CHUNKS programs per tile of the
    # remaining rows. The glue picks FRONT_ROWS and CHUNKS so the programs fill whole waves of the GPU: the owned
    # tiles give full waves, and splitting only the rest keeps the fp32 partials to those rows.
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(L, BLOCK_L) * tiles_k
    front = FRONT_ROWS * tiles_k
    owned = pid < front
    if owned:
        tile = pid
        chunk = 0
    else:
        tile = front + (pid - front) // CHUNKS
        chunk = (pid - front) % CHUNKS
    tile_l = tile // tiles_k  # tiles enumerate (L tile, K tile) pairs, K tiles fastest
    tile_k = tile % tiles_k
    offs_l = tile_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    mask_l = offs_l < L
    mask_k = offs_k < K
    if owned:
        n_start = 0
        n_count = N
    else:
        n_start = chunk * EXAMPLES_PER_CHUNK
        n_count = tl.minimum(EXAMPLES_PER_CHUNK, N - n_start)
    t_blocks = tl.cdiv(T, BLOCK_T)
    dw = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
    dw_i = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
    for step in range(0, n_count * t_blocks):
        n = n_start + step // t_blocks
        t0 = (step % t_blocks) * BLOCK_T
        row0 = (n * T + t0).to(tl.int64)  # rows times a width can pass 2**31; offsets within a block cannot
        mask_t = offs_t < T - t0
        g_t = tl.load(
            G + row0 * L + (offs_l[:, None] + offs_t[None, :] * L), mask=mask_l[:, None] & mask_t[None, :], other=0.0
        )  # (BLOCK_L, BLOCK_T): g transposed
        x = tl.load(
            X + row0 * K + (offs_t[:, None] * K + offs_k[None, :]), mask=mask_t[:, None] & mask_k[None, :], other=0.0
        )
        if DOT_IN_FP32:
            g_t = g_t.to(tl.float32)
            x = x.to(tl.float32)
        dw_i = tl.dot(g_t, x, dw_i, input_precision=INPUT_PRECISION)
        if t0 + BLOCK_T >= T:
            # example n's last rows: its tile is complete; record its squared norm, fold it into dW
            tl.store(W_PE_SQNORM_PART + n.to(tl.int64) * tiles + tile, tl.sum(dw_i * dw_i))
            dw += dw_i
            dw_i = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
    if owned:  # this program owns its tile: dW in its dtype, no fp32 round trip
        tl.store(
            DW + offs_l[:, None].to(tl.int64) * K + offs_k[None, :],
            dw.to(DW.dtype.element_ty),
            mask=mask_l[:, None] & mask_k[None, :],
        )
    else:
        split_rows = L - FRONT_ROWS * BLOCK_L
        out = (chunk.to(tl.int64) * split_rows + (offs_l[:, None] - FRONT_ROWS * BLOCK_L)) * K + offs_k[None, :]
        tl.store(DW_PART + out, dw, mask=mask_l[:, None] & mask_k[None, :])
