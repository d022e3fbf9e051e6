"""
Batch-size schedules (nanogns/schedules.py) as pure functions, and one tiny train.py run with
--bs_schedule=linear.

    python -m pytest tests/test_schedules.py -q
"""

import math
import warnings

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
