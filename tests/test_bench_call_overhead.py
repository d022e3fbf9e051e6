"""
Per-step Python work of the per-example layers, counted and not timed (a count does not move with the machine's
load): the Python calls and dispatched ops of one training step of the baby GPT's structure (forward, backward,
GNSMonitor.step, AdamW) beside the plain step's, counted by bench/call_overhead.py (cProfile's calls, a
TorchDispatchMode's ops).

Issue 39 halved the calls the layers add: before it, the all-layer gns step made 10,515 calls more than the plain
one and the LayerNorm-only step 4,015 (6 blocks); the bounds below are half of those. The ops the layers add are
held at what they became after issue 36: the position table's rows are looked up once as the table (arange ids,
one row for every example) and once more per example where the table meets the examples (core/shared.py), one op
more, and Rows.per_example returns an (N, T, D) tensor as it is instead of dispatching a view (26 and 84 ops
fewer). What is left is the per-example arithmetic and the buffer updates.

Issue 45's bookkeeping is held by the same bounds: the monitor's look at the model at a step's first forward and at
its read (monitor/following.py: ModelShape.same(), C calls over the modules' dicts), the first step's mixing check
(nothing at later steps but a lookup) and each layer's one question whether a torch.func transform is running add
44 calls to the LayerNorm-only step (1758 -> 1802) and 77 to the all-layer one (5115 -> 5192), and no op.

    python -m pytest -q tests/test_bench_call_overhead.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import call_overhead  # noqa: E402

# (Python calls, dispatched ops) a step may add beside the plain step's, 6 blocks
MOST_ADDED = {"LayerNorm-only gns": (4015 // 2, 288), "all-layer gns": (10515 // 2, 828)}


def test_a_steps_added_python_calls_are_half_what_they_were():
    plain_ops, plain_calls = call_overhead.step_counts("nn", n_layer=6)
    found = {}
    for choice, (most_calls, most_ops) in MOST_ADDED.items():
        ops, calls = call_overhead.step_counts(choice, n_layer=6)
        found[choice] = (calls - plain_calls, ops - plain_ops)
        assert calls - plain_calls <= most_calls and ops - plain_ops <= most_ops, (choice, found)
