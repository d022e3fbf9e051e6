"""
Linear, Embedding and LayerNorm layers that record per-example squared gradient
norms during backward, in plain PyTorch.

Vocabulary (used everywhere in this project):
  example      one index along dim 0 of a layer's input; every other leading
               dim (the sequence, T) belongs to that example. 2-D input (N, K)
               is read as T = 1.
  pe_sqnorm    per-example squared gradient norm: ||dL/dp restricted to example i||^2.
  buffer       `<param>_upegsqnorm` (BUFFER_SUFFIX), float32, shape (2,):
               [sum over examples of pe_sqnorm, count of examples]. Backward
               adds to it, so micro-batches of a gradient-accumulation step
               accumulate; `zero_sqgradnorm_buffers` clears it after the step.

Why [sum, count]: the step's loss is the mean over its B examples, so backward
sees g_i / B where g_i is example i's own gradient. The buffer then holds
[sum_i ||g_i||^2 / B^2, B] and its product is sum_i ||g_i||^2 / B =
mean_i ||g_i||^2, the quantity the GNS estimator needs (gnstracking.py).

The per-example identities (example i, its rows t; x inputs, g output grads):
  Linear y_t = W x_t + b:   dW_i = sum_t g_t x_t^T,  db_i = sum_t g_t
      ||dW_i||^2 = sum_{s,t} (g_s . g_t)(x_s . x_t)          (the "Gram trick")
  Embedding y_t = E[id_t]:  dE_i[v] = sum_{t: id_t = v} g_t
  LayerNorm y_t = xhat_t * w + b:  dw_i = sum_t g_t * xhat_t,  db_i = sum_t g_t

Linear picks, per call, the cheaper of two exact ways (Li et al. 2022's
"book-keeping" analysis, with memory traffic counted as well as FLOPs), for K
inputs, L outputs, T rows per example and N examples:
  Gram trick:        2*N*T^2*(K+L) FLOPs (the two Gram matrices), N*T^2 memory
  materialise dW_i:  2*N*T*K*L FLOPs, and N*K*L elements written and read back
The gns Linear sums the materialised dW_i into the weight gradient, so their
FLOPs replace the plain weight-gradient GEMM and materialising costs only its
traffic (write dW_i, read it to sum, read it to square); the Gram trick costs
its FLOPs on top of one plain GEMM. `linear_strategy` converts bytes into FLOPs
with the device's machine balance (MACHINE_BALANCE, FLOPs per byte: the ratio
measured by bench/linear_strategies.py), so short sequences take the Gram trick
even where it has more FLOPs. Materialising goes a chunk of examples at a time
(at most SIMULTANEOUS_CHUNK_ELEMENTS elements of dW_i), bounding its memory.
The shim computes the norms on top of PyTorch's own weight gradient, so there
materialising pays its FLOPs too (`linear_uses_gram`). Every choice is exact and
works in float32 (float64 for float64): it changes the cost, not the numbers
(beyond float rounding). The gns and fused Linear compute neither the gradient
nor the norms of a frozen weight or bias (requires_grad=False).

Three flavours per layer kind (registered in layer_config.py):
  shim   the plain layer, plus a no-op autograd node that reads the output
         gradient and computes the norms in backward (parameter gradients come
         from PyTorch as usual);
  gns    one autograd Function computes the parameter gradients and the norms
         together ("simultaneous"), sharing the per-example work;
  fused  Triton kernels (fused_gns.py).
All keep the replaced class's constructor, parameter names, order and shapes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BUFFER_SUFFIX = "_upegsqnorm"
SIMULTANEOUS_CHUNK_ELEMENTS = 2**22  # per-example weight-gradient elements held at once (16 MB in fp32)
# Machine balance for the Linear strategy rule: how many FLOPs take as long as moving one byte. "cpu": the
# crossover bench/linear_strategies.py measured on this project's 2-core machine (bench/RESULTS.md); "cuda":
# fp32 FLOP/s over memory bytes/s of A100 (12.5) and H100 (20) from their spec sheets, not yet measured
MACHINE_BALANCE = {"cpu": 12.0, "cuda": 16.0}
LINEAR_STRATEGY = None  # None: linear_strategy picks per call; "gram" or "materialise" forces one (tests, benchmarks)


# -----------------------------------------------------------------------------
# buffers

def register_pe_sqnorm_buffers(module, param_names):
    """Give `module` one `<name>_upegsqnorm` buffer per parameter name (those that exist)."""
    for name in param_names:
        if getattr(module, name, None) is not None:
            # non-persistent: checkpoints stay loadable by plain nanoGPT layers
            module.register_buffer(name + BUFFER_SUFFIX, torch.zeros(2, device=getattr(module, name).device), persistent=False)


def accumulate_pe_sqnorm(buffer, pe_sqnorm):
    """buffer += [sum of pe_sqnorm (N,), N]."""
    if buffer is None:
        return
    with torch.no_grad():
        buffer[0] += pe_sqnorm.sum().to(buffer.dtype)
        buffer[1] += pe_sqnorm.numel()


def zero_sqgradnorm_buffers(model):
    """Clear every per-example norm buffer of `model`; call after each optimizer step's reading."""
    for name, buffer in model.named_buffers():
        if name.endswith(BUFFER_SUFFIX):
            buffer.zero_()


