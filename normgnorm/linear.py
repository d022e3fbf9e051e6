"""
Triton kernel for a Linear layer's weight gradient together with the squared
norm of every example's weight gradient, in one pass over x and dL/dy. The
autograd glue (launch configurations, autotuning, the bias) is in fused_gns.py.

The maths: for y = x W^T + b with x (N, T, K) and g = dL/dy (N, T, L),

    dW_i = sum_t g_{i,t} x_{i,t}^T    (L, K), example i's weight gradient
    dW   = sum_i dW_i
    ||dW_i||^2 = sum over (L, K) tiles of ||tile of dW_i||^2

`_linear_bwd_dw_pesq` is a GEMM dW = G^T X over the N * T rows whose reduction
is cut at example boundaries. One program owns a (BLOCK_L, BLOCK_K) tile of dW
for a chunk of examples and walks their rows BLOCK_T at a time in a single
flattened loop (example, row block), so Triton's software pipeline prefetches
the next example's rows while the current one is multiplied, however short the
sequences. Two fp32 accumulators live in registers: dw_i, the tile of the
current example's gradient, and dw, the tile of the sum. When an example's
last row block is in, its tile's squared Frobenius norm is stored to a
per-(example, tile) partial, dw_i is added to dw and cleared; dW_i never
reaches memory. With one chunk of examples a program owns its tile and writes
dW in the layer's dtype; with more, each chunk writes an fp32 (L, K) partial
that the glue sums. normgnorm/finish.py sums the (N, tiles) squares per example.
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
@triton.jit(do_not_specialize=["N", "T", "EXAMPLES_PER_CHUNK"])
def _linear_bwd_dw_pesq(
    X,  # pointer to the layer input, (N * T, K) rows, contiguous (zero columns where the glue padded K)
    G,  # pointer to the upstream gradient dL/dy, (N * T, L) rows, likewise, same dtype as X
    DW,  # pointer to the weight gradient, (L, K) in X's dtype, written when one chunk (program) owns a tile
    DW_PART,  # pointer to per-chunk weight-grad partials, (chunks, L, K) fp32, written when there are more
    W_PESQ_PART,  # pointer to per-(example, dW tile) squared norms, (N, tiles) fp32
    N,  # examples
    T,  # rows per example
    L,  # output features (rows of G are L apart), >= 16
    K,  # input features (rows of X are K apart), >= 16
    EXAMPLES_PER_CHUNK,  # examples handled by one program (grid axis 1 enumerates the chunks)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 inputs ("ieee" or "tf32")
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit operands before tl.dot (Triton 3.9's interpreter misreads bf16 in dot)
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tile = tl.program_id(0)  # grid axis 0 enumerates (L tile, K tile) pairs, K tiles fastest
    chunk = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tile_l = tile // tiles_k
    tile_k = tile % tiles_k
    offs_l = tile_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_T)
    mask_l = offs_l < L
    mask_k = offs_k < K
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
        g_t = tl.load(G + row0 * L + (offs_l[:, None] + offs_t[None, :] * L),
                      mask=mask_l[:, None] & mask_t[None, :], other=0.0)  # (BLOCK_L, BLOCK_T): g transposed
        x = tl.load(X + row0 * K + (offs_t[:, None] * K + offs_k[None, :]),
                    mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        if DOT_IN_FP32:
            g_t = g_t.to(tl.float32)
            x = x.to(tl.float32)
        dw_i = tl.dot(g_t, x, dw_i, input_precision=INPUT_PRECISION)
        if t0 + BLOCK_T >= T:
            # example n's last rows: its tile is complete; record its squared norm, fold it into dW
            tl.store(W_PESQ_PART + n.to(tl.int64) * tl.num_programs(0) + tile, tl.sum(dw_i * dw_i))
            dw += dw_i
            dw_i = tl.zeros((BLOCK_L, BLOCK_K), dtype=tl.float32)
    if tl.num_programs(1) == 1:  # this program owns its tile: dW in its dtype, no fp32 round trip
        tl.store(DW + offs_l[:, None].to(tl.int64) * K + offs_k[None, :], dw.to(DW.dtype.element_ty),
                 mask=mask_l[:, None] & mask_k[None, :])
    else:
        out = (chunk.to(tl.int64) * L + offs_l[:, None]) * K + offs_k[None, :]
        tl.store(DW_PART + out, dw, mask=mask_l[:, None] & mask_k[None, :])
