"""
The pass: the forward running now, and what every layer asks of it.

`install(model)` (convert() and GNSMonitor call it) registers the model's root hooks: at each forward the pre-hook
reads the arguments (core/inputs.py's layout_of_inputs: `input_ids`, `inputs_embeds`, `pixel_values`, ... or the
first tensor), tags the ids (core/ids.py) and `enter`s a Pass: its Layout (core/rowmaps.py: which example each row
is), the model's RowMapper (core/mapper.py: where refusals are kept), the uses of each recorded tensor, the scopes
layers run in (core/scopes.py); the forward hook `leave`s it. Layers ask the functions below, never the passes'
owner directly:

    rows_for(shape, module=...)   the Rows of an input of that shape, or why they cannot be mapped
    items_of(dim0)                the Items on dim 0 of the examples' data (conv, tables, replays)
    note_uses(buffers)            a use of these buffers' tensors by the forward (core/uses.py sums repeated uses)
    note_refusal(reason, buffers) why these buffers' step is refused, for the monitor's error
    looks_up_a_table(ids)         ids the forward did not compute from its examples: a table's (core/shared.py)
    current_pass(), current()     the Pass (or its Layout) layers record into now; backward_pass() in a backward

During a backward pass the last forward's Pass stays current, so layers recomputed by activation checkpointing read
the same map. Outside an installed model's forward (a bare layer called in a test) dim 0 is the example; tests and
benchmarks that run bare layers as a model's forward use `running(Layout(...))`.

A user with a layout of their own passes `install(model, layout_of=fn)`, fn(args, kwargs) -> Layout. Under
torch.compile the ids are not tagged (a traced forward keeps no Python tags): an Embedding then takes ids with the
examples on dim 0 as theirs and one row of ids for all as a table, and refuses N ids at N == T, which could be
either (untold_ids); `RowMapper.tags_ids = False` does the same eagerly.

Where the passes live: one Passes object per process (PASSES), as torch keeps its autocast state: the passes of the
root forwards running now, innermost last, the last one's (a weak reference, so a model no longer used is freed),
the collectors of refusals outside any model (`collecting`, convert's probes), and the depth of per-example replays
(`replay`, conversion/replay.py).
"""

import contextlib
import weakref
from typing import Callable, Optional

import torch

from nanogns.core import scopes
from nanogns.core.ids import ExampleIds, MadeIds, is_made, tagged_inputs
from nanogns.core.inputs import grouped, layout_of_inputs  # noqa: F401 (grouped: documented here)
from nanogns.core.mapper import RowMapper
from nanogns.core.module_state import state_of
from nanogns.core.rowmaps import SEQUENCE_FIRST, WINDOWS, Layout, Rows, ragged  # noqa: F401 (ragged: documented here)


class Pass:
    """One forward of an installed model, and the backward that follows it: its Layout, the model's RowMapper,
    how many times the forward used each recorded tensor (by its buffer's address; `counting` is False for a
    recompute by activation checkpointing, which is no use), and the per-example gradients that tensors used more
    than once gather until their last use's backward (uses.py)."""

    def __init__(self, layout, mapper, counting, tagged=False, inputs=None):
        self.layout, self.mapper, self.counting = layout, mapper, counting
        self.tagged = tagged  # the root's ids carry ExampleIds: ids without the tag are a table's
        self.inputs = inputs or {}  # the root's keyword arguments (a vision tower's scope reads its input_ids)
        self.uses = {}  # {buffer's data_ptr: uses in this forward}
        self.pending = {}  # {key: what uses.py gathers for a tensor used more than once}
        self.groups = {}  # {buffer's data_ptr: SharedTensor}
        self.scopes = []  # where layers run now, innermost last: WINDOWS, SEQUENCE_FIRST, a Tower
        self.rows = {}  # {(input shape, scope): its Rows, or why none}: the Layout's answer, once per forward
        self.module_scopes = {}  # {id(layer): the scope it ran in}, for a recompute in backward (rows_for)
        self.backward_seen = False  # a layer's backward asked about this pass's uses (uses.py)
        self.interleaved = False  # it began before the backward of an earlier forward with tensors used twice
        self.examples_moved = False  # its ids or data were seen with their examples moved off dim 0 (a transpose)
        self.ids_moved = False  # its ids were (an autograd history then starts at data whose examples are not dim 0)
        self.sequence_first_ran = False  # a sequence-first module (batch_first=False) ran in it (core/scopes.py)
        self.windows = []  # [[module, its MadeHere or None once closed], ...] open now, innermost last (core/ids.py)
        self.root_data = ()  # weak references to the root's floating-point arguments, in a forward with no ids
        if counting:
            for shared in mapper.shared:
                for address in shared.addresses():
                    self.groups[address] = shared

    def note_uses(self, buffers):
        if not self.counting:
            return
        for buffer in buffers:
            if buffer is not None:
                address = buffer.data_ptr()
                self.uses[address] = self.uses.get(address, 0) + 1

    def finish(self):
        """Record every tensor whose uses are still pending (a use whose backward never came adds nothing)."""
        pending, self.pending = self.pending, {}
        for gathered in pending.values():
            gathered.finish()


