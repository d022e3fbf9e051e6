"""
Reliability (issue 8): resumes continue the run and its log exactly, SIGKILLs at
any point lose nothing, bad input ends with a clear one-line error, and
non-finite steps are logged as such but kept out of the GNS.

    python -m pytest -q tests/test_train_reliability.py

train.py runs in subprocesses with a tiny CPU model (as in tests/test_train.py).
"""

import atexit
import math
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conftest import GNS_LAYERS, run_script  # noqa: E402
from conftest import TINY as TINY_BASE

import nanogns as lc  # noqa: E402
from nanogns import estimator  # noqa: E402
from nanogns import monitor as gnstracking  # noqa: E402
from nanogns.analysis import analyze as ga
from nanogns.analysis import cli as analysis_cli
from nanogns.core.buffers import zero_pe_sqnorm_buffers  # noqa: E402
from nanogns.runlog.reader import load_csv  # noqa: E402
from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV, LogWrapper  # noqa: E402

TINY = [*TINY_BASE, *GNS_LAYERS]
TOKENS_PER_ITER = 4 * 2 * 16
pytestmark = pytest.mark.usefixtures("shakespeare_data")


# one intra-op thread: with two, a fresh process's first call of a float unary op (AdamW's sqrt) can run one
# thread's chunk through a low-accuracy kernel (oneMKL 2024.2's lazy dispatch raced by two threads,
# pytorch/pytorch#188792), so a resumed run's weights can differ from the uninterrupted run's in the last bits
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


def train(*args, cwd=ROOT):
    return run_script("train.py", *TINY, *args, cwd=cwd, env=ONE_THREAD)


def assert_clean_error(proc, *messages):
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    for m in messages:
        assert m in proc.stderr, proc.stderr


def assert_one_row_per_step(out_dir, max_iters):
    """Every row is one optimizer step with its measurements, the last one with the final evaluation."""
    df = load_csv(out_dir)
    assert df["iter_num"].tolist() == list(range(max_iters))
    assert df["step"].tolist() == df["iter_num"].tolist()
    assert df["tokens_processed"].tolist() == [(i + 1) * TOKENS_PER_ITER for i in range(max_iters)]
    assert df["val/loss"].notna().iloc[-1]
    # the check the paper's figures notebook makes on every row: one batch size per step, for every parameter
    batch_size_cols = [c for c in df.columns if c.endswith("/batch_size")]
    assert batch_size_cols and df[batch_size_cols].notna().all().all()
    assert (df[batch_size_cols].nunique(axis=1) == 1).all()
    return df


def load_ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=False)


# -----------------------------------------------------------------------------
# 1. resume


