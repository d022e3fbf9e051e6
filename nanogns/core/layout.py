"""
Which example each row of a layer's input belongs to.

A layer's input has shape (..., D); its rows are the vectors along the last dim.
Per-example norms need, for every row, the example (one sequence, one image, one
question with its choices) whose loss it serves. Which example that is, is learned
from how the rows were made from the model's inputs, never from sizes that happen
to match:

  root input               the forward's examples          a layer input's rows
  (N, T) token ids         N examples of T positions       (N, ...) dim 0 is the example
                                                           (N*T,)   flattened: row r is example r // T
  (N, C, T) ids            N questions of C choices        (N*C, ...) each question's C rows (multiple
                           (multiple choice)               choice; a channel-independent model's channels)
  (1, R) packed ids,       N sequences, position_ids       (1, R) or (R,): each row's sequence
  position_ids restart     restarting at 0 (or cu_seq_lens)
  (N, ...) any tensor      N examples                      (N, ...) dim 0 is the example

Three things say which rows are which, rather than their sizes:

  a tag that follows the ids   the integer tensors the model computes from its example inputs
                               (input_ids, token types...) carry ExampleIds, a tensor subclass that
                               follows every op on them: an Embedding looking up tagged ids looks up
                               the examples' rows; ids without the tag (positions from torch.arange,
                               relative-position buckets, a buffer) are a table the examples share
                               (core/shared.py), whatever their sizes. Floating-point tensors are the
                               examples' data unless they are such a table (shared.SharedRows).
  scopes                       a module that works on other rows than the examples': inside a
                               sequence-first module (batch_first=False: (T, N) rows), a module that
                               splits each example into windows (WINDOWED), a vision tower whose rows
                               are images or their patches, each belonging to the example whose image
                               tokens it fills (core/towers.py: counted from input_ids, and the image
                               grids of Qwen2-VL), whatever the number of images or patches.
  torch's broadcasting         where a table meets the examples' data (shared.py), the table's dim
                               aligned with the data's example dim tells whether each example gets
                               all of it (size 1, or no such dim) or its own slice (size N).

`install(model)` registers the hooks that give every forward of the model a Layout
(convert() and GNSMonitor call it): the root's forward pre-hook reads its arguments
(`input_ids`, `inputs_embeds`, `pixel_values`, ... or the first tensor) and tags its
ids; layers ask `rows_for(shape)` in their forward. During a backward pass the last
forward's Layout stays current, so layers recomputed by activation checkpointing
read the same map. Outside an installed model's forward (a bare layer called in a
test) dim 0 is the example.

A layer input that fits none of these (a (1, T) data row broadcast over the batch,
rows of no known length) cannot be mapped: `rows_for` returns the reason, and the
layer records it so that the monitor refuses the step with an error naming the
layer (never a number). A user with a layout of their own passes `install(model,
layout_of=fn)`, fn(args, kwargs) -> Layout. Under torch.compile the ids are not
tagged (a traced forward keeps no Python tags): an Embedding then takes ids with
the examples on dim 0 as theirs and one row of ids for all as a table, and refuses
N ids at N == T, which could be either (untold_ids).
"""

import contextlib
import re
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from nanogns.core import towers, trees

BUFFER_SUFFIX = "_pe_sqnorm"  # buffers.py's (which imports this module)
# layers (by class name) that split each example into windows of rows, stacked example after example on dim 0
# (transformers' Swin blocks: window_partition of (N, H, W, C) into (N * windows, ws, ws, C)), and join them back
WINDOWED = ("SwinLayer", "Swinv2Layer")
# keyword arguments that hold the examples, most specific first (transformers' names); else the first tensor
EXAMPLE_ARGUMENTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "idx")
# arguments that describe shapes (SigLIP2's spatial_shapes (N, 2), Qwen2-VL's image_grid_thw): no token grid
_SHAPE_ARGUMENT = re.compile(r"(shapes|sizes|_thw|_hw)$")
# models that fold each series' channels into their batch (channel independence): (N, L, C) -> N*C rows
CHANNEL_INDEPENDENT = ("patchtst", "patchtsmixer")
_HOOK_ATTRIBUTE = "_pe_layout_hook"
# scopes (Pass.scopes): where a layer's rows are not the examples' batch-first rows
WINDOWS, SEQUENCE_FIRST = "windows", "sequence first"