# -----------------------------------------------------------------------------
# a model's forwards, each starting a Pass


def install(
    model: torch.nn.Module,
    layout_of: Callable[[tuple, dict], Optional[Layout]] = layout_of_inputs,
    mapper: Optional[RowMapper] = None,
) -> RowMapper:
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

    def start(module, args, kwargs):
        if not torch.compiler.is_compiling() and not mapper.step_started and mapper.step_watchers:
            mapper.start_step(module, args, kwargs)  # the monitor follows the model, before its layers run
            mapper.step_started = torch.is_grad_enabled()  # (an evaluation's forward does not start the step)
        elif mapper.later_forwards_watched and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            mapper.later_forward(module, args, kwargs)
        found = read(args, kwargs)
        tagged = None
        if found is not None and mapper.tags_ids and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            tagged = tagged_inputs(args, kwargs)  # the examples' ids, tagged for the forward's layers
        this = enter(found, mapper, tagged is not None, tagged[1] if tagged is not None else kwargs)
        if tagged is None and _opens_window(this):  # no ids to tag: those made from no example's data are (ids.py)
            scopes.start_made_ids(this, model, mapper, (args, kwargs), current_pass, _opens_window)
        return tagged

    mapper.handles += (
        model.register_forward_pre_hook(start, with_kwargs=True),
        model.register_forward_hook(leave, with_kwargs=True, always_call=True),
    )
    mapper.handles += scopes.scope_handles(model, current_pass)
    state.row_mapper = mapper
    return mapper


def mapper_of(model):
    """The RowMapper `install` gave `model`, or None."""
    return state_of(model).row_mapper


# -----------------------------------------------------------------------------
# the passes of this process


class Passes:
    """The forward context of this process (PASSES): what the functions below read and the root hooks change."""

    def __init__(self):
        self.active = []  # the Passes of the root forwards running now, innermost last
        self.last = None  # a weak reference to the last root forward's Pass with gradients (backward reads it)
        self.collectors = []  # RowMappers collecting refusals outside any installed model (`collecting`)
        self.replays = 0  # > 0 while a module is replayed per example (`replay`)


PASSES = Passes()


def enter(layout, mapper, tagged, inputs):
    """Start the Pass of a root forward whose Layout is `layout` (install's pre-hook calls it) and make it the
    one layers read until `leave`; returns it. A forward with gradients (not a recompute by activation checkpointing,
    which runs in backward) is also the Pass its backward reads once the forward has ended (PASSES.last), and
    finishes what the previous one's uses left pending (core/uses.py).

    Args:
        mapper: the model's RowMapper. tagged: the root's ids carry ExampleIds. inputs: its keyword arguments.
    """
    # (in_backward's question, inline: this runs at every root forward)
    recompute = not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
    this = Pass(layout, mapper, torch.is_grad_enabled() and not recompute, tagged, inputs)
    if tagged:  # (ids moved by an earlier forward say nothing of this one's: see ExampleIds)
        ExampleIds._moved_any = False
    mapper.forwards += 1
    if this.counting:
        mapper.layouts.append(layout)
    if layout is not None and this.counting:
        # the bookkeeping of uses runs eagerly only: a compiled backward sums no uses (the monitor then drops such a
        # tensor with its reason), and reading the last forward here would make Dynamo guard on it
        if not torch.compiler.is_compiling():
            earlier = mapper.last_pass  # a forward with tensors used several times whose backward has not begun:
            if earlier is not None and not earlier.backward_seen and any(n > 1 for n in earlier.uses.values()):
                this.interleaved = True  # their uses could not be told apart from this forward's (uses.py)
            mapper.finish()  # the previous forward's backward is over: what its uses left pending is recorded
        mapper.last_pass = this
        PASSES.last = weakref.ref(this)
    PASSES.active.append(this)
    return this


