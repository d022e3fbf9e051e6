"""
Which example each row of a layer's input belongs to.

A layer's input has shape (..., D); its rows are the vectors along the last dim.
Per-example norms need, for every row, the example (one sequence, one image)
whose loss it serves. The rule is not "dim 0 is the example" but a map set once
per forward from what the model was called with, and read by every layer:

  root input             the forward's examples            a layer input's rows
  (N, T) token ids       N examples of T positions         (N, ...) dim 0 is the example
                                                           (N*T,)   flattened: row r is example r // T
  (1, R) packed ids,     N sequences, position_ids         (1, R) or (R,): each row's sequence
  position_ids restart   restarting at 0 (or cu_seq_lens)
  (N, ...) any tensor    N examples                        (N, ...) dim 0 is the example
                                                           (T, N)   sequence-first: dim 1 is (T a length
                                                                    of the inputs, T != N)

`install(model)` registers hooks on the model (convert() and GNSMonitor call
it) that read the forward's arguments (`input_ids`, `inputs_embeds`,
`pixel_values`, ... or the first tensor) and set the current Layout for the
duration of the forward; layers ask `rows_for(shape)` in their forward. During
a backward pass, the last forward's Layout stays current, so layers recomputed
by activation checkpointing read the same map. Outside an installed model's
forward (a bare layer called in a test) dim 0 is the example.

A layer input that fits none of these (a (1, T) table broadcast over the batch,
a sequence-first (T, N, D) tensor, rows of no known length) cannot be mapped:
`rows_for` returns the reason, and the layer records it so that the monitor
refuses the step with an error naming the layer (never a number). A user with a
layout of their own passes `install(model, layout_of=fn)`, fn(args, kwargs) ->
Layout.
"""

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

BUFFER_SUFFIX = "_pe_sqnorm"  # buffers.py's (which imports this module)
# layers (by class name) that split each example into windows of rows, stacked example after example on dim 0
# (transformers' Swin blocks: window_partition of (N, H, W, C) into (N * windows, ws, ws, C)), and join them back
WINDOWED = ("SwinLayer", "Swinv2Layer")
# keyword arguments that hold the examples, most specific first (transformers' names); else the first tensor
EXAMPLE_ARGUMENTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "idx")
_HOOK_ATTRIBUTE = "_pe_layout_hook"


@dataclass(frozen=True)
class Rows:
    """How one input's rows map to examples.

    kind: 'dim0'     (N, ...): dim 0 is the example, the other leading dims its positions;
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
class Layout:
    """The examples of one forward: N, the token lengths of its (N, T) inputs, or packed sequences.

    Attributes:
        examples: N, the number of examples (sequences) in this forward.
        lengths: the T of every (N, T) token grid among the forward's inputs (ids, masks, embeddings).
        packed: for packed sequences (one row of R tokens holding several), the Rows of those R tokens.
    """

    examples: int
    lengths: tuple | frozenset = ()
    packed: Optional[Rows] = None
    sequence_first: bool = False  # the model holds sequence-first layers (torch's batch_first=False)

    def rows_for(self, shape, windows=False):
        """Rows for an input of `shape` (..., D), or a str saying why its rows cannot be mapped. windows: inside a
        layer known to split each example into windows (WINDOWED), a dim 0 of k * N rows holds the examples'
        windows one example after the other."""
        leading = tuple(shape[:-1])
        rows = 1
        for n in leading:
            rows *= n
        if self.packed is not None:
            if leading in ((1, self.packed.example_of_row.numel()), (self.packed.example_of_row.numel(),)):
                return self.packed
            return (
                f"its input has rows {leading}, but the forward holds {self.examples} packed sequences of "
                f"{self.packed.example_of_row.numel()} tokens in all: only (1, R) or (R,) rows can be mapped"
            )
        if self.sequence_first and len(leading) == 2 and leading[0] == leading[1] == self.examples:
            return (
                f"its input has rows {leading}: {self.examples} examples of {self.examples} positions, in a model "
                "with sequence-first layers (batch_first=False), could be either way round; use "
                "batch_first=True, or a batch size other than the sequence length"
            )
        if len(leading) == 1 and leading[0] == self.examples and self.examples in self.lengths:
            return (
                f"its input has {self.examples} rows and the forward has {self.examples} examples of "
                f"{self.examples} positions: one row per example and a per-position table broadcast over the "
                "batch (e.g. position embeddings of torch.arange(T)) cannot be told apart; pass per-example "
                "rows (positions expanded to (B, T)), or use a batch size other than the sequence length"
            )
        if leading and leading[0] == self.examples:
            return Rows("dim0", self.examples)
        if len(leading) > 1 and leading[0] == 1:  # one row for the N examples: a table they share (shared.py)
            return Rows("shared", self.examples)
        if len(leading) == 1 and self.examples and rows % self.examples == 0 and rows // self.examples in self.lengths:
            return Rows("flat", self.examples, positions=rows // self.examples)
        if len(leading) == 2 and leading[1] == self.examples and leading[0] in self.lengths:
            return Rows("seqfirst", self.examples, positions=leading[0])
        if windows and leading and self.examples and leading[0] % self.examples == 0:
            return Rows("flat", self.examples, positions=rows // self.examples)  # example-major windows
        lengths = ", ".join(f"({self.examples}, {T})" for T in sorted(self.lengths))
        return (
            f"its input has rows {leading or '()'}: dim 0 is not the forward's {self.examples} examples"
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

    def __init__(self, layout, mapper, counting):
        self.layout, self.mapper, self.counting = layout, mapper, counting
        self.uses = {}  # {buffer's data_ptr: uses in this forward}
        self.pending = {}  # {key: what uses.py gathers for a tensor used more than once}
        self.groups = {}  # {buffer's data_ptr: SharedTensor}
        self.windows = 0  # > 0 while a layer splitting its examples into windows runs (WINDOWED)
        self.replaying = 0  # > 0 while a module's forward is replayed per example (replay.py): layers plain
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


def rows_for(shape):
    """Rows of an input of `shape` under the current layout (dim 0 when none is set), or why it cannot be mapped."""
    found = current_pass()
    if found is None or found.layout is None:
        return Rows("dim0", shape[0] if len(shape) > 1 else 1)
    return found.layout.rows_for(shape, windows=found.windows > 0)


def replaying():
    """True while a module's forward is replayed per example (replay.py): layers under it compute plainly."""
    found = current_pass()
    return found is not None and found.replaying > 0


