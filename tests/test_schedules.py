"""
Batch-size schedules (nanogns/schedules.py) as pure functions, and one tiny train.py run with
--bs_schedule=linear.

    python -m pytest tests/test_schedules.py -q
"""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from conftest import TINY, run_script

from nanogns import schedules
from nanogns.runlog.reader import load_csv


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_per_rank_steps_rounds_up():
    assert [schedules.per_rank_steps(t, 2) for t in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert schedules.per_rank_steps(5, 1) == 5


def test_linear_schedule_hits_its_endpoints(tmp_path):
    path = str(tmp_path / schedules.SCHEDULE_FILE)
    points = schedules.linear_points(2, 20, 1000, n=10)
    assert points[0] == (0, 2) and points[-1] == (1000, 20) and len(points) == 10
    assert schedules.write_schedule_if_absent(path, points)
    schedule = schedules.FileSchedule(path)
    assert schedule(0) == 2 and schedule(1000) == 20 and schedule(10**9) == 20
    assert schedule(500) == 11
    values = [schedule(t) for t in range(0, 1001, 50)]
    assert values == sorted(values)
    # a resumed run keeps an existing (maybe edited) file
    write(path, "0, 3\n10, 3\n")
    assert not schedules.write_schedule_if_absent(path, points)
    assert schedule(5) == 3


def test_an_edit_takes_effect_at_the_next_call(tmp_path):
    path = str(tmp_path / "s.txt")
    write(path, "0, 1\n100, 1\n")
    schedule = schedules.FileSchedule(path)
    assert schedule(50) == 1
    write(path, "# doubled\n0, 2\n100, 6\n")
    assert schedule(50) == 4


@pytest.mark.parametrize("bad", ["0, 1\n100, x\n", "0, 2\n0, 3\n", "0, 2\n50, 0\n", "", "# nothing\n", "0 2\n"])
def test_a_broken_edit_keeps_the_last_good_schedule_and_warns_once(tmp_path, bad):
    path = str(tmp_path / "s.txt")
    write(path, "0, 2\n100, 4\n")
    schedule = schedules.FileSchedule(path)
    assert schedule(50) == 3
    write(path, bad)
    with pytest.warns(UserWarning, match="keeping the last good schedule"):
        assert schedule(50) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same bad content again: no second warning
        assert schedule(100) == 4
    write(path, "0, 5\n100, 5\n")  # fixed again
    assert schedule(50) == 5


def test_a_schedule_file_that_is_bad_from_the_start_is_an_error(tmp_path):
    path = str(tmp_path / "s.txt")
    write(path, "nonsense\n")
    with pytest.raises(ValueError, match="not 'tokens, steps'"):
        schedules.FileSchedule(path)(0)


def test_gns_schedule_follows_the_gns_smoothly_and_clamped():
    batch_size, steps, history = 4, 1, []
    feed = [math.nan, math.nan] + [40.0] * 12 + [400.0] * 20 + [8.0] * 20
    for gns in feed:
        steps = schedules.gns_steps(steps, gns, batch_size, factor=1.0, min_steps=1, max_steps=16, max_delta=1)
        history.append(steps)
    assert history[:2] == [1, 1]  # NaN keeps the current value
    assert all(abs(a - b) <= 1 for a, b in zip([1] + history, history))  # smooth
    assert history[2:11] == list(range(2, 11)) and history[13] == 10  # rises to 40 / 4 = 10 and stays
    assert max(history) == 16 and history[33] == 16  # 400 / 4 = 100 clamped at 16
    assert history[-1] == 2  # falls back to 8 / 4
    assert schedules.gns_steps(3, 1e-9, batch_size, min_steps=2, max_steps=16, max_delta=8) == 2  # clamped below
    assert schedules.gns_steps(1, 80.0, batch_size, factor=0.5, max_steps=64, max_delta=100) == 10  # factor


def test_the_linear_schedule_is_clamped_to_its_bounds_and_says_so(tmp_path):
    path = str(tmp_path / schedules.SCHEDULE_FILE)
    write(path, "0, 1\n1000, 40\n")
    schedule = schedules.FileSchedule(path, min_steps=2, max_steps=8)
    with pytest.warns(UserWarning, match=r"1 accumulation steps at 0 tokens is outside .* = \[2, 8\]; using 2"):
        assert schedule(0) == 2
    with pytest.warns(UserWarning, match="using 8"):
        assert schedule(1000) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per value asked for, not per step
        assert schedule(0) == 2 and schedule(1000) == 8


@pytest.mark.slow
def test_linear_schedule_in_train_py_changes_the_batch(tmp_path, shakespeare_data):
    args = [
        *TINY,
        "--max_iters=100",
        "--max_tokens=1024",
        "--eval_interval=100",
        "--bs_schedule=linear",
        "--bs_min_accum_steps=1",
        "--bs_max_accum_steps=4",
        "--linearclass=gns",
        "--lnclass=gns",
        f"--out_dir={tmp_path}",
    ]
    out = run_script("train.py", *args)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / schedules.SCHEDULE_FILE).exists()
    df = load_csv(tmp_path)
    accum = list(df["gradient_accumulation_steps"])
    assert accum[0] == 1 and max(accum) >= 3 and accum[:-1] == sorted(accum[:-1])  # the last step may be cut
    assert (df["batch_size"] == df["gradient_accumulation_steps"] * 4).all()
    assert df["tokens_processed"].diff().dropna().tolist() == (df["batch_size"].iloc[1:] * 16).tolist()
    bs_cols = [c for c in df.columns if c.startswith("train/gns/") and c.endswith("/batch_size")]
    assert bs_cols
    for c in bs_cols:
        assert (df[c] == df["batch_size"]).all(), c
    assert df["tokens_processed"].iloc[-1] == 1024  # the budget: the last step runs only the micro-batches left
    assert (
        "tokens per iteration will follow the linear batch-size schedule: 64 to 256 (1 to 4 accumulation steps)"
        in out.stdout
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["linear", "gns"])
def test_a_schedule_ends_at_max_tokens(tmp_path, shakespeare_data, schedule):
    """61,440 tokens once ended at 73,216 (the last step took 57 micro-batches); here 4 x 16 = 64 tokens per
    micro-batch and a budget of 1,600 = 25 micro-batches that no step size of the schedule divides."""
    args = [
        *TINY,
        "--max_iters=100",
        "--max_tokens=1600",
        "--eval_interval=100",
        f"--bs_schedule={schedule}",
        "--bs_min_accum_steps=3",
        "--bs_max_accum_steps=8",
        "--lnclass=gns",
        f"--out_dir={tmp_path}",
    ]
    out = run_script("train.py", *args)
    assert out.returncode == 0, out.stderr
    df = load_csv(tmp_path)
    assert df["tokens_processed"].iloc[-1] == 1600 and df["batch_size"].sum() * 16 == 1600
    assert df["tokens_processed"].diff().dropna().tolist() == (df["batch_size"].iloc[1:] * 16).tolist()
    assert (df["gradient_accumulation_steps"].iloc[:-1] >= 3).all()  # only the last step is cut


