"""
The run's CSV log (nanogns/runlog/): LogWrapper and load_csv: the CSV layout, a run in
progress, a killed run, non-finite values, print formatting, out_dir=None.

    python -m pytest -q tests/test_runlog.py
"""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogns.errors import DirectoryHoldsAnotherRun, LogNotContinuable  # noqa: E402
from nanogns.runlog.reader import load_csv  # noqa: E402
from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV, LogWrapper  # noqa: E402


def _write_three_steps(out_dir):
    t = LogWrapper(out_dir=str(out_dir))
    t.log({"a": 1.5})
    t.step()
    t.log({"a": 2.5, "b": "x"})  # b appears mid-run
    t.step()
    t.log({"b": "y"})  # a missing
    t.step()
    return t


def test_columns_appear_mid_run_and_missing_keys_are_empty(tmp_path):
    t = _write_three_steps(tmp_path)
    t.close()
    with open(tmp_path / LOG_CSV) as f:
        lines = f.read().splitlines()
    assert lines == ["step,a,b", "0,1.5,", "1,2.5,x", "2,,y"]
    df = load_csv(tmp_path)
    assert list(df.columns) == ["step", "a", "b"]
    assert df["step"].tolist() == [0, 1, 2]
    assert math.isnan(df["b"][0]) and math.isnan(df["a"][2])
    assert not (tmp_path / HEADER_TMP).exists() and not (tmp_path / DATA_TMP).exists()


def test_run_in_progress_loads_with_short_rows_padded(tmp_path):
    t = _write_three_steps(tmp_path)
    assert not (tmp_path / LOG_CSV).exists()
    with open(tmp_path / DATA_TMP) as f:
        first = f.readline()
    assert first == "0,1.5\n"  # written before column b existed
    df = load_csv(tmp_path)
    assert df["a"].tolist()[:2] == [1.5, 2.5] and df["b"].tolist()[1:] == ["x", "y"]
    assert math.isnan(df["b"][0])
    t.close()


def test_truncated_last_line_is_dropped(tmp_path):
    t = _write_three_steps(tmp_path)
    with open(tmp_path / DATA_TMP, "a") as f:
        f.write("3,9.")  # a row cut off by a kill mid-write
    assert load_csv(tmp_path)["step"].tolist() == [0, 1, 2]
    t.close()  # close() drops it too
    assert load_csv(tmp_path)["step"].tolist() == [0, 1, 2]


def test_step_counter_advances_on_every_step_call(tmp_path):
    t = LogWrapper(out_dir=str(tmp_path))
    t.step()  # nothing logged: no row, but the counter moves
    t.log({"a": 1})
    assert t.log_dict == {"a": 1}
    t.step()
    assert t.log_dict == {}
    t.close()
    assert load_csv(tmp_path)["step"].tolist() == [1]


def test_non_finite_and_exact_floats_round_trip(tmp_path):
    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "third": 1 / 3,
        "f32": np.float32(0.1),
        "f64": np.float64(0.1) + 0.2,
        "big": 2**53 + 1,
    }
    t = LogWrapper(out_dir=str(tmp_path))
    t.log(values)
    t.step()
    t.close()
    with open(tmp_path / LOG_CSV) as f:
        row = f.read().splitlines()[1].split(",")
    assert row[1:4] == ["nan", "inf", "-inf"]
    df = load_csv(tmp_path)
    assert math.isnan(df["nan"][0]) and df["inf"][0] == math.inf and df["ninf"][0] == -math.inf
    assert df["third"][0] == 1 / 3
    assert df["f32"][0] == float(np.float32(0.1))
    assert df["f64"][0] == 0.1 + 0.2
    assert int(df["big"][0]) == 2**53 + 1


def test_config_json_written_with_str_for_unserialisable(tmp_path):
    t = LogWrapper(config={"lr": 0.1, "device": object, "layers": ["gns"]}, out_dir=str(tmp_path))
    t.close()
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["lr"] == 0.1 and config["layers"] == ["gns"] and config["device"] == str(object)


def test_print_formats_like_an_fstring(tmp_path, capsys):
    t = LogWrapper(out_dir=None)
    t.log({"train/lossf": 0.123456, "dt": 0.5, "mfu": 12.345, "tokens_per_sec": 12345.6})
    line = t.print("{train_lossf=:.4f}, dt={dt:.3f}s, {mfu=:.2f}%, {tokens_per_sec=:,.0f}", prefix="iter 3: ")
    expected = "iter 3: train/lossf=0.1235, dt=0.500s, mfu=12.35%, tokens_per_sec=12,346"
    assert line == expected
    assert capsys.readouterr().out == expected + "\n"
    assert t.print("{step} {{literal}}") == "0 {literal}"


