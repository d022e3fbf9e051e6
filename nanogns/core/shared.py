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
elementwise broadcasts and matmuls, Tensor.expand(N, ...) and expand_as (XLM), Tensor.repeat(N, ...) (DeBERTa),
the attention mask of scaled_dot_product_attention, torch.einsum (the table gains the subscript under which the
data holds the examples, one copy per example: Funnel's, SeamlessM4T's relative positions), and torch.cat or stack
along another dim than 0, bmm and baddbmm, whose output's dim 0 is their operands' (a table of one row per example
there: RoCBert's and LED's ids made for the batch). Which part of the table an example gets is torch's broadcasting's: where the table's
dim aligned with the data's example dim has size 1 (or the table has no such dim), every example gets all of it, a
copy each; where it has size N, example i gets slice i (no copies: a table of one row per example, per-example ids
looked up without the examples' tag, core/layout.py), so no decision rests on sizes that happen to match. The data's
dim 0 may hold items of the examples (their choices, windows, a tower's images: Items): the copies are then
per item, and an example's gradient its items' sum. Any other meeting refuses the step with the op named. A table
that is an Embedding's lookup met as it is is looked up again for each example (the Embedding kind's own
per-example norms, no pull-back). A custom autograd.Function is no op __torch_function__ sees, and torch runs its
forward without gradients: there, as under no_grad, an op on tables and parameters alone gives a table (SEW-D's
XDropout of its relative embeddings returns one, its gradient through the Function's backward), and an op with any
other tensor a plain result; a table that stays without gradients carries none to its sources.

Tables start where a layer of a kind is handed one: an Embedding looking up ids the forward did not compute from
its example inputs (positions from torch.arange, as one (1, T) row or (T,); GPT-2's, BERT's, CLIP's and nanoGPT's
default positions), an Embedding its parent feeds a table (T5's relative_attention_bias), or a layer whose input is
a parameter itself (DeBERTa's LayerNorm of its relative embeddings); layers running on a table compute plainly.

Cost: the copies (N times the table, the size of the broadcast's result), and per meeting the batched backward of
the table's computation, forming each example's gradient of its parameters (N x their elements).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import history, layout, trees
from nanogns.core.einsum import ALONG_EXAMPLES, along_examples, einsum_with_copies, per_example_conv1d
from nanogns.core.ids import MadeIds, is_made
from nanogns.core.pullback import DRAWING, DROPOUTS, ExampleCopies, Recipe, SlicedTable, random_state_at
from nanogns.core.scopes import is_root_data

_MATMUL = {torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.matmul, torch.matmul}
# ops where a table meets the examples' data, broadcast over them: arithmetic (x + t, t - x, x *= t...), where,
# masked_fill, matmul
_ELEMENTWISE = {
    getattr(torch.Tensor, f"__{p}{op}__") for op in ("add", "sub", "mul", "truediv") for p in ("", "r", "i")
}
_ELEMENTWISE |= {
    getattr(torch.Tensor, op) for op in ("add", "sub", "mul", "div", "masked_fill") for op in (op, op + "_")
}
_ELEMENTWISE |= {torch.add, torch.sub, torch.mul, torch.div, torch.where, torch.Tensor.where} | _MATMUL
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
    """A tensor shared by every example of the forward (see the module docstring). `pe_sources`: ((parameter,
    its buffer), ...) that it was computed from."""

    pe_shared = True  # what core/buffers.py asks (it cannot import this module)
    pe_sources = ()  # ((parameter, its buffer or None), ...) it was computed from
    pe_lookup = None  # (ids, per_example) when it is an Embedding's lookup met as it is (`lookup`)
    pe_recipe = None  # Recipe: how to compute it again from its sources (a backward that cannot run twice)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES or getattr(func, "__name__", None) == "__get__" or func is torch.Tensor.as_subclass:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _follow(func, args, kwargs)


def is_shared(t):
    return isinstance(t, SharedRows)


def recipe_of(value):
    """The Recipe standing for value in another's recipe: a table's own, else the value itself."""
    return value.pe_recipe if isinstance(value, SharedRows) and value.pe_recipe is not None else value


def table(t, sources, recipe=None):
    """`t` (plain) as a table computed from `sources` ((parameter, buffer or None), ...), by `recipe` (a Recipe, or
    None where it cannot be computed again)."""
    out = t.as_subclass(SharedRows)
    out.pe_sources = tuple(sources)
    out.pe_recipe = recipe
    return out


def lookup(ids, weight, padding_idx, buffer, per_example=None):
    """F.embedding of ids shared by every example (one row for N examples, or a table of relative positions): a
    table whose source is the embedding's weight. per_example(ids, rows): the same lookup recording each example's
    norms (the Embedding kind's); where the table itself meets the examples, each example's rows of it are then
    looked up for it (no pull-back through the table, no N x V x D per-example gradients)."""
    recipe = Recipe(F.embedding, (ids.as_subclass(torch.Tensor), weight, padding_idx))
    out = table(F.embedding(ids, weight, padding_idx), [(weight, buffer)], recipe)
    if per_example is not None:
        out.pe_lookup = (ids, per_example)
    return out


def parameters_as_tables(module, args):
    """A forward pre-hook of every converted layer (registry.adopt): a trainable parameter passed as the layer's
    input (DeBERTa's LayerNorm of its relative-position embeddings' weight) is a table shared by the examples."""
    if not any(isinstance(a, nn.Parameter) for a in args):
        return None
    current = layout.current_pass()
    if current is None:
        return None
    return tuple(
        table(a.view_as(a), [(a, current.mapper.buffer_of(a))], Recipe(torch.Tensor.view_as, (a, a)))
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
    flat = trees.leaves((args, kwargs))
    tables = [t for t in flat if isinstance(t, SharedRows)]
    graded = torch.is_grad_enabled()
    sources = {}
    for t in tables:
        if t.requires_grad or not graded:  # (a table made without gradients, under no_grad, carries none to them)
            sources.update({id(p): (p, b) for p, b in t.pe_sources})
    current = layout.current()
    if current is None or layout.replaying() or not (graded or _in_a_forward_with_gradients()):
        return _run(func, *trees.map_leaves(_plain, (args, kwargs)))  # outside a forward: plain tensors
    if not graded:
        return _without_gradients(func, args, kwargs, flat, sources)
    if func is torch.Tensor.expand_as and len(args) == 2 and isinstance(args[0], SharedRows) and not kwargs:
        if isinstance(args[1], torch.Tensor) and not isinstance(args[1], SharedRows) and _items(args[1]) is not None:
            # expand_as(x) is expand(x's sizes): x gives only its shape (a table of one row per example, Flaubert's
            # positions looked up from ids expanded over the batch, stays a table until it meets the data)
            func, args = torch.Tensor.expand, (args[0], tuple(args[1].shape))
            flat = trees.leaves((args, kwargs))
    others = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, SharedRows)]
    meets = _meeting(func, args, kwargs)
    if meets is not None:  # Tensor.expand(N, ...), Tensor.repeat(N, ...): copies made here
        return meets(sources)
    data = [(t, items) for t in others for items in (_items(t),) if items is not None]
    if data:
        if func in _ELEMENTWISE or func is F.scaled_dot_product_attention:
            t, items = max(data, key=lambda found: found[0].dim())
            return _at_meeting(func, args, kwargs, items, t.dim(), sources)
        if func is torch.functional.einsum or func is torch.einsum:
            found = _einsum_meeting(args, kwargs, sources)
            if found is not None:
                return found
        if func is F.conv1d:  # (Qwen3.5's gated DeltaNet: its conv1d.weight.squeeze(1), unsqueezed again)
            copies = lambda t, items: _copies(t, items, (items.count, *t.shape), sources) if is_shared(t) else None  # noqa
            found = per_example_conv1d(*args, **kwargs, copies=copies)
            if found is not None:
                return found
        carried = [(t, items) for t, items in data if _carries_gradient(t)]  # (a constant's size proves nothing)
        if func in ALONG_EXAMPLES and carried:  # each item given its slice of each table
            found = along_examples(func, args, kwargs, carried, SharedRows, lambda t, i: _sliced(t, i, sources))
            if found is not None:
                return _run(func, *found)
        return _refused(func, args, kwargs, sources, "meets the examples' data there")
    data = [t for t in others if t.requires_grad and not isinstance(t, nn.Parameter)]
    if data and (func is torch.functional.einsum or func is torch.einsum):  # (data holding its examples on dim 1)
        found = _einsum_meeting(args, kwargs, sources)
        if found is not None:
            return found
    if data and func in _BATCHED_MATMUL and len(args) == 2 and not kwargs:  # (H, N*T, d) @ a table (H, d, k)
        if all(isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[0] == args[0].shape[0] for a in args):
            found = _einsum_meeting(("bmk,bkl->bml", *args), {}, sources)
            if found is not None:
                return found
    if data:
        return _refused(
            func,
            args,
            kwargs,
            sources,
            f"meets data of shape {tuple(data[0].shape)}, whose dim 0 is not the {current.examples} examples",
        )
    return _as_tables(func, args, kwargs, others, sources)


def _as_tables(func, args, kwargs, others, sources):
    """func's outputs on tables, constants and parameters: tables computed from the tables' sources and the
    parameters among `others`."""
    for p in others:
        if isinstance(p, nn.Parameter) and p.requires_grad:
            sources[id(p)] = (p, layout.current_pass().mapper.buffer_of(p))
    plain = trees.map_leaves(_plain, (args, kwargs))
    drawn_from = random_state_at(trees.leaves(plain)) if func in DRAWING or func in DROPOUTS else None
    out = _run(func, *plain)
    given = trees.map_leaves(recipe_of, (args, kwargs))
    single = isinstance(out, torch.Tensor)
    positions = iter(range(len(trees.leaves(out))))

    def as_table(t):
        index = None if single else next(positions)
        if not isinstance(t, torch.Tensor):
            return t
        return table(t, sources.values(), Recipe(func, given[0], given[1], index, drawn_from))

    return trees.map_leaves(as_table, out)


def _in_a_forward_with_gradients():
    """True in a root forward with gradients (or its recompute by activation checkpointing, in a backward pass): an
    op run there without them is in a region under no_grad, or in a custom autograd.Function's forward."""
    found = layout.current_pass()
    return found is not None and (found.counting or layout.in_backward())


def _without_gradients(func, args, kwargs, flat, sources):
    """An op run without gradients in a forward with them. torch runs a custom autograd.Function's forward so (SEW-D's
    XDropout of its relative-position embeddings), and Function.apply is no op that __torch_function__ sees: the ops
    inside its forward are followed instead. An op on tables and parameters alone gives a table, so a forward made
    of such ops returns one, which apply returns as it is, its gradient now through the Function's backward; any
    other tensor among the op's operands (the examples' data, a constant: without gradients no history tells them
    apart) leaves its result plain, as every op's outside a forward. A table that stays without gradients (a region
    under no_grad) carries none to its sources where an op with gradients takes it (_follow)."""
    if any(isinstance(t, torch.Tensor) and not isinstance(t, (SharedRows, nn.Parameter)) for t in flat):
        return _run(func, *trees.map_leaves(_plain, (args, kwargs)))
    return _as_tables(func, args, kwargs, [t for t in flat if isinstance(t, nn.Parameter)], sources)


def _items(t):
    """The Items of t when it is the examples' data (its dim 0 holds the forward's examples, or their choices,
    windows, images...; with one example, a tensor carrying gradients or the root's input), else None. Ids the
    forward made from no example's data (core/ids.py's MadeIds) are none."""
    if t.dim() == 0 or (type(t) is MadeIds and is_made(t)):
        return None
    items = layout.items_of(t.shape[0])
    if items is None and t.requires_grad and not isinstance(t, nn.Parameter):
        return history.items_folded_on_dim0(t)  # (N*H, ...): heads folded into the batch by a reshape of (N, ...)
    if items is None or (items.count == 1 and not _carries_gradient(t) and not is_root_data(layout.current_pass(), t)):
        return None
    return items


def _meeting(func, args, kwargs):
    """A thunk making the copies for Tensor.expand / Tensor.repeat of a table over the examples' items, else None."""
    if func not in (torch.Tensor.expand, torch.Tensor.repeat) or not isinstance(args[0], SharedRows) or kwargs:
        return None
    s = args[0]
    sizes = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else tuple(args[1:])
    items = layout.items_of(sizes[0]) if sizes and isinstance(sizes[0], int) else None
    if items is None or len(sizes) != s.dim():
        return None
    count = items.count
    if func is torch.Tensor.expand and s.shape[0] == 1:
        return lambda sources: _copies(s, items, (count, *s.shape[1:]), sources).expand(count, *sizes[1:])
    if func is torch.Tensor.repeat:  # repeat(N, ...): N copies of the table, one after the other on dim 0
        rest = sizes[1:]
        return lambda sources: _copies(s, items, (count, *s.shape), sources).flatten(0, 1).repeat(1, *rest)
    return None


def _at_meeting(func, args, kwargs, items, rank, sources):
    """Run func with every table given to the examples as torch's broadcasting gives it against operands of `rank`
    dims holding the items on dim 0: the table's dim aligned with that dim decides. None or size 1: each item gets
    all of it (copies, one per item); size `items.count`: each item its own slice (its gradient is that item's)."""
    count = items.count
    for t in trees.leaves((args, kwargs)):
        if not isinstance(t, SharedRows):
            continue
        aligned = t.dim() - rank  # the table's dim aligned with the data's dim 0 (negative: none)
        if aligned > 0 or (func in _MATMUL and (rank < 3 or (aligned == 0 and t.dim() <= 2))):
            why = f"is broadcast there in a way per-example copies cannot follow (shape {tuple(t.shape)})"
            return _refused(func, args, kwargs, sources, why)

    def given(t):
        if not isinstance(t, SharedRows):
            return t
        aligned = t.dim() - rank
        if aligned == 0 and t.shape[0] == count and count != 1:
            return _sliced(t, items, sources)
        if aligned == 0 and t.shape[0] == 1:
            return _copies(t, items, (count, *t.shape[1:]), sources)
        if aligned == 0:
            return t.as_subclass(torch.Tensor)  # torch's own error: it does not broadcast
        return _copies(t, items, (count,) + (1,) * (-aligned - 1) + tuple(t.shape), sources)

    args, kwargs = trees.map_leaves(given, (args, kwargs))
    return _run(func, args, kwargs)


def _carries_gradient(t):
    """True for the examples' data as the forward computed it (a gradient flows through it): a constant (sinusoidal
    positions, a mask) whose dim 0 happens to have the items' size is no example's (Funnel's relative positions,
    2T rows, met 2N choices)."""
    return t.requires_grad and not isinstance(t, nn.Parameter)


def _einsum_meeting(args, kwargs, sources):
    """torch.einsum of tables with the examples' data: each table one copy per item (einsum_with_copies)."""
    given = einsum_with_copies(
        args,
        kwargs,
        lambda t: isinstance(t, SharedRows),
        lambda t: history.items_of_data(t) if _carries_gradient(t) else None,
        lambda t, items: _copies(t, items, (items.count, *t.shape), sources),
        lambda t, items: _sliced(t, items, sources),
    )
    return None if given is None else _run(torch.einsum, given, {})


_BATCHED_MATMUL = {torch.bmm, torch.Tensor.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def copies_for(t, items):
    """(items.count, *t.shape): one copy of table t per item, each receiving its item's gradient (pulled back to the
    parameters t was computed from), for an op that takes each item's copy itself (a grouped convolution)."""
    sources = {id(p): (p, b) for p, b in t.pe_sources}
    return _copies(t, items, (items.count, *t.shape), sources)


def _note_uses(sources):
    """Each meeting is a use of every parameter the table was computed from (core/uses.py); one in a recompute by
    activation checkpointing is none (layout.note_uses)."""
    layout.note_uses([b for _, b in sources.values() if b is not None])


def _copies(s, items, shape, sources):
    """(count, ...) copies of table s, shaped `shape` to broadcast as s did against the items' operands."""
    _note_uses(sources)
    found = s.pe_lookup
    if found is not None:  # a lookup met as it is: each item's rows looked up for its example
        ids, per_example = found
        ids = ids.reshape((1,) * (len(shape) - 1 - ids.dim()) + tuple(ids.shape)).expand(shape[:-1])
        return per_example(ids, items.rows(ids.shape))
    plain = s.as_subclass(torch.Tensor)
    return ExampleCopies.apply(plain, shape, items, (tuple(sources.values()), s.pe_recipe))


def _sliced(t, items, sources):
    """t, whose dim 0 holds one slice per item: each item's gradient of it is its own slice's."""
    _note_uses(sources)
    found = t.pe_lookup
    if found is not None and found[0].dim() + 1 == t.dim():  # a lookup of the items' own ids
        ids, per_example = found
        return per_example(ids, items.rows(ids.shape))
    return SlicedTable.apply(t.as_subclass(torch.Tensor), items, (tuple(sources.values()), t.pe_recipe))


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
    return _run(func, *trees.map_leaves(_plain, (args, kwargs)))
