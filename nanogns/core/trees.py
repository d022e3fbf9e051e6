"""
torch's pytree map and leaves, with the plain containers done directly: the layers' forwards and the tags'
`__torch_function__` meet a tensor, a tuple or a dict on nearly every call, where pytree's generic walk costs some
forty Python calls (tests/test_bench_call_overhead.py counts them). Any other node (a namedtuple, torch.return_types,
an OrderedDict, a registered dataclass) goes to pytree itself, so the results are pytree's.
"""

import torch
from torch.utils import _pytree as pytree

_LEAVES = (int, float, bool, str, type(None), torch.device, torch.dtype, torch.layout, torch.memory_format)


def map_leaves(fn, value):
    """pytree.tree_map(fn, value)."""
    kind = type(value)
    if kind is tuple or kind is list or kind is torch.Size:  # (a Size is pytree's node of ints)
        return kind([map_leaves(fn, v) for v in value])
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in value.items()}
    if kind in _LEAVES or isinstance(value, torch.Tensor):
        return fn(value)
    return pytree.tree_map(fn, value)


def leaves(value):
    """pytree.tree_leaves(value), as a list."""
    found = []
    _collect(value, found)
    return found


def _collect(value, found):
    kind = type(value)
    if kind is tuple or kind is list or kind is torch.Size:
        for v in value:
            _collect(v, found)
    elif kind is dict:
        for v in value.values():
            _collect(v, found)
    elif kind in _LEAVES or isinstance(value, torch.Tensor):
        found.append(value)
    else:
        found.extend(pytree.tree_leaves(value))