@pytest.mark.slow
def test_an_edited_linear_schedule_cannot_take_a_step_below_its_minimum(tmp_path, shakespeare_data):
    """A line `0, 1` with batch_size 1 would make every step B = 1 (GNS undefined): bs_min_accum_steps holds."""
    args = [
        *TINY,
        "--batch_size=1",
        "--bs_schedule=linear",
        "--bs_min_accum_steps=2",
        "--bs_max_accum_steps=4",
        "--eval_interval=2",
        "--always_save_checkpoint=True",
        "--lnclass=gns",
        f"--out_dir={tmp_path}",
    ]
    first = run_script("train.py", *args, "--max_iters=2")
    assert first.returncode == 0, first.stderr
    write(str(tmp_path / schedules.SCHEDULE_FILE), "0, 1\n")
    resumed = run_script("train.py", *args, "--max_iters=4", "--init_from=resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "outside [bs_min_accum_steps, bs_max_accum_steps] = [2, 4]; using 2" in resumed.stderr
    df = load_csv(tmp_path)
    assert df["batch_size"].tolist()[2:] == [2, 2] and (df["batch_size"] >= 2).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bs_schedule=cubic"], "unknown bs_schedule 'cubic'"),
        (["--bs_schedule=gns"], "bs_schedule='gns' follows the measured GNS"),
        (
            ["--bs_schedule=linear", "--bs_min_accum_steps=3", "--bs_max_accum_steps=2"],
            "need 1 <= bs_min_accum_steps (3)",
        ),
    ],
)
def test_bad_schedule_settings_are_clear_errors(tmp_path, flags, message):
    out = run_script("train.py", *TINY, *flags, f"--out_dir={tmp_path}")
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------------------------
# the batch-size controller (schedules.BatchSizeController) and its GNS (schedules.RatioGNS)


