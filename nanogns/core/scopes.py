"""
Scopes inside a forward: modules whose rows are not the examples' batch-first rows get a scope around their forward
(in backward too, for a recompute by activation checkpointing), which the Pass running now keeps (Pass.scopes) and
core/rowmaps.py's Layout.rows_for reads: windows (WINDOWED: Swin's blocks split each example into windows of rows),
sequence-first modules (batch_first=False: (T, N) rows), and vision towers (core/towers.py: rows that are images or
their patches). core/layout.py's install registers them (`scope_handles`) with the model's root hooks.
"""

import torch

from nanogns.core import towers
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
