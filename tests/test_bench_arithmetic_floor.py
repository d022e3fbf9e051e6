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


class _TiedModel(nn.Module):
    """nanoGPT's shape in small: token and position embeddings, a block, a LayerNorm and a head tied to the tokens'."""

    def __init__(self, vocab, positions, dim, bias):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.fc, self.ln = nn.Linear(dim, dim, bias=bias), nn.LayerNorm(dim, bias=bias)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        x = self.wte(ids) + self.wpe(pos)
        return self.head(self.ln(x + torch.tanh(self.fc(x))))


@pytest.mark.parametrize("cross_term", ["table", "gather"])
@pytest.mark.parametrize("vocab", [3, 11])  # fewer tokens than positions, and more
def test_the_floor_s_embeddings_and_tied_head_add_the_oracle_s_norms(vocab, cross_term, force_strategy):
    force_strategy(cross_term=cross_term)
    torch.manual_seed(0)
    N = T = 5  # as many examples as positions, on purpose
    plain = _TiedModel(vocab, T, 6, bias=True).double()
    floor = copy.deepcopy(plain)
    assert floor.head.weight is floor.wte.weight
    sink = arithmetic_floor.install(floor)
    ids = torch.randint(0, vocab, (N, T))
    ids[0, :2] = ids[0, 2]  # a token repeated within an example: its rows add before squaring
    grad_out = torch.randn(N, T, vocab, dtype=torch.float64)
    out_plain, out_floor = plain(ids), floor(ids)
    torch.testing.assert_close(out_floor, out_plain)
    out_plain.backward(grad_out)
    out_floor.backward(grad_out)
    for (name, p_plain), p_floor in zip(plain.named_parameters(), floor.parameters()):
        torch.testing.assert_close(p_floor.grad, p_plain.grad, msg=name)
    expected = sum(v.sum() for v in per_example_sqnorms_by_loop(plain, ids, grad_out).values())
    torch.testing.assert_close(sink, expected)  # the tied weight once, with its cross term


@pytest.mark.parametrize("shape, strategy", [((4, 3, 5, 6), "gram"), ((2, 64, 8, 8), "materialise")])
def test_one_linear_s_floor_is_timed_under_the_strategy_the_gns_linear_picks(shape, strategy, capsys):
    timed = arithmetic_floor.linear_floor(*shape, rounds=2)
    assert timed["strategy"] == strategy
    assert all(timed[name][0] > 0 and timed[name][1] > 0 for name in ("plain", "floor", "gns"))
    assert timed["plain"][1] == 1.0  # each round's plain time over itself
    arithmetic_floor.main(["--shapes=" + ",".join(map(str, shape)), "--rounds=2", "--clock=cpu"])
    assert f"| {', '.join(map(str, shape))} | {strategy} |" in capsys.readouterr().out


def test_the_floor_of_the_nanogpt_model_adds_what_the_gns_layers_buffers_hold():
    # the step bench/step_overhead.py times as "arithmetic floor": the same squared norms as the all-layer gns step
    import contextlib
    import io

    import nanogns as lc
    from model import GPT, GPTConfig
    from nanogns.monitor import GNSMonitor

    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=5, bias=True, dropout=0.0)
    models = {}
    for name, classes in (("floor", ("nn", "nn", "nn")), ("gns", ("gns", "gns", "gns"))):
        torch.manual_seed(0)
        with lc.set_contextual_config(**lc.layer_classes(*classes)), contextlib.redirect_stdout(io.StringIO()):
            models[name] = GPT(config).double()
    sink = arithmetic_floor.install(models["floor"])
    GNSMonitor(models["gns"])  # links the tied wte and lm_head, as in bench/step_overhead.py
    ids = torch.randint(0, 5, (6, 6), generator=torch.Generator().manual_seed(1))  # batch = block = 6: on purpose
    for model in models.values():
        _, loss = model(ids, ids)
        loss.backward()
    # each buffer's sum once, the tied weight's cross term <e_i, h_i> twice (the monitor's coefficient, tied.py)
    held = {n: b[0] for n, b in models["gns"].named_buffers() if n.endswith("_pe_sqnorm")}
    cross = held["transformer.wte.weight_tiecross_pe_sqnorm"]
    assert len(held) > 10 and cross != 0
    torch.testing.assert_close(sink.float(), sum(held.values()) + cross)  # (buffers are float32)
    for p_floor, p_gns in zip(models["floor"].parameters(), models["gns"].parameters()):
        torch.testing.assert_close(p_floor.grad, p_gns.grad)
