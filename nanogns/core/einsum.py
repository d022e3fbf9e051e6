"""
torch.einsum and F.conv1d where a shared operand (a table the examples share, core/shared.py; a module's own
parameter, conversion/intercept.py) meets the examples' data: each item of the examples gets its own copy of the
shared operand (in einsum under a new subscript, the one under which the data holds the items; in a convolution as
one group per example), so that each item's output depends on its copy alone and backward gives each copy its
item's gradient; in a join along another dim than 0 (and a batched matmul) each item gets its slice of it.
"""

import torch

from nanogns.core import layout, trees
from nanogns.core.rowmaps import Items


def same_items(a, b):
    """True when Items a and b are the same items (equal counts of the same examples, in the same order)."""
    if a is b:
        return True
    if (a.count, a.examples) != (b.count, b.examples):
        return False
    if a.example_of_item is None or b.example_of_item is None:
        return a.example_of_item is None and b.example_of_item is None
    return torch.equal(a.example_of_item, b.example_of_item)


def einsum_with_copies(args, kwargs, copied, items_of, copy, slices=None):
    """torch.einsum's arguments with each operand for which `copied(t)` holds (a table, a parameter) given one copy
    per item of the examples' data, `copy(t, items)` -> (count, *t.shape), under a new leading subscript: the one
    under which every other operand holding the examples' data (`items_of(t)` -> (Items, the dim holding them) or
    None: only tensors a gradient flows through, as the callers give it) has them, on dim 0 or, in a forward that
    moved its examples to dim 1, there (XLNet's "ibh,hnd->ibnd"), which the output keeps and no copied operand
    carries (each item's output then depends on its own copy alone); a copied operand carrying it (a table of one
    slice per item) is given as `slices(t, items)`, that dim first. None when that does not hold (an ellipsis, the
    examples summed over, operands of different items)."""
    if kwargs or len(args) < 2 or not isinstance(args[0], str):
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    equation = args[0].replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(operands) or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    letters, found = set(), None
    for subscript, t in zip(subscripts, operands):
        held = None if copied(t) or not subscript else items_of(t)
        if held is None:
            continue
        items, dim = held
        if dim >= len(subscript) or (found is not None and not same_items(items, found)):
            return None
        found = items
        letters.add(subscript[dim])
    if found is None or len(letters) != 1:
        return None
    (letter,) = letters
    if letter not in output or any(s.count(letter) > 1 for s in subscripts):
        return None
    if any(letter in s and t.shape[s.index(letter)] != found.count for s, t in zip(subscripts, operands)):
        return None
    if slices is None and any(letter in s for s, t in zip(subscripts, operands) if copied(t)):
        return None

    def give(s, t):
        if not copied(t):
            return s, t
        if letter in s:  # a table of one slice per item under the items' subscript: item i's is slice i
            at = s.index(letter)
            return letter + s[:at] + s[at + 1 :], slices(t.movedim(at, 0) if at else t, found)
        return letter + s, copy(t, found)

    given = [give(s, t) for s, t in zip(subscripts, operands)]
    return (",".join(s for s, _ in given) + "->" + output, *[t for _, t in given])


# ops that keep dim 0 of their operands as their output's dim 0 (operands of equal dim 0): where the examples' data
# holds the items on dim 0, a shared operand of as many rows gives item i its slice i
ALONG_EXAMPLES = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.bmm, torch.Tensor.bmm, torch.baddbmm}
_JOINS = (torch.cat, torch.concat, torch.concatenate, torch.stack)


def along_examples(func, args, kwargs, data, shared_type, sliced):
    """The arguments of cat / stack along a dim other than 0, bmm, baddbmm of shared operands (of `shared_type`) with
    the examples' data (`data`: [(tensor, its Items)], dim 0 holding the items): dim 0 of the output is the operands'
    dim 0, so item i's output holds only slice i of each shared operand, which is given as `sliced(t, items)` (dim 0
    of the items' count, as the op requires). None when the op joins along dim 0 (the output's rows are no longer
    the items) or the operands' dim 0 differ."""
    items = data[0][1]
    if not all(same_items(found, items) for _, found in data):
        return None
    operands = list(args[0]) if func in _JOINS else list(args)
    if func in _JOINS:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        rank = operands[0].dim() + (1 if func is torch.stack else 0)
        if not isinstance(dim, int) or dim % max(rank, 1) == 0:
            return None
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if any(t.dim() == 0 or t.shape[0] != items.count for t in tensors):
        return None
    given = lambda t: sliced(t, items) if isinstance(t, shared_type) else t  # noqa: E731
    return trees.map_leaves(given, (args, kwargs))


def per_example_conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, copies):
    """F.conv1d of the examples' data `input` (N, C, L) with a weight and bias shared by the examples (a module's
    parameters, tables computed from them: Mamba's and the gated DeltaNets' depthwise causal convolutions), each
    example given its own copy of each, `copies(t, items)` -> (N, *t.shape) or None, as one grouped convolution over
    the N examples' channels (the same arithmetic), so that backward gives each copy its example's gradient. None
    when that does not hold (then the caller refuses)."""
    x = input
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.requires_grad or isinstance(padding, str):
        return None
    items = layout.items_of(x.shape[0]) if layout.current() is not None else Items(x.shape[0], x.shape[0])
    shared = getattr(type(x), "pe_shared", False)  # (a table as the data: none of the examples')
    if items is None or items.count != items.examples or shared or isinstance(x, torch.nn.Parameter):
        return None
    given = [None if t is None else copies(t, items) for t in (weight, bias)]
    if given[0] is None or (bias is not None and given[1] is None):
        return None
    N, (w, b) = x.shape[0], given
    with torch._C.DisableTorchFunctionSubclass():  # (plain tensors: the copies carry the examples' gradients)
        out = torch.nn.functional.conv1d(
            x.reshape(1, N * x.shape[1], x.shape[2]),
            w.reshape(N * weight.shape[0], *weight.shape[1:]),
            None if b is None else b.reshape(-1),
            stride,
            padding,
            dilation,
            groups * N,
        )
    return out.view(N, weight.shape[0], out.shape[-1])