@pytest.mark.slow
def test_resume_restores_weights_optimizer_and_continues_the_log(tmp_path):
    out = str(tmp_path)
    first = train("--max_iters=3", "--eval_interval=3", "--always_save_checkpoint=True", f"--out_dir={out}")
    assert first.returncode == 0, first.stderr
    ckpt3 = load_ckpt(tmp_path / "ckpt.pt")
    assert ckpt3["iter_num"] == 3 and ckpt3["log_step"] == 3
    shutil.copy(tmp_path / "ckpt.pt", tmp_path / "ckpt3.pt")

    # a crash while saving left a half-written ckpt.pt.tmp: ignored and removed, ckpt.pt loads
    with open(tmp_path / "ckpt.pt.tmp", "wb") as f:
        f.write(b"PK\x03\x04 half a checkpoint")
    # nothing left to train: the resumed run writes no row and leaves the checkpoint as it was
    again = train(
        "--max_iters=3", "--eval_interval=3", "--always_save_checkpoint=True", "--init_from=resume", f"--out_dir={out}"
    )
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "ckpt.pt.tmp").exists()
    assert (tmp_path / "ckpt.pt").read_bytes() == (tmp_path / "ckpt3.pt").read_bytes()
    assert_one_row_per_step(out, 3)

    # continue to 6: the optimizer goes on (Adam's step count), the log appends, LR follows the token schedule
    more = train(
        "--max_iters=6", "--eval_interval=3", "--always_save_checkpoint=True", "--init_from=resume", f"--out_dir={out}"
    )
    assert more.returncode == 0, more.stderr
    ckpt6 = load_ckpt(tmp_path / "ckpt.pt")
    assert ckpt6["iter_num"] == 6 and ckpt6["log_step"] == 6
    assert ckpt6["optimizer"]["state"][0]["step"] == 6
    assert ckpt6["model"]["tokens_processed"].item() == 6 * TOKENS_PER_ITER
    df = assert_one_row_per_step(out, 6)
    lr = df["lr"].to_numpy()
    # linear warmup in tokens as nanoGPT's (it + 1) / (warmup_iters + 1): never 0, unbroken at the resume
    np.testing.assert_allclose(lr, lr[0] * np.arange(1, 7), rtol=1e-12)
    assert lr[0] > 0

    # a crash after the iteration-3 checkpoint: rows 3..5 are in the log but not in the weights
    shutil.copy(tmp_path / "ckpt3.pt", tmp_path / "ckpt.pt")
    redo = train(
        "--max_iters=6", "--eval_interval=3", "--always_save_checkpoint=True", "--init_from=resume", f"--out_dir={out}"
    )
    assert redo.returncode == 0, redo.stderr
    assert "moved to" in redo.stdout
    assert pd.read_csv(tmp_path / "log_after_step_3.csv")["step"].tolist() == [3, 4, 5]
    assert_one_row_per_step(out, 6)
    assert load_ckpt(tmp_path / "ckpt.pt")["optimizer"]["state"][0]["step"] == 6


def test_log_wrapper_resume_step_sets_later_rows_aside(tmp_path):
    t = LogWrapper(out_dir=str(tmp_path))
    for s in range(5):
        t.log({"a": float(s)})
        t.step()
    t._data.close()  # as if killed: no close(), the tmp files hold rows 0..4
    atexit.unregister(t._close_at_exit)
    t = LogWrapper(out_dir=str(tmp_path), resume=True, resume_step=3)
    assert t.step_count == 3
    t.log({"a": 30.0})
    t.step()
    t.close()
    df = load_csv(tmp_path)
    assert df["step"].tolist() == [0, 1, 2, 3] and df["a"].tolist() == [0.0, 1.0, 2.0, 30.0]
    assert pd.read_csv(tmp_path / "log_after_step_3.csv")["a"].tolist() == [3.0, 4.0]


# -----------------------------------------------------------------------------
# 2. SIGKILL at pseudo-random points, then resume until done: the same log as a run never stopped

KILL_ITERS = 8
# dropout and evaluation batches draw from the random state (restored from the checkpoint, every rank's);
# --data_seed makes the training batches a function of the iteration
EXACT = [
    f"--max_iters={KILL_ITERS}",
    "--eval_interval=2",
    "--always_save_checkpoint=True",
    "--dropout=0.1",
    "--data_seed=5",
    "--bs_schedule=gns",
    "--bs_min_accum_steps=1",
    "--bs_max_accum_steps=4",
]
WALL_CLOCK = ["dt", "tokens_per_sec", "mfu"]