def leave(module, args, kwargs, output):
    """The root forward's hook (install): its Pass is no longer the one running (it may stay the last)."""
    this = PASSES.active.pop()
    if this.windows:  # (the root's own, and any a module's exception left open)
        scopes.close_windows(this.windows)


def _opens_window(found):
    """True when a module calling an Embedding opens a window (core/ids.py's MadeHere) in the forward of Pass `found`:
    one that tagged no ids and has a Layout, with gradients, eagerly (a traced forward keeps no tags), not in a
    module's replay (whose layers compute plainly)."""
    return (
        not found.tagged
        and found.layout is not None
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and PASSES.replays == 0
    )


@contextlib.contextmanager
def running(layout, mapper=None, counting=False):
    """Run the block as inside a root forward whose Layout is `layout` (tests and benchmarks of bare layers);
    yields the Pass."""
    this = Pass(layout, mapper if mapper is not None else RowMapper(), counting)
    PASSES.active.append(this)
    try:
        yield this
    finally:
        PASSES.active.remove(this)


def in_backward():
    """True while autograd's engine runs a backward pass (a recompute by activation checkpointing runs in one)."""
    # Dynamo cannot trace the graph-task query; a traced forward outside any root forward is no recompute
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def current_pass():
    """The Pass layers record into now: the innermost running root forward's, or during a backward pass (layers
    recomputed by activation checkpointing, backward functions) the last root forward's; None outside both."""
    if PASSES.active:
        return PASSES.active[-1]
    if PASSES.last is not None and in_backward():
        return PASSES.last()
    return None


def backward_pass():
    """current_pass() for a layer's backward function, which runs in a backward pass (autograd's engine) by
    construction: the question asked of the engine is spared (this runs in every layer's backward)."""
    if PASSES.active:
        return PASSES.active[-1]
    return PASSES.last() if PASSES.last is not None else None


def current():
    """The Layout layers read now: the innermost running root forward's, or during a backward pass (layers
    recomputed by activation checkpointing) the last root forward's; None outside both."""
    found = current_pass()
    return found.layout if found is not None else None


def note_uses(buffers):
    """Count a use of each of these buffers' tensors by the forward running now (not by a recompute in backward,
    nor outside an installed model's forward; not under torch.compile, which traces no such bookkeeping)."""
    if PASSES.active and not torch.compiler.is_compiling():
        PASSES.active[-1].note_uses(buffers)


def note_refusal(reason, buffers):
    """Keep why these buffers' step is refused, with the RowMapper of the forward running now (or, in backward,
    of the last one; or the innermost `collecting()`), for the monitor's error. Outside all of them the count
    of NaN still refuses the step; only the reason is not kept."""
    found = current_pass()
    if found is not None:
        mapper = found.mapper
    elif PASSES.collectors:
        mapper = PASSES.collectors[-1]
    else:
        return
    mapper.note_refusal(reason, buffers)


@contextlib.contextmanager
def collecting():
    """Collect the refusals of layers run outside any installed model (a probe of one module), in a RowMapper."""
    mapper = RowMapper()
    PASSES.collectors.append(mapper)
    try:
        yield mapper
    finally:
        PASSES.collectors.remove(mapper)