@contextlib.contextmanager
def replay():
    """Mark the current pass as replaying a module's forward per example (its backward's, usually)."""
    found = current_pass()
    if found is not None:
        found.replaying += 1
    try:
        yield
    finally:
        if found is not None:
            found.replaying -= 1


def in_windows():
    """True while a layer known to split each example into windows runs (WINDOWED)."""
    found = current_pass()
    return found is not None and found.windows > 0


def _tensors(args, kwargs):
    yield from ((None, a) for a in args if isinstance(a, torch.Tensor))
    yield from ((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))


def layout_of_inputs(args, kwargs):
    """The Layout of a forward called with (args, kwargs), or None when it has no tensor argument."""
    named = [kwargs[k] for k in EXAMPLE_ARGUMENTS if isinstance(kwargs.get(k), torch.Tensor)]
    tensors = [t for _, t in _tensors(args, kwargs)]
    main = named[0] if named else (tensors[0] if tensors else None)
    if main is None or main.dim() == 0:
        return None
    N = main.shape[0]
    lengths = ()  # the distinct T of ids, masks, labels, (N, T, D) embeddings: compared, never hashed (a hash would
    for t in tensors:  # make torch.compile specialise on each T, and recompile this hook for every new length)
        if t.dim() >= 2 and t.shape[0] == N and (not t.is_floating_point() or t.dim() == 3):
            if not any(t.shape[1] == T for T in lengths):
                lengths += (t.shape[1],)
    packed = _packed_rows(N, kwargs)
    if packed is not None:
        return Layout(packed.examples, lengths, packed)
    return Layout(N, lengths)


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
    sequence_first = any(getattr(m, "batch_first", True) is False for m in model.modules())

    def enter(module, args, kwargs):
        global _last
        found = layout_of(args, kwargs)
        if found is not None and sequence_first:
            found = dataclasses.replace(found, sequence_first=True)
        recompute = _in_backward()  # activation checkpointing running the whole model again: no new uses
        this = Pass(found, mapper, counting=torch.is_grad_enabled() and not recompute)
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

    def leave(module, args, kwargs, output):
        _active.pop()

    mapper.handles += (
        model.register_forward_pre_hook(enter, with_kwargs=True),
        model.register_forward_hook(leave, with_kwargs=True, always_call=True),
    )
    for module in model.modules():
        if type(module).__name__.endswith(WINDOWED):
            mapper.handles += (
                module.register_forward_pre_hook(_windows_entered),
                module.register_forward_hook(_windows_left, always_call=True),
            )
    model.__dict__[_HOOK_ATTRIBUTE] = mapper  # not a submodule or buffer: state_dict and copies stay clean
    return mapper


def _windows_entered(module, args):
    found = current_pass()  # in backward too: a recompute by activation checkpointing
    if found is not None:
        found.windows += 1


def _windows_left(module, args, output):
    found = current_pass()
    if found is not None:
        found.windows = max(0, found.windows - 1)


def mapper_of(model):
    """The RowMapper `install` gave `model`, or None."""
    return model.__dict__.get(_HOOK_ATTRIBUTE)


def clear():
    """Forget the last layout (tests; a new model)."""
    global _last
    _active.clear()
    _last = None