def test_print_missing_key_names_available_keys():
    t = LogWrapper()
    t.log({"train/lossf": 1.0, "lr": 0.1})
    with pytest.raises(KeyError, match=r"'val_loss'.*available: \['lr', 'train/lossf'\]"):
        t.print("{val_loss=:.3f}")


def test_out_dir_none_writes_nothing_but_calls_logf(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []
    t = LogWrapper(logf=calls.append, config={"a": 1}, out_dir=None)
    t.log({"x": 1})
    t.log({"x": 2, "y": 3})  # later values overwrite
    t.step()
    t.step()  # nothing logged: logf not called
    t.close()
    t.close()
    assert calls == [{"x": 2, "y": 3}]
    assert list(tmp_path.iterdir()) == []


def test_close_twice_is_safe_and_flushes_pending_values(tmp_path):
    calls = []
    t = LogWrapper(logf=calls.append, out_dir=str(tmp_path))
    t.log({"a": 1})
    t.step()
    t.log({"val/loss": 2.0})  # logged but never stepped
    t.close()
    first = (tmp_path / LOG_CSV).read_text()
    t.close()
    assert (tmp_path / LOG_CSV).read_text() == first
    assert calls == [{"a": 1}, {"val/loss": 2.0}]
    assert load_csv(tmp_path)["val/loss"].tolist()[-1] == 2.0
    with pytest.raises(RuntimeError):
        t.log({"a": 2})


def test_resume_appends_to_a_finished_log(tmp_path):
    _write_three_steps(tmp_path).close()
    t = LogWrapper(out_dir=str(tmp_path), resume=True)
    t.log({"c": 7})
    t.step()
    t.close()
    df = load_csv(tmp_path)
    assert list(df.columns) == ["step", "a", "b", "c"]
    assert df["step"].tolist() == [0, 1, 2, 3]
    assert df["a"].tolist()[:2] == [1.5, 2.5] and df["c"].tolist()[-1] == 7


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("saved_as", ["utf-8-bom", "crlf", "utf-8-bom-crlf"])
@pytest.mark.parametrize("resume_step", [None, 2])
def test_a_resume_continues_a_log_saved_again_by_a_spreadsheet_as_written(tmp_path, saved_as, resume_step):
    """A byte order mark was read into the column `step` (the resume refused it as not this package's log); CR LF
    lines were copied into the new log beside LF ones. Both are read as written, and the log goes on in UTF-8 LF."""
    t = LogWrapper(out_dir=str(tmp_path), config={"n": 1})
    for step in range(3):
        t.log({"a": step + 0.5, "b": f"x{step}"})
        t.step()
    t.close()
    text = (tmp_path / LOG_CSV).read_bytes()
    text = text.replace(b"\n", b"\r\n") if "crlf" in saved_as else text
    (tmp_path / LOG_CSV).write_bytes((b"\xef\xbb\xbf" if "bom" in saved_as else b"") + text)
    t = LogWrapper(out_dir=str(tmp_path), resume=True, resume_step=resume_step)
    t.log({"a": 9.5, "b": "y"})
    t.step()
    t.close()
    kept = 3 if resume_step is None else resume_step
    assert (tmp_path / LOG_CSV).read_bytes().decode().splitlines(keepends=True) == [
        "step,a,b\n",
        *(f"{step},{step + 0.5},x{step}\n" for step in range(kept)),
        f"{kept},9.5,y\n",
    ]


@pytest.mark.parametrize("codec", ["utf-16", "utf-32", "latin-1"])
def test_a_resume_of_a_log_in_another_encoding_is_refused_in_one_line_with_nothing_changed(tmp_path, codec):
    """A log saved as UTF-16 ended the resume in a UnicodeDecodeError traceback, after config.json was rewritten."""
    t = LogWrapper(out_dir=str(tmp_path), config={"n": 1})
    t.log({"a": 1.5, "b": "é" if codec == "latin-1" else "x"})
    t.step()
    t.close()
    (tmp_path / LOG_CSV).write_bytes((tmp_path / LOG_CSV).read_text().encode(codec))
    before = _files(tmp_path)
    with pytest.raises(LogNotContinuable) as refused:
        LogWrapper(out_dir=str(tmp_path), config={"n": 2}, resume=True, resume_step=1)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    if codec == "latin-1":
        assert message.startswith(f"cannot continue the log {tmp_path / LOG_CSV}: it holds bytes that are not UTF-8")
    else:
        assert message.startswith(f"cannot continue the log: {tmp_path / LOG_CSV} holds UTF-"), message
        assert "convert it with `iconv -f UTF-" in message
    assert _files(tmp_path) == before  # config.json not rewritten, no file left beside the log


@pytest.mark.parametrize("left", ["finished", "killed"])
def test_a_new_log_in_a_directory_holding_another_runs_log_is_refused_unless_it_says_resume_or_replace(tmp_path, left):
    """Running the README's library example twice silently replaced out-tiny/log.csv and left the previous run's
    gns_analysis.csv and figures beside it, describing a log no longer there (train.py refuses the same)."""
    first = _write_three_steps(tmp_path)
    if left == "finished":
        first.close()
    else:  # a killed run's .tmp files
        atexit_unregister(first)
    for name in ("gns_parameters.json", "gns_analysis.csv", "gns_emas.png", "log_after_step_2.csv", "notes.txt"):
        (tmp_path / name).write_text("from the first run")
    before = _files(tmp_path)
    with pytest.raises(DirectoryHoldsAnotherRun) as refused:
        LogWrapper(out_dir=str(tmp_path), config={"n": 2})
    found = "log.csv" if left == "finished" else "log_header.csv.tmp, log_data.csv.tmp"
    assert str(refused.value) == (
        f"{str(tmp_path)!r} already holds the log of another run ({found}), which this new log would replace: choose "
        "another out_dir, continue that log with LogWrapper(..., resume=True), or start afresh there with "
        "LogWrapper(..., replace=True)"
    )
    assert _files(tmp_path) == before
    log = LogWrapper(out_dir=str(tmp_path), replace=True)
    log.log({"z": 1})
    log.step()
    log.close()
    assert sorted(os.listdir(tmp_path)) == ["log.csv", "notes.txt"]  # the user's own file stays
    assert load_csv(tmp_path).columns.tolist() == ["step", "z"]
    with pytest.raises(ValueError, match="pass one"):
        LogWrapper(out_dir=str(tmp_path), resume=True, replace=True)


def atexit_unregister(log):
    """Leave a log as a killed run does: its .tmp files, no close() at exit."""
    import atexit

    atexit.unregister(log._close_at_exit)
    log._data.close()


WRITER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    from nanogns.runlog.writer import LogWrapper
    t = LogWrapper(config={{"n": 1}}, out_dir={out!r})
    step = 0
    while True:
        t.log({{"loss": step / 7, "sq": step * step}})
        if step >= 3:
            t.log({{"late": -step}})  # a column that appears mid-run
        t.step()
        print(step, flush=True)
        if step == {exit_at}:
            os._exit(0)  # no close(), no atexit
        step += 1
    """
)


def _check_rows(df, n_completed):
    assert len(df) >= n_completed
    assert df["step"].tolist() == list(range(len(df)))
    assert np.allclose(df["loss"], df["step"] / 7, rtol=0, atol=0)
    assert (df["sq"] == df["step"] ** 2).all()
    late = df["late"].to_numpy()
    assert np.isnan(late[:3]).all() and (late[3:] == -df["step"].to_numpy()[3:]).all()


def test_run_exited_without_close_loads_every_row(tmp_path):
    script = WRITER.format(root=ROOT, out=str(tmp_path), exit_at=9)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / LOG_CSV).exists()
    df = load_csv(tmp_path)
    assert len(df) == 10
    _check_rows(df, 10)


def test_sigkilled_run_loads_every_completed_row(tmp_path):
    script = WRITER.format(root=ROOT, out=str(tmp_path), exit_at=-1)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if int(line) == 25:  # 26 rows reported complete; kill while it keeps writing
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    df = load_csv(tmp_path)
    _check_rows(df, 26)


# -----------------------------------------------------------------------------
# a log as long as a long run's: close() and a resume's rewrite stream it; a full disk is one line


def _write_log_tmp_files(out_dir, rows, columns):
    """A killed run's .tmp files of `rows` steps, each with `columns` values, the first half of the rows short
    (written before the later columns appeared)."""
    names = [f"train/gns/p{i}/norm" for i in range(columns)]
    with open(os.path.join(out_dir, HEADER_TMP), "w") as f:
        f.write(",".join(["step", *names]) + "\n")
    with open(os.path.join(out_dir, DATA_TMP), "w") as f:
        for s in range(rows):
            width = columns if s >= rows // 2 else columns // 2
            f.write(",".join([str(s)] + [repr(0.1 + s + i * 1e-3) for i in range(width)]) + "\n")
    return os.path.getsize(os.path.join(out_dir, DATA_TMP))


def test_close_and_a_resumes_rewrite_stream_the_rows(tmp_path, capsys):
    """Their peak Python memory is a few rows', not the log's (bench/log_writer_memory.py measures a 1 GB log)."""
    size = _write_log_tmp_files(tmp_path, rows=4000, columns=100)
    assert size > 3e6
    tracemalloc.start()
    t = LogWrapper(out_dir=str(tmp_path), resume=True, resume_step=3000)
    resumed = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    t.log({"train/gns/p0/norm": 7.0, "new": 1.0})
    t.step()
    t.close()
    closed = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert resumed < 1e6 and closed < 1e6, (resumed, closed, size)  # reading the whole log would take > size
    assert "log: 1000 row(s) written after the checkpoint (step >= 3000) moved to" in capsys.readouterr().out
    df = load_csv(tmp_path)
    assert df["step"].tolist() == list(range(3001)) and df["new"].notna().tolist() == [False] * 3000 + [True]
    assert df.loc[10, "train/gns/p49/norm"] == 0.1 + 10 + 49e-3 and np.isnan(df.loc[10, "train/gns/p50/norm"])
    assert df.loc[2999, "train/gns/p99/norm"] == 0.1 + 2999 + 99e-3
    aside = pd.read_csv(tmp_path / "log_after_step_3000.csv")
    assert aside["step"].tolist() == list(range(3000, 4000)) and aside.shape[1] == 101


FULL_DISK = """
import resource, sys
from nanogns.runlog.writer import LogWrapper
t = LogWrapper(out_dir=sys.argv[1], config={"a": 1})
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # files stop growing at 20 kB, as on a full disk
try:
    for s in range(100000):
        t.log({"a": float(s), "b": "x" * 100})
        t.step()
except Exception as e:  # what a caller catches: the library raised, it did not exit
    print(f"{type(e).__name__} {e.path}: {e}", file=sys.stderr)
    sys.exit(1)
"""


def test_a_full_disk_raises_one_line_and_the_rows_written_before_are_kept(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"WriteFailed {tmp_path / DATA_TMP}: cannot write the log {tmp_path / DATA_TMP} (File too large): logging "
        "stopped; the rows"
    )
    df = load_csv(tmp_path)  # the .tmp files: every row written before, a row cut by the full disk dropped
    assert len(df) > 100 and df["step"].tolist() == list(range(len(df))) and df["b"].notna().all()
    assert df["a"].tolist() == [float(s) for s in range(len(df))]


def test_a_log_without_a_row_writes_no_log_csv_so_the_same_command_runs_again(tmp_path):
    """A run that fails before its first step (an evaluation that raises) leaves config.json but no log.csv, which
    train.py would take for another run's log; a later LogWrapper starts there without refusal."""
    with pytest.raises(ZeroDivisionError):
        with LogWrapper(out_dir=str(tmp_path), config={"a": 1}):
            1 / 0
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
    with LogWrapper(out_dir=str(tmp_path)) as log:
        log.log({"a": 1.0})
        log.step()
    assert load_csv(str(tmp_path))["a"].tolist() == [1.0]


def test_the_package_errors_are_one_exception_family_that_pickles():
    import pickle

    from nanogns import errors

    raised = [
        errors.DirectoryInUse("out", 42, "out/run.lock"),
        errors.DirectoryHoldsAnotherRun("'out' already holds ...", "out", ["log.csv"]),
        errors.WriteFailed("cannot write the log out/log.csv (No space left on device): ...", "out/log.csv", "full"),
        errors.LogNotContinuable("cannot continue ..."),
        errors.CheckpointNotUsable("cannot resume: ..."),
    ]
    for error in raised:
        assert isinstance(error, errors.NanoGNSError) and isinstance(error, Exception)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.__dict__ == error.__dict__
    assert raised[0].pid == 42 and "pid 42 holds out/run.lock" in str(raised[0])
    import nanogns

    assert all(getattr(nanogns, name) is getattr(errors, name) for name in ("NanoGNSError", "WriteFailed"))
