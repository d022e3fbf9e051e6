"""
Which example each row of a layer's input belongs to: the values a forward's layers read (Rows, Items, Tower,
Layout). Nothing here keeps state; core/layout.py holds the forward running now, core/inputs.py makes its Layout.

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

Four things say which rows are which, rather than their sizes:

  a tag that follows the ids   the integer tensors the model computes from its example inputs
                               (input_ids, token types...) carry ExampleIds (core/ids.py), a tensor
                               subclass that follows every op on them: an Embedding looking up tagged
                               ids looks up the examples' rows; ids without the tag (positions from
                               torch.arange, relative-position buckets, a buffer) are a table the
                               examples share (core/shared.py), whatever their sizes. Floating-point
                               tensors are the examples' data unless they are such a table.
  scopes                       a module that works on other rows than the examples': inside a
                               sequence-first module (batch_first=False: (T, N) rows), a module that
                               splits each example into windows (WINDOWS), a vision tower whose rows
                               are images or their patches (Tower), each belonging to the example whose
                               image tokens it fills (core/towers.py), whatever the number of images.
  torch's broadcasting         where a table meets the examples' data (core/shared.py), the table's dim
                               aligned with the data's example dim tells whether each example gets
                               all of it (size 1, or no such dim) or its own slice (size N).
  the autograd history         where an input's sizes fit no mapping, the ops that made it (transposes,
                               permutes, stacks: core/inputs.py's dim_by_history) say which dim holds the
                               examples (Longformer's (T', N, D) states, T' padded); a replay's outputs too.

A layer input that fits none of these (a (1, T) data row broadcast over the batch, rows of no known length)
cannot be mapped: `Layout.rows_for` returns the reason as a str, and the layer records it so that the monitor
refuses the step with an error naming the layer (never a number).
"""

from dataclasses import dataclass
from typing import Optional

import torch

# scopes (Pass.scopes, core/layout.py): where a layer's rows are not the examples' batch-first rows
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
        out[self.example_of_row, position_in_example(self.example_of_row, self.examples)] = flat
        return out

    def example_ids(self, rows, device):
        """(rows,) the example of each of `rows` rows, in row order."""
        if self.kind == "ragged":
            return self.example_of_row.to(device)
        if self.kind == "seqfirst":
            return torch.arange(rows, device=device) % self.examples
        per = rows // self.examples if self.kind == "dim0" else self.positions
        return torch.arange(rows, device=device) // per


def position_in_example(example_of_row, examples):
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
