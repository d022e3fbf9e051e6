"""
Scopes inside a forward: modules whose rows are not the examples' batch-first rows get a scope around their forward
(in backward too, for a recompute by activation checkpointing), which the Pass running now keeps (Pass.scopes) and
core/rowmaps.py's Layout.rows_for reads: windows (WINDOWED: Swin's blocks split each example into windows of rows),
sequence-first modules (batch_first=False: (T, N) rows), and vision towers (core/towers.py: rows that are images or
their patches). core/layout.py's install registers them (`scope_handles`) with the model's root hooks.

In a forward with no ids to tag (core/ids.py), the modules that call an Embedding get a window in which the ids they
make from no example's data are tagged (core/ids.py's MadeIds): `made_ids_handles`, registered at the first such
forward.
"""

import weakref

import torch
import torch.nn as nn

from nanogns.core import ids, towers, trees
from nanogns.core.ids import untagged
from nanogns.core.rowmaps import SEQUENCE_FIRST, WINDOWS, Tower

# layers (by class name) that split each example into windows of rows, stacked example after example on dim 0
# (transformers' Swin blocks: window_partition of (N, H, W, C) into (N * windows, ws, ws, C)), and join them back
WINDOWED = ("SwinLayer", "Swinv2Layer")


def scope_handles(model, current_pass):
    """Register a scope around the forward of every module of `model` that has one; returns the hooks' handles.
    current_pass() -> the Pass layers record into now (core/layout.py's, handed over: it imports this module)."""
    handles = ()
    for module in model.modules():
        if type(module).__name__.endswith(WINDOWED):
            scope = _scope_hooks(lambda module, args, kwargs: WINDOWS, current_pass)
        elif module is not model and _sequence_first(module):
            scope = _scope_hooks(lambda module, args, kwargs: SEQUENCE_FIRST, current_pass)
        else:
            continue
        handles += (
            module.register_forward_pre_hook(scope[0], with_kwargs=True),
            module.register_forward_hook(scope[1], always_call=True),
        )
    for module, name, config in towers.tower_modules(model):
        scope = _scope_hooks(_tower_scope(name, config, current_pass), current_pass)
        handles += (
            module.register_forward_pre_hook(scope[0], with_kwargs=True),
            module.register_forward_hook(scope[1], always_call=True),
        )
    return handles


def _sequence_first(module):
    """True for a module whose rows are (T, N): batch_first=False, or torch's Transformer layers (which keep theirs
    on their attention) around a sequence-first attention."""
    if getattr(module, "batch_first", None) is False:
        return True
    attention = getattr(module, "self_attn", None)
    return isinstance(module, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)) and (
        getattr(attention, "batch_first", None) is False
    )


def _scope_hooks(scope_of, current_pass):
    """(pre-hook, hook) entering and leaving the scope scope_of(module, args, kwargs) gives, around a module's
    forward (in backward too: a recompute by activation checkpointing)."""

    def entered(module, args, kwargs):
        found = current_pass()
        if found is not None:
            found.scopes.append(scope_of(module, args, kwargs))
            found.sequence_first_ran = found.sequence_first_ran or found.scopes[-1] is SEQUENCE_FIRST

    def left(module, args, output):
        found = current_pass()
        if found is not None and found.scopes:
            found.scopes.pop()

    return entered, left


def _tower_scope(name, config, current_pass):
    def scope_of(module, args, kwargs):
        found = current_pass()
        examples = found.layout.examples if found.layout is not None else 0
        maps, reason = towers.example_maps(config, untagged(args), untagged(kwargs), untagged(found.inputs))
        return Tower(name, examples, maps, reason)

    return scope_of


# modules whose forward is never called (ModuleList, ModuleDict) or only calls their children in turn (Sequential):
# ids made for a child of theirs are made by the module above them
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def made_ids_callers(model):
    """The modules of `model` that call an Embedding of a kind (pe_kind "Embedding"): each one's nearest ancestor
    that is no container (the model's root included)."""
    parents = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), []).append(module)
    callers = {}
    for module in model.modules():
        if getattr(module, "pe_kind", None) != "Embedding":
            continue
        above = list(parents.get(id(module), ()))
        while above:
            parent = above.pop()
            if isinstance(parent, _CONTAINERS):
                above.extend(parents.get(id(parent), ()))
            else:
                callers[id(parent)] = parent
    return list(callers.values())


def made_ids_handles(callers, current_pass, opens_window):
    """Register a window (core/ids.py's MadeHere) around the forward of each of `callers` (not the root: its own
    hooks open it, core/layout.py), opened where its forward starts when opens_window(the Pass) (a forward with no
    ids to tag) and closed at its first Embedding lookup (core/layout.py's looks_up_a_table) or where its forward ends;
    returns the hooks' handles."""

    def opened(module, args):
        found = current_pass()
        if found is not None and opens_window(found):
            found.windows.append([module, ids.open_window()])

    def closed(module, args, output):
        found = current_pass()
        if found is not None and found.windows and found.windows[-1][0] is module:
            _, mode = found.windows.pop()
            if mode is not None:
                ids.close_window(mode)

    handles = ()
    for module in callers:
        handles += (module.register_forward_pre_hook(opened), module.register_forward_hook(closed, always_call=True))
    return handles


def start_made_ids(found, model, mapper, arguments, current_pass, opens_window):
    """At the start of a root forward (Pass `found`) with no ids to tag: keep weak references to its floating-point
    arguments (core/shared.py: the examples' data, though they carry no gradient), register the windows of the
    modules calling an Embedding at the model's first such forward (kept in mapper.made_ids_callers), and open the
    root's own when it is one of them."""
    found.root_data = tuple(
        weakref.ref(t) for t in trees.leaves(arguments) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
    )
    if mapper.made_ids_callers is None:
        mapper.made_ids_callers = made_ids_callers(model)
        others = [m for m in mapper.made_ids_callers if m is not model]
        mapper.handles += made_ids_handles(others, current_pass, opens_window)
    if any(m is model for m in mapper.made_ids_callers):
        found.windows.append([model, ids.open_window()])


def is_root_data(found, t):
    """True when `t` is one of the floating-point arguments of Pass `found`'s root forward, or a view of one, in a
    forward with no ids to tag (start_made_ids): the examples' data, though it carries no gradient."""
    if found is None or not found.root_data:
        return False
    base = t._base
    return any(ref() is t or (base is not None and ref() is base) for ref in found.root_data)


def close_innermost(windows):
    """Close the innermost of `windows` (a Pass's) still open: an Embedding looks up ids now, which its caller made
    before, and the rest of the caller's forward runs without the mode."""
    for window in reversed(windows):
        if window[1] is not None:
            ids.close_window(window[1])
            window[1] = None
            return


def close_windows(windows):
    """Close every window of `windows` (a Pass's, at the end of its root forward), innermost first."""
    while windows:
        _, mode = windows.pop()
        if mode is not None:
            ids.close_window(mode)
