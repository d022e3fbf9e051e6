"""
SOGNS, the approximate per-example norms (nanogns/variants/sogns.py): the buffers hold the
defining formula, it is exact where it should be (T = 1, bias), the `gns+sogns`
class keeps the exact numbers, and train.py logs both under their own prefixes.

    python -m pytest -q tests/test_layers_sogns.py
"""

import pytest
import torch
from conftest import TINY, run_script
from oracle import per_example_sqnorms_by_loop

from nanogns import monitor as gnstracking
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.kinds.linear import ExactAndSOGNSLinear, PerExampleLinear, SOGNSLinear
from nanogns.runlog.reader import load_csv


def defining_formula(x, g):
    """Per example: (1/T) sum_{t,k} x_tk^2 * ||sum_t g_t||^2 (weight), ||sum_t g_t||^2 (bias), by loops."""
    weight, bias = [], []
    for xi, gi in zip(x.double(), g.double()):
        xi, gi = xi.reshape(-1, xi.shape[-1]), gi.reshape(-1, gi.shape[-1])
        out_sq = sum(gi[t] for t in range(gi.shape[0])).pow(2).sum()
        weight.append(sum(xi[t].pow(2).sum() for t in range(xi.shape[0])) / xi.shape[0] * out_sq)
        bias.append(out_sq)
    return torch.stack(weight), torch.stack(bias)


@pytest.mark.parametrize("cls", [SOGNSLinear, ExactAndSOGNSLinear])
@pytest.mark.parametrize("shape", [(5, 7), (3, 9, 7), (1, 4, 7), (2, 3, 4, 7)], ids=str)
def test_buffers_hold_the_defining_formula(cls, shape):
    torch.manual_seed(0)
    layer = cls(7, 5).double()
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 5, dtype=torch.float64)
    layer(x).backward(g)
    weight, bias = defining_formula(x, g)
    torch.testing.assert_close(
        layer.weight_sogns_pe_sqnorm, torch.tensor([weight.sum(), shape[0]], dtype=torch.float32)
    )
    torch.testing.assert_close(layer.bias_sogns_pe_sqnorm, torch.tensor([bias.sum(), shape[0]], dtype=torch.float32))


def test_exact_for_one_row_per_example_and_for_the_bias():
    torch.manual_seed(0)
    layer = SOGNSLinear(6, 3).double()
    x, g = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    layer(x).backward(g)
    recorded = layer.weight_sogns_pe_sqnorm[0].item()  # read first: the oracle's own backward passes add to it
    exact = per_example_sqnorms_by_loop(layer, x, g)
    assert recorded == pytest.approx(exact["weight"].sum().item(), rel=1e-6)
    layer.zero_grad()
    zero_pe_sqnorm_buffers(layer)
    x3, g3 = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    layer(x3).backward(g3)
    recorded_weight, recorded_bias = layer.weight_sogns_pe_sqnorm[0].item(), layer.bias_sogns_pe_sqnorm[0].item()
    exact = per_example_sqnorms_by_loop(layer, x3, g3)
    assert recorded_bias == pytest.approx(exact["bias"].sum().item(), rel=1e-6)
    # the weight is an approximation for T > 1: not the exact number
    assert recorded_weight != pytest.approx(exact["weight"].sum().item(), rel=1e-3)


def test_gns_plus_sogns_keeps_the_exact_numbers_and_tracks_both():
    torch.manual_seed(0)
    exact_only, both = PerExampleLinear(6, 4).double(), ExactAndSOGNSLinear(6, 4).double()
    both.load_state_dict(exact_only.state_dict())
    x, g = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    for layer in (exact_only, both):
        layer(x).backward(g)
    torch.testing.assert_close(both.weight.grad, exact_only.weight.grad)
    torch.testing.assert_close(both.weight_pe_sqnorm, exact_only.weight_pe_sqnorm)
    monitor = gnstracking.GNSMonitor(both)
    exact, approx = monitor.measure(batch_size=3), monitor.approx_measurements
    assert [m.metadata["name"] for m in exact] == [m.metadata["name"] for m in approx] == ["weight", "bias"]
    assert approx[0].norm == exact[0].norm  # the batch norm is exact in both
    assert approx[1].rms_pe_norm == pytest.approx(exact[1].rms_pe_norm, rel=1e-6)  # bias: exact
    assert approx[0].rms_pe_norm != pytest.approx(exact[0].rms_pe_norm, rel=1e-3)


def test_sogns_buffers_stay_float32_under_bf16():
    layer = SOGNSLinear(4, 4).to(torch.bfloat16)
    assert layer.weight_sogns_pe_sqnorm.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("linearclass", ["sogns", "gns+sogns"])
def test_train_logs_exact_and_approximate_side_by_side(tmp_path, linearclass, shakespeare_data):
    out = run_script(
        "train.py",
        *TINY,
        "--max_iters=4",
        "--eval_interval=4",
        "--lnclass=gns",
        "--embeddingclass=gns",
        f"--linearclass={linearclass}",
        f"--out_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr
    # gns+sogns: the tied matrix is logged exactly, and SOGNS says nothing false of it; sogns: the head records
    # approximate norms only, so the tied matrix cannot be measured exactly, and the warning says so
    assert ("not tracking transformer.wte.weight" in out.stderr) == (linearclass == "sogns")
    df = load_csv(tmp_path)
    assert df["train/sogns/transformer.h.0.mlp.c_fc.weight/pegn"].notna().all()
    assert df["train/gns/transformer.h.0.ln_1.weight/pegn"].notna().all()
    exact_linear = any(c.startswith("train/gns/transformer.h.0.mlp") for c in df.columns)
    assert exact_linear == (linearclass == "gns+sogns")  # 'sogns': the Linear layers are approximate only
    tied = "train/gns/transformer.wte.weight+lm_head.weight/norm"
    assert (tied in df) == (linearclass == "gns+sogns")  # exact tied matrix only when the head records exact norms
    analysis = run_script("gns-analysis.py", str(tmp_path), "--no-plots")
    assert analysis.returncode == 0, analysis.stderr
    assert "Approximate (SOGNS)" in analysis.stdout
