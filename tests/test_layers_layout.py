"""
Row maps (nanogns/core/layout.py): which example each row of a layer's input belongs to, set once per forward
from what the model was called with, and the RowMapper that keeps a step's refusals for the monitor.

    python -m pytest -q tests/test_layers_layout.py
"""

import torch
import torch.nn as nn

from nanogns.core import layout
from nanogns.core.buffers import refuse_step
from nanogns.core.inputs import layout_of_inputs
from nanogns.core.layout import install, mapper_of
from nanogns.core.rowmaps import Layout


def test_rows_of_the_usual_inputs():
    found = Layout(examples=3, lengths=frozenset({5}))
    dim0 = found.rows_for((3, 5, 8))
    assert dim0.kind == "dim0" and dim0.examples == 3
    flat = found.rows_for((15, 8))  # (B*T, D): row r is example r // T
    assert flat.kind == "flat" and flat.positions == 5
    assert flat.example_ids(15, "cpu").tolist() == [0] * 5 + [1] * 5 + [2] * 5
    seqfirst = found.rows_for((5, 3, 8))  # (T, B, D)
    assert seqfirst.kind == "seqfirst" and seqfirst.example_ids(15, "cpu").tolist() == [0, 1, 2] * 5
    t = torch.arange(5 * 3 * 2.0).view(5, 3, 2)
    assert torch.equal(seqfirst.per_example(t)[1], t[:, 1])  # example 1's rows, in position order


def test_rows_that_cannot_be_mapped_say_why():
    found = Layout(examples=3, lengths=frozenset({5}))
    why = found.rows_for((7, 8))  # neither the examples nor their positions flattened
    assert isinstance(why, str) and "dim 0 is not the forward's 3 examples" in why
    # 4 rows, 4 examples of 4 positions: the examples' rows (a table of positions is tagged where it is made,
    # core/shared.py: an untagged tensor is the examples' data, whatever its sizes)
    square = Layout(examples=4, lengths=frozenset({4}))
    assert square.rows_for((4, 8)).kind == "dim0"


def test_packed_sequences_from_position_ids_and_from_cu_seq_lens():
    ids = torch.zeros(1, 7, dtype=torch.long)
    by_positions = layout_of_inputs((), {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])})
    by_lengths = layout_of_inputs((), {"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 3, 5, 7])})
    for found in (by_positions, by_lengths):
        assert found.examples == 3
        rows = found.rows_for((1, 7, 4))
        assert rows.kind == "ragged" and rows.example_of_row.tolist() == [0, 0, 0, 1, 1, 2, 2]
        x = torch.arange(7.0).view(7, 1)
        padded = rows.per_example(x)  # (examples, longest, D), zero rows padding the shorter ones
        assert padded.shape == (3, 3, 1) and padded[:, :, 0].tolist() == [[0, 1, 2], [3, 4, 0], [5, 6, 0]]
    assert layout_of_inputs((), {"input_ids": torch.zeros(2, 7, dtype=torch.long)}).packed is None


def test_install_sets_each_forward_s_layout_and_returns_one_mapper():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(layout.current())
            return x

    model = nn.Sequential(Probe())
    mapper = install(model)
    assert install(model) is mapper and mapper_of(model) is mapper  # idempotent
    model(torch.zeros(6, 2, 3))
    assert seen[0].examples == 6 and 2 in seen[0].lengths
    assert layout.current() is None  # outside the forward (and outside a backward)
    child = nn.Sequential(Probe())
    assert install(child, mapper=mapper) is mapper  # shared: a LightningModule's children
    layout.clear()


def test_a_refusal_is_kept_by_the_forward_s_mapper_and_cleared_with_it():
    buffer = torch.zeros(2)

    class Refusing(nn.Module):
        def forward(self, x):
            refuse_step("its rows are the wrong shape", [buffer])
            return x * 2

    model = Refusing()
    mapper = install(model)
    model(torch.ones(3, 4, requires_grad=True))
    assert torch.isnan(buffer[1]) and mapper.reasons(buffer) == ["its rows are the wrong shape"]
    assert mapper.reasons(torch.zeros(2)) == []  # another buffer
    mapper.clear()
    assert mapper.reasons(buffer) == []
    with layout.collecting() as collected:  # outside any installed model: convert's probes
        refuse_step("probed", [buffer])
    assert collected.reasons(buffer) == ["probed"]
    layout.clear()