@pytest.fixture(scope="module")
def reference_log(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    proc = train(*EXACT, f"--out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    return load_csv(out)


def run_and_kill(args, kill_after):
    """Run train.py; SIGKILL it after it printed `kill_after` progress lines (once a checkpoint exists).

    Returns True if it was killed, False if it finished first."""
    proc = subprocess.Popen(
        [sys.executable, "-u", os.path.join(ROOT, "train.py"), *TINY, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ONE_THREAD,
    )
    seen = 0
    saving = False
    saved = "--init_from=resume" in args  # the first run: only once its first checkpoint is complete
    for line in proc.stdout:
        saved = saved or (saving and line.startswith("iter "))
        saving = saving or line.startswith("saving checkpoint")
        if line.startswith(("iter ", "step ", "saving checkpoint")):
            seen += 1
        if saved and seen >= kill_after:  # may land while a later checkpoint is being written
            proc.send_signal(signal.SIGKILL)
            break
    proc.stdout.close()
    rc = proc.wait(timeout=300)
    assert rc in (0, -signal.SIGKILL), rc
    return rc == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkilled_run_resumes_to_the_uninterrupted_log(tmp_path, seed, reference_log):
    rng = random.Random(seed)
    out = str(tmp_path)
    common = [*EXACT, f"--out_dir={out}"]
    killed = run_and_kill(common, rng.randint(3, 14))  # 14: "iter 6" of 17 lines, so the kill lands before the end
    assert killed
    for _ in range(2):  # up to two more kills while resuming
        if not run_and_kill(common + ["--init_from=resume"], rng.randint(1, 12)):
            break
    final = train(*common, "--init_from=resume")
    assert final.returncode == 0, final.stderr
    df = load_csv(out)
    assert len(set(reference_log["batch_size"])) > 1  # the gns schedule moved, and must move the same way
    # every column but the wall-clock ones, every row: equal to the run that was never stopped, bit for bit (with
    # two threads per process, 2 of 79 local kill-and-resume sequences had norms 1e-7 apart: see ONE_THREAD)
    assert list(df.columns) == list(reference_log.columns)
    pd.testing.assert_frame_equal(df.drop(columns=WALL_CLOCK), reference_log.drop(columns=WALL_CLOCK), check_exact=True)
    assert os.path.exists(os.path.join(out, LOG_CSV))
    assert not any(os.path.exists(os.path.join(out, f)) for f in (HEADER_TMP, DATA_TMP, "ckpt.pt.tmp"))
    analysis = subprocess.run(
        [sys.executable, "gns-analysis.py", out, "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert analysis.returncode == 0, analysis.stderr
    assert "Final GNS:" in analysis.stdout


# -----------------------------------------------------------------------------
# 3. bad input: a one-line message naming the problem and the fix, nothing written


@pytest.mark.slow
def test_unknown_config_key(tmp_path):
    proc = train("--batch_sise=4", f"--out_dir={tmp_path / 'o'}")
    assert_clean_error(proc, "unknown config key 'batch_sise'", "did you mean batch_size")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_wrong_type(tmp_path):
    proc = train("--max_iters=ten", f"--out_dir={tmp_path / 'o'}")
    assert_clean_error(proc, "config key 'max_iters'", "expects int", "got str 'ten'")
    assert not (tmp_path / "o").exists()


def make_dataset(root, train_tokens=1000, val_tokens=1000, meta=b"ok"):
    d = root / "data" / "shakespeare_char"
    d.mkdir(parents=True)
    if train_tokens is not None:
        np.arange(train_tokens, dtype=np.uint16).__mod__(65).astype(np.uint16).tofile(d / "train.bin")
    if val_tokens is not None:
        (np.arange(val_tokens, dtype=np.uint16) % 65).astype(np.uint16).tofile(d / "val.bin")
    if meta == b"ok":
        with open(d / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": 65}, f)
    elif meta is not None:
        (d / "meta.pkl").write_bytes(meta)
    return d


@pytest.mark.slow
def test_truncated_meta_pkl(tmp_path):
    good = pickle.dumps({"vocab_size": 65, "itos": {i: chr(i) for i in range(65)}})
    make_dataset(tmp_path, meta=good[: len(good) // 2])
    proc = train(f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(proc, "cannot read data/shakespeare_char/meta.pkl (UnpicklingError: ", "make it again: ")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_block_size_larger_than_the_data(tmp_path):
    make_dataset(tmp_path, val_tokens=16)
    proc = train("--block_size=16", f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(proc, "val.bin holds 16 tokens, too few for block_size=16", "lower --block_size")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("leftover", [LOG_CSV, HEADER_TMP, "grad_accum_schedule.txt"])
@pytest.mark.slow
def test_out_dir_with_another_runs_log_is_refused(tmp_path, leftover):
    (tmp_path / leftover).write_text("step,a\n0,1.0\n")
    before = sorted(os.listdir(tmp_path))
    proc = train("--max_iters=2", f"--out_dir={tmp_path}")
    assert_clean_error(proc, "already holds another run", "choose another --out_dir", "--init_from=resume")
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / leftover).read_text() == "step,a\n0,1.0\n"


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip", None], ids=["empty", "garbage", "missing"])
@pytest.mark.slow
def test_corrupt_or_missing_checkpoint_on_resume(tmp_path, content):
    if content is not None:
        (tmp_path / "ckpt.pt").write_bytes(content)
    proc = train("--init_from=resume", f"--out_dir={tmp_path}")
    if content is None:
        assert_clean_error(proc, "cannot resume: no checkpoint", "--init_from=scratch")
    else:
        assert_clean_error(proc, "is not a readable checkpoint", "fresh out_dir")
    assert not (tmp_path / "config.json").exists() and not (tmp_path / HEADER_TMP).exists()


def test_gns_analysis_on_dirs_without_a_usable_log(tmp_path, capsys):
    # existing behaviour (tests/test_analysis.py covers a missing dir, header-only log, no GNS columns);
    # here: an empty existing dir, a zero-byte log.csv, and a killed run that logged nothing
    empty, zero, killed = tmp_path / "empty", tmp_path / "zero", tmp_path / "killed"
    for d in (empty, zero, killed):
        d.mkdir()
    (zero / LOG_CSV).write_text("")
    (killed / HEADER_TMP).write_text("step\n")
    (killed / DATA_TMP).write_text("")
    for d, message in [(empty, "no log in"), (zero, "is empty"), (killed, "has no rows")]:
        assert analysis_cli.main([str(d), "--no-plots"]) == 1
        err = capsys.readouterr().err
        assert message in err and "gns-analysis.py: error:" in err
        assert not (d / "gns_analysis.csv").exists()


# -----------------------------------------------------------------------------
# 4. numerical faults: a non-finite step is logged as such and left out of the GNS


def test_non_finite_steps_are_logged_and_excluded_from_the_gns(tmp_path):
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", embeddingclass="gns", lnclass="gns")):
        from model import GPT, GPTConfig

        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.0, bias=True))
    tracker = gnstracking.GNSMonitor(model)
    running, clean_running = estimator.RunningGNS(0.9), estimator.RunningGNS(0.9)
    log = LogWrapper(out_dir=str(tmp_path))
    B, micro, n_steps = 4, 2, 8
    bad_param = "transformer.h.0.mlp.c_fc.weight"
    faults = {2: "loss", 5: "grad"}  # step -> inf in the second micro-batch's loss, or in one parameter's gradient
    for step in range(n_steps):
        for m in range(micro):
            x = torch.randint(0, 32, (B, 8))
            _, loss = model(x, torch.roll(x, 1, 1))
            loss = loss / micro
            if m == 1 and faults.get(step) == "loss":
                loss = loss * math.inf  # every gradient and per-example norm becomes inf/nan
            loss.backward()
        if faults.get(step) == "grad":
            model.get_parameter(bad_param).grad[0, 0] = math.inf
        measurements = tracker.measure(batch_size=B * micro)
        zero_pe_sqnorm_buffers(model)
        sums = gnstracking.summed_squares(measurements)
        columns = {
            f"train/gns/{m.metadata['name']}/{key}": value
            for m in measurements
            for key, value in (
                ("norm", m.norm),
                ("pegn", m.rms_pe_norm),
                ("batch_size", m.batch_size),
            )
        }
        log.log({**columns, "gns": running.update(*sums), "iter_num": step})
        if step not in faults:
            clean_running.update(*sums)
        log.step()
        model.zero_grad(set_to_none=True)
    log.close()

    df = load_csv(tmp_path)
    norms = [c for c in df.columns if c.endswith("/norm")]
    pegns = [c.replace("/norm", "/pegn") for c in norms]
    assert len(norms) > 5 and df["step"].tolist() == list(range(n_steps))
    # logged as nan/inf, not dropped
    assert not np.isfinite(df.loc[2, norms + pegns].to_numpy(dtype=float)).any()
    assert df.loc[5, f"train/gns/{bad_param}/norm"] == math.inf
    assert np.isfinite(df.drop(index=[2, 5])[norms + pegns].to_numpy(dtype=float)).all()
    # the online EMAs skipped the faults: unchanged by them, the same as never seeing them
    gns = df["gns"].to_numpy(dtype=float)
    for step in faults:
        np.testing.assert_equal(gns[step], gns[step - 1])
    assert math.isfinite(running.gtg.value) and math.isfinite(running.trsigma.value)
    assert (running.gtg.value, running.trsigma.value) == (clean_running.gtg.value, clean_running.trsigma.value)
    assert tracker.nonfinite_steps == len(faults) and tracker.scaler_skipped_steps == 0  # counted, not hidden

    results = ga.analyze_gns(str(tmp_path), alpha=0.9).set_index("step")
    assert 2 not in results.index  # no finite norm at all: dropped like an eval-only row
    assert math.isnan(results.loc[5, "gtg"]) and math.isnan(results.loc[5, "trsigma"])  # kept, not a measurement
    # analysing the log without the faulty rows gives the same EMAs, and they match the online ones
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    df.drop(index=list(faults)).to_csv(clean_dir / LOG_CSV, index=False)
    clean_results = ga.analyze_gns(str(clean_dir), alpha=0.9)
    for col, online in [("gtg_ema", running.gtg.value), ("trsigma_ema", running.trsigma.value)]:
        assert math.isfinite(results[col].iloc[-1])
        np.testing.assert_allclose(results[col].iloc[-1], clean_results[col].iloc[-1], rtol=1e-12)
        np.testing.assert_allclose(results[col].iloc[-1], online, rtol=1e-9)
    np.testing.assert_allclose(results["gns"].iloc[-1], clean_results["gns"].iloc[-1], rtol=1e-12)


def _tiny_fp16_gpt(lnclass="gns"):
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", embeddingclass="gns", lnclass=lnclass)):
        from model import GPT, GPTConfig

        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.0, bias=True))


@pytest.mark.parametrize("bad", ["loss", "untracked-grad"])
def test_grad_scaler_skipped_steps_are_not_measurements(bad):
    """fp16 autocast + GradScaler: a normal step is measured (scale divided out, within 3e-2 of float32);
    a step the scaler skips for inf/nan yields no measurement, is counted, and the weights stay put,
    also when the inf is in a parameter the tracker does not read (lnclass='nn')."""
    model = _tiny_fp16_gpt(lnclass="gns" if bad == "loss" else "nn")
    reference = _tiny_fp16_gpt(lnclass="gns" if bad == "loss" else "nn")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tracker = gnstracking.GNSMonitor(model, scaler=scaler)
    reference_tracker = gnstracking.GNSMonitor(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))

    _, loss = reference(x, torch.roll(x, 1, 1))
    loss.backward()
    expected = {m.metadata["name"]: m for m in reference_tracker.measure(batch_size=4)}
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, torch.roll(x, 1, 1))
    scaler.scale(loss).backward()
    got = tracker.measure(batch_size=4)
    assert len(got) == len(expected) > 0
    for m in got:
        assert m.rms_pe_norm == pytest.approx(expected[m.metadata["name"]].rms_pe_norm, rel=3e-2)
        assert m.norm == pytest.approx(expected[m.metadata["name"]].norm, rel=3e-2)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    zero_pe_sqnorm_buffers(model)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale()
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, torch.roll(x, 1, 1))
    scaler.scale(loss * (math.inf if bad == "loss" else 1.0)).backward()
    if bad == "untracked-grad":
        assert "transformer.ln_f.weight" in tracker.untracked
        model.transformer.ln_f.weight.grad[0] = math.nan
    assert tracker.measure(batch_size=4) == []
    assert tracker.scaler_skipped_steps == 1 and tracker.nonfinite_steps == 0
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() < scale  # the scaler did skip it
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