def exact_step(gtg, trsigma, B):
    """The squared norms a step of B examples has in expectation: |g_B|^2 = |G|^2 + tr(Sigma) / B and
    mean_i |g_i|^2 = |G|^2 + tr(Sigma)."""
    return gtg + trsigma / B, gtg + trsigma, B


def controller(rule="sqrt", **kw):
    kw = {"micro_batch_size": 4, "base_batch_size": 64, "max_accum_steps": 128, **kw}
    return schedules.BatchSizeController(rule, **kw)


def test_ratio_gns_is_exact_on_exact_norms_and_its_horizon_is_in_examples():
    est = schedules.RatioGNS(horizon_examples=1000)
    for B in (4, 16, 64, 256):
        est.update(*exact_step(2.0, 60.0, B))
    assert est.gns == pytest.approx(30.0, rel=1e-9) and est.raw_gns == pytest.approx(30.0, rel=1e-9)
    # the weight of the past after n steps of B examples is exp(-n B / horizon): 10 x 64 examples = 40 x 16
    a, b = schedules.RatioGNS(1000), schedules.RatioGNS(1000)
    for est2, B, n in ((a, 64, 10), (b, 16, 40)):
        est2.update(*exact_step(1.0, 10.0, 64))  # the old GNS (10), from the same step ...
        for _ in range(n):
            est2.update(*exact_step(1.0, 50.0, B))  # ... forgotten alike, in examples
    assert a.gns == pytest.approx(b.gns, rel=1e-6) and 10 < a.gns < 50


def test_ratio_gns_bias_correction_removes_most_of_the_small_batch_bias():
    """At B = 2 the unbiased |G|^2 of one step is very noisy, and a ratio of averages reads high on average (Jensen:
    +29% here, over ~10 steps' worth of examples); the delta-method correction takes it to within a few percent."""
    rng = np.random.default_rng(0)
    raw, corrected = [], []
    for _ in range(400):
        est = schedules.RatioGNS(horizon_examples=20)
        for _ in range(60):
            g = rng.normal(0.3, 1.0, size=(2, 50))  # |G|^2 = 50 x 0.09 = 4.5, tr(Sigma) = 50: GNS 11.1
            mean = g.mean(0)
            est.update(float(mean @ mean), float((g * g).sum(1).mean()), 2)
        raw.append(est.raw_gns)
        corrected.append(est.gns)
    bias_raw = np.mean(raw) / (50 / 4.5) - 1
    bias_corrected = np.mean(corrected) / (50 / 4.5) - 1
    assert bias_raw > 0.15 and abs(bias_corrected) < bias_raw / 4, (bias_raw, bias_corrected)