@dataclass(frozen=True)
class Rows:
    """How one input's rows map to examples.

    kind: 'dim0'     (N, ...): dim 0 is the example, the other leading dims its positions (or N*k, ...: each
                     example's k rows of the model's inner batch one after the other, its choices or channels);
          'flat'     (N*T,): row r belongs to example r // T (flattened from (N, T));
          'seqfirst' (T, N): dim 1 is the example (torch's sequence-first layers, batch_first=False);
          'ragged'   rows in any order, `example_of_row` (R,) giving each row's example;
          'shared'   (1, ...): one row for all N examples, a table they share (core/shared.py).
    """

    kind: str
    examples: int
    positions: int = 0  # 'flat': T
    example_of_row: Optional[torch.Tensor] = None  # 'ragged': (R,) int64
    longest: int = 0  # 'ragged': most rows of one example (the padded length)
    counted: bool = True  # False: these rows' norms add to a buffer whose examples are counted once elsewhere

    def per_example(self, t):
        """t (rows..., D) as (N, P, D): example i's rows in t[i], zero rows padding a ragged layout."""
        D = t.shape[-1]
        if self.kind == "dim0":
            if t.dim() == 3 and t.shape[0] == self.examples:  # (N, T, D) already: no view to dispatch
                return t
            return t.reshape(self.examples, -1, D)
        if self.kind == "flat":
            return t.reshape(self.examples, self.positions, D)
        if self.kind == "seqfirst":
            return t.reshape(self.positions, self.examples, D).transpose(0, 1)
        flat = t.reshape(-1, D)
        out = flat.new_zeros(self.examples, self.longest, D)
        out[self.example_of_row, _position_in_example(self.example_of_row, self.examples)] = flat
        return out

    def example_ids(self, rows, device):
        """(rows,) the example of each of `rows` rows, in row order."""
        if self.kind == "ragged":
            return self.example_of_row.to(device)
        if self.kind == "seqfirst":
            return torch.arange(rows, device=device) % self.examples
        per = rows // self.examples if self.kind == "dim0" else self.positions
        return torch.arange(rows, device=device) // per


def _position_in_example(example_of_row, examples):
    """(R,) index of each row among its example's rows, in row order."""
    R = example_of_row.numel()
    order = torch.argsort(example_of_row, stable=True)
    counts = torch.bincount(example_of_row, minlength=examples)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty(R, dtype=torch.long, device=example_of_row.device)
    position[order] = torch.arange(R, device=example_of_row.device) - starts[example_of_row[order]]
    return position


def ragged(example_of_row, examples, counted=True):
    """Rows of `examples` examples in any order (example_of_row (R,) int64)."""
    example_of_row = example_of_row.reshape(-1).long()
    longest = int(torch.bincount(example_of_row, minlength=examples).max()) if example_of_row.numel() else 0
    return Rows("ragged", examples, example_of_row=example_of_row, longest=longest, counted=counted)


