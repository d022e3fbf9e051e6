"""
GNSMonitor and its parts (nanogns/monitor/) and the GNS estimator (nanogns/estimator.py).

    python -m pytest tests/test_monitor.py -q
"""

import math
import os
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward

from nanogns import estimator
from nanogns import monitor as gnstracking
from nanogns.core.buffers import BUFFER_SUFFIX, zero_pe_sqnorm_buffers
from nanogns.errors import NanoGNSError, StepNotMeasured
from nanogns.kinds.embedding import ShimEmbedding
from nanogns.kinds.layernorm import PerExampleLayerNorm
from nanogns.kinds.linear import PerExampleLinear
from nanogns.runlog.record import read_parameter_record


def test_unbiased_stats_formula_and_batch_of_one():
    gtg, trsigma = estimator.unbiased_stats(2.0, 10.0, 4)
    assert gtg == pytest.approx((4 * 2.0 - 10.0) / 3)
    assert trsigma == pytest.approx((10.0 - 2.0) / (1 - 1 / 4))
    gtg, trsigma = estimator.unbiased_stats(2.0, 10.0, 1)  # GNS undefined: NaN, no ZeroDivisionError
    assert math.isnan(gtg) and math.isnan(trsigma)
    series = estimator.unbiased_stats(pd.Series([2.0, 2.0]), pd.Series([10.0, 10.0]), pd.Series([4, 1]))
    assert isinstance(series[0], pd.Series)
    assert series[0].iloc[0] == pytest.approx(-2 / 3) and math.isnan(series[0].iloc[1])


def test_gns_from_emas_is_nan_when_gtg_not_positive():
    assert estimator.gns_from_emas(2.0, 10.0) == 5.0
    assert math.isnan(estimator.gns_from_emas(-1.0, 10.0))
    np.testing.assert_array_equal(np.isnan(estimator.gns_from_emas([1.0, 0.0], [3.0, 3.0])), [False, True])


def test_ema_skips_non_finite_values():
    ema = estimator.EMA(0.5)
    assert math.isnan(ema.value)
    assert ema.update(4.0) == 4.0
    assert ema.update(float("nan")) == 4.0
    assert ema.update(float("inf")) == 4.0
    assert ema.update(2.0) == 3.0
    # the same rule as pandas' ewm(adjust=False, ignore_na=True), which gns-analysis.py uses
    assert pd.Series([4.0, np.nan, 2.0]).ewm(alpha=0.5, adjust=False, ignore_na=True).mean().iloc[-1] == 3.0


class TinyNet(nn.Module):
    """Embedding -> LayerNorm -> Linear, plus a plain layer the tracker must skip."""

    def __init__(self):
        super().__init__()
        self.emb = ShimEmbedding(13, 8)
        self.ln = PerExampleLayerNorm(8)
        self.head = PerExampleLinear(8, 5)
        self.plain = nn.Linear(5, 5)

    def forward(self, ids):
        return self.plain(self.head(self.ln(self.emb(ids))))


def test_tracker_matches_per_example_loop_with_accumulation():
    torch.manual_seed(0)
    net = TinyNet().double()
    tracker = gnstracking.GNSMonitor(net)
    assert set(tracker.untracked) == {"plain.weight", "plain.bias"}
    micro_batches = [torch.randint(0, 13, (3, 7)) for _ in range(2)]  # B = 6 over two micro-batches
    targets = [torch.randn(3, 7, 5, dtype=torch.float64) for _ in range(2)]
    B = 6
    for ids, y in zip(micro_batches, targets):
        loss = F.mse_loss(net(ids), y) / len(micro_batches)
        loss.backward()
    row = tracker.step(batch_size=B)
    measurements = tracker.measurements
    assert all(b.abs().sum() == 0 for n, b in net.named_buffers())  # step zeroed the buffers
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}

    # oracle: each example's own gradient g_i of its loss (mean over its tokens), from the batched forwards
    losses = [
        F.mse_loss(net(ids), y, reduction="none").flatten(1).mean(dim=1) for ids, y in zip(micro_batches, targets)
    ]
    per_example, _ = loss_sqnorms_from_batched_forward(net, losses)
    names = [m.metadata["name"] for m in measurements]
    assert names == ["emb.weight", "ln.weight", "ln.bias", "head.weight", "head.bias"]  # named_parameters() order
    for m in measurements:
        name = m.metadata["name"]
        assert m.batch_size == B
        assert m.norm == pytest.approx(grads[name].norm().item(), rel=1e-9)
        assert m.rms_pe_norm == pytest.approx(math.sqrt(per_example[name]), rel=1e-6)
    assert row["train/gns/ln.weight/batch_size"] == B
    assert row["train/gns/head.bias/pegn"] == measurements[-1].rms_pe_norm