def test_sqrt_rule_follows_factor_times_sqrt_gns_anchor_in_whole_micro_batches_with_hysteresis():
    ctl = controller("sqrt", factor=2.0, anchor=25.0, hysteresis=0.1)
    assert ctl.decide(1e-3).batch_size == 4 and math.isnan(ctl.gns)  # no measurement yet: min batch kept
    for _ in range(5):
        ctl.observe(*exact_step(1.0, 16.0, 64))
    d = ctl.decide(1e-3)
    assert d.switched and d.batch_size == 40 and d.batch_size % 4 == 0  # 2 sqrt(16 x 25) = 40
    ctl.anchor = 36.0  # 2 sqrt(16 x 36) = 48: 12 micro-batches, out of the band [40 / 1.1, 40 x 1.1]: switched
    assert ctl.decide(1e-3).batch_size == 48
    ctl.anchor = 30.25  # 44: 11 micro-batches, inside [12 / 1.1, 12 x 1.1]: kept
    assert not ctl.decide(1e-3).switched and ctl.decide(1e-3).batch_size == 48
    ctl.anchor = 1e9  # clamped to max_accum_steps micro-batches
    assert ctl.decide(1e-3).batch_size == 128 * 4


def test_sqrt_rule_anchors_on_the_base_batch_by_default_not_on_a_noisy_maximum():
    """Issue 48: the default anchor was the largest GNS measured so far, so one early noisy estimate fixed where a
    run landed; it is the base batch (explicit), whatever the GNS did on the way."""
    ctl = controller("sqrt", horizon_examples=64)
    for trsigma in (10.0, 40.0, 10.0, 10.0, 10.0, 10.0, 10.0):
        ctl.observe(*exact_step(1.0, trsigma, 64))
    assert ctl.anchor == 64.0 and ctl.gns < 15
    d = ctl.decide(1e-3)
    assert d.batch_size == 4 * round(math.sqrt(ctl.gns * 64) / 4)


def test_no_decision_on_a_gns_whose_g_squared_is_not_resolved():
    """Issue 48: at a batch far below the GNS one step's |G|^2 is mostly noise (often negative); the controller
    decides nothing until its average's relative standard error is below max_rel_error."""
    rng = np.random.default_rng(0)
    ctl = controller("sqrt", factor=1.0, max_rel_error=0.3, start_accum_steps=2)
    est = ctl.estimator
    assert est.relative_error == math.inf and not ctl.resolved  # nothing measured
    ctl.observe(*exact_step(1.0, 400.0, 8))
    assert est.relative_error == math.inf  # one step: no spread to judge it by
    errors, batches = [], []
    for _ in range(60):  # |G|^2 = 1, tr(Sigma) = 400, B = 8: a step's |G|^2 estimate has a spread of ~50 x its mean
        g = rng.normal(0.05, 1.0, size=(8, 400))  # |G|^2 = 400 x 0.0025 = 1, tr(Sigma) = 400: GNS 400
        mean = g.mean(0)
        ctl.observe(float(mean @ mean), float((g * g).sum(1).mean()), 8)
        errors.append(est.relative_error)
        batches.append(ctl.decide(1e-3).batch_size)
    assert all(e > 0.3 for e in errors) and set(batches) == {8}, (errors[-1], set(batches))
    exact = controller("sqrt", factor=1.0)
    for _ in range(3):
        exact.observe(*exact_step(1.0, 400.0, 8))
    assert exact.estimator.relative_error == 0.0 and exact.decide(1e-3).batch_size == 4 * round(math.sqrt(400 * 64) / 4)