@dataclass(frozen=True)
class Items:
    """What dim 0 of the examples' data holds: `count` items (the examples themselves, or their choices, channels,
    windows, images), each belonging to one of `examples` examples. A table the examples share meets them item by
    item (core/shared.py), a parameter broadcast over them too (intercept.py), a replayed module replays them one
    by one (replay.py); each example's gradient is then the sum of its items' (`to_examples`), squared after."""

    count: int
    examples: int
    example_of_item: Optional[torch.Tensor] = None  # None: example-major, count // examples items each

    def to_examples(self, per_item):
        """per_item (count, ...) -> (examples, ...): each example's items summed."""
        if self.example_of_item is None:
            if self.count == self.examples:
                return per_item
            return per_item.reshape(self.examples, self.count // self.examples, *per_item.shape[1:]).sum(1)
        out = per_item.new_zeros(self.examples, *per_item.shape[1:])
        return out.index_add_(0, self.example_of_item.to(per_item.device), per_item)

    def rows(self, leading):
        """Rows of an input whose leading dims are `leading`, with these items on dim 0."""
        if self.example_of_item is None:
            return Rows("dim0", self.examples)
        rows = 1
        for n in leading:
            rows *= n
        return ragged(self.example_of_item.repeat_interleave(rows // self.count), self.examples)


class Tower:
    """A scope whose rows are images (or video frames), or their patches, each belonging to one example: a vision
    tower's and its projector's (core/towers.py finds which example from the image tokens of input_ids).

    maps: {rows: (that many,) example of each}, for the counts of rows its layers see (images; Qwen2-VL's patches
    and merged patches), or None with `reason` when the examples of its images cannot be told."""

    def __init__(self, name, examples, maps=None, reason=None):
        self.name, self.examples, self.maps, self.reason = name, examples, maps or {}, reason
        self._rows = {}

    def items_of(self, dim0):
        found = self.maps.get(dim0)
        return Items(dim0, self.examples, found) if found is not None else None

    def rows_for(self, leading, rows):
        if self.reason is not None:
            return f"it runs in {self.name}, whose images cannot be told apart by example: {self.reason}"
        key = (leading[0] if leading else 1, rows)
        if key not in self._rows:
            found = self.maps.get(key[0])
            if found is None:
                if len(leading) > 1 and leading[0] == 1:
                    return Rows("shared", self.examples)
                counts = ", ".join(str(n) for n in sorted(self.maps))
                return (
                    f"its input has rows {leading or '()'} in {self.name}, whose images' rows are {counts} on "
                    "dim 0: none is its dim 0"
                )
            self._rows[key] = ragged(
                found.repeat_interleave(rows // key[0]) if rows != key[0] else found, self.examples
            )
        return self._rows[key]


@dataclass(frozen=True)
class Layout:
    """The examples of one forward: N, the token lengths of its (N, T) inputs, or packed sequences.

    Attributes:
        examples: N, the number of examples (sequences) in this forward.
        lengths: the T of every (N, T) token grid among the forward's inputs (ids, masks, embeddings).
        packed: for packed sequences (one row of R tokens holding several), the Rows of those R tokens.
        groups: k for an inner batch of N*k rows, each example's k one after the other (the C choices of a multiple
            choice question, the C channels of a channel-independent time series).
    """

    examples: int
    lengths: tuple | frozenset = ()
    packed: Optional[Rows] = None
    groups: tuple = ()

    def items_of(self, dim0, scope=None):
        """Items when dim 0 of size `dim0` holds the examples' data here (None: it does not)."""
        if scope is not None and isinstance(scope, Tower):
            return scope.items_of(dim0)
        N = self.examples
        if self.packed is not None or not N:
            return None
        if dim0 == N:
            return Items(N, N)
        if (scope is WINDOWS and dim0 % N == 0) or any(dim0 == N * k for k in self.groups):
            return Items(dim0, N)
        return None

    def rows_for(self, shape, scope=None):
        """Rows for an input of `shape` (..., D), or a str saying why its rows cannot be mapped. scope: where the
        layer runs (Pass.scopes): WINDOWS, SEQUENCE_FIRST, a Tower, or None (the examples' batch-first rows)."""
        leading = tuple(shape[:-1])
        rows = 1
        for n in leading:
            rows *= n
        N = self.examples
        if self.packed is not None:
            if leading in ((1, self.packed.example_of_row.numel()), (self.packed.example_of_row.numel(),)):
                return self.packed
            return (
                f"its input has rows {leading}, but the forward holds {N} packed sequences of "
                f"{self.packed.example_of_row.numel()} tokens in all: only (1, R) or (R,) rows can be mapped"
            )
        if isinstance(scope, Tower):
            return scope.rows_for(leading, rows)
        if scope is SEQUENCE_FIRST and len(leading) == 2 and leading[1] == N:  # (T, N): inside batch_first=False
            return Rows("seqfirst", N, positions=leading[0])
        if leading and (leading[0] == N or any(leading[0] == N * k for k in self.groups)):
            return Rows("dim0", N)  # (the examples, or their k rows each, one example after the other)
        if scope is WINDOWS and leading and N and leading[0] % N == 0:
            return Rows("flat", N, positions=rows // N)  # example-major windows
        if len(leading) > 1 and leading[0] == 1:  # one row for the N examples: a table they share (shared.py)
            return Rows("shared", N)
        if len(leading) == 1 and N and rows % N == 0 and rows // N in self.lengths:
            return Rows("flat", N, positions=rows // N)
        if len(leading) == 2 and leading[1] == N and leading[0] in self.lengths:
            return Rows("seqfirst", N, positions=leading[0])
        lengths = ", ".join(f"({N}, {T})" for T in sorted(self.lengths))
        return (
            f"its input has rows {leading or '()'}: dim 0 is not the forward's {N} examples"
            + (f", nor are they the {lengths} positions flattened" if lengths else "")
            + " (a table broadcast over the batch, or a sequence-first layout, cannot be told apart per example)"
        )


class RowMapper:
    """What `install(model)` sets up for a model: the hooks that give each of its forwards a Layout, and the
    reasons its layers gave for the rows they could not map this step (a buffer's count is then NaN, and the
    monitor's error says why). The monitor clears the reasons with the buffers after each step.

    Reasons are kept by the address range of the buffer they concern: a bank's buffer holds its slices' views.
    `shared` lists the tensors whose uses are summed together although several modules record them (a matrix
    tied between an embedding and a head): see core/uses.py."""

    def __init__(self, layout_of=None):
        self.layout_of = layout_of
        self.handles = ()
        self.refusals = {}  # {buffer's data_ptr: reason}
        self.mixing = {}  # {layer: why} of this step's layers that mixed the examples (batchnorm.py): no number
        self.shared = []  # [SharedTensor]: tensors recorded by several modules' buffers (uses.py)
        self._model = None  # a weak reference to the model installed (its parameters' buffers: buffer_of); weak,
        # since the last forward's Pass (a module global) holds this mapper, and a distributed engine must see the
        # model freed before it destroys its process group
        self._buffers_of = {}  # {id(parameter): its buffer}
        self.last_pass = None  # the last forward with gradients (its uses are finished before the next one)
        self.forwards = 0  # root forwards since the monitor's last read (none: the layers ran outside the model's)
        self.layouts = []  # the Layouts of those forwards with gradients (what a count error says it observed)

    def note_refusal(self, reason, buffers):
        for buffer in buffers:
            if buffer is not None:
                self.refusals[buffer.data_ptr()] = reason

    def reasons(self, buffer):
        """The reasons noted for `buffer` or any view inside it."""
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        return [reason for address, reason in self.refusals.items() if start <= address < end]

    def note_mixing(self, layer, reason):
        self.mixing[layer] = reason

    def clear(self):
        self.refusals.clear()
        self.mixing.clear()
        self.forwards = 0
        self.layouts.clear()

    @property
    def model(self):
        return self._model() if self._model is not None else None

    @model.setter
    def model(self, model):
        self._model = weakref.ref(model) if model is not None else None

    def buffer_of(self, param):
        """The `<name>_pe_sqnorm` buffer recording parameter `param` on the model's modules, or None."""
        if id(param) not in self._buffers_of and self.model is not None:
            self._buffers_of = {
                id(p): module._buffers.get(name + BUFFER_SUFFIX)
                for module in self.model.modules()
                for name, p in module.named_parameters(recurse=False)
            }
        found = self._buffers_of.get(id(param))
        return found if found is not None and param.requires_grad else None

    def finish(self):
        """Record what the last forward's uses left pending (uses.py); the monitor calls it before reading a step."""
        if self.last_pass is not None:
            self.last_pass.finish()


@dataclass(frozen=True)
class SharedTensor:
    """One tensor whose per-example gradient several modules' buffers record (a tied embedding and head).

    Attributes:
        members: ((module, buffer name), ...), the first one's buffer records the sum of every use's gradient.
        pairwise: True when each member used once is measured by the members' own norms and a cross term (tied.py).
    """

    members: tuple
    pairwise: bool = False

    def addresses(self):
        return tuple(module._buffers[name].data_ptr() for module, name in self.members)

    def target(self):
        module, name = self.members[0]
        return module._buffers[name]


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


# The forward context every layer reads, per process as torch's autocast state is: the Passes of the root forwards
# running now (innermost last), the last root forward's (what activation checkpointing recomputes under in
# backward; a weak reference, so that a model no longer used is freed), and collectors of refusals outside any
# installed model (convert's probes).
_active = []
_last = None
_collectors = []
_replays = 0  # > 0 while a module is replayed per example (replay.py)


def _in_backward():
    # Dynamo cannot trace the graph-task query; a traced forward outside any root forward is no recompute
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def current_pass():
    """The Pass layers record into now: the innermost running root forward's, or during a backward pass (layers
    recomputed by activation checkpointing, backward functions) the last root forward's; None outside both."""
    if _active:
        return _active[-1]
    if _last is not None and _in_backward():
        return _last()
    return None


def backward_pass():
    """current_pass() for a layer's backward function, which runs in a backward pass (autograd's engine) by
    construction: the question asked of the engine is spared (this runs in every layer's backward)."""
    if _active:
        return _active[-1]
    return _last() if _last is not None else None


def current():
    """The Layout layers read now: the innermost running root forward's, or during a backward pass (layers
    recomputed by activation checkpointing) the last root forward's; None outside both."""
    found = current_pass()
    return found.layout if found is not None else None


def note_uses(buffers):
    """Count a use of each of these buffers' tensors by the forward running now (not by a recompute in backward,
    nor outside an installed model's forward; not under torch.compile, which traces no such bookkeeping)."""
    if _active and not torch.compiler.is_compiling():
        _active[-1].note_uses(buffers)


def note_refusal(reason, buffers):
    """Keep why these buffers' step is refused, with the RowMapper of the forward running now (or, in backward,
    of the last one; or the innermost `collecting()`), for the monitor's error. Outside all of them the count
    of NaN still refuses the step; only the reason is not kept."""
    found = current_pass()
    if found is not None:
        mapper = found.mapper
    elif _collectors:
        mapper = _collectors[-1]
    else:
        return
    mapper.note_refusal(reason, buffers)


@contextlib.contextmanager
def collecting():
    """Collect the refusals of layers run outside any installed model (a probe of one module), in a RowMapper."""
    mapper = RowMapper()
    _collectors.append(mapper)
    try:
        yield mapper
    finally:
        _collectors.remove(mapper)


def rows_for(shape, batch_first=False, module=None):
    """Rows of an input of `shape` under the current layout (dim 0 when none is set), or why it cannot be mapped.
    batch_first: the layer has put its input's examples on dim 0 itself (nn.MultiheadAttention with
    batch_first=False transposes its (T, N) input): no sequence-first scope applies. module: the layer asking;
    the scope it ran in during the forward is kept, so that a recompute in backward (activation checkpointing of
    one block, whose recompute never enters the scope's module: a vision tower's, a sequence-first one) maps its
    rows as the forward did."""
    found = current_pass()
    if found is None or found.layout is None:
        return Rows("dim0", shape[0] if len(shape) > 1 else 1)
    scope = found.scopes[-1] if found.scopes else None
    if module is not None:
        if _active:  # the forward (a recompute runs after it, in backward, with no root forward running)
            if scope is not None:
                found.module_scopes[id(module)] = scope
        elif scope is None:
            scope = found.module_scopes.get(id(module))
    if batch_first and scope is SEQUENCE_FIRST:
        scope = None
    if torch.compiler.is_compiling():  # (a traced forward's shapes are symbolic: a dict of them, a guard each)
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
    buckets, a buffer's ids), whatever their sizes. Where no forward tags its ids (a bare layer, a user's
    layout_of, torch.compile), False: rows_for decides ((1, ...) ids are a table)."""
    found = current_pass()
    return found is not None and found.tagged and found.layout is not None and not isinstance(ids, ExampleIds)


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
    return _replays > 0


@contextlib.contextmanager
def replay():
    """Mark what runs inside as a module's forward replayed per example (in its backward, usually), in a model's
    forward or outside any (a bare module): a replay's own backward then starts no replay of its own."""
    global _replays
    _replays += 1
    try:
        yield
    finally:
        _replays -= 1


def in_windows():
    """True while a layer known to split each example into windows runs (WINDOWED)."""
    found = current_pass()
    return found is not None and WINDOWS in found.scopes


def example_dim(t, count):
    """The dim of t that holds `count` examples: the only dim of that size; where several have it (Gemma 3n stacks its
    (N, T, D) states into (K, N, T, D), and K may equal N), the one t's autograd history puts the examples on
    (torch.stack, unsqueeze, repeat, expand, permute, transpose, select followed back to data with the examples on
    dim 0). None when no dim has that size; a str saying why when the history does not tell."""
    dims = [d for d, n in enumerate(t.shape) if n == count]
    if len(dims) <= 1:
        return dims[0] if dims else None
    found = _traced_example_dim(t.grad_fn, t.dim(), 0)
    if found in dims:
        return found
    return (
        f"two of its dims (shape {tuple(t.shape)}) have the forward's {count} examples and its history does not "
        "say which holds them"
    )


_SAME_DIMS = ("Clone", "ToCopy", "Alias", "Neg", "Tanh", "Sigmoid", "Add", "Sub", "Mul", "Div", "Gelu", "Silu")


def _traced_example_dim(node, ndim, depth):
    """The dim holding the examples in the output (ndim dims) of autograd node `node`, followed back through ops that
    move dims; 0 where the history gives no such op (data arrives with its examples on dim 0)."""
    if node is None or depth > 64:
        return 0
    name = type(node).__name__
    inputs = [f for f, _ in node.next_functions if f is not None]
    first = inputs[0] if inputs else None
    if name in ("StackBackward0", "UnsqueezeBackward0"):  # a new dim d: dims from d on move one up
        d = node._saved_dim % ndim
        inner = _traced_example_dim(first, ndim - 1, depth + 1)
        return inner + 1 if d <= inner else inner
    if name in ("RepeatBackward0", "ExpandBackward0"):  # new leading dims
        before = len(node._saved_self_sym_sizes)
        return _traced_example_dim(first, before, depth + 1) + ndim - before
    if name == "PermuteBackward0":
        inner = _traced_example_dim(first, ndim, depth + 1)
        return [d % ndim for d in node._saved_dims].index(inner)
    if name == "TransposeBackward0":
        d0, d1 = node._saved_dim0 % ndim, node._saved_dim1 % ndim
        inner = _traced_example_dim(first, ndim, depth + 1)
        return d1 if inner == d0 else d0 if inner == d1 else inner
    if name == "SelectBackward0":
        before = len(node._saved_self_sym_sizes)
        d, inner = node._saved_dim % before, _traced_example_dim(first, before, depth + 1)
        return inner - 1 if d < inner else inner
    if name == "AsStridedBackward0":  # a view of a contiguous base written in place (x.permute(...) += y)
        strides = node._saved_stride
        outermost = sorted(range(len(strides)), key=lambda j: -strides[j])  # the base's dims, as the view's
        inner = _traced_example_dim(first, len(strides), depth + 1)
        return outermost[inner] if inner < len(outermost) else 0
    if name == "CopySlices" or name.rstrip("0123456789").removesuffix("Backward") in _SAME_DIMS:
        return _traced_example_dim(first, ndim, depth + 1)
    return 0


# -----------------------------------------------------------------------------
# the tag that follows the examples' ids


class ExampleIds(torch.Tensor):
    """Integer tensors computed from the forward's example inputs (its ids, and everything the model computes from
    them: views, shifted or masked ids, positions counted from them): every op taking one returns its integer and
    boolean results tagged too (__torch_function__), floating-point ones plain. An Embedding looking up tagged ids
    looks up the examples' rows; one looking up untagged ids looks up a table (see the module docstring).

    Results that take only the ids' dtype, device or shape (`torch.arange(T).type_as(ids)`, `ids.new_tensor(...)`,
    `torch.ones_like(ids)`) and those indexing one example out (`ids[0]`, `ids.select(0, i)`) are not the examples'
    ids: they stay plain, so that a lookup of them is a table's, whatever the sizes (an untagged lookup is exact
    either way: core/shared.py gives each example its rows of the table as torch broadcasts them)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _NOT_FROM_THE_IDS or _takes_dtype_only(func, args) or _one_example_out(func, args, kwargs):
            return out
        return trees.map_leaves(_tag, out)


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


def _tensors(args, kwargs):
    yield from ((None, a) for a in args if isinstance(a, torch.Tensor))
    yield from ((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))


def _tagged_inputs(args, kwargs):
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


def layout_of_inputs(args, kwargs, model=None):
    """The Layout of a forward called with (args, kwargs), or None when it has no tensor argument. model: the model
    called (its config says when its batch holds each example's channels: CHANNEL_INDEPENDENT)."""
    named = [kwargs[k] for k in EXAMPLE_ARGUMENTS if isinstance(kwargs.get(k), torch.Tensor)]
    tensors = [(k, t) for k, t in _tensors(args, kwargs) if not (k and _SHAPE_ARGUMENT.search(k))]
    main = named[0] if named else (tensors[0][1] if tensors else None)
    if main is None or main.dim() == 0:
        return None
    N = main.shape[0]
    groups = ()
    choices = (main.dim() == 3 and not main.is_floating_point()) or (
        main is kwargs.get("inputs_embeds") and main.dim() == 4
    )
    if choices and main.shape[1] > 1:  # (N, C, T) ids: N questions of C choices, folded into N*C rows by the model
        groups = (main.shape[1],)
    config = getattr(model, "config", None)
    past = kwargs.get("past_values")
    if (
        getattr(config, "model_type", None) in CHANNEL_INDEPENDENT
        and isinstance(past, torch.Tensor)
        and past.dim() == 3
    ):
        groups = (past.shape[-1],)  # (N, L, C) series: each channel a row of the model's batch
    lengths = ()  # the distinct T of ids, masks, labels, (N, T, D) embeddings: compared, never hashed (a hash would
    for _, t in tensors:  # make torch.compile specialise on each T, and recompile this hook for every new length)
        grid = t.dim() >= 2 and (t.shape[0] == N and (not t.is_floating_point() or t.dim() == 3))
        if grid:
            T = t.shape[-1] if (choices and t.dim() == 3 and not t.is_floating_point()) else t.shape[1]
            for found in (T, *(k * T for k in groups)):
                if not any(found == known for known in lengths):
                    lengths += (found,)
    packed = _packed_rows(N, kwargs)
    if packed is not None:
        return Layout(packed.examples, lengths, packed)
    return Layout(N, lengths, groups=groups)


def grouped(k):
    """A layout_of for forwards whose input holds each example as k rows, one after the other ((N * k, T) ids: a
    chosen and a rejected answer, k text queries for one image): `install(model, layout_of=grouped(k))` before
    convert(model). Each example's gradient is then its k rows' together, and a step counts N examples."""

    def layout_of(args, kwargs):
        found = layout_of_inputs(args, kwargs)
        if found is None or found.packed is not None or found.examples % k:
            return found
        lengths = found.lengths + tuple(k * T for T in found.lengths if k * T not in found.lengths)
        return Layout(found.examples // k, lengths, groups=(k,))

    return layout_of


def _packed_rows(N, kwargs):
    """Rows of packed sequences: one row of R tokens whose position_ids restart at 0, or cu_seq_lens_q; else None."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if N == 1 and isinstance(cu_seq_lens, torch.Tensor) and cu_seq_lens.numel() > 2:
        lengths = torch.diff(cu_seq_lens.long())
        example_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return ragged(example_of_row, lengths.numel())
    position_ids = kwargs.get("position_ids")
    if N == 1 and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[0] == 1:
        starts = position_ids[0] == 0
        sequences = int(starts.sum())
        if sequences > 1 and bool(starts[0]):
            return ragged(torch.cumsum(starts.long(), 0) - 1, sequences)
    return None


def install(model, layout_of=layout_of_inputs, mapper=None):
    """Set the Layout that `model`'s layers read from every forward of `model` (idempotent); returns the model's
    RowMapper.

    Args:
        layout_of: layout_of(args, kwargs) -> Layout, or None for a forward whose layers then read dim 0.
        mapper: a RowMapper to share (the children of a LightningModule, whose own forward is not called,
            note their refusals where the monitor of the whole module reads them).
    """
    found = model.__dict__.get(_HOOK_ATTRIBUTE)
    if found is not None:
        return found
    mapper = mapper if mapper is not None else RowMapper(layout_of)
    mapper.model = mapper.model or model
    read = (lambda args, kwargs: layout_of_inputs(args, kwargs, model)) if layout_of is layout_of_inputs else layout_of

    def enter(module, args, kwargs):
        global _last
        found = read(args, kwargs)
        recompute = _in_backward()  # activation checkpointing running the whole model again: no new uses
        tagged = None
        if found is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            tagged = _tagged_inputs(args, kwargs)  # the examples' ids, tagged for the forward's layers
        inputs = tagged[1] if tagged is not None else kwargs
        this = Pass(found, mapper, torch.is_grad_enabled() and not recompute, tagged is not None, inputs)
        mapper.forwards += 1
        if this.counting:
            mapper.layouts.append(found)
        if found is not None and this.counting:
            # the bookkeeping of uses runs eagerly only: a compiled backward sums no uses (the monitor then drops such
            # a tensor with its reason), and reading the last forward here would make Dynamo guard on it
            if not torch.compiler.is_compiling():
                earlier = mapper.last_pass  # a forward with tensors used several times whose backward has not begun:
                if earlier is not None and not earlier.backward_seen and any(n > 1 for n in earlier.uses.values()):
                    this.interleaved = True  # their uses could not be told apart from this forward's (uses.py)
                mapper.finish()  # the previous forward's backward is over: what its uses left pending is recorded
            mapper.last_pass = this
            _last = weakref.ref(this)
        _active.append(this)
        return tagged

    def leave(module, args, kwargs, output):
        _active.pop()

    mapper.handles += (
        model.register_forward_pre_hook(enter, with_kwargs=True),
        model.register_forward_hook(leave, with_kwargs=True, always_call=True),
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
    model.__dict__[_HOOK_ATTRIBUTE] = mapper  # not a submodule or buffer: state_dict and copies stay clean
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
        found = current_pass()
        if found is not None:
            found.scopes.append(scope_of(module, args, kwargs))

    def left(module, args, output):
        found = current_pass()
        if found is not None and found.scopes:
            found.scopes.pop()

    return entered, left


def _tower_scope(name, config):
    def scope_of(module, args, kwargs):
        found = current_pass()
        examples = found.layout.examples if found.layout is not None else 0
        maps, reason = towers.example_maps(config, untagged(args), untagged(kwargs), untagged(found.inputs))
        return Tower(name, examples, maps, reason)

    return scope_of


def mapper_of(model):
    """The RowMapper `install` gave `model`, or None."""
    return model.__dict__.get(_HOOK_ATTRIBUTE)


def clear():
    """Forget the last layout (tests; a new model)."""
    global _last
    _active.clear()
    _last = None
