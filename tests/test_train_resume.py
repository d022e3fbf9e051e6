"""
A resume continues the run it claims to continue, or refuses in one line (nanogns/settings.py, resume_check):
through train.py itself, from the checkpoint of a tiny 4-step gns run (checkpoints at steps 2 and 4).

- its log lost: the new rows keep the checkpoint's step numbers, and gns-analysis names the missing steps;
- a nanoGPT checkpoint (no token count, no log step): the token count is iter_num x its tokens per step, said in
  one line, so the token-based learning rate goes on where it was;
- another n_layer or block_size, or layer classes that would change what the log measures: one line naming the
  flag, the run's files untouched; shim, gns and fused measure the same and may be swapped;
- another batch_size: the log's batch_size and tokens_processed record it, config.json holds the new value and
  gns-analysis says where the batch size changed;
- a finished run says which limit ends it and what to raise; the README's resume example has steps left.

    python -m pytest -q tests/test_train_resume.py
"""

import json
import os
import re
import shutil

import pytest
import torch
from conftest import REPO, run_script
from test_train_reliability import ONE_THREAD, TINY, assert_clean_error

from nanogns import settings
from nanogns.analysis import cli as analysis_cli
from nanogns.runlog.reader import load_csv

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shakespeare_data")]
RUN = ["--eval_interval=2", "--always_save_checkpoint=True"]
TOKENS_PER_ITER = 4 * 2 * 16  # batch_size x gradient_accumulation_steps x block_size of TINY


def train(out_dir, *args):
    return run_script("train.py", *TINY, *RUN, *args, f"--out_dir={out_dir}", env=ONE_THREAD)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 4 steps (its checkpoint at iteration 4, its log of steps 0-3), copied by each test."""
    out_dir = tmp_path_factory.mktemp("finished")
    proc = train(out_dir, "--max_iters=4")
    assert proc.returncode == 0, proc.stderr
    return out_dir


@pytest.fixture
def run(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def analysis_lines(out_dir, capsys):
    assert analysis_cli.main([str(out_dir), "--no-plots", "--output-dir", str(out_dir / "analysis")]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_resume_whose_log_was_lost_keeps_the_checkpoints_step_numbers(run, capsys):
    os.remove(run / "log.csv")
    proc = train(run, "--max_iters=6", "--init_from=resume")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"log: warning: no log in {run} to continue, but the checkpoint was saved at step 4: the log starts at "
        "step 4, steps 0..3 are not in it"
    ) in proc.stdout
    log = load_csv(str(run))
    assert log["step"].tolist() == [4, 5] and log["iter_num"].tolist() == [4, 5]
    assert log["tokens_processed"].tolist() == [5 * TOKENS_PER_ITER, 6 * TOKENS_PER_ITER]
    lines = analysis_lines(run, capsys)
    assert any(line.startswith(f"note: {run / 'log.csv'}: no row for 4 step(s) (0-3): ") for line in lines), lines
    assert f"Total tokens processed: {6 * TOKENS_PER_ITER:,}" in lines


def nanogpt_checkpoint(path):
    """The run's checkpoint as nanoGPT's train.py writes it: weights without the token counter, no log step, no
    running GNS, random states or scaler, a config of nanoGPT's keys (its sizes among them)."""
    ours = torch.load(path, map_location="cpu", weights_only=False)
    model = {k: v for k, v in ours["model"].items() if k != "tokens_processed"}
    config = {k: ours["config"][k] for k in ("batch_size", "gradient_accumulation_steps", "block_size", "n_layer")}
    keys = ("optimizer", "model_args", "iter_num", "best_val_loss")
    torch.save({"model": model, **{k: ours[k] for k in keys}, "config": config}, path)


