"""
Hostile input and concurrent runs, through train.py and sample.py themselves: a checkpoint or a meta.pkl that
would run code is refused unrun (a marker file never appears); one run per out_dir (two fresh runs at once, a
resume while a run goes, and under torchrun); a bad flag, an unwritable out_dir, GPT-2 weights offline and a
full disk are each one line; sample.py reads its own configurator.py from any directory.

    python -m pytest -q tests/test_train_hostile.py

No test waits on time. A run that must still be going while another starts writes its output to a 4 KiB pipe
(F_SETPIPE_SZ) that the test does not read yet: with more than that left to print, it cannot end (and so
release its lock) until the test reads it. The value range of every flag is tested in tests/test_settings.py.
"""

import fcntl
import json
import os
import pickle
import resource
import select
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_script
from test_analysis_steps import read_only  # noqa: F401 (a fixture)
from test_runlog_lock import hold
from test_train_reliability import ONE_THREAD, TINY, assert_clean_error, assert_one_row_per_step, make_dataset, train

from nanogns.runlog.lock import LOCK_FILE

pytestmark = [pytest.mark.usefixtures("shakespeare_data"), pytest.mark.slow]


class WritesAFile:
    """Unpickling this runs os.system: what a file received from someone else could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tiny_checkpoint(path, dataset="shakespeare_char", **extra):
    """A checkpoint as train.py writes it (the keys sample.py reads), of an untrained 1-layer model."""
    from model import GPT, GPTConfig

    model_args = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, bias=False, vocab_size=65, dropout=0.0)
    model = GPT(GPTConfig(**model_args, device_name="cpu"))
    checkpoint = dict(model=model.state_dict(), model_args=model_args, config={"dataset": dataset}, iter_num=0)
    torch.save({**checkpoint, **extra}, path)


def sample(*args, cwd=REPO):
    return run_script("sample.py", "--device=cpu", "--num_samples=1", "--max_new_tokens=8", *args, cwd=cwd)


# -----------------------------------------------------------------------------
# files are data


def test_a_checkpoint_that_would_run_code_is_refused_by_train_and_sample(tmp_path):
    marker = tmp_path / "marker"
    tiny_checkpoint(tmp_path / "ckpt.pt", optimizer={}, best_val_loss=1.0, payload=WritesAFile(marker))
    refused = (
        f"{tmp_path / 'ckpt.pt'} holds objects other than tensors and plain data (posix.system): it was not loaded"
    )
    proc = train("--init_from=resume", f"--out_dir={tmp_path}")
    assert_clean_error(proc, f"train.py: cannot resume: {refused}")
    assert len(proc.stderr.splitlines()) == 1
    proc = sample(f"--out_dir={tmp_path}")
    assert proc.returncode == 1 and proc.stderr == f"sample.py: {refused}, as loading them could run code " + (
        "(a checkpoint train.py writes never holds them)\n"
    )
    assert not marker.exists() and os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_meta_pkl_that_would_run_code_is_refused_by_train_and_sample(tmp_path):
    marker = tmp_path / "marker"
    make_dataset(tmp_path, meta=pickle.dumps({"vocab_size": 65, "itos": WritesAFile(marker)}))
    proc = train(f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(proc, "train.py: data/shakespeare_char/meta.pkl is not plain data (it names posix.system")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()
    tiny_checkpoint(tmp_path / "ckpt.pt")
    proc = sample(f"--out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith(
        "sample.py: data/shakespeare_char/meta.pkl is not plain data (it names posix.system"
    )
    assert not marker.exists()


def test_sample_reads_its_own_configurator_and_finds_the_data_from_any_directory(tmp_path):
    """Run elsewhere, with a configurator.py there that would write a file: the one beside sample.py is used, and
    the vocabulary comes from the checkout's data/ (meta.json)."""
    marker = tmp_path / "marker"
    (tmp_path / "configurator.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    tiny_checkpoint(tmp_path / "ckpt.pt")
    proc = sample(f"--out_dir={tmp_path}", "--start=ab", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"Loading meta from {os.path.join(REPO, 'data', 'shakespeare_char')}..." in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("Loading meta"))) + 1].startswith("ab")
    assert not marker.exists()


# -----------------------------------------------------------------------------
# one run per directory

RUN = ["--max_iters=64", "--eval_interval=32", "--always_save_checkpoint=True"]