class PESqNormBuffersMixin:
    """Keeps the buffers float32 when the module is cast (model.to(torch.bfloat16)):
    a bf16 count stops being exact past 256 examples. `pe_kind` names the layer
    kind for the tracker's record (gnstracking.describe_tracked)."""

    pe_kind = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, buffer in self._buffers.items():
            if name.endswith(BUFFER_SUFFIX) and buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    def pe_buffer(self, param_name):
        """The parameter's buffer, or None when it is absent or frozen (no gradient: nothing to record)."""
        param = getattr(self, param_name, None)
        if param is None or not param.requires_grad:
            return None
        return self._buffers.get(param_name + BUFFER_SUFFIX)


def norm_dtype(t):
    # norms are summed in float32 (float64 kept for tests)
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _per_example(t):
    """(N, ..., D) -> (N, T, D) with T the product of the middle dims (1 for 2-D)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


def autocast_inputs(x, *params):
    """Cast x and params to autocast's dtype if it is on, as F.linear would; the
    casts are differentiable so parameter gradients come back in their own dtype."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *params)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None else None for t in (x, *params))


# -----------------------------------------------------------------------------
# the per-example norm functions (one per layer type, shared by every flavour)

def _balance(device_type):
    return MACHINE_BALANCE.get(device_type, MACHINE_BALANCE["cuda"])  # other accelerators: GPU-like


def linear_uses_gram(T, in_features, out_features, element_size=4, device_type="cpu"):
    """Shim rule: True when the Gram trick costs less than materialising per-example dW on top of
    PyTorch's own weight gradient. Per example: 2*T^2*(K+L) FLOPs and two T x T float32 Grams
    written and read, against 2*T*K*L FLOPs and K*L elements written and read."""
    K, L = in_features, out_features
    balance = _balance(device_type)
    gram = 2 * T * T * (K + L) + balance * 16 * T * T
    materialise = 2 * T * K * L + balance * 2 * element_size * K * L
    return gram < materialise


def simultaneous_uses_gram(T, in_features, out_features, element_size=4, device_type="cpu"):
    """gns rule: True when the Gram trick (a plain weight-gradient GEMM, plus 2*T^2*(K+L) FLOPs and
    two T x T float32 Grams per example) costs no more than materialising dW_i, whose FLOPs give the
    weight gradient too but whose K*L elements are written, read to sum and read to square."""
    K, L = in_features, out_features
    balance = _balance(device_type)
    gram = 2 * T * T * (K + L) + balance * 16 * T * T
    materialise = balance * 3 * element_size * K * L
    return gram <= materialise


def linear_strategy(T, in_features, out_features, element_size=4, device_type="cpu"):
    """'gram' or 'materialise': how the gns Linear forms its weight gradient and norms (LINEAR_STRATEGY forces one)."""
    if LINEAR_STRATEGY is not None:
        assert LINEAR_STRATEGY in ("gram", "materialise"), f"LINEAR_STRATEGY {LINEAR_STRATEGY!r}"
        return LINEAR_STRATEGY
    return "gram" if simultaneous_uses_gram(T, in_features, out_features, element_size, device_type) else "materialise"