def test_grow_rule_trades_lr_decay_for_batch_growth_up_to_the_cap():
    ctl = controller("grow", cap=4.0, hysteresis=0.0, max_accum_steps=1000)
    for _ in range(5):
        ctl.observe(*exact_step(1.0, 100.0, 64))  # GNS 100: the cap is at 400 examples
    for decay, batch in ((1.0, 64), (0.5, 128), (0.25, 256), (0.1, 400)):
        d = ctl.decide(4e-3 * decay, decay)
        assert d.batch_size == batch
        assert d.lr == pytest.approx(4e-3 * decay * math.sqrt(batch / 64))  # LR x sqrt(a) at B / a
        assert d.lr <= 4e-3 * math.sqrt(decay) + 1e-12
    # early, while the GNS is small, the cap makes a batch warmup
    early = controller("grow", cap=4.0, start_accum_steps=16)
    for _ in range(3):  # (one or two steps: too few to judge the estimate by)
        early.observe(*exact_step(1.0, 3.0, 64))
    assert early.decide(4e-3, 1.0).batch_size == 12


def test_goodput_rule_finds_pollux_optimum_of_the_measured_step_time():
    ctl = controller("goodput", max_accum_steps=256, start_accum_steps=4)
    gns, t0, t1 = 50.0, 0.004, 0.0004
    seen = []
    for _ in range(60):
        d = ctl.decide(1e-3)
        seen.append(d.batch_size)
        ctl.observe(*exact_step(1.0, gns, d.batch_size), step_seconds=t0 + t1 * d.batch_size)
    assert len(set(seen[:5])) > 1  # it explored a second batch size to fit t(B) (once the GNS was resolved)
    assert ctl.step_time_model() == pytest.approx((t0, t1), rel=1e-6)
    best = math.sqrt(t0 * gns / t1)  # argmax B / (t0 + t1 B) / (GNS + B)
    assert abs(seen[-1] - best) <= 4 * 1.1 + 0.1 * best


def test_goodput_explores_one_band_up_when_noisy_times_show_no_cost_per_example():
    """Times that fall with the batch (noise) fit t1 <= 0: goodput would then rise with B up to the largest batch;
    the controller grows one hysteresis band instead (the full run's goodput seed 0 once jumped to 512)."""
    ctl = controller("goodput", max_accum_steps=128, start_accum_steps=8, hysteresis=0.1)
    for B, seconds in ((32, 0.020), (36, 0.019), (32, 0.021), (36, 0.018)):
        ctl.observe(*exact_step(1.0, 50.0, B), step_seconds=seconds)
    assert ctl.step_time_model()[1] == 0.0
    d = ctl.decide(1e-3)
    assert d.batch_size == 4 * (math.ceil(8 * 1.1) + 1)  # 40, not 512


def test_couplings_lr_beta2_weight_decay_and_adam_state_at_a_switch():
    ctl = controller("sqrt", beta2=0.99, weight_decay=0.1, anchor=400.0, hysteresis=0.0, lr_exponent=0.3)
    for _ in range(3):
        ctl.observe(*exact_step(1.0, 100.0, 64))  # GNS 100, target sqrt(100 x 400) = 200
    d = ctl.decide(1e-3)
    assert d.batch_size == 200
    assert d.lr == pytest.approx(1e-3 * (200 / 64) ** 0.3)  # the sweep's exponent, not held at the GNS (issue 48)
    assert ctl.lr_multiplier(400) == pytest.approx(2**0.3 * ctl.lr_multiplier(200))
    assert controller("sqrt").lr_multiplier(256) == pytest.approx(2.0)  # default: Adam's square root
    half_life = lambda beta2, B: math.log(0.5) / math.log(beta2) * B  # noqa: E731  (in examples, so in tokens)
    assert half_life(d.beta2, 200) == pytest.approx(half_life(0.99, 64))
    assert 200 / (d.lr * d.weight_decay) == pytest.approx(64 / (1e-3 * 0.1))  # AdamW's timescale B / (lr wd)
    assert d.second_moment_scale == pytest.approx((1 + 100 / 200) / (1 + 100 / 4))  # from the 4 it started at
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": 0.1}, {"params": [q], "weight_decay": 0.0}], lr=1.0)
    (p.sum() + q.sum()).backward()
    opt.step()
    before = opt.state[p]["exp_avg_sq"].clone()
    schedules.BatchSizeController.apply(opt, d)
    g_decay, g_rest = opt.param_groups
    assert g_decay["lr"] == d.lr and g_decay["betas"] == (0.9, d.beta2) and g_decay["weight_decay"] == d.weight_decay
    assert g_rest["weight_decay"] == 0.0  # parameters without decay keep none
    bias = (1 - d.beta2) / (1 - 0.999)  # one step taken at torch's default beta2 0.999 (see the next test)
    assert torch.allclose(opt.state[p]["exp_avg_sq"], before * d.second_moment_scale * bias)
    assert not ctl.decide(1e-3).switched and ctl.decide(1e-3).second_moment_scale == 1.0