def start(out_dir, *args):
    """train.py with its output on a 4 KiB pipe that is not read yet (see the module docstring)."""
    proc = subprocess.Popen(
        [sys.executable, "-u", os.path.join(REPO, "train.py"), *TINY, *RUN, *args, f"--out_dir={out_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_THREAD,
    )
    fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    return proc


def read_until(proc, prefix):
    """Read proc's output up to the end of the first line starting with `prefix`, one byte at a time: no further
    (the rest, more than the pipe holds, keeps it from ending)."""
    line = b""
    while not line.startswith(prefix.encode()) or not line.endswith(b"\n"):
        line = b"" if line.endswith(b"\n") else line
        byte = os.read(proc.stdout.fileno(), 1)
        assert byte, f"{prefix!r} never came: {proc.communicate()}"
        line += byte


def first_to_end(procs):
    """The process of `procs` that ends first (pidfds: no polling, no sleep)."""
    fds = {os.pidfd_open(p.pid): p for p in procs}
    ready, _, _ = select.select(list(fds), [], [])
    for fd in fds:
        os.close(fd)
    return fds[ready[0]]


def refused_for(proc, holder, out_dir):
    """proc's one line: out_dir is in use by `holder`; proc wrote nothing there."""
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"train.py: {str(out_dir)!r} is in use by another run (pid {holder.pid} holds ")
    assert err.endswith("wait for it to end (or stop it), then resume, or choose another out_dir\n")


def test_two_fresh_runs_at_once_one_runs_and_logs_every_step_once(tmp_path):
    runs = [start(tmp_path), start(tmp_path)]
    loser = first_to_end(runs)
    winner = runs[1 - runs.index(loser)]
    refused_for(loser, winner, tmp_path)
    _, err = winner.communicate(timeout=600)
    assert winner.returncode == 0, err
    assert_one_row_per_step(str(tmp_path), 64)
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_resume_while_the_run_goes_is_refused_and_the_run_logs_every_step_once(tmp_path):
    run = start(tmp_path)
    read_until(run, "Initializing a new model from scratch")  # printed once it holds the lock, 6 kB still to print
    resume = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "train.py"), *TINY, *RUN, "--init_from=resume", f"--out_dir={tmp_path}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_THREAD,
    )
    refused_for(resume, run, tmp_path)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    assert_one_row_per_step(str(tmp_path), 64)


