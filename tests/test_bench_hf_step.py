"""
The per-step work convert() adds to a Hugging Face model, counted (not timed: a count does not move with the
machine's load): the dispatched ops and Python calls of one training step of a 2-layer, 64-wide Llama (forward,
backward, the monitor's read, AdamW) converted, beside the same step unconverted (bench/hf_step.py --count).

The bounds are what the step added when issue 47 first counted it (288 ops, 2,783 Python calls: the ids' tag
following the examples through the model, the scopes' and the root's hooks, the layers' per-example arithmetic and
the monitor's read); they hold it from growing.

    python -m pytest -q tests/test_bench_hf_step.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import hf_step  # noqa: E402

MOST_ADDED = {"llama-small": (288, 2800)}  # (ops, Python calls) a converted step may add beside the plain one


def test_a_converted_llama_step_adds_no_more_work_than_counted():
    found = hf_step.counted(list(MOST_ADDED))
    for name, (most_ops, most_calls) in MOST_ADDED.items():
        plain_ops, plain_calls, ops, calls = found[name]
        assert plain_ops > 0 and plain_calls > 0
        assert ops - plain_ops <= most_ops and calls - plain_calls <= most_calls, (name, found[name])
