"""
A resume continues the run it claims to continue, or refuses in one line (nanogns/settings.py, resume_check):
through train.py itself, from the checkpoint of a tiny 4-step gns run (checkpoints at steps 2 and 4).

- its log lost: the new rows keep the checkpoint's step numbers, and gns-analysis names the missing steps;
- a nanoGPT checkpoint (no token count, no log step): the token count is iter_num x its tokens per step, said in
  one line, so the token-based learning rate goes on where it was;
- another n_layer or block_size, any other key of the checkpoint's model_args that makes the model (cos_attn,
  spectral_c_attn, ...), another data_seed, or layer classes that would change what the log measures: one line
  naming the flag, the run's files untouched; shim, gns and fused measure the same and may be swapped;
- another run's ckpt.pt copied into a run directory (its run id, or its row of the log, differs) and a log saved
  again as UTF-16: one line, the run's files untouched;
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
        (
            ["--cos_attn=[0]"],
            "--cos_attn=[0] differs from the checkpoint's cos_attn=[]: a resume continues the checkpoint's model; "
            "resume with --cos_attn=[]",
        ),
        (["--fp32_attention_layers=[1]"], "--fp32_attention_layers=[1] differs from the checkpoint's "),
        (["--data_seed=3"], "--data_seed=3 differs from the checkpoint's data_seed=-1: "),
    ],
    ids=["n_layer", "block_size", "layers-nn", "layers-approximate", "cos_attn", "fp32_attention", "data_seed"],
)
def test_a_resume_that_would_change_the_model_or_what_its_log_measures_is_one_line(run, flags, message):
    before = files(run)
    proc = train(run, "--max_iters=6", "--init_from=resume", *flags)
    assert_clean_error(proc, f"train.py: {message}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert files(run) == before  # nothing rewritten (the lock it took is gone)


def test_a_resume_without_a_flag_that_changed_the_models_function_names_it(tmp_path):
    """Without --spectral_c_attn the strict load_state_dict ended in a RuntimeError traceback (and without
    --cos_attn the run trained another model on the same weights, without a word)."""
    out_dir = tmp_path / "spectral"
    spectral = ["--linearclass=nn", "--spectral_c_attn=[1]"]
    proc = train(out_dir, "--max_iters=2", *spectral)
    assert proc.returncode == 0, proc.stderr
    before = files(out_dir)
    proc = train(out_dir, "--max_iters=4", "--init_from=resume", "--linearclass=nn")
    assert_clean_error(
        proc,
        "train.py: --spectral_c_attn=[] differs from the checkpoint's spectral_c_attn=[1]: a resume continues the "
        "checkpoint's model; resume with --spectral_c_attn=[1]",
    )
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert files(out_dir) == before


def test_weights_that_do_not_fit_the_model_are_one_line():
    from nanogns import engines
    from nanogns.errors import CheckpointNotUsable

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {"0.weight": torch.zeros(4, 3), "1.weight": torch.zeros(2, 5), "2.weight": torch.zeros(1)}
    with pytest.raises(CheckpointNotUsable) as refused:
        engines.load_weights(model, state, "out/ckpt.pt")
    assert str(refused.value) == (
        "cannot resume: the weights in out/ckpt.pt do not fit the model these settings build (missing 0.bias, "
        "1.bias; unexpected 2.weight; another shape for 1.weight): resume with the flags the run was trained with "
        "(its config is in the checkpoint and config.json)"
    )
    optimizer = torch.optim.AdamW(model.parameters())
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict()
    with pytest.raises(CheckpointNotUsable, match=r"^cannot resume: the optimizer state in out/ckpt.pt does not fit "):
        engines.load_optimizer_state(engines.OneProcessEngine("cpu"), model, optimizer, other, "out/ckpt.pt")


def test_another_runs_checkpoint_copied_into_a_run_directory_is_refused(run, tmp_path):
    """It was resumed into that run's log without a word (its tokens jumped by more than a step's)."""
    other = tmp_path / "other"
    proc = train(other, "--max_iters=2", "--batch_size=8")
    assert proc.returncode == 0, proc.stderr
    shutil.copy(other / "ckpt.pt", run / "ckpt.pt")
    before = files(run)
    proc = train(run, "--max_iters=6", "--init_from=resume")
    ours = json.loads((run / "config.json").read_text())["run_id"]
    theirs = torch.load(other / "ckpt.pt", weights_only=False)["config"]["run_id"]
    assert_clean_error(
        proc,
        f"train.py: cannot resume: {run / 'ckpt.pt'} was written by another run (run_id={theirs!r}) than the log in "
        f"{run} (run_id={ours!r} in its config.json); its steps would be appended to that run's log: resume the run "
        "this checkpoint belongs to in its own out_dir, or copy ckpt.pt alone into a new --out_dir",
    )
    assert files(run) == before
    # a run directory without the run id (an earlier version's): its log's row at the checkpoint's step tells
    config = json.loads((run / "config.json").read_text())
    del config["run_id"]
    (run / "config.json").write_text(json.dumps(config))
    before = files(run)
    proc = train(run, "--max_iters=6", "--init_from=resume")
    assert_clean_error(
        proc,
        f"train.py: cannot resume: {run / 'ckpt.pt'} does not continue the log in {run}: the log's step 1 (the "
        f"checkpoint's last) has tokens_processed={2 * TOKENS_PER_ITER}, the checkpoint "
        f"tokens_processed={4 * TOKENS_PER_ITER}; its steps would be appended to another run's log",
    )
    assert files(run) == before
    # the same checkpoint in a new out_dir starts a new log from it, as before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(other / "ckpt.pt", fresh / "ckpt.pt")
    proc = train(fresh, "--max_iters=3", "--init_from=resume", "--batch_size=8")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((fresh / "config.json").read_text())["run_id"] == theirs


def test_a_resume_of_a_log_saved_again_as_utf16_is_one_line_and_changes_nothing(run):
    """It ended in a UnicodeDecodeError traceback, after config.json had been rewritten."""
    (run / "log.csv").write_bytes((run / "log.csv").read_text().encode("utf-16"))
    before = files(run)
    proc = train(run, "--max_iters=6", "--init_from=resume")
    assert_clean_error(
        proc,
        f"train.py: cannot continue the log: {run / 'log.csv'} holds UTF-16LE text (as a spreadsheet's \"Unicode "
        f"text\" or an editor's UTF-16 saves it), not the UTF-8 lines a log is written in: convert it with `iconv ",
    )
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert files(run) == before


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


def test_every_key_of_the_checkpoints_model_args_is_compared():
    """Each key that makes the model is refused naming its flag, a key an older checkpoint lacks counts as its
    default, the dataset's vocabulary is compared, and what may change (dropout, device_name) is said."""
    sizes = dict(n_layer=2, n_head=2, n_embd=32, bias=False, block_size=16)
    config = dict(sizes, batch_size=4, dropout=0.0, device_name="cpu", dataset="shakespeare_char")
    config.update(cos_attn=[], spectral_c_attn=[], fp32_attention_layers=[], data_seed=-1)
    model_args = dict(sizes, vocab_size=65, dropout=0.0, device_name="cpu", cos_attn=[1])
    checkpoint = {"config": dict(config), "model_args": model_args}
    assert settings.resume_check(config, checkpoint, has_log=True)[0].startswith(
        "--cos_attn=[] differs from the checkpoint's cos_attn=[1]: a resume continues the checkpoint's model; "
    )
    model_args.update(cos_attn=[], dropout=0.1, device_name="A100")  # and no spectral_c_attn: an older checkpoint
    problem, notes = settings.resume_check(dict(config, spectral_c_attn=[0]), checkpoint, has_log=True)
    assert problem.startswith("--spectral_c_attn=[0]: the checkpoint's model has spectral_c_attn=[] (its model_args ")
    problem, notes = settings.resume_check(config, checkpoint, has_log=True, vocab_size=65)
    assert problem is None and notes == [
        "note: --dropout=0.0 differs from the checkpoint's dropout=0.1 (dropout is a training setting, not part of "
        "the weights (nanoGPT's fine-tuning changes it))",
        "note: --device_name=cpu differs from the checkpoint's device_name='A100' (only the MFU's denominator)",
    ]
    assert settings.resume_check(config, checkpoint, has_log=True, vocab_size=50304)[0] == (
        "--dataset='shakespeare_char' has vocab_size=50304 (its meta.json), where the checkpoint's model has "
        "vocab_size=65: a resume continues the checkpoint's run on its data; prepare the dataset as the run had it "
        "(its meta.json changed), or train a new model in a new out_dir"
    )
    other = dict(config, dataset="openwebtext")
    assert settings.resume_check(other, checkpoint, has_log=True, vocab_size=50304)[0].endswith(
        "resume with the run's --dataset='shakespeare_char'"
    )


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