def test_under_torchrun_rank_0_takes_the_lock(tmp_path):
    holder = hold(tmp_path)
    proc = run_script("train.py", *TINY, "--max_iters=2", "--backend=gloo", f"--out_dir={tmp_path}", nproc=2)
    holder.stdin.close()
    holder.wait()
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train.py: ")]
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr
    assert ours[0].startswith(f"train.py: {str(tmp_path)!r} is in use by another run (pid {holder.pid} holds ")
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# one line, nothing created


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--grad_clip=-1.0", "--grad_clip=-1.0 is out of range: it must be a number in [0, inf)"),
        ("--n_head=3", "--n_embd=32 is not divisible by --n_head=3"),
        ("--dtype=float64", "unknown dtype 'float64'"),
        ("--eval_interval=0", "--eval_interval=0 is out of range: it must be an integer >= 1"),
        ("--gns_ema_decay=1.0", "--gns_ema_decay=1.0 is out of range: it must be a number in (0, 1)"),
        ("--max_iters=-5", "--max_iters=-5 is out of range: it must be an integer >= 1"),
        ("--block_size=110000", "val.bin holds 111540 tokens, too few for block_size=110000 with batch_size=4"),
        ("--device=foo", "--device='foo' is not a device: use cpu, cuda, cuda:N (a GPU's index) or mps"),
        pytest.param(
            "--device=mps",
            "--device='mps': this machine or torch build has no MPS (Apple GPU) backend; use --device=cpu",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS"),
        ),
        ("--n_embd=1000000", "the model would have 24,000,086,000,000 parameters (n_layer=2, n_embd=1,000,000, "),
        ("--n_layer=10000000", "the model would have 123,520,002,624 parameters (n_layer=10,000,000, n_embd=32, "),
        ("--eval_iters=100000000000000000000", "--eval_iters=100000000000000000000 is out of range: it must be an "),
    ],
    ids=lambda v: v if v.startswith("--") else "",
)
def test_a_bad_flag_is_one_line_and_creates_nothing(tmp_path, flag, message):
    proc = train("--max_iters=2", flag, f"--out_dir={tmp_path / 'o'}")
    assert_clean_error(proc, f"train.py: {message}" if flag != "--block_size=110000" else message)
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch_size = 4\nmax_iters = = 2\n", "line 2: SyntaxError: invalid syntax"),
        ("batch_size = 4\n\nmax_iters = steps * 2\n", "line 3: NameError: name 'steps' is not defined"),
    ],
    ids=["syntax-error", "unknown-name"],
)
def test_a_config_file_mistake_is_one_line_naming_the_file_and_line(tmp_path, text, message):
    (tmp_path / "my_config.py").write_text(text)
    proc = train(str(tmp_path / "my_config.py"), f"--out_dir={tmp_path / 'o'}")
    assert_clean_error(proc, f"configurator: config file {tmp_path / 'my_config.py'}, {message}")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"vocab_size": 60}, "data/shakespeare_char/train.bin holds token id 64, but vocab_size is 60 (from "),
        ({"vocab_size": 10**13}, "the model would have 320,000,000,025,248 parameters (n_layer=2, n_embd=32, "),
        ("deep", "cannot read data/shakespeare_char/meta.json (it is nested too deeply to be a meta.json)"),
        (
            {"vocab_size": 65, "itos": ["a", "b"]},
            "data/shakespeare_char/meta.json: itos names the characters of 2 of the vocab_size=65 token ids",
        ),
    ],
    ids=["vocab-below-the-data", "vocab-absurd", "deeply-nested", "itos-short"],
)
def test_a_bad_meta_json_is_one_line_for_train_and_sample(tmp_path, meta, message):
    data = make_dataset(tmp_path, meta=None)
    text = '{"vocab_size": 65, "x": ' + "[" * 100000 + "]" * 100000 + "}" if meta == "deep" else json.dumps(meta)
    (data / "meta.json").write_text(text)
    proc = train(f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(proc, f"train.py: {message}")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()
    if "vocab_size is" in message or "would have" in message:
        return  # sample.py reads meta.json for its characters only; the model's vocabulary is the checkpoint's
    tiny_checkpoint(tmp_path / "ckpt.pt")
    proc = sample(f"--out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith(f"sample.py: {message}"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(n_head=3), "have n_embd=16 not divisible by n_head=3"),
        (dict(n_layer=None), "lack n_layer"),
        (dict(n_embd="16"), "have n_embd='16', not a positive integer"),
    ],
    ids=["n_head", "missing-key", "string"],
)
def test_a_checkpoint_whose_model_args_build_no_model_is_one_line_for_train_and_sample(tmp_path, change, problem):
    path = tmp_path / "ckpt.pt"
    tiny_checkpoint(path, optimizer={}, best_val_loss=1.0)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["model_args"].update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        del checkpoint["model_args"][k]
    torch.save(checkpoint, path)
    before = sorted(os.listdir(tmp_path))
    proc = train("--init_from=resume", f"--out_dir={tmp_path}")
    assert_clean_error(
        proc, f"train.py: cannot resume: {path} is not a checkpoint of train.py's GPT (its model_args {problem}); "
    )
    assert len(proc.stderr.splitlines()) == 1 and sorted(os.listdir(tmp_path)) == before
    proc = sample(f"--out_dir={tmp_path}")
    assert proc.returncode == 1 and proc.stderr == (
        f"sample.py: {path} is not a checkpoint of train.py's GPT (its model_args {problem})\n"
    )


def test_sample_start_outside_the_vocabulary_or_a_missing_file_is_one_line(tmp_path):
    tiny_checkpoint(tmp_path / "ckpt.pt")
    proc = sample(f"--out_dir={tmp_path}", "--start=h\u00e9llo")
    meta = os.path.join("data", "shakespeare_char", "meta.json")
    assert proc.returncode == 1 and proc.stderr == (
        f"sample.py: --start holds 1 character(s) not in the vocabulary of {meta} ('\u00e9'); the model knows only "
        "its 65 characters\n"
    )
    proc = sample(f"--out_dir={tmp_path}", f"--start=FILE:{tmp_path / 'prompt.txt'}")
    assert proc.returncode == 1 and proc.stderr == (
        f"sample.py: --start='FILE:{tmp_path / 'prompt.txt'}': cannot read '{tmp_path / 'prompt.txt'}' (No such "
        "file or directory)\n"
    )
    proc = sample(f"--out_dir={tmp_path}", "--device=foo")
    assert proc.returncode == 1 and proc.stderr.startswith("sample.py: --device='foo' is not a device")


