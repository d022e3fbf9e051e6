"""
bench/controller.py --quick (CI, under a minute): the batch-size controller's pieces on the GNS trace recorded by
the full run (its decisions, an exact resume from its state, the LR / beta2 / weight-decay couplings, the goodput
optimum), then a tiny sweep, fit and run of every method of the full benchmark, with its table and figures.

    python -m pytest -q tests/test_bench_controller.py
"""

import json
import math
import os
import sys

from conftest import REPO

from nanogns import schedules

sys.path.insert(0, os.path.join(REPO, "bench"))
import controller as bench  # noqa: E402


def test_the_recorded_trace_is_the_full_runs():
    path = os.path.join(REPO, "bench", "figures", "controller", "gns_trace.json")
    with open(path) as f:
        steps = json.load(f)["steps"]
    assert len(steps) > 50 and len({s["B"] for s in steps}) > 1
    assert all(math.isfinite(s["sq_norm"]) and s["pe_sqnorm"] > s["sq_norm"] > 0 for s in steps[1:])
    assert bench.recorded_trace() == steps


def test_quick_run_checks_the_pieces_and_runs_every_method(tmp_path):
    result = bench.main(["--quick", f"--out_dir={tmp_path}"])
    assert [p[0] for p in result["pieces"]] == list(schedules.CONTROLLER_RULES)
    rows = {r["name"]: r for r in result["rows"]}
    assert result["reference"] in rows
    kinds = ["fixed", "linear", "doubling", "seesaw", "gns rule", "ctl sqrt", "ctl grow", "ctl goodput"]
    assert all(any(name.startswith(k) for name in rows) for k in kinds), sorted(rows)
    assert all(r["reached"] == r["runs"] == 1 for r in rows.values()), {n: r["reached"] for n, r in rows.items()}
    ref = rows[result["reference"]]
    assert ref["steps_ratio"][0] == 1.0 and ref["tokens_ratio"][0] == 1.0
    assert all(math.isfinite(r["cpu_model_s"][0]) and r["dp_units"][0] >= r["steps"][0] - 1 for r in rows.values())
    fit = result["fit"]
    assert 0 < fit["S_min"] and 0 < fit["E_min"]
    assert sorted(os.path.basename(p) for p in result["figures"]) == ["steps_vs_tokens.png", "trajectories.png"]
    for path in result["figures"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.json").exists()
    assert "goal per seed" in result["report"]
