"""
bench/arithmetic_floor.py, the bare per-example arithmetic that bench/step_overhead.py's "arithmetic floor" times:
it must compute what it claims (a floor that skipped work would be no floor). Its layers give plain torch's output
and gradients, and the squared norms it adds up are the brute-force loop's.

    python -m pytest -q tests/test_bench_arithmetic_floor.py
"""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
from oracle import per_example_sqnorms_by_loop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import arithmetic_floor  # noqa: E402


@pytest.mark.parametrize("strategy", ["gram", "materialise"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_floor_computes_plain_gradients_and_the_oracle_s_norms(strategy, bias, force_strategy):
    force_strategy(linear=strategy)
    torch.manual_seed(0)
    N, T, D = 3, 3, 5  # as many examples as positions, on purpose
    plain = nn.Sequential(nn.Linear(D, 7, bias=bias), nn.GELU(), nn.LayerNorm(7, bias=bias), nn.Linear(7, 2, bias=bias))
    plain = plain.double()
    floor = copy.deepcopy(plain)
    sink = arithmetic_floor.install(floor)
    assert sink.dtype == torch.float64
    inputs, grad_out = torch.randn(N, T, D, dtype=torch.float64), torch.randn(N, T, 2, dtype=torch.float64)
    x_plain, x_floor = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    out_plain, out_floor = plain(x_plain), floor(x_floor)
    torch.testing.assert_close(out_floor, out_plain)
    out_plain.backward(grad_out)
    out_floor.backward(grad_out)
    torch.testing.assert_close(x_floor.grad, x_plain.grad)
    for (name, p_plain), p_floor in zip(plain.named_parameters(), floor.parameters()):
        torch.testing.assert_close(p_floor.grad, p_plain.grad, msg=name)
    expected = sum(v.sum() for v in per_example_sqnorms_by_loop(plain, inputs, grad_out).values())
    torch.testing.assert_close(sink, expected)


@pytest.mark.parametrize("shape, strategy", [((4, 3, 5, 6), "gram"), ((2, 64, 8, 8), "materialise")])
def test_one_linear_s_floor_is_timed_under_the_strategy_the_gns_linear_picks(shape, strategy, capsys):
    plain_ms, added_ms, picked = arithmetic_floor.linear_floor(*shape, rounds=2)
    assert picked == strategy and plain_ms > 0 and added_ms == added_ms  # (a time, not NaN)
    arithmetic_floor.main(["--shapes=" + ",".join(map(str, shape)), "--rounds=2"])
    assert f"| {', '.join(map(str, shape))} | {strategy} |" in capsys.readouterr().out
