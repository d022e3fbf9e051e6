"""
Tables shared by every example: a tensor computed from parameters alone, with no example's data in it (positions
looked up as one (1, T) row for the whole batch, T5's relative-position buckets, DeBERTa's relative-position
embeddings read straight from their parameter), which the model then broadcasts over its examples.

Autograd sums a broadcast's gradient over the examples before it reaches the table, so no layer of the table sees
an example's own gradient. Each example therefore gets its own copy of the table where it meets the examples:

    S (no example dim)  ->  E = N copies of S, (N, ...)  at the op broadcasting S over the examples

and the op runs on E, which gives the same values. In backward, copy i receives example i's gradient dS_i of the
table (a broadcast reduces nothing over E's example dim), and each example's gradient of every parameter the table
was computed from is dS_i pulled back through the table's own computation, for all examples at once:

    torch.autograd.grad(S, sources, grad_outputs=(dS_1 .. dS_N), is_grads_batched=True)

(one by one where a backward formula cannot be batched). The table keeps its gradient, sum_i dS_i, as without the
copies. Its parameters' per-example gradients are recorded as any layer's are (a table broadcast at several ops,
T5's bias at every layer, or a parameter also used by the examples, DeBERTa's query projection, sums its uses in
core/uses.py).

How a table is known: it is a SharedRows tensor, a torch.Tensor subclass that follows every op taking it
(__torch_function__): an op on tables, constants and parameters gives a table (the parameters join its sources);
an op meeting the examples' data (dim 0 holding the forward's N examples) is where the copies are made:
elementwise broadcasts and matmuls, Tensor.expand(N, ...), Tensor.repeat(N, ...) (DeBERTa), the attention mask of
scaled_dot_product_attention. Any other meeting, or data whose examples cannot be told apart (dim 0 neither 1 nor
N: Swin's windows), refuses the step with the op named. Tables start where a layer of a kind is handed one: an
Embedding looking up ids with one row for N examples (GPT-2's and BERT's default positions, CLIP's), an Embedding
its parent feeds a table (T5's relative_attention_bias), or a layer whose input is a parameter itself (DeBERTa's
LayerNorm of its relative embeddings); layers running on a table compute plainly.

Cost: the copies (N times the table, the size of the broadcast's result), and per meeting the batched backward of
the table's computation, forming each example's gradient of its parameters (N x their elements).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from nanogns.core import layout, uses
from nanogns.core.buffers import add_pe_sqnorm

# ops where a table meets the examples' data, broadcast over them
_ELEMENTWISE = {
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__iadd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__isub__,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__imul__,
    torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__,
    torch.Tensor.__itruediv__,
    torch.Tensor.add,
    torch.Tensor.add_,
    torch.Tensor.sub,
    torch.Tensor.sub_,
    torch.Tensor.mul,
    torch.Tensor.mul_,
    torch.Tensor.div,
    torch.Tensor.div_,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.where,
    torch.Tensor.where,
    torch.Tensor.masked_fill,
    torch.Tensor.masked_fill_,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.Tensor.matmul,
    torch.matmul,
}
# queries through which no gradient flows: answered on the plain tensor
_QUERIES = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr,
    torch.Tensor.__len__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.tolist,
    torch.Tensor.item,
}


class SharedRows(torch.Tensor):
    """A tensor shared by every example of the forward (see the module docstring). `_pe_sources`: ((parameter,
    its buffer), ...) that it was computed from."""

    pe_shared = True  # what core/buffers.py asks (it cannot import this module)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES or getattr(func, "__name__", None) == "__get__" or func is torch.Tensor.as_subclass:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _follow(func, args, kwargs)


def is_shared(t):
    return isinstance(t, SharedRows)


def table(t, sources):
    """`t` (plain) as a table computed from `sources` ((parameter, buffer or None), ...)."""
    out = t.as_subclass(SharedRows)
    out._pe_sources = tuple(sources)
    return out


def lookup(ids, weight, padding_idx, buffer):
    """F.embedding of ids shared by every example (one row for N examples, or a table of relative positions): a
    table whose source is the embedding's weight."""
    return table(F.embedding(ids, weight, padding_idx), [(weight, buffer)])


