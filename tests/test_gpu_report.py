"""
bench/gpu_report.py's correctness half, run on the CPU with the Triton kernels in
Triton's interpreter: every per-example norm layer class (each Linear strategy
included) against the brute-force oracle, so the GPU command cannot rot.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_report.py
"""

import io
import os
import sys

import pytest

import fused_gns

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_report  # noqa: E402


@pytest.mark.skipif(not fused_gns.kernels_interpreted(), reason="needs TRITON_INTERPRET=1 (kernels on CPU tensors)")
def test_every_layer_class_matches_the_oracle():
    out = io.StringIO()
    failed = gpu_report.check_layers("cpu", out=out)
    lines = out.getvalue().splitlines()
    assert not failed, "\n".join(line for line in lines if line.startswith("FAIL"))
    assert len(lines) == 2 * 2 * len(gpu_report.layer_cases())  # float32 and bfloat16, two shapes each
    assert all(line.startswith("ok") for line in lines)