def gram_pe_sqnorm(x, g):
    """||dW_i||^2 = sum_{s,t} (x_s . x_t)(g_s . g_t) for x (N, T, K), g (N, T, L); (N,) in their dtype."""
    x_gram = torch.bmm(x, x.transpose(1, 2))  # (N, T, T)
    g_gram = torch.bmm(g, g.transpose(1, 2))  # (N, T, T)
    return (x_gram * g_gram).sum(dim=(1, 2))


def materialised_pe_grads(x, g, with_sum=True):
    """Form dW_i = g_i^T x_i (L, K) for x (N, T, K), g (N, T, L) in float32 (float64 for float64), so the
    norms are those of the Gram trick and the kernel, a chunk of examples at a time (at most
    SIMULTANEOUS_CHUNK_ELEMENTS elements, one reused workspace); return (sum_i dW_i or None, ||dW_i||^2 (N,))."""
    N, _, K = x.shape
    L = g.shape[-1]
    dtype = norm_dtype(x)
    chunk = max(1, min(N, SIMULTANEOUS_CHUNK_ELEMENTS // max(1, K * L)))
    threads = torch.get_num_threads() if x.device.type == "cpu" else 1
    if chunk > threads:  # a multiple of the CPU threads sharing each bmm: 7 examples on 2 threads cost 15% more than 6
        chunk -= chunk % threads
    work = torch.empty(chunk, L, K, dtype=dtype, device=x.device)
    grad_weight = None
    weight_sq = torch.empty(N, dtype=dtype, device=x.device)
    for start in range(0, N, chunk):
        n = min(chunk, N - start)
        g_chunk, x_chunk = g[start:start + n].to(dtype), x[start:start + n].to(dtype)  # no copy for float32
        pe_grad = torch.bmm(g_chunk.transpose(1, 2), x_chunk, out=work[:n])  # (n, L, K)
        if with_sum:
            chunk_sum = pe_grad.sum(dim=0)
            grad_weight = chunk_sum if grad_weight is None else grad_weight.add_(chunk_sum)
        weight_sq[start:start + n] = torch.linalg.vector_norm(pe_grad.flatten(1), dim=1).pow(2)
    if with_sum and grad_weight is None:  # no examples
        grad_weight = torch.zeros(L, K, dtype=dtype, device=x.device)
    return grad_weight, weight_sq


def linear_pe_sqnorm(x, grad_out, has_bias=True):
    """Per-example squared norms of a Linear layer's weight and bias gradients.

    Args:
        x: input (N, ..., K).
        grad_out: output gradient (N, ..., L).
        has_bias: whether to return the bias norms.
    Returns:
        (weight_sq (N,), bias_sq (N,) or None), float32 (float64 for float64 input).
    """
    dtype = norm_dtype(x)
    x, g = _per_example(x).to(dtype), _per_example(grad_out).to(dtype)  # (N, T, K), (N, T, L)
    N, T, K = x.shape
    L = g.shape[-1]
    if linear_uses_gram(T, K, L, dtype.itemsize, x.device.type):
        weight_sq = gram_pe_sqnorm(x, g)
    else:
        _, weight_sq = materialised_pe_grads(x, g, with_sum=False)
    bias_sq = g.sum(dim=1).pow(2).sum(dim=1) if has_bias else None
    return weight_sq, bias_sq


def linear_weight_grad_and_pe_sqnorm(x, grad_out, strategy=None):
    """The weight gradient (L, K) in x's dtype and the per-example squared norms (N,) of it (float32,
    float64 for float64 input), computed together by `strategy` ('gram' or 'materialise'; default
    `linear_strategy` for these shapes and this device).

    Args:
        x: input (N, ..., K).
        grad_out: output gradient (N, ..., L), same dtype as x.
    """
    xs, gs = _per_example(x), _per_example(grad_out)  # (N, T, K), (N, T, L)
    _, T, K = xs.shape
    L = gs.shape[-1]
    strategy = strategy or linear_strategy(T, K, L, norm_dtype(x).itemsize, x.device.type)
    if strategy == "gram":
        dtype = norm_dtype(x)
        grad_weight = gs.reshape(-1, L).t() @ xs.reshape(-1, K)  # the plain weight-gradient GEMM
        weight_sq = gram_pe_sqnorm(xs.to(dtype), gs.to(dtype))
        return grad_weight, weight_sq
    assert strategy == "materialise", f"unknown Linear strategy {strategy!r}"
    grad_weight, weight_sq = materialised_pe_grads(xs, gs)
    return grad_weight.to(x.dtype), weight_sq


def embedding_pe_sqnorm(ids, grad_out, num_embeddings, padding_idx=None):
    """Per-example squared norms of an Embedding's weight gradient.

    Rows of one example that hit the same token add up before squaring. Each
    (example, token) pair is gathered with torch.unique + index_add: memory
    O(N*T*D), no one-hot over the vocabulary, no loop over examples.

    Args:
        ids: token ids (N, ...).
        grad_out: output gradient (N, ..., D).
        num_embeddings: vocabulary size V.
        padding_idx: the row that gets no gradient (nn.Embedding's padding_idx), or None.
    Returns:
        weight_sq (N,), float32 (float64 for float64 grads).
    """
    dtype = norm_dtype(grad_out)
    N = ids.shape[0]
    ids = ids.reshape(N, -1)  # (N, T)
    g = _per_example(grad_out).to(dtype)  # (N, T, D)
    if padding_idx is not None:
        g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
    example = torch.arange(N, device=ids.device).unsqueeze(1).expand_as(ids)
    pair = (example * num_embeddings + ids).reshape(-1)  # one key per (example, token)
    unique_pairs, pair_index = torch.unique(pair, return_inverse=True)
    summed = torch.zeros(unique_pairs.numel(), g.shape[-1], dtype=dtype, device=g.device)
    summed.index_add_(0, pair_index, g.reshape(-1, g.shape[-1]))  # (pairs, D)
    weight_sq = torch.zeros(N, dtype=dtype, device=g.device)
    weight_sq.index_add_(0, unique_pairs // num_embeddings, summed.pow(2).sum(dim=1))
    return weight_sq


def layernorm_pe_sqnorm(xhat, grad_out, has_bias=True):
    """Per-example squared norms of a LayerNorm's (or RMSNorm's) affine gradients.

    Args:
        xhat: the normalised input (N, ..., D), before the affine transform.
        grad_out: output gradient (N, ..., D).
        has_bias: whether to return the bias norms.
    Returns:
        (weight_sq (N,), bias_sq (N,) or None), float32 (float64 for float64 input).
    """
    weight_grads, bias_grads = layernorm_pe_grads(xhat, grad_out, has_bias)
    bias_sq = bias_grads.pow(2).sum(dim=1) if has_bias else None
    return weight_grads.pow(2).sum(dim=1), bias_sq


def layernorm_pe_grads(xhat, grad_out, has_bias=True):
    """Per-example affine gradients (N, D): dw_i = sum_t g_t * xhat_t, db_i = sum_t g_t."""
    dtype = norm_dtype(grad_out)
    g = _per_example(grad_out).to(dtype)  # (N, T, D)
    weight_grads = (g * _per_example(xhat).to(dtype)).sum(dim=1)
    bias_grads = g.sum(dim=1) if has_bias else None
    return weight_grads, bias_grads


# -----------------------------------------------------------------------------
# shims: an identity on the layer output whose backward records the norms

class _LinearShim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, x, weight_buffer, bias_buffer):
        ctx.save_for_backward(x)
        ctx.buffers = (weight_buffer, bias_buffer)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        if weight_buffer is not None:
            weight_sq, bias_sq = linear_pe_sqnorm(x, grad_out, has_bias=bias_buffer is not None)
            accumulate_pe_sqnorm(weight_buffer, weight_sq)
            accumulate_pe_sqnorm(bias_buffer, bias_sq)
        elif bias_buffer is not None:  # no weight buffer (a frozen weight): the bias norms only
            pe_grad_bias = _per_example(grad_out).sum(dim=1, dtype=norm_dtype(grad_out))  # (N, L)
            accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))
        return grad_out, None, None, None


