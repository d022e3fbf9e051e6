"""
The tags on a forward's ids: ExampleIds follows the examples' ids, MadeIds the tensors the forward made from none of
its examples' data.

The root forward's pre-hook (core/layout.py's install) tags the integer tensors among the model's arguments (`tagged_inputs`);
every op on a tagged tensor returns its integer and boolean results tagged too, so that the ids the model computes
from its example inputs (views, shifted or masked ids, token types) stay known as the examples', whatever their
sizes, and ids made otherwise (positions from torch.arange, relative-position buckets, a buffer) stay plain: an
Embedding looking up plain ids looks up a table the examples share (core/shared.py, core/layout.py's
looks_up_a_table). Under torch.compile nothing is tagged (a traced forward keeps no Python tags).

A forward whose arguments hold no integer tensor (audio features, latents, pixels) has nothing to tag, and there an
untagged id tells nothing: an int tensor can be made from the examples' data (an argmax, a quantizer's codes). What
is known instead is how some ids were made: by a constructor that takes no tensor (torch.arange, torch.full, ...),
then by ops on such tensors and numbers alone (wav2vec2-BERT's relative distances `arange(T)[None] - arange(T)[:,
None]`, clamped). Those hold no example's data, whatever their sizes: MadeIds tags them, and an Embedding looking
them up looks up a table the examples share. The constructors are seen by a TorchFunctionMode (MadeHere), which sees
every op while it is on; it is on only in such forwards, in windows (`open_window`): from the start of the forward of
a module that calls an Embedding (core/scopes.py's made_ids_callers, the root's in core/layout.py's install) to that
module's first lookup (core/layout.py's looks_up_a_table) or the end of its forward, whichever comes first.
"""

import torch
from torch.overrides import TorchFunctionMode

from nanogns.core import trees


class ExampleIds(torch.Tensor):
    """Integer tensors computed from the forward's example inputs (its ids, and everything the model computes from
    them: views, shifted or masked ids, positions counted from them): every op taking one returns its integer and
    boolean results tagged too (__torch_function__), floating-point ones plain. An Embedding looking up tagged ids
    looks up the examples' rows; one looking up untagged ids looks up a table (see the module docstring).

    Results that take only the ids' dtype, device or shape (`torch.arange(T).type_as(ids)`, `ids.new_tensor(...)`,
    `torch.ones_like(ids)`) and those indexing one example out (`ids[0]`, `ids.select(0, i)`) are not the examples'
    ids: they stay plain, so that a lookup of them is a table's, whatever the sizes (an untagged lookup is exact
    either way: core/shared.py gives each example its rows of the table as torch broadcasts them)."""

    _examples_dim = 0  # the dim holding the examples (examples_dim), set on ids whose examples an op moved
    _moved_any = False  # (class-wide) some ids had their examples moved in this root forward (layout.enter resets
    # it): only then are the other arguments of an op looked at for them (torch.cat of moved ids)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        moved = 0
        with torch._C.DisableTorchFunctionSubclass():  # (ndim read in here: no __torch_function__ of its own)
            out = func(*args, **(kwargs or {}))
            if args and type(args[0]) is ExampleIds and (func in _MOVES or args[0]._examples_dim != 0):
                if type(out) is torch.Tensor:  # where the examples are in the output, for the tag below
                    moved = _moved(func, args, kwargs, args[0]._examples_dim, args[0].ndim, out.ndim)
            elif ExampleIds._moved_any and type(out) is torch.Tensor:  # moved ids among the others (torch.cat)
                source = _moved_source(args)
                if source is not None:
                    moved = source._examples_dim if source.ndim == out.ndim else None
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], ExampleIds):
            _written_into(args[0])
        if func in _NOT_FROM_THE_IDS or _takes_dtype_only(func, args) or _one_example_out(func, args, kwargs):
            return out
        out = trees.map_leaves(_tag, out)
        if moved != 0 and type(out) is ExampleIds:
            out._examples_dim = moved
            ExampleIds._moved_any = True
        return out


