"""
bench/step_faults.py runs each layer choice in its own process and reports its page faults and CPU time per step.

    python -m pytest -q tests/test_bench_step_faults.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import step_faults  # noqa: E402

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=8", "--block_size=4", "--batch_size=2", "--steps=2", "--warmup=1"]


def test_each_choice_is_measured_in_its_own_process(capsys):
    step_faults.main([*TINY, "--choices=nn,all-layer gns", "--runs=1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["nn", "all-layer gns"]
    for row in rows:
        faults, sys_ms, user_ms, wall_ms = (float(v.replace(",", "")) for v in row.split("|")[3:7])
        assert faults >= 0 and sys_ms >= 0 and user_ms > 0 and wall_ms > 0, row