class _EmbeddingShim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, ids, num_embeddings, padding_idx, weight_buffer):
        ctx.save_for_backward(ids)
        ctx.num_embeddings, ctx.padding_idx, ctx.weight_buffer = num_embeddings, padding_idx, weight_buffer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        if ctx.weight_buffer is not None:
            weight_sq = embedding_pe_sqnorm(ids, grad_out, ctx.num_embeddings, ctx.padding_idx)
            accumulate_pe_sqnorm(ctx.weight_buffer, weight_sq)
        return grad_out, None, None, None, None


class _LayerNormShim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, xhat, weight_buffer, bias_buffer):
        ctx.save_for_backward(xhat)
        ctx.buffers = (weight_buffer, bias_buffer)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (xhat,) = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        if weight_buffer is None and bias_buffer is None:  # frozen affine parameters
            return grad_out, None, None, None
        weight_sq, bias_sq = layernorm_pe_sqnorm(xhat, grad_out, has_bias=bias_buffer is not None)
        accumulate_pe_sqnorm(weight_buffer, weight_sq)
        accumulate_pe_sqnorm(bias_buffer, bias_sq)
        return grad_out, None, None, None


# -----------------------------------------------------------------------------
# simultaneous: parameter gradients and norms from the same per-example work

def linear_backward(ctx, grad_out, weight_grad_fn=linear_weight_grad_and_pe_sqnorm):
    """Backward of a Linear Function whose forward saved (x or None, weight or None) and ctx.buffers:
    the gradients autograd asks for (ctx.needs_input_grad; a frozen weight or bias gets no gradient and
    no norms), the weight's from weight_grad_fn(x, grad_out) -> (dW, per-example squared norms)."""
    x, weight = ctx.saved_tensors
    weight_buffer, bias_buffer = ctx.buffers
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    grad_x = grad_out @ weight if needs_x else None
    grad_weight = grad_bias = None
    if needs_weight:
        grad_weight, weight_sq = weight_grad_fn(x, grad_out)
        accumulate_pe_sqnorm(weight_buffer, weight_sq)
    if needs_bias:
        pe_grad_bias = _per_example(grad_out).sum(dim=1, dtype=norm_dtype(grad_out))  # (N, L)
        grad_bias = pe_grad_bias.sum(dim=0).to(grad_out.dtype)
        accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))
    return grad_x, grad_weight, grad_bias, None, None


