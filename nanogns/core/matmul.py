"""
The per-example maths of a weight used in a matrix product, shared by every Linear-like kind (Linear, Conv1D,
Conv, the experts, attention's projections, the functional layers) and by the fused Linear's torch strategies.

For y_t = W x_t + b over the rows t of example i (x inputs (N, T, K), g = dL/dy (N, T, L)):

    dW_i = sum_t g_t x_t^T,   db_i = sum_t g_t
    ||dW_i||^2 = sum_{s,t} (g_s . g_t)(x_s . x_t)          (the "Gram trick")

The weight's per-example norms come one of two exact ways (Li et al. 2022's
"book-keeping" analysis, with memory traffic counted as well as FLOPs), for K
inputs, L outputs, T rows per example and N examples:

    Gram trick:        2*N*T^2*(K+L) FLOPs (the two Gram matrices), N*T^2 memory
    materialise dW_i:  2*N*T*K*L FLOPs, and N*K*L elements written and read back

The gns Linear sums the materialised dW_i into the weight gradient, so their
FLOPs replace the plain weight-gradient GEMM and materialising costs only its
traffic (write dW_i, read it to sum, read it to square); the Gram trick costs its
FLOPs on top of one plain GEMM. `linear_strategy` converts bytes into FLOPs with
the device's machine balance (MACHINE_BALANCE, FLOPs per byte: the ratio
measured by bench/linear_strategies.py), so short sequences take the Gram trick
even where it has more FLOPs. Materialising goes a chunk of examples at a time
(at most SIMULTANEOUS_CHUNK_ELEMENTS elements of dW_i), bounding its memory; on
the CPU into a workspace of that size kept per thread between calls (_Workspaces:
a fresh one per call faults its pages in again). The shim computes the norms on
top of PyTorch's own weight gradient, so there materialising pays its FLOPs too
(`linear_uses_gram`). Every choice is exact and works in float32 (float64 for
float64): it changes the cost, not the numbers. The gns and fused Linear compute
neither the gradient nor the norms of a frozen weight or bias (requires_grad=False).

Rows are mapped to examples by layout.py (flattened (N*T, K) inputs and packed
sequences too); the functions here take the per-example views (N, T, K).
"""

import math
import threading

import torch
import torch.nn.functional as F

from nanogns.core import strategy
from nanogns.core.buffers import norm_dtype

SIMULTANEOUS_CHUNK_ELEMENTS = 2**22  # per-example weight-gradient elements held at once (16 MB in fp32)
# Machine balance for the strategy rule: how many FLOPs take as long as moving one byte. "cpu": the crossover
# bench/linear_strategies.py measured on this project's 2-core machine (bench/RESULTS.md); "cuda": fp32 FLOP/s
# over memory bytes/s of A100 (12.5) and H100 (20) from their spec sheets, not yet measured
MACHINE_BALANCE = {"cpu": 12.0, "cuda": 16.0}


# -----------------------------------------------------------------------------
# the maths


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
    """'gram' or 'materialise': how the gns Linear forms its weight gradient and norms (strategy.forced(linear=...)
    forces one)."""
    forced = strategy.current().linear
    if forced is not None:
        return forced
    return "gram" if simultaneous_uses_gram(T, in_features, out_features, element_size, device_type) else "materialise"


def gram_pe_sqnorm(x, g):
    """||dW_i||^2 = sum_{s,t} (x_s . x_t)(g_s . g_t) for x (N, T, K), g (N, T, L); (N,) in their dtype."""
    x_gram = torch.bmm(x, x.transpose(1, 2))  # (N, T, T)
    g_gram = torch.bmm(g, g.transpose(1, 2))  # (N, T, T)
    return (x_gram * g_gram).sum(dim=(1, 2))


class _Workspaces(threading.local):
    """Each thread's CPU workspace per dtype for the per-example weight gradients, kept between calls. A fresh one
    per Linear call (megabytes, freed at once) is, as often as not, handed back to the system by glibc's malloc and
    its pages fault in again at the next call: the 4 x 256 GPT's all-layer step in its own process made 2,541 to
    6,448 page faults a step, 128 to 2,891 with the kept workspace (bench/step_faults.py, three runs each;
    bench/RESULTS.md, issue 47). Per thread: two backwards running at once in two threads never share one. At most
    SIMULTANEOUS_CHUNK_ELEMENTS elements each (16 MB in float32). GPUs' caching allocators keep their blocks
    already."""

    def __init__(self):
        self.by_dtype = {}

    def get(self, shape, dtype):
        elements = math.prod(shape)
        work = self.by_dtype.get(dtype)
        if work is None or work.numel() < elements:
            work = self.by_dtype[dtype] = torch.empty(elements, dtype=dtype)
        return work[:elements].view(shape)


_WORKSPACES = _Workspaces()