def test_apply_keeps_adams_bias_correction_right_when_beta2_changes():
    """Issue 48: torch divides exp_avg_sq by 1 - beta2^t with the beta2 of the step, although the average was built
    with the old one; after 20 steps at 0.999 a switch to 0.99 read it 8x too small. apply rescales it so that the
    corrected second moment is the same just before and after, and the next steps weigh the new gradients as an
    average (weights summing to one) should."""
    import torch

    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(30)]
    p = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.999))
    for g in grads[:20]:
        p.grad = g.clone()
        opt.step()
    t = float(opt.state[p]["step"])
    corrected = opt.state[p]["exp_avg_sq"] / (1 - 0.999**t)
    truth = sum(0.999 ** (19 - i) * grads[i] ** 2 for i in range(20)) * 0.001 / (1 - 0.999**20)
    assert torch.allclose(corrected, truth, rtol=1e-5)
    d = schedules.Decision(4, 64, 1e-3, 0.99, None, 1.0, True, 10.0)
    schedules.BatchSizeController.apply(opt, d)
    assert torch.allclose(opt.state[p]["exp_avg_sq"] / (1 - 0.99**t), corrected, rtol=1e-6)  # the same average
    p.grad = grads[20].clone()
    opt.step()
    after = opt.state[p]["exp_avg_sq"] / (1 - 0.99 ** (t + 1))
    expected = (0.99 * (1 - 0.99**t) * corrected + 0.01 * grads[20] ** 2) / (1 - 0.99 ** (t + 1))
    assert torch.allclose(after, expected, rtol=1e-5)
    without = (0.99 * truth * (1 - 0.999**20) + 0.01 * grads[20] ** 2) / (1 - 0.99 ** (t + 1))  # torch alone
    assert (without / expected).mean() < 0.3  # what it would have read: several times too small


def test_temper_lowers_the_temperature_as_the_gns_grows_and_grows_the_batch_within_cap_x_gns():
    """'temper': the temperature is min(1, anchor / G)^(log 2 / log ratio), G the largest resolved GNS so far (a
    lower bound: exact norms here, so the estimate itself); the batch doubles (LR x sqrt 2) while 2B <= cap x GNS."""
    ctl = controller("temper", base_batch_size=64, anchor=32.0, cap=2.5, start_accum_steps=16, max_accum_steps=1024)
    assert ctl.decide(1e-2).temperature == 1.0 and ctl.decide(1e-2).batch_size == 64  # nothing measured yet
    seen = []
    for gns in [16.0] * 3 + [64.0] * 30 + [128.0] * 30 + [40.0] * 30 + [512.0] * 40:
        ctl.observe(*exact_step(1.0, gns, ctl.accum * 4))
        d = ctl.decide(1e-2)
        seen.append((gns, d))
    for gns, d in seen:
        assert d.lr == pytest.approx(1e-2 * math.sqrt(d.batch_size / 64) * d.temperature)
    by_gns = {gns: d for gns, d in seen}  # the last decision at each level
    assert by_gns[16.0].temperature == 1.0 and by_gns[16.0].batch_size == 64  # 2 x 64 > 2.5 x 16: kept
    # (the GNS's average lags a step change: within 5% after 30 steps)
    assert by_gns[64.0].temperature == pytest.approx(0.5, rel=0.05) and by_gns[64.0].batch_size == 128
    assert by_gns[128.0].temperature == pytest.approx(0.25, rel=0.05) and by_gns[128.0].batch_size == 256
    assert by_gns[40.0].temperature == by_gns[128.0].temperature and by_gns[40.0].batch_size == 256  # no way back
    assert by_gns[512.0].temperature == pytest.approx(1 / 16, rel=0.05) and by_gns[512.0].batch_size == 1024
    temps = [d.temperature for _, d in seen]
    assert temps == sorted(temps, reverse=True)
    slow = controller("temper", base_batch_size=64, anchor=32.0, ratio=4.0)  # halves per 4-fold growth
    for _ in range(30):
        slow.observe(*exact_step(1.0, 128.0, 64))
    assert slow.decide(1e-2).temperature == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("rule", schedules.CONTROLLER_RULES)
