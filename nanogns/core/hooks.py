"""
install(model): the hooks that give every forward of a model its Pass (core/layout.py), and the scopes inside it.

The root's forward pre-hook reads its arguments (core/inputs.py's layout_of_inputs: `input_ids`, `inputs_embeds`,
`pixel_values`, ... or the first tensor), tags its ids (core/ids.py) and enters a Pass with that Layout; its forward
hook leaves it. Modules whose rows are not the examples' batch-first rows get a scope around their forward (in
backward too, for a recompute by activation checkpointing): windows (WINDOWED: Swin), sequence-first modules
(batch_first=False), and vision towers (core/towers.py). convert() and GNSMonitor call `install`; the RowMapper it
returns is the model's (`mapper_of`).

A user with a layout of their own passes `install(model, layout_of=fn)`, fn(args, kwargs) -> Layout. Under
torch.compile the ids are not tagged (a traced forward keeps no Python tags): an Embedding then takes ids with the
examples on dim 0 as theirs and one row of ids for all as a table, and refuses N ids at N == T, which could be
either (layout.untold_ids); `RowMapper.tags_ids = False` does the same eagerly.
"""

import torch

from nanogns.core import layout, towers
from nanogns.core.ids import tagged_inputs, untagged
from nanogns.core.inputs import layout_of_inputs
from nanogns.core.layout import Pass
from nanogns.core.mapper import RowMapper
from nanogns.core.module_state import state_of
from nanogns.core.rowmaps import SEQUENCE_FIRST, WINDOWS, Tower

# layers (by class name) that split each example into windows of rows, stacked example after example on dim 0
# (transformers' Swin blocks: window_partition of (N, H, W, C) into (N * windows, ws, ws, C)), and join them back
WINDOWED = ("SwinLayer", "Swinv2Layer")


def install(model, layout_of=layout_of_inputs, mapper=None):
    """Set the Layout that `model`'s layers read from every forward of `model` (idempotent); returns the model's
    RowMapper.

    Args:
        layout_of: layout_of(args, kwargs) -> Layout, or None for a forward whose layers then read dim 0.
        mapper: a RowMapper to share (the children of a LightningModule, whose own forward is not called,
            note their refusals where the monitor of the whole module reads them).
    """
    state = state_of(model)
    if state.row_mapper is not None:
        return state.row_mapper
    mapper = mapper if mapper is not None else RowMapper(layout_of)
    mapper.model = mapper.model or model
    read = (lambda args, kwargs: layout_of_inputs(args, kwargs, model)) if layout_of is layout_of_inputs else layout_of

    def enter(module, args, kwargs):
        if not torch.compiler.is_compiling() and not mapper.step_started and mapper.step_watchers:
            mapper.start_step(module, args, kwargs)  # the monitor follows the model, before its layers run
            mapper.step_started = torch.is_grad_enabled()  # (an evaluation's forward does not start the step)
        found = read(args, kwargs)
        recompute = layout.in_backward()  # activation checkpointing running the whole model again: no new uses
        tagged = None
        if found is not None and mapper.tags_ids and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            tagged = tagged_inputs(args, kwargs)  # the examples' ids, tagged for the forward's layers
        inputs = tagged[1] if tagged is not None else kwargs
        this = Pass(found, mapper, torch.is_grad_enabled() and not recompute, tagged is not None, inputs)
        mapper.forwards += 1
        remembered = found is not None and this.counting  # the Pass a backward reads once this forward has ended
        if remembered:
            # the bookkeeping of uses runs eagerly only: a compiled backward sums no uses (the monitor then drops such
            # a tensor with its reason), and reading the last forward here would make Dynamo guard on it
            if not torch.compiler.is_compiling():
                earlier = mapper.last_pass  # a forward with tensors used several times whose backward has not begun:
                if earlier is not None and not earlier.backward_seen and any(n > 1 for n in earlier.uses.values()):
                    this.interleaved = True  # their uses could not be told apart from this forward's (uses.py)
                mapper.finish()  # the previous forward's backward is over: what its uses left pending is recorded
            mapper.last_pass = this
        layout.enter(this, remembered)
        return tagged

    mapper.handles += (
        model.register_forward_pre_hook(enter, with_kwargs=True),
        model.register_forward_hook(layout.leave, with_kwargs=True, always_call=True),
    )
    for module in model.modules():
        if type(module).__name__.endswith(WINDOWED):
            scope = _scope_hooks(lambda module, args, kwargs: WINDOWS)
        elif module is not model and _sequence_first(module):
            scope = _scope_hooks(lambda module, args, kwargs: SEQUENCE_FIRST)
        else:
            continue
        mapper.handles += (
            module.register_forward_pre_hook(scope[0], with_kwargs=True),
            module.register_forward_hook(scope[1], always_call=True),
        )
    for module, name, config in towers.tower_modules(model):
        scope = _scope_hooks(_tower_scope(name, config))
        mapper.handles += (
            module.register_forward_pre_hook(scope[0], with_kwargs=True),
            module.register_forward_hook(scope[1], always_call=True),
        )
    state.row_mapper = mapper
    return mapper


def _sequence_first(module):
    """True for a module whose rows are (T, N): batch_first=False, or torch's Transformer layers (which keep theirs
    on their attention) around a sequence-first attention."""
    if getattr(module, "batch_first", None) is False:
        return True
    attention = getattr(module, "self_attn", None)
    return isinstance(module, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)) and (
        getattr(attention, "batch_first", None) is False
    )


def _scope_hooks(scope_of):
    """(pre-hook, hook) entering and leaving the scope scope_of(module, args, kwargs) gives, around a module's
    forward (in backward too: a recompute by activation checkpointing)."""

    def entered(module, args, kwargs):
        found = layout.current_pass()
        if found is not None:
            found.scopes.append(scope_of(module, args, kwargs))

    def left(module, args, output):
        found = layout.current_pass()
        if found is not None and found.scopes:
            found.scopes.pop()

    return entered, left


def _tower_scope(name, config):
    def scope_of(module, args, kwargs):
        found = layout.current_pass()
        examples = found.layout.examples if found.layout is not None else 0
        maps, reason = towers.example_maps(config, untagged(args), untagged(kwargs), untagged(found.inputs))
        return Tower(name, examples, maps, reason)

    return scope_of


def mapper_of(model):
    """The RowMapper `install` gave `model`, or None."""
    return state_of(model).row_mapper