def test_tracker_divides_out_the_grad_scale():
    class FakeScaler:
        def is_enabled(self):
            return True

        def get_scale(self):
            return 1024.0

    torch.manual_seed(0)
    layer = PerExampleLinear(6, 4)
    x = torch.randn(4, 6)
    (layer(x).pow(2).mean()).backward()
    plain = gnstracking.GNSMonitor(layer).measure(batch_size=4)
    layer.zero_grad()
    zero_pe_sqnorm_buffers(layer)
    (1024.0 * layer(x).pow(2).mean()).backward()
    scaled = gnstracking.GNSMonitor(layer, scaler=FakeScaler()).measure(batch_size=4)
    for a, b in zip(plain, scaled):
        assert b.norm == pytest.approx(a.norm, rel=1e-5)
        assert b.rms_pe_norm == pytest.approx(a.rms_pe_norm, rel=1e-5)


def test_tracker_rejects_a_wrong_batch_size_and_skips_unused_layers():
    layer = PerExampleLinear(3, 2)
    tracker = gnstracking.GNSMonitor(layer)
    with pytest.raises(StepNotMeasured, match=r"^GNS: step\(\) found no example in any of the 2 tracked layers"):
        tracker.measure(batch_size=4)  # nothing ran backward: refused (it returned no measurement, the GNS nan)
    layer(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match="counted 4 examples"):
        tracker.measure(batch_size=8)