def test_controller_state_round_trips_through_json_and_resumes_exactly(rule):
    import json

    rng = np.random.default_rng(1)
    trace = [exact_step(1.0 / (1 + i / 30), (2 + i) / (1 + i / 30) * rng.uniform(0.7, 1.3), 16) for i in range(80)]

    def run(ctl, steps, start=0):
        out = []
        for i, step in enumerate(steps, start):
            d = ctl.decide(1e-3 * (1 - i / 100), 1 - i / 100)
            out.append(d)
            ctl.observe(*step, step_seconds=0.003 + 0.0002 * d.batch_size)
        return out

    whole = run(controller(rule, beta2=0.99, weight_decay=0.1), trace)
    first = controller(rule, beta2=0.99, weight_decay=0.1)
    run(first, trace[:40])
    resumed = controller(rule, beta2=0.99, weight_decay=0.1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert run(resumed, trace[40:], 40) == whole[40:]
    other = "grow" if rule != "grow" else "sqrt"
    with pytest.raises(ValueError, match=f"ran rule {rule!r}"):
        controller(other).load_state_dict(first.state_dict())


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(rule="cubic"), "unknown controller rule 'cubic'"),
        (dict(min_accum_steps=4, max_accum_steps=2), "need 1 <= min_accum_steps"),
        (dict(cap=0.0), "cap > 0"),
    ],
)
def test_controller_bad_settings_are_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        controller(**kw)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sqrt", "grow", "temper"])
def test_a_controller_in_train_py_moves_the_batch_and_resumes_exactly(tmp_path, shakespeare_data, rule):
    """--bs_schedule=sqrt|grow: the batch moves in whole micro-batches, the LR follows the coupling, and a run
    resumed from its checkpoint at iteration 4 logs what the run never stopped logs (the controller's state is in
    the checkpoint)."""
    common = [
        *TINY,
        "--linearclass=gns",
        "--lnclass=gns",
        "--data_seed=3",
        "--eval_interval=4",
        "--always_save_checkpoint=True",
        f"--bs_schedule={rule}",
        "--bs_min_accum_steps=1",
        "--bs_max_accum_steps=16",
        "--bs_gns_factor=4.0",
        "--bs_cap=16.0",
        "--warmup_tokens=0",
        "--lr_decay_tokens=3000",
        "--min_lr=1e-4",
    ]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_script("train.py", *common, "--max_iters=10", f"--out_dir={whole}").returncode == 0
    first = run_script("train.py", *common, "--max_iters=4", f"--out_dir={part}")
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", *common, "--max_iters=10", "--init_from=resume", f"--out_dir={part}")
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_csv(whole), load_csv(part)
    wall = ["dt", "tokens_per_sec", "mfu"]
    assert len(set(a["batch_size"])) > 1, a["batch_size"].tolist()  # the controller moved the batch
    assert (a["batch_size"] % 4 == 0).all() and (a["batch_size"] == a["gradient_accumulation_steps"] * 4).all()
    pd.testing.assert_frame_equal(a.drop(columns=wall), b.drop(columns=wall), check_exact=True)