class MadeIds(torch.Tensor):
    """Tensors the forward made from none of its examples' data (see the module docstring): the result of a
    constructor that takes no tensor (MadeHere tags it), and every op's result whose tensor arguments are all
    MadeIds (__torch_function__); an op taking any other tensor gives a plain result. A write into one from
    anything else (an in-place op, a view written into) moves its version counter, shared by its views, past the
    one it was tagged at: it is then no longer taken as made (`is_made`)."""

    _made_version = -1  # the tensor's version counter when it was tagged

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(types) != 1 or next(iter(types)) is not MadeIds:  # another tag among the arguments
            if any(t is ExampleIds or getattr(t, "pe_shared", False) for t in types):
                return NotImplemented  # the examples' ids or a table (core/shared.py): their tags follow the op
            return func(*trees.map_leaves(_unmade, args), **trees.map_leaves(_unmade, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            made = all(_made_tensor(t) for t in trees.leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            out = func(*args, **kwargs)
            return trees.map_leaves(_stamp, out) if made else out


def _made_tensor(t):
    return type(t) is MadeIds and t._version == t._made_version


def _stamp(t):
    """t (a result of MadeIds alone) tagged at its current version; called with torch functions disabled."""
    if type(t) is torch.Tensor:
        t = t.as_subclass(MadeIds)
    if type(t) is MadeIds:
        t._made_version = t._version
    return t


def _unmade(t):
    return t.as_subclass(torch.Tensor) if type(t) is MadeIds else t


def is_made(ids):
    """True for ids made in the forward from none of its examples' data (MadeIds, not written into since)."""
    if type(ids) is not MadeIds:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return ids._version == ids._made_version


# constructors whose result holds nothing but their numbers (and a tensor argument's dtype, device or shape: the
# *_like and new_* ones); torch.empty's memory is what it was, torch.tensor's lists may hold the examples' values
_CONSTRUCTORS = frozenset(
    {
        torch.arange,
        torch.range,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.eye,
        torch.linspace,
        torch.logspace,
        torch.tril_indices,
        torch.triu_indices,
    }
)
_FROM_A_TENSOR_S_SHAPE = frozenset(
    {
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
    }
)


class MadeHere(TorchFunctionMode):
    """While on: the result of a constructor given no tensor (but the one whose shape a *_like or new_* takes) is
    MadeIds. Not under a torch.func transform (vmap of a mask builder)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CONSTRUCTORS or func in _FROM_A_TENSOR_S_SHAPE:
            given = trees.leaves((args[1:], kwargs) if func in _FROM_A_TENSOR_S_SHAPE else (args, kwargs))
            if type(out) is torch.Tensor and not any(isinstance(t, torch.Tensor) for t in given):
                if not torch._C._are_functorch_transforms_active():
                    with torch._C.DisableTorchFunctionSubclass():
                        return _stamp(out)
        return out


def open_window():
    """Turn a MadeHere on (pushed on torch's stack of function modes); returns it."""
    mode = MadeHere()
    torch._C._push_on_torch_function_stack(mode)
    return mode


def close_window(mode):
    """Turn `mode` off: taken from torch's stack of function modes, wherever it is in it (the modes pushed after it
    and still on are put back as they were)."""
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for top in reversed(above):
        torch._C._push_on_torch_function_stack(top)


def _moved_source(args):
    """The first tagged ids with their examples moved off dim 0 among args (and the lists and tuples in them)."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if type(t) is ExampleIds and t._examples_dim != 0:
                return t
    return None


def examples_dim(ids):
    """The dim of tagged ids that holds the examples: 0 as the root's inputs hold them, the dim a transpose,
    permute, movedim or unsqueeze moved it to (XLNet's (T, N) ids), None where an op changed the rank of ids whose
    examples had moved (no longer known)."""
    return ids._examples_dim


# ops that move the dims of a tensor (a tagged one's examples_dim follows them)
_MOVES = frozenset(
    {
        torch.transpose,
        torch.Tensor.transpose,
        torch.swapaxes,
        torch.Tensor.swapaxes,
        torch.swapdims,
        torch.Tensor.swapdims,
        torch.t,
        torch.Tensor.t,
        torch.permute,
        torch.Tensor.permute,
        torch.movedim,
        torch.Tensor.movedim,
        torch.moveaxis,
        torch.Tensor.moveaxis,
        torch.unsqueeze,
        torch.Tensor.unsqueeze,
        torch.Tensor.T.__get__,
        torch.Tensor.mT.__get__,
    }
)


def _moved(func, args, kwargs, at, before, after):
    """The dim holding the examples in func's output, for tagged ids (of `before` dims) holding them on dim `at`;
    None (no longer known) for arguments read otherwise than expected: the user's forward never fails here."""
    try:
        return _dim_after(func, args, kwargs, at, before, after)
    except (IndexError, ValueError, TypeError):
        return None


def _dim_after(func, args, kwargs, at, before, after):
    if at is None:
        return None
    if func not in _MOVES:  # an op keeping the rank keeps the dims (elementwise, slices, clone)
        return at if before == after else (0 if at == 0 else None)
    given = (*args[1:], *kwargs.values()) if kwargs else args[1:]
    if func in (torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.t, torch.Tensor.t):
        order = list(range(after))
        if func is torch.Tensor.T.__get__:
            order.reverse()
        elif after >= 2:
            order[-2], order[-1] = order[-1], order[-2]
        return order.index(at)
    if func in (torch.unsqueeze, torch.Tensor.unsqueeze):
        return at + 1 if given[0] % after <= at else at
    if func in (torch.permute, torch.Tensor.permute):
        order = list(given[0]) if len(given) == 1 and not isinstance(given[0], int) else list(given)
        return [d % after for d in order].index(at)
    if func in (torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis):
        sources, destinations = ([g] if isinstance(g, int) else list(g) for g in given[:2])
        sources, destinations = [d % after for d in sources], [d % after for d in destinations]
        if at in sources:
            return destinations[sources.index(at)]
        rest = [d for d in range(after) if d not in destinations]
        return rest[[d for d in range(before) if d not in sources].index(at)]
    d0, d1 = (d % after for d in given[:2])  # transpose, swapaxes, swapdims
    return d1 if at == d0 else d0 if at == d1 else at


def _written_into(target):
    """A plain integer tensor into which the examples' ids were written (`shifted = ids.new_zeros(ids.shape);
    shifted[:, 1:] = ids[:, :-1]`: T5's, BART's and MVP's decoder inputs) holds the examples' ids: tagged in place."""
    if type(target) in (torch.Tensor, MadeIds) and not (target.is_floating_point() or target.is_complex()):
        target.__class__ = ExampleIds


# ops whose result takes nothing from a tagged argument but its dtype, device or shape
_NOT_FROM_THE_IDS = frozenset(
    {
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
        torch.empty_like,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.Tensor.new_empty,
        torch.Tensor.new_tensor,
    }
)


def _takes_dtype_only(func, args):
    """x.type_as(ids) or x.to(ids) with x untagged: ids give their dtype and device only."""
    return func in (torch.Tensor.type_as, torch.Tensor.to) and len(args) > 1 and not isinstance(args[0], ExampleIds)


def _one_example_out(func, args, kwargs):
    """ids[i] (an int first index) or ids.select(0, i): one example's ids, not the examples'."""
    if func is torch.Tensor.__getitem__ and len(args) == 2:
        index = args[1][0] if type(args[1]) is tuple and args[1] else args[1]
        return type(index) is int
    if func is torch.Tensor.select:
        dim = kwargs.get("dim") if kwargs else (args[1] if len(args) > 1 else None)
        return dim == 0
    return False


def _tag(t):
    if type(t) is torch.Tensor and not (t.is_floating_point() or t.is_complex()):
        return t.as_subclass(ExampleIds)
    return t


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, ExampleIds) else t


def untagged(value):
    """value (a tensor, or a structure of them) with every ExampleIds tag taken off."""
    return trees.map_leaves(_plain, value)


def tagged_inputs(args, kwargs):
    """The root's arguments with their integer tensors tagged, in lists, tuples and dicts too (masks are left plain:
    they only mask, and the models' mask builders run under vmap, which a subclass would break); None when there is
    none."""
    found = False

    def tag(value, name=""):
        nonlocal found
        if isinstance(value, dict):
            return {k: tag(v, k) for k, v in value.items()} if type(value) is dict else value
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(tag(v, name) for v in value)
        if (
            type(value) is torch.Tensor
            and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
            and not name.endswith("mask")
        ):
            found = True
            return value.as_subclass(ExampleIds)
        return value

    args, kwargs = tag(tuple(args)), tag(dict(kwargs))
    return (args, kwargs) if found else None