def test_first_hour_mistakes_in_ones_own_loop_are_one_line_each(tmp_path):
    """A step before any backward returned {'gns': nan}, a batch of one gave nan without a word, and a loop without
    log.step() wrote the whole run as one row (the analysis then reported "over 1 steps"): the first and the last
    are now a StepNotMeasured (a NanoGNSError and a ValueError) naming the fix, after which the next step, done
    right, is measured; a batch of one is measured (its norms are exact) with one warning that its GNS is nan."""
    from nanogns.runlog.writer import LogWrapper

    model = nn.Sequential(nn.Embedding(16, 8), PerExampleLayerNorm(8), PerExampleLinear(8, 16))
    model[0] = ShimEmbedding(16, 8)
    log = LogWrapper(out_dir=str(tmp_path))
    monitor = gnstracking.GNSMonitor(model, log=log)
    ids = torch.randint(0, 16, (4, 5))

    def backward(batch=ids):
        model(batch).pow(2).mean().backward()

    with pytest.raises(StepNotMeasured) as refused:
        monitor.step(batch_size=4)  # before any backward
    assert str(refused.value) == (
        "GNS: step() found no example in any of the 5 tracked layers' buffers (no backward of a converted model "
        "since the last step): call monitor.step() after the step's last loss.backward(), once per optimizer step, "
        "before optimizer.zero_grad()"
    )
    assert isinstance(refused.value, NanoGNSError) and isinstance(refused.value, ValueError)
    backward(ids[:1])
    with pytest.warns(UserWarning, match=r"^GNS: step\(batch_size=1\): the norms are measured, but the GNS ") as said:
        row = monitor.step()  # the batch size the layers counted: one
    assert len(said) == 1 and math.isnan(row["gns"]) and row["train/gns/2.weight/batch_size"] == 1
    log.step()
    model.zero_grad(set_to_none=True)
    backward(ids[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.step(batch_size=1)  # said once
    log.step()
    model.zero_grad(set_to_none=True)
    backward()
    assert monitor.step(batch_size=4)["train/gns/2.weight/batch_size"] == 4
    model.zero_grad(set_to_none=True)
    backward()
    with pytest.raises(StepNotMeasured) as refused:
        monitor.step(batch_size=4)  # log.step() forgotten
    assert str(refused.value) == (
        "GNS: step() again before the log wrote the previous step's row (log.step() was not called since step 2): "
        "every row would overwrite the last and the log would hold the whole run as one row; call log.step() once "
        "per optimizer step, after monitor.step() and your own log.log(...)"
    )
    assert all(b.sum() == 0 for n, b in model.named_buffers() if n.endswith(BUFFER_SUFFIX))  # zeroed all the same
    log.step()
    model.zero_grad(set_to_none=True)
    backward()
    monitor.step(batch_size=4)
    log.step()
    log.close()
    assert pd.read_csv(tmp_path / "log.csv")["step"].tolist() == [0, 1, 2, 3]


def test_tied_embedding_and_linear_are_tracked_once_under_both_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = ShimEmbedding(10, 4)
            self.lm_head = PerExampleLinear(4, 10, bias=False)
            self.lm_head.weight = self.wte.weight

    tracker = gnstracking.GNSMonitor(Tied())
    assert [name for name, _, _ in tracker.tracked] == ["wte.weight+lm_head.weight"] and tracker.untracked == {}
    assert [c for _, _, c in tracker.tracked[0][2]] == [
        1.0,
        1.0,
        2.0,
    ]  # embedding, head, 2 x cross term (tests/test_layers_tied.py)


def test_summed_sqnorms_and_running_gns():
    ms = [gnstracking.Measurement(1.0, 2.0, 8), gnstracking.Measurement(2.0, 3.0, 8)]
    assert gnstracking.summed_squares(ms) == (5.0, 13.0, 8)
    running = estimator.RunningGNS(decay=0.9)
    assert math.isnan(running.gns)
    gtg, trsigma = estimator.unbiased_stats(5.0, 13.0, 8)
    assert running.update(5.0, 13.0, 8) == pytest.approx(trsigma / gtg)
    assert running.update(5.0, 13.0, 1) == pytest.approx(trsigma / gtg)  # B = 1 carries no information


@pytest.mark.parametrize("T", [1, 4])
def test_gns_matches_analytic_least_squares(T):
    """Least squares, x ~ N(0, I_d), y = w*.x + eps with eps ~ N(0, s^2), loss 1/2 (w.x - y)^2
    per token, an example's loss the mean over its T iid tokens, weights held fixed:
        G = w - w*,  tr(Sigma) = ((d + 1)|w - w*|^2 + d s^2) / T
    so GNS = ((d + 1) + d s^2 / |w - w*|^2) / T. Averaging the unbiased per-step
    estimates over many steps must land within 3% of it."""
    torch.manual_seed(0)
    d, s, B, steps = 8, 0.5, 32, 300
    layer = PerExampleLinear(d, 1, bias=False).double()
    w_star = torch.randn(1, d, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(w_star + torch.randn(1, d, dtype=torch.float64) / math.sqrt(d))  # |w - w*| ~ 1
    delta_sq = (layer.weight - w_star).pow(2).sum().item()
    expected = ((d + 1) + d * s**2 / delta_sq) / T
    tracker = gnstracking.GNSMonitor(layer)
    gtgs, trsigmas = [], []
    for _ in range(steps):
        x = torch.randn(B, T, d, dtype=torch.float64)
        y = x @ w_star.T + s * torch.randn(B, T, 1, dtype=torch.float64)
        (0.5 * F.mse_loss(layer(x), y)).backward()  # mean over tokens and examples
        gtg, trsigma = estimator.unbiased_stats(*gnstracking.summed_squares(tracker.measure(batch_size=B)))
        gtgs.append(gtg)
        trsigmas.append(trsigma)
        layer.zero_grad()
        zero_pe_sqnorm_buffers(layer)
    assert np.mean(gtgs) == pytest.approx(delta_sq, rel=0.03)
    assert np.mean(trsigmas) / np.mean(gtgs) == pytest.approx(expected, rel=0.03)


class Blocks(nn.Module):
    """Parameters whose names mislead a name rule: a norm called ln_attn, a Linear called norm_proj."""

    def __init__(self):
        super().__init__()
        self.emb = ShimEmbedding(13, 8)
        self.h = nn.ModuleList(
            [nn.ModuleDict(dict(ln_attn=PerExampleLayerNorm(8), norm_proj=PerExampleLinear(8, 8))) for _ in range(2)]
        )
        self.head = PerExampleLinear(8, 5)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.h:
            x = x + block["norm_proj"](block["ln_attn"](x))
        return self.head(x)


def test_record_says_each_parameters_kind_and_block_from_the_model_not_its_name():
    record = gnstracking.GNSMonitor(Blocks()).describe()
    assert record["h.1.ln_attn.weight"] == {
        "kind": "LayerNorm",
        "group": "LayerNorm",
        "layer": "PerExampleLayerNorm",
        "block": 1,
        "names": ["h.1.ln_attn.weight"],
        "numel": 8,
        "bank_slices": None,
    }
    assert record["h.0.norm_proj.bias"]["kind"] == "Linear" and record["h.0.norm_proj.bias"]["block"] == 0
    assert record["h.0.norm_proj.bias"]["group"] == "Linear"
    assert record["emb.weight"]["kind"] == "Embedding" and record["emb.weight"]["block"] is None


def test_monitor_measures_zeroes_logs_and_resumes(tmp_path):
    from nanogns.runlog.writer import LogWrapper

    torch.manual_seed(0)
    model = Blocks()
    log = LogWrapper(out_dir=str(tmp_path))
    monitor = gnstracking.GNSMonitor(model, log=log, ema_decay=0.9)
    assert read_parameter_record(str(tmp_path)) == monitor.describe()
    reference = estimator.RunningGNS(decay=0.9)
    ids = torch.randint(0, 13, (6, 4, 5))
    rows = []
    for step in range(4):
        model(ids[step]).pow(2).mean().backward()
        measurements = {}
        for name, ref, terms in monitor.tracked:  # what the row must hold, read before the monitor zeroes
            module, buffer_name, _ = terms[0]
            total, count = module._buffers[buffer_name].tolist()
            measurements[name] = (ref.get().grad.norm().item(), (total * count) ** 0.5)
        row = monitor.step(batch_size=4)
        rows.append(row)
        assert all(b.sum() == 0 for n, b in model.named_buffers() if n.endswith(BUFFER_SUFFIX))
        for name, (norm, pegn) in measurements.items():
            assert row[f"train/gns/{name}/norm"] == pytest.approx(norm, rel=1e-5)
            assert row[f"train/gns/{name}/pegn"] == pytest.approx(pegn, rel=1e-5)
            assert row[f"train/gns/{name}/batch_size"] == 4
        sums = gnstracking.summed_squares([gnstracking.Measurement(n, p, 4) for n, p in measurements.values()])
        assert row["gns"] == pytest.approx(reference.update(*sums), rel=1e-5, nan_ok=True)
        assert log.log_dict == row  # handed to the log for this step's row
        log.step()
        model.zero_grad(set_to_none=True)
        if step == 1:  # a resume: a new monitor continues the running GNS from the saved state
            state = monitor.state_dict()
            monitor = gnstracking.GNSMonitor(model, log=log, ema_decay=0.9)
            monitor.load_state_dict(state)
    assert monitor.step_count == 4 and rows[-1]["gns"] == pytest.approx(reference.gns, rel=1e-5)


def test_monitor_refuses_a_model_without_per_example_layers():
    with pytest.raises(ValueError, match="no parameter of Sequential has a per-example norm layer; convert it first"):
        gnstracking.GNSMonitor(nn.Sequential(nn.Linear(2, 2)))


def test_a_parametrized_weight_is_skipped_with_the_reason():
    """spectral_norm makes c_attn compute with W / sigma(W): its buffer holds the norms of that, not of the
    trainable W (train.py refuses the combination; a tracker made anyway says why it skips the tensor)."""
    import nanogns as lc

    with lc.set_contextual_config(**lc.layer_classes("gns", "gns", "gns")):
        from model import GPT, GPTConfig

        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11, spectral_c_attn=[1]))
    tracker = gnstracking.GNSMonitor(model)
    name = "transformer.h.1.attn.c_attn.parametrizations.weight.original"
    assert tracker.untracked[name].startswith("parametrized (torch.nn.utils.parametrize, e.g. spectral_norm)")
    assert "transformer.h.0.attn.c_attn.weight" in [t.name for t in tracker.tracked]


def test_a_wrong_batch_size_is_an_error_not_a_dropped_parameter():
    """Two micro-batches of 4 read with batch_size=4 (the micro-batch, not the step): every buffer counted 8.
    That is no module used twice (nothing counted 4), so the tracker raises instead of dropping them all."""
    import nanogns as lc

    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    gns = gnstracking.GNSMonitor(lc.convert(model).model)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).mean().backward()
    with pytest.raises(
        ValueError,
        match=r"0.weight's buffer counted 8 examples but step\(batch_size=4\) says the step had 4\. Observed this "
        r"step: 2 forwards of the converted model with gradients, reading 4, 4 examples .*"
        r"if the step's examples are the 8 its forwards read, pass batch_size=8",
    ):
        gns.step(batch_size=4)
    assert not gns.dropped


def test_step_read_takes_a_few_ops_whatever_the_depth():
    """Issue 23: GNSMonitor.step (read + zeroing) is a handful of dispatched ops, the same for 12 and 24 blocks,
    LayerNorm-only or every layer tracked (bench/read_ops.py prints these beside a plain step's)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import read_ops

    found = {
        (n, choice): read_ops.counts(choice, n)[1]
        for n in (12, 24)
        for choice in ("LayerNorm-only gns", "all-layer gns")
    }
    assert max(found.values()) <= 40 and len(set(found.values())) == 1, found