class _LinearFunction(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward forms the weight gradient and its per-example norms
    together (linear_weight_grad_and_pe_sqnorm), and only the gradients autograd asks for."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_buffer, bias_buffer):
        # x is needed only for the weight gradient, weight only for the input gradient
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.buffers = (weight_buffer, bias_buffer)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return linear_backward(ctx, grad_out)


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, weight_buffer):
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.padding_idx, ctx.weight_buffer = weight.shape, padding_idx, weight_buffer
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:  # a frozen embedding: no gradient, no norms
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        num_embeddings, dim = ctx.weight_shape
        grad_weight = torch.zeros(ctx.weight_shape, dtype=grad_out.dtype, device=grad_out.device)
        grad_weight.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, dim))
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            grad_weight[ctx.padding_idx] = 0
        accumulate_pe_sqnorm(ctx.weight_buffer, embedding_pe_sqnorm(ids, grad_out, num_embeddings, ctx.padding_idx))
        return None, grad_weight, None, None


class _AffineFunction(torch.autograd.Function):
    """y = xhat * weight (+ bias): the affine half of a norm layer whose normalisation autograd handles."""

    @staticmethod
    def forward(ctx, xhat, weight, bias, weight_buffer, bias_buffer):
        ctx.save_for_backward(xhat, weight)
        ctx.buffers = (weight_buffer, bias_buffer)
        ctx.has_bias = bias is not None
        return torch.addcmul(bias, xhat, weight) if bias is not None else xhat * weight

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_xhat = grad_out * weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # else frozen: no gradients, no norms
            pe_grad_weight, pe_grad_bias = layernorm_pe_grads(xhat, grad_out, ctx.has_bias)  # (N, D) each
            if ctx.needs_input_grad[1]:
                accumulate_pe_sqnorm(weight_buffer, pe_grad_weight.pow(2).sum(dim=1))
                grad_weight = pe_grad_weight.sum(dim=0).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))
                grad_bias = pe_grad_bias.sum(dim=0).to(weight.dtype)
        return grad_xhat, grad_weight, grad_bias, None, None