def _workspace(shape, dtype, x, g, building_graph):
    """Where bmm writes a chunk of dW_i (out=): the thread's kept CPU workspace for plain tensors, a fresh tensor on
    other devices, under torch.compile and for tensor subclasses (a fake tensor's workspace is no real one), None in
    a backward that builds a graph (create_graph=True: out= takes no tensor that requires a gradient)."""
    if building_graph:
        return None
    device = x.device
    if device.type == "cpu" and type(x) is type(g) is torch.Tensor and not torch.compiler.is_compiling():
        return _WORKSPACES.get(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def materialised_pe_grads(x, g, with_sum=True):
    """Form dW_i = g_i^T x_i (L, K) for x (N, T, K), g (N, T, L) in float32 (float64 for float64), so the
    norms are those of the Gram trick and the kernel, a chunk of examples at a time (at most
    SIMULTANEOUS_CHUNK_ELEMENTS elements, in a workspace reused by every chunk and, on the CPU, by every call:
    _Workspaces); return (sum_i dW_i or None, ||dW_i||^2 (N,))."""
    N, _, K = x.shape
    L = g.shape[-1]
    dtype = norm_dtype(x)
    building_graph = torch.is_grad_enabled() and (g.requires_grad or x.requires_grad)
    if N * K * L <= SIMULTANEOUS_CHUNK_ELEMENTS or N <= 1:  # one chunk (every Linear of a small model): no slice
        if x.dtype != dtype:  # or copy, five ops where the loop dispatches twelve
            x, g = x.to(dtype), g.to(dtype)
        pe_grad = torch.bmm(g.transpose(1, 2), x, out=_workspace((N, L, K), dtype, x, g, building_graph))
        pe_sqnorms = torch.linalg.vector_norm(pe_grad.flatten(1), dim=1).pow(2)
        return (pe_grad.sum(dim=0) if with_sum else None), pe_sqnorms
    chunk = max(1, min(N, SIMULTANEOUS_CHUNK_ELEMENTS // max(1, K * L)))
    # (not read under torch.compile: a Python int from torch would break the graph; the rounding only saves time)
    threads = torch.get_num_threads() if x.device.type == "cpu" and not torch.compiler.is_compiling() else 1
    if chunk > threads:  # a multiple of the CPU threads sharing each bmm: 7 examples on 2 threads cost 15% more than 6
        chunk -= chunk % threads
    work = _workspace((chunk, L, K), dtype, x, g, building_graph)
    grad_weight = None
    weight_pe_sqnorms = torch.empty(N, dtype=dtype, device=x.device)
    for start in range(0, N, chunk):
        n = min(chunk, N - start)
        g_chunk, x_chunk = g[start : start + n].to(dtype), x[start : start + n].to(dtype)  # no copy for float32
        pe_grad = torch.bmm(g_chunk.transpose(1, 2), x_chunk, out=None if work is None else work[:n])  # (n, L, K)
        if with_sum:
            chunk_sum = pe_grad.sum(dim=0)
            grad_weight = chunk_sum if grad_weight is None else grad_weight.add_(chunk_sum)
        weight_pe_sqnorms[start : start + n] = torch.linalg.vector_norm(pe_grad.flatten(1), dim=1).pow(2)
    if with_sum and grad_weight is None:  # no examples
        grad_weight = torch.zeros(L, K, dtype=dtype, device=x.device)
    return grad_weight, weight_pe_sqnorms


def linear_pe_sqnorm(x, g):
    """Per-example squared norms of a Linear weight's gradient, on top of a gradient computed elsewhere (shim).

    Args:
        x: input per example (N, T, K).
        g: output gradient per example (N, T, L).
    Returns:
        weight_pe_sqnorms (N,), float32 (float64 for float64 input).
    """
    dtype = norm_dtype(x)
    x, g = x.to(dtype), g.to(dtype)
    N, T, K = x.shape
    if linear_uses_gram(T, K, g.shape[-1], dtype.itemsize, x.device.type):
        return gram_pe_sqnorm(x, g)
    return materialised_pe_grads(x, g, with_sum=False)[1]


def bias_pe_grads(g):
    """Per-example bias gradients (N, L) = sum_t g_t for g (N, T, L), float32 (float64 for float64)."""
    return g.sum(dim=1, dtype=norm_dtype(g))


def linear_weight_grad_and_pe_sqnorm(x, g, strategy=None):
    """The weight gradient (L, K) in x's dtype and the per-example squared norms (N,) of it (float32,
    float64 for float64 input), computed together by `strategy` ('gram' or 'materialise'; default
    `linear_strategy` for these shapes and this device).

    Args:
        x: input per example (N, T, K).
        g: output gradient per example (N, T, L), same dtype as x.
    """
    _, T, K = x.shape
    L = g.shape[-1]
    dtype = norm_dtype(x)
    strategy = strategy or linear_strategy(T, K, L, dtype.itemsize, x.device.type)
    if strategy == "gram":
        grad_weight = g.reshape(-1, L).t() @ x.reshape(-1, K)  # the plain weight-gradient GEMM
        if x.dtype != dtype:  # (a float32 layer's tensors already are)
            x, g = x.to(dtype), g.to(dtype)
        return grad_weight, gram_pe_sqnorm(x, g)
    assert strategy == "materialise", f"unknown Linear strategy {strategy!r}"
    grad_weight, weight_pe_sqnorms = materialised_pe_grads(x, g)
    return grad_weight.to(x.dtype), weight_pe_sqnorms


def linear_forward(x, weight, bias):
    """F.linear(x, weight, bias), never a view: an autograd Function's output that is a view cannot be modified in
    place (nn.ReLU(inplace=True) after the layer). F.linear's output for a (N, T, K) input is a view of its (N*T, L)
    product; detach() aliases it without being a view (and costs one dispatch, where an out= product costs three)."""
    return F.linear(x, weight, bias).detach()
