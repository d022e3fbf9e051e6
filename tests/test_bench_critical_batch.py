"""
bench/critical_batch.py: the McCandlish fit recovers S_min and E_min from data made by the formula, and the
--quick run trains its sweep and schedules to the target and writes the fit and the figures.

    python -m pytest -q tests/test_bench_critical_batch.py
"""

import math
import os
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import critical_batch as cb  # noqa: E402


@pytest.mark.parametrize("s_min, e_min, noise", [(200.0, 8000.0, 0.0), (55.0, 30000.0, 0.0), (120.0, 3000.0, 0.05)])
def test_fit_recovers_s_min_and_e_min_from_the_formula(s_min, e_min, noise):
    B = np.repeat([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], 3)
    S = s_min + e_min / B  # (S/S_min - 1)(E/E_min - 1) = 1 with E = B S
    S = S * np.exp(np.random.default_rng(0).normal(0, noise, len(B)))
    fit = cb.fit_tradeoff(B, S)
    tol = 1e-6 if noise == 0 else 0.1
    assert fit["S_min"] == pytest.approx(s_min, rel=tol)
    assert fit["E_min"] == pytest.approx(e_min, rel=tol)
    assert fit["B_crit"] == pytest.approx(e_min / s_min, rel=tol)
    E = B * S
    if noise == 0:  # the fitted pair satisfies the formula at every point
        np.testing.assert_allclose((S / fit["S_min"] - 1) * (E / fit["E_min"] - 1), 1.0, rtol=1e-5)


def test_fit_ignores_runs_that_did_not_reach_the_target():
    B = [4, 16, 64, 256]
    S = [100 + 4000 / b for b in B]
    fit = cb.fit_tradeoff(B + [1024], S + [math.nan])
    assert fit["B_crit"] == pytest.approx(40.0, rel=1e-6)


def test_quick_run_fits_and_draws(tmp_path):
    result = cb.main(["--quick", f"--out_dir={tmp_path}"])
    fit = result["summary"]["fit"]
    assert all(t["reached"] == t["runs"] for t in result["summary"]["table"])
    assert 0 < fit["S_min"] and 0 < fit["E_min"] and 4 / 8 < fit["B_crit"] < 256 * 8
    assert math.isfinite(result["summary"]["gns"]) and math.isfinite(result["summary"]["gns_ln"])
    assert [r["reached"] for r in result["schedules"]] == [1, 1, 1]
    names = sorted(os.path.basename(p) for p in result["figures"])
    assert names == ["bcrit_vs_gns.png", "schedules.png", "steps_vs_examples.png"]
    for path in result["figures"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.json").exists()
    assert "measured B_crit" in result["report"] and "B_crit / GNS" in result["report"]
