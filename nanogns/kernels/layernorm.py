"""
Triton kernels for LayerNorm and RMSNorm that also produce, per example, the
gradients of the affine parameters, so their squared norms come out of the same
backward pass. The autograd glue (allocation, grids, shape guards) is in
nanogns/variants/fused/.

The maths (one row x of D features; "example" i owns the rows t = 1..T of
input i, every leading dim after the first flattened into t):

    forward   mu = mean(x)            (0 for RMSNorm)
              rstd = 1 / sqrt(mean((x - mu)^2) + eps)
              xhat = (x - mu) * rstd
              y = xhat * w + b        (no b for RMSNorm / bias=False)

    backward  given g = dL/dy for the row, let wg = w * g. Then
              dx = rstd * (wg - (xhat * c1 + c2)),
                  c1 = mean(xhat * wg),   c2 = mean(wg)   (c2 = 0 for RMSNorm)
              example i's parameter gradients are sums over its own rows:
                  dw_i = sum_t g_t * xhat_t,   db_i = sum_t g_t
              and the batch gradients are dw = sum_i dw_i, db = sum_i db_i.
              The per-example squared norms are ||dw_i||^2 and ||db_i||^2.

`_ln_bwd_dx_pe_sqnorm` runs one program per (example, chunk of that example's rows).
It writes dx, and keeps dw_i / db_i restricted to its rows in fp32 registers,
storing them once as a row of the (N * chunks, D) partial buffers. No (N, T, D)
tensor of per-example partials exists; kernels/finish.py then sums the chunks
of each example (N * chunks * D numbers), squares, sums over examples for dw and
db, and updates the buffers, in one more launch.

Rows are STRIDE apart. A width that is a multiple of 16 gives STRIDE = D, which
Triton knows is divisible by 16 (16-byte accesses); a ragged width from 16 on is
not padded either up to 4096 features: STRIDE = D again, masked, in a second
specialisation that the compile gate compiles too. Below 16 features, and for a
ragged width above 4096 (its unaligned backward spills), the glue zero-pads rows
to a multiple of 16.
"""

import triton
import triton.language as tl


# Rows are STRIDE apart, STRIDE >= D: either a multiple of 16 (rows loaded and stored whole, masked by STRIDE,
# which Triton knows is divisible by 16 and so turns into 16-byte accesses) or a ragged D itself (the same code,
# compiled without that hint); the maths masks by D. Only pointers and STRIDE are specialised: two compiled
# kernels per launch configuration, both of which bench/compile_gate.py compiles.
@triton.jit(do_not_specialize=["D"])
def _ln_fwd(
    X,  # pointer to the input, (M, D) rows STRIDE apart
    Y,  # pointer to the output, (M, D) rows STRIDE apart, same dtype as X
    W,  # pointer to the weight, (D,)
    B,  # pointer to the bias, (D,) (unused unless HAS_BIAS)
    MEAN,  # pointer to the saved row means, (M,) fp32 (unused for RMSNorm)
    RSTD,  # pointer to the saved row 1/std, (M,) fp32
    D,  # number of features per row
    STRIDE,  # elements between rows, >= D: a multiple of 16, or D
    eps,  # added to the variance
    IS_RMS: tl.constexpr,  # RMSNorm: no mean subtraction, no bias
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < STRIDE  # the whole row (zero-padded to STRIDE when it is)
    mask = cols < D  # the layer's features
    # load one row, compute its statistics in fp32 (padding columns are zeros)
    x = tl.load(X + row * STRIDE + cols, mask=in_row, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    var = tl.sum(xc * xc, axis=0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + row, rstd)
    # normalise and apply the affine transform
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * STRIDE + cols, y.to(Y.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["T", "D", "ROWS_PER_CHUNK"])
def _ln_bwd_dx_pe_sqnorm(
    X,  # pointer to the forward input, (N * T, D) rows STRIDE apart
    G,  # pointer to the upstream gradient dL/dy, (N * T, D) rows STRIDE apart
    DX,  # pointer to the input gradient, (N * T, D) rows STRIDE apart, same dtype as X
    W,  # pointer to the weight, (D,)
    MEAN,  # pointer to the saved row means, (N * T,) fp32 (unused for RMSNorm)
    RSTD,  # pointer to the saved row 1/std, (N * T,) fp32
    DW_PART,  # pointer to per-(example, chunk) weight-grad partials, (N * chunks, D) rows STRIDE apart, fp32
    DB_PART,  # pointer to per-(example, chunk) bias-grad partials, like DW_PART (unused unless HAS_BIAS)
    T,  # rows per example
    D,  # features per row
    STRIDE,  # elements between rows, >= D: a multiple of 16, or D
    ROWS_PER_CHUNK,  # rows of one example handled by one program
    IS_RMS: tl.constexpr,  # RMSNorm: no mean, c2 = 0
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    example = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)  # grid axis 1: chunks of one example's rows
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < STRIDE  # the whole row (zero-padded to STRIDE when it is)
    mask = cols < D  # the layer's features
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_i = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db_i = tl.zeros((BLOCK_D,), dtype=tl.float32)
    t_start = chunk * ROWS_PER_CHUNK
    t_end = tl.minimum(t_start + ROWS_PER_CHUNK, T)
    for t in range(t_start, t_end):
        row = example * T + t
        # reload the row and rebuild xhat from the saved statistics
        x = tl.load(X + row * STRIDE + cols, mask=in_row, other=0.0).to(tl.float32)
        g = tl.load(G + row * STRIDE + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        # dx = rstd * (w g - (xhat c1 + c2))
        wg = w * g
        c1 = tl.sum(xhat * wg, axis=0) / D
        if IS_RMS:
            dx = (wg - xhat * c1) * rstd
        else:
            c2 = tl.sum(wg, axis=0) / D
            dx = (wg - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * STRIDE + cols, dx.to(DX.dtype.element_ty), mask=in_row)
        # this example's parameter gradients, restricted to this chunk's rows
        dw_i += g * xhat
        if HAS_BIAS:
            db_i += g
    part = example * tl.num_programs(1) + chunk
    tl.store(DW_PART + part * STRIDE + cols, dw_i, mask=in_row)
    if HAS_BIAS:
        tl.store(DB_PART + part * STRIDE + cols, db_i, mask=in_row)