def test_an_out_dir_that_is_a_file_or_unwritable_is_one_line(tmp_path, read_only):  # noqa: F811
    (tmp_path / "file").write_text("")
    proc = train(f"--out_dir={tmp_path / 'file'}")
    assert_clean_error(proc, f"train.py: --out_dir={str(tmp_path / 'file')!r} is a file, not a directory")
    (tmp_path / "ro").mkdir()
    read_only(tmp_path / "ro")
    proc = train(f"--out_dir={tmp_path / 'ro' / 'run'}")
    assert_clean_error(proc, f"train.py: cannot write --out_dir={str(tmp_path / 'ro' / 'run')!r} (")
    assert len(proc.stderr.splitlines()) == 1 and os.listdir(tmp_path / "ro") == []


def test_gpt2_weights_offline_are_one_line_and_leave_no_out_dir(tmp_path):
    env = dict(ONE_THREAD, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = run_script("train.py", *TINY, "--init_from=gpt2", f"--out_dir={tmp_path / 'o'}", env=env)
    assert_clean_error(proc, "train.py: cannot load the gpt2 weights (", "run once with a network")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_full_disk_while_saving_is_one_line_and_loses_nothing(tmp_path):
    """Files stop growing at 100 kB (RLIMIT_FSIZE, as a disk that fills): the log's few rows fit, the checkpoint does
    not. The run ends at its first save with one line; the rows logged before it are in log.csv."""
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "train.py"),
            *TINY,
            "--max_iters=4",
            "--eval_interval=2",
            f"--out_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=ONE_THREAD,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)),
        timeout=300,
    )
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"train.py: cannot write the checkpoint {tmp_path / 'ckpt.pt'} (")
    assert "the log is kept; free some space, then continue with --init_from=resume" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["config.json", "gns_parameters.json", "log.csv"]
    from nanogns.runlog.reader import load_csv

    assert load_csv(str(tmp_path))["step"].tolist() == [0, 1]


def test_a_finished_run_resumed_says_nothing_is_left_and_leaves_its_files(tmp_path):
    first = train("--max_iters=2", "--eval_interval=2", "--always_save_checkpoint=True", f"--out_dir={tmp_path}")
    assert first.returncode == 0, first.stderr
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    again = train("--max_iters=2", "--init_from=resume", f"--out_dir={tmp_path}")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == (
        f"train.py: nothing left to do: the checkpoint in {tmp_path} is at iteration 2 and 256 tokens; "
        "max_iters=2 ends the run; its files are left untouched (raise --max_iters to train further)"
    )
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_missing_dataset_names_its_prepare_script_only_where_there_is_one(tmp_path):
    make_dataset(tmp_path, train_tokens=None)
    proc = train(f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(
        proc,
        "train.py: missing data/shakespeare_char/train.bin; prepare the dataset first: data/shakespeare_char has no "
        "prepare.py: put train.bin and val.bin there (uint16 token ids",
        "or choose a --dataset with a prepare.py (none in ./data)",
    )
    (tmp_path / "data" / "shakespeare_char" / "prepare.py").write_text("")
    proc = train(f"--out_dir={tmp_path / 'o'}", cwd=tmp_path)
    assert_clean_error(
        proc,
        "missing data/shakespeare_char/train.bin; prepare the dataset first: python data/shakespeare_char/prepare.py",
    )
    proc = train("--dataset=shakespeare", f"--out_dir={tmp_path / 'o'}")  # nanoGPT's name, not a dataset here
    assert_clean_error(proc, "data/shakespeare has no prepare.py", "(openwebtext, shakespeare_char)")
    assert not (tmp_path / "o").exists()


def test_sigkill_releases_the_lock_of_a_run(tmp_path):
    """A run killed with SIGKILL holds no lock: the next run takes over its stale lock file."""
    run = start(tmp_path)
    read_until(run, "Initializing a new model from scratch")
    run.send_signal(signal.SIGKILL)
    run.communicate()
    assert (tmp_path / LOCK_FILE).read_text() == f"{run.pid}\n"  # left behind, no longer held
    resumed = train("--max_iters=2", "--init_from=resume", f"--out_dir={tmp_path}")
    assert_clean_error(resumed, "train.py: cannot resume: no checkpoint")  # not "in use": the lock went with it