def rows_for(shape, batch_first=False, module=None, compiling=None):
    """Rows of an input of `shape` under the current layout (dim 0 when none is set), or why it cannot be mapped.
    batch_first: the layer has put its input's examples on dim 0 itself (nn.MultiheadAttention with
    batch_first=False transposes its (T, N) input): no sequence-first scope applies. module: the layer asking;
    the scope it ran in during the forward is kept, so that a recompute in backward (activation checkpointing of
    one block, whose recompute never enters the scope's module: a vision tower's, a sequence-first one) maps its
    rows as the forward did. compiling: torch.compiler.is_compiling(), where the caller has asked it already."""
    found = current_pass()
    if found is None or found.layout is None:
        return Rows("dim0", shape[0] if len(shape) > 1 else 1)
    scope = found.scopes[-1] if found.scopes else None
    if module is not None:
        if PASSES.active:  # the forward (a recompute runs after it, in backward, with no root forward running)
            if scope is not None:
                found.module_scopes[id(module)] = scope
        elif scope is None:
            scope = found.module_scopes.get(id(module))
    if batch_first and scope is SEQUENCE_FIRST:
        scope = None
    if torch.compiler.is_compiling() if compiling is None else compiling:  # (a traced forward's shapes are symbolic:
        # a dict of them, a guard each)
        return found.layout.rows_for(shape, scope)
    key = (shape if type(shape) is torch.Size else tuple(shape), scope)  # (the layers of a model meet few shapes)
    rows = found.rows.get(key)
    if rows is None:
        rows = found.rows[key] = found.layout.rows_for(shape, scope)
    return rows


def items_of(dim0):
    """Items when a tensor whose dim 0 has `dim0` rows holds the examples' data in the running forward (the
    examples, their choices or channels, a tower's images...), else None."""
    found = current_pass()
    if found is None or found.layout is None:
        return None
    return found.layout.items_of(dim0, found.scopes[-1] if found.scopes else None)


def looks_up_a_table(ids):
    """True when an Embedding looking up `ids` in the running forward looks up a table the examples share: ids the
    forward did not compute from its example inputs (untagged: positions from torch.arange, relative-position
    buckets, a buffer's ids), whatever their sizes; in a forward with no ids to tag, those it made from no example's
    data (core/ids.py's MadeIds). Where no forward tags its ids (a bare layer, a user's layout_of, torch.compile),
    and for other ids there, False: rows_for decides ((1, ...) ids are a table)."""
    found = current_pass()
    if found is None or found.layout is None:
        return False
    if found.windows:  # the caller's ids are made: the innermost window still open closes (core/scopes.py)
        scopes.close_innermost(found.windows)
    if found.tagged:
        return not isinstance(ids, ExampleIds)
    return type(ids) is MadeIds and is_made(ids)


def untold_ids(shape):
    """Why an Embedding looking up ids of `shape` (..., 1) cannot be mapped where no forward tags its ids
    (torch.compile, a user's layout_of): one id per example and a (T,) table of positions broadcast over the batch
    have the same sizes when N == T, and without the tag nothing tells them apart; None otherwise."""
    found = current_pass()
    if found is None or found.tagged or found.layout is None or len(shape) != 2:
        return None
    N = found.layout.examples
    if shape[0] != N or not any(N == T for T in found.layout.lengths):
        return None
    return (
        f"its ids are {N} rows and the forward has {N} examples of {N} positions, and no tag says where the ids come "
        "from (under torch.compile the examples' ids are not tagged): pass positions expanded to (B, T), or use a "
        "batch size other than the sequence length"
    )


def replaying():
    """True while a module's forward is replayed per example (replay.py): layers under it compute plainly."""
    return PASSES.replays > 0


@contextlib.contextmanager
def replay():
    """Mark what runs inside as a module's forward replayed per example (in its backward, usually), in a model's
    forward or outside any (a bare module): a replay's own backward then starts no replay of its own."""
    PASSES.replays += 1
    try:
        yield
    finally:
        PASSES.replays -= 1


def in_windows():
    """True while a layer known to split each example into windows runs (WINDOWED)."""
    found = current_pass()
    return found is not None and WINDOWS in found.scopes


def clear():
    """Forget the running and the last passes (tests; a new model)."""
    PASSES.active.clear()
    PASSES.last = None
