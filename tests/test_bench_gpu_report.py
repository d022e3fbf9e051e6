"""
bench/gpu_report.py's checks, run on the CPU with the Triton kernels in Triton's
interpreter: every per-example norm layer class (each Linear strategy included)
and every candidate tile of the Linear kernel against the brute-force oracle,
the fused layers under torch.compile against eager, and the launch table, so
the GPU command cannot rot.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_bench_gpu_report.py
"""

import io
import os
import sys

import pytest

import fused_gns
from nanogns.variants.fused import linear_plan as fused_linear_plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_report  # noqa: E402


@pytest.mark.skipif(not fused_gns.kernels_interpreted(), reason="needs TRITON_INTERPRET=1 (kernels on CPU tensors)")
def test_report_checks_pass_on_the_cpu(capsys):
    out = io.StringIO()
    failed = gpu_report.run_checks("cpu", out=out)
    lines = out.getvalue().splitlines()
    assert not failed, "\n".join(line for line in lines if line.startswith("FAIL"))
    checks = [line for line in lines if line.startswith(("ok", "FAIL", "skip"))]
    candidates = sum(len(c) for c in fused_linear_plan.LINEAR_CANDIDATES.values())
    # layers: float32 and bfloat16, two shapes each; every candidate; compiled in two dtypes; one stated skip
    assert len(checks) == 2 * 2 * len(gpu_report.layer_cases()) + candidates + 2 + 1
    assert [line for line in checks if not line.startswith("ok")] == [
        "skip kernel past 2**31 elements: needs a GPU (too large for Triton's interpreter)"
    ]
    gpu_report.launch_table("cpu")
    table = capsys.readouterr().out
    assert "| LayerNorm | 1 | 2 |" in table and "| Linear | 3 | 4 |" in table