def parameters_as_tables(module, args):
    """A forward pre-hook of every converted layer (registry.adopt): a trainable parameter passed as the layer's
    input (DeBERTa's LayerNorm of its relative-position embeddings' weight) is a table shared by the examples."""
    if not any(isinstance(a, nn.Parameter) for a in args):
        return None
    current = layout.current_pass()
    if current is None:
        return None
    return tuple(
        table(a.view_as(a), [(a, current.mapper.buffer_of(a))])
        if isinstance(a, nn.Parameter) and a.requires_grad
        else a
        for a in args
    )


def _plain(value):
    return value.as_subclass(torch.Tensor) if isinstance(value, SharedRows) else value


def _run(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _follow(func, args, kwargs):
    flat = pytree.tree_leaves((args, kwargs))
    tables = [t for t in flat if isinstance(t, SharedRows)]
    sources = {}
    for t in tables:
        sources.update({id(p): (p, b) for p, b in t._pe_sources})
    current = layout.current()
    if current is None or not torch.is_grad_enabled() or layout.replaying():  # outside a forward: plain tensors
        return _run(func, *pytree.tree_map(_plain, (args, kwargs)))
    N = current.examples
    others = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, SharedRows)]
    examples = [t for t in others if _is_data(t, N)]
    meets = _meeting(func, args, kwargs, N)
    if meets is not None:  # Tensor.expand(N, ...), Tensor.repeat(N, ...): copies made here
        return meets(sources)
    if examples:
        if func in _ELEMENTWISE or func is F.scaled_dot_product_attention:
            rank, rows = max((t.dim(), t.shape[0]) for t in examples)
            return _at_meeting(func, args, kwargs, N, rank, sources, rows // N)
        return _refused(func, args, kwargs, sources, "meets the examples' data there")
    data = [t for t in others if t.requires_grad and not isinstance(t, nn.Parameter)]
    if data:
        return _refused(
            func,
            args,
            kwargs,
            sources,
            f"meets data of shape {tuple(data[0].shape)}, whose dim 0 is not the {N} examples",
        )
    for p in others:
        if isinstance(p, nn.Parameter) and p.requires_grad:
            sources[id(p)] = (p, layout.current_pass().mapper.buffer_of(p))
    out = _run(func, *pytree.tree_map(_plain, (args, kwargs)))
    return pytree.tree_map(lambda t: table(t, sources.values()) if isinstance(t, torch.Tensor) else t, out)


def _is_data(t, N):
    """True for the examples' data: dim 0 holds the N examples (with one example, a tensor carrying gradients);
    inside a layer splitting its examples into windows (layout.WINDOWED), k windows of each."""
    if t.dim() == 0 or (t.shape[0] != N and not (layout.in_windows() and t.shape[0] % N == 0)):
        return False
    return N != 1 or (t.requires_grad and not isinstance(t, nn.Parameter))


def _meeting(func, args, kwargs, N):
    """A thunk making the copies for Tensor.expand / Tensor.repeat of a table over the N examples, else None."""
    if func not in (torch.Tensor.expand, torch.Tensor.repeat) or not isinstance(args[0], SharedRows) or kwargs:
        return None
    s = args[0]
    sizes = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else tuple(args[1:])
    if func is torch.Tensor.expand and len(sizes) == s.dim() and sizes[0] == N and s.shape[0] == 1:
        return lambda sources: _copies(s, N, s.dim(), sources).expand(N, *sizes[1:])
    if func is torch.Tensor.repeat and len(sizes) == s.dim() and sizes[0] == N:
        rest = sizes[1:]  # repeat(N, ...): N copies of the table, one after the other on dim 0
        return lambda sources: _copies(s, N, s.dim() + 1, sources).flatten(0, 1).repeat(1, *rest)
    return None


def _at_meeting(func, args, kwargs, N, rank, sources, windows=1):
    """Run func with every table replaced by its N per-example copies, shaped to broadcast as the table did
    against operands of `rank` dims holding the examples on dim 0 (each example's `windows` rows, one after the
    other, sharing its copy)."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, SharedRows) and t.dim() == rank and t.shape[0] == N * windows and N != 1:
            why = f"its dim 0 has {t.shape[0]} rows, as the examples' data: the two cannot be told apart"
            return _refused(func, args, kwargs, sources, why)

    def copies(t):
        found = _copies(t, N, rank, sources)
        if windows == 1:
            return found
        return found.unsqueeze(1).expand(N, windows, *found.shape[1:]).flatten(0, 1)

    args, kwargs = pytree.tree_map(lambda t: copies(t) if isinstance(t, SharedRows) else t, (args, kwargs))
    return _run(func, args, kwargs)


def _copies(s, N, rank, sources):
    """(N, ...) copies of table s, right-aligned to broadcast as s did against `rank`-dim operands."""
    current = layout.current_pass()
    buffers = [b for _, b in sources.values() if b is not None]
    if current is not None:
        current.note_uses(buffers)  # each meeting is a use of every parameter the table was computed from
    plain = s.as_subclass(torch.Tensor)
    if plain.dim() == rank and plain.shape[0] == 1:
        shape = (N, *plain.shape[1:])
    else:
        shape = (N,) + (1,) * max(0, rank - 1 - plain.dim()) + tuple(plain.shape)
    return ExampleCopies.apply(plain, shape, tuple(sources.values()))


def _refused(func, args, kwargs, sources, why):
    name = torch.overrides.resolve_name(func) or getattr(func, "__qualname__", repr(func))
    buffers = [b for _, b in sources.values() if b is not None]
    if torch.is_grad_enabled() and buffers:
        with torch.no_grad():
            for buffer in buffers:
                buffer[..., 1] = float("nan")
        layout.note_refusal(
            f"a table shared by the examples (computed from it, with no example's data) {why}, in {name}, where no "
            "example's own gradient of it can be told apart",
            buffers,
        )
    return _run(func, *pytree.tree_map(_plain, (args, kwargs)))


class ExampleCopies(torch.autograd.Function):
    """copies(table (plain), shape (N, ...), sources) -> the table's N copies; backward records each example's
    gradient of the sources (pulled back through the table's computation, batched over the examples) and returns
    the table's gradient, the copies' sum."""

    @staticmethod
    def forward(ctx, plain, shape, sources):
        ctx.save_for_backward(plain)
        ctx.sources, ctx.table_shape = sources, plain.shape
        return plain.reshape(1, *shape[1:]).expand(shape).clone()  # a copy: an output may not be a view of an input

    @staticmethod
    def backward(ctx, grad):
        (plain,) = ctx.saved_tensors
        N = grad.shape[0]
        per_example = grad.reshape(N, *ctx.table_shape)
        recorded = [(p, b) for p, b in ctx.sources if b is not None and p.requires_grad]
        if recorded:
            grads = _pulled_back(plain, [p for p, _ in recorded], per_example)
            for (param, buffer), g in zip(recorded, grads):
                g = torch.zeros(N, *param.shape, dtype=grad.dtype, device=grad.device) if g is None else g
                if not uses.hand_over(buffer, lambda g=g: uses.DenseFactor(g)):
                    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
                    add_pe_sqnorm(buffer, g.flatten(1).pow(2).sum(1, dtype=dtype))
        return per_example.sum(0), None, None


def _pulled_back(table_tensor, params, per_example):
    """Each example's gradients of `params` (N, *shape each) for its gradient of the table, through the table's
    computation: batched over the examples, or one by one where a backward formula cannot be batched."""
    try:
        return torch.autograd.grad(
            table_tensor, params, per_example, is_grads_batched=True, retain_graph=True, allow_unused=True
        )
    except RuntimeError:
        found = [
            torch.autograd.grad(table_tensor, params, g, retain_graph=True, allow_unused=True) for g in per_example
        ]
        return [None if found[0][j] is None else torch.stack([f[j] for f in found]) for j in range(len(params))]