class _LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim whose backward also records the affine per-example norms.

    Forward and the input gradient are PyTorch's own fused kernels; backward then
    rebuilds xhat = (x - mean) * rstd once to form dw_i = sum_t g_t * xhat_t."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, weight_buffer, bias_buffer):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.buffers = (weight_buffer, bias_buffer)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x, _, _ = torch.ops.aten.native_layer_norm_backward(
                grad_out, x, weight.shape, mean, rstd, weight, bias, [True, False, False])
        dtype = norm_dtype(grad_out)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # else a frozen weight: no gradient, no norms
            xhat_times_g = torch.sub(x, mean).mul_(rstd).mul_(grad_out)  # one temporary, reused in place
            pe_grad_weight = _per_example(xhat_times_g).sum(dim=1, dtype=dtype)  # (N, D)
            accumulate_pe_sqnorm(weight_buffer, pe_grad_weight.pow(2).sum(dim=1))
            grad_weight = pe_grad_weight.sum(dim=0).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            pe_grad_bias = _per_example(grad_out).sum(dim=1, dtype=dtype)  # (N, D)
            accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))
            grad_bias = pe_grad_bias.sum(dim=0).to(bias.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None


# -----------------------------------------------------------------------------
# the layers

class PEGradNormShimLinear(PESqNormBuffersMixin, nn.Linear):
    """nn.Linear whose backward also records per-example norms of weight and bias gradients."""

    pe_kind = "Linear"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        register_pe_sqnorm_buffers(self, ["weight", "bias"])

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        out = F.linear(x, weight, bias)
        return _LinearShim.apply(out, x.detach(), self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormLinear(PESqNormBuffersMixin, nn.Linear):
    """nn.Linear whose backward computes weight/bias gradients and per-example norms together."""

    pe_kind = "Linear"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        register_pe_sqnorm_buffers(self, ["weight", "bias"])

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return _LinearFunction.apply(x, weight, bias, self.pe_buffer("weight"), self.pe_buffer("bias"))


def note_single_row_input(embedding, ids):
    """Remember an input of one row (ids (1, T)): broadcast over a batch later (Hugging Face GPT-2's default
    position_ids), it makes the buffer count 1 example per micro-batch, and the tracker then says why."""
    if ids.dim() > 1 and ids.shape[0] == 1 and torch.is_grad_enabled():
        embedding._pe_single_row_input = True


_PLAIN_EMBEDDING_DEFAULTS = dict(max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)


def _check_plain_embedding(kwargs):
    unsupported = [k for k, v in kwargs.items()
                   if k in _PLAIN_EMBEDDING_DEFAULTS and v != _PLAIN_EMBEDDING_DEFAULTS[k]
                   or k not in _PLAIN_EMBEDDING_DEFAULTS and k not in ("padding_idx", "device", "dtype")]
    if unsupported:
        raise ValueError(f"per-example norm Embedding does not support {sorted(unsupported)}; "
                         f"use embeddingclass='nn' for such an embedding")


class PEGradNormShimEmbedding(PESqNormBuffersMixin, nn.Embedding):
    """nn.Embedding whose backward also records per-example norms of the weight gradient."""

    pe_kind = "Embedding"

    def __init__(self, num_embeddings, embedding_dim, **kwargs):
        _check_plain_embedding(kwargs)
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        register_pe_sqnorm_buffers(self, ["weight"])

    def forward(self, ids):
        note_single_row_input(self, ids)
        out = F.embedding(ids, self.weight, self.padding_idx)
        return _EmbeddingShim.apply(out, ids, self.num_embeddings, self.padding_idx, self.pe_buffer("weight"))


class PEGradNormEmbedding(PESqNormBuffersMixin, nn.Embedding):
    """nn.Embedding whose backward scatters the weight gradient and records per-example norms."""

    pe_kind = "Embedding"

    def __init__(self, num_embeddings, embedding_dim, **kwargs):
        _check_plain_embedding(kwargs)
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        register_pe_sqnorm_buffers(self, ["weight"])

    def forward(self, ids):
        note_single_row_input(self, ids)
        return _EmbeddingFunction.apply(ids, self.weight, self.padding_idx, self.pe_buffer("weight"))


class _PEGradNormLayerNormBase(PESqNormBuffersMixin, nn.Module):
    """LayerNorm(ndim, bias=True, eps=1e-5) with parameters `weight` (ones) and `bias` (zeros or None)."""

    pe_kind = "LayerNorm"

    def __init__(self, ndim, bias=True, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        assert len(self.normalized_shape) == 1, "per-example norm LayerNorm normalises the last dim only"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype)) if bias else None
        register_pe_sqnorm_buffers(self, ["weight", "bias"])

    def normalize(self, x):
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"


class PEGradNormSeparatedLayerNorm(_PEGradNormLayerNormBase):
    """LayerNorm split into normalisation and affine parts, with a shim recording the affine norms."""

    def forward(self, x):
        xhat = self.normalize(x)
        out = xhat * self.weight + self.bias if self.bias is not None else xhat * self.weight
        return _LayerNormShim.apply(out, xhat.detach(), self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormLayerNorm(_PEGradNormLayerNormBase):
    """LayerNorm whose backward computes the affine gradients and per-example norms together."""

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):
            x = x.float()  # autocast runs layer_norm in float32, and so do we
        with torch.autocast(x.device.type, enabled=False):
            return _LayerNormFunction.apply(x, self.weight, self.bias, self.eps,
                                            self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormRMSNorm(_PEGradNormLayerNormBase):
    """RMSNorm with a weight, y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), recording the weight's
    per-example norms.

    weight_offset = 1 is Gemma's RMSNorm, whose weight starts at 0 and scales by (1 + weight); example i's
    gradient of (offset + weight) is its gradient of weight, so the norms are the same. eps=None is the
    machine epsilon of the dtype F.rms_norm computes in, as in F.rms_norm (with an offset that is float32 at
    least: the input is promoted, as Gemma does).
    """

    pe_kind = "RMSNorm"

    def __init__(self, ndim, eps=1e-6, weight_offset=0.0, device=None, dtype=None):
        super().__init__(ndim, bias=False, eps=eps, device=device, dtype=dtype)
        self.weight_offset = weight_offset
        if weight_offset:
            with torch.no_grad():
                self.weight.sub_(weight_offset)  # the scale (offset + weight) starts at 1

    def normalize(self, x):
        return F.rms_norm(x, self.normalized_shape, None, self.eps)

    def scale(self):
        """offset + weight, in float32 at least: in bf16, 1 + a small weight would round the weight away."""
        if not self.weight_offset:
            return self.weight
        return self.weight.to(torch.promote_types(self.weight.dtype, torch.float32)) + self.weight_offset

    def forward(self, x):
        if not self.weight_offset:
            return _AffineFunction.apply(self.normalize(x), self.weight, None, self.pe_buffer("weight"), None)
        scale = self.scale()
        xhat = self.normalize(x.to(torch.promote_types(x.dtype, scale.dtype)))  # in float32 at least, as Gemma does
        return _AffineFunction.apply(xhat, scale, None, self.pe_buffer("weight"), None).to(x.dtype)

    def extra_repr(self):
        return super().extra_repr() + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


# -----------------------------------------------------------------------------
# transformers' Conv1D: GPT-2's Linear, weight stored (in, out)

class _PEGradNormConv1DBase(PESqNormBuffersMixin, nn.Module):
    """transformers' Conv1D(nf, nx): weight (nx, nf) = (in, out), bias (nf,), y = x @ weight + bias.

    The layer is a Linear with weight.t(): a transpose leaves every example's gradient norm unchanged, so
    the Linear per-example norms apply to the weight as stored. Same constructor, parameters and
    attributes (nf, nx) as transformers' class, so checkpoints and code reading them carry over.
    """

    pe_kind = "Linear"  # the layer kind in the tracker's record of each parameter: a Linear, stored transposed

    def __init__(self, nf, nx, bias=True, device=None, dtype=None):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)  # transformers' initialisation
        register_pe_sqnorm_buffers(self, ["weight", "bias"])

    def extra_repr(self):
        return f"nf={self.nf}, nx={self.nx}, bias={self.bias is not None}"


class PEGradNormShimConv1D(_PEGradNormConv1DBase):
    """Conv1D whose backward also records per-example norms of weight and bias gradients (shim)."""

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        out = F.linear(x, weight.t(), bias)
        return _LinearShim.apply(out, x.detach(), self.pe_buffer("weight"), self.pe_buffer("bias"))


class PEGradNormConv1D(_PEGradNormConv1DBase):
    """Conv1D whose backward computes weight/bias gradients and per-example norms together."""

    def forward(self, x):
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            return _LinearFunction.apply(x, weight.t(), bias, self.pe_buffer("weight"), self.pe_buffer("bias"))