def test_a_nanogpt_checkpoint_resumes_at_iter_num_times_its_tokens_per_step(run):
    """Without the token count the learning-rate warmup would start again from zero tokens: the count is rebuilt
    from the checkpoint's config and said in one line, and the log starts at the checkpoint's iteration."""
    nanogpt_checkpoint(run / "ckpt.pt")
    os.remove(run / "log.csv")
    proc = train(run, "--max_iters=6", "--init_from=resume")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"note: the checkpoint holds no token count (nanoGPT's checkpoints do not): the run continues at 4 iterations "
        f"x {TOKENS_PER_ITER} tokens (its config's gradient_accumulation_steps x batch_size x block_size) = "
        f"{4 * TOKENS_PER_ITER} tokens"
    ) in proc.stdout
    log = load_csv(str(run))
    assert log["step"].tolist() == [4, 5]
    assert log["tokens_processed"].tolist() == [5 * TOKENS_PER_ITER, 6 * TOKENS_PER_ITER]
    warmup_tokens = 100 * 64 * 256  # config/train_shakespeare_char.py's, in tokens
    expected = 1e-3 * (4 * TOKENS_PER_ITER + TOKENS_PER_ITER) / (warmup_tokens + TOKENS_PER_ITER)
    assert log["lr"].iloc[0] == pytest.approx(expected, rel=1e-12)  # the warmup goes on, it does not restart
    assert torch.load(run / "ckpt.pt", weights_only=False)["model"]["tokens_processed"] == 6 * TOKENS_PER_ITER


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--n_layer=3"],
            "--n_layer=3 differs from the checkpoint's n_layer=2: a resume continues the checkpoint's model; resume "
            "with --n_layer=2",
        ),
        (["--block_size=8"], "--block_size=8 differs from the checkpoint's block_size=16: "),
        (
            ["--linearclass=nn", "--embeddingclass=nn", "--lnclass=nn"],
            "--linearclass=nn measures nothing, where the checkpoint's run measured exact per-example norms with "
            "linearclass='gns': its log would change what it records mid-run; resume with --linearclass=gns",
        ),
        (["--linearclass=sogns"], "--linearclass=sogns measures approximate norms, where the checkpoint's run"),
    ],
    ids=["n_layer", "block_size", "layers-nn", "layers-approximate"],
)
def test_a_resume_that_would_change_the_model_or_what_its_log_measures_is_one_line(run, flags, message):
    before = files(run)
    proc = train(run, "--max_iters=6", "--init_from=resume", *flags)
    assert_clean_error(proc, f"train.py: {message}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert files(run) == before  # nothing rewritten (the lock it took is gone)


def test_a_resume_with_another_batch_size_trains_it_and_the_log_and_analysis_say_so(run, capsys):
    proc = train(run, "--max_iters=6", "--init_from=resume", "--batch_size=8")
    assert proc.returncode == 0, proc.stderr
    assert "note: --batch_size=8 differs from the checkpoint's 4: from this step on the log's batch_size" in (
        proc.stdout
    )
    log = load_csv(str(run))
    assert log["step"].tolist() == list(range(6))
    assert log["batch_size"].tolist() == [8, 8, 8, 8, 16, 16]
    per_parameter = log[[c for c in log.columns if c.endswith("/batch_size")]]
    assert (per_parameter.iloc[4:] == 16).all().all() and (per_parameter.iloc[:4] == 8).all().all()
    assert log["tokens_processed"].diff().tolist()[1:] == [128, 128, 128, 256, 256]
    with open(run / "config.json") as f:
        assert json.load(f)["batch_size"] == 8  # what trains now
    lines = analysis_lines(run, capsys)
    assert "Batch size changed 1 time(s): 8 (steps 0-3), then 16 (steps 4-5)" in lines
    assert f"Total tokens processed: {4 * 128 + 2 * 256:,}" in lines


def test_swapping_layers_that_measure_the_same_is_allowed():
    checkpoint = {"config": dict(linearclass="gns", embeddingclass="gns", lnclass="shim"), "model_args": {}}
    config = dict(n_layer=2, n_head=2, n_embd=32, bias=False, block_size=16, batch_size=4)
    checkpoint["model_args"] = {k: config[k] for k in ("n_layer", "n_head", "n_embd", "bias", "block_size")}
    for choice in (
        dict(linearclass="fused", embeddingclass="shim", lnclass="gns"),
        dict(linearclass="shim", embeddingclass="gns", lnclass="fused"),
    ):
        assert settings.resume_check({**config, **choice}, checkpoint, has_log=True) == (None, [])
    # without a log (a copy of ckpt.pt in a new out_dir) what is measured may change: the new log starts afresh
    nn = dict(linearclass="nn", embeddingclass="nn", lnclass="nn")
    assert settings.resume_check({**config, **nn}, checkpoint, has_log=False) == (None, [])
    assert settings.resume_check({**config, **nn}, checkpoint, has_log=True)[0].startswith("--linearclass=nn")


def test_a_finished_run_names_the_limit_that_ends_it_and_the_readme_example_has_steps_left(run):
    proc = train(run, "--max_iters=8", "--max_tokens=512", "--init_from=resume")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"train.py: nothing left to do: the checkpoint in {run} is at iteration 4 and 512 tokens; max_tokens=512 "
        "ends the run; its files are left untouched (raise --max_tokens to train further)"
    )
    assert settings.what_ends(300, 614400, 300, 614400).startswith(
        "max_iters=300 and max_tokens=614,400 end the run; its files are left untouched (raise --max_iters and "
        "--max_tokens to train further, both)"
    )
    # the README's resume example, on the quick start's config: both limits raised past the finished run's
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    example = re.search(r"python train\.py config/train_shakespeare_char_cpu\.py --init_from=resume ([^`\n]*)", readme)
    assert example, "the README shows no resume command for the quick start"
    flags = dict(re.findall(r"--(\w+)=(\S+)", example.group(1)))
    config = {}
    with open(os.path.join(REPO, "config", "train_shakespeare_char_cpu.py")) as f:
        exec(f.read(), config)
    finished_at = (config["max_iters"], config["max_iters"] * config["_tokens_per_iter"])
    assert int(flags["max_iters"]) > finished_at[0] and int(flags["max_tokens"]) > finished_at[1], flags
