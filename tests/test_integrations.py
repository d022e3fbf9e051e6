"""
nanogns/integrations.py under the trainers themselves: a tiny Llama and a tiny GPT-2 trained for 2 steps by
transformers.Trainer, Lightning and Accelerate (examples/hf_trainer.py, lightning_gpt.py, accelerate_gpt.py;
accumulation 2, clipping at 1.0 active, float64), in one process and on 2 CPU processes (torchrun, gloo): every
logged `norm` and `pegn` equals a brute-force loop over the examples each step used, with the trainer's own
weighting of them, and gns-analysis reads each run.

    python -m pytest -q tests/test_integrations.py

tests/scripts/integrations_worker.py runs an example and records every training forward's inputs and
parameters, and the gradient norm each optimizer step used after clipping.
"""

import functools
import importlib.util
import math
import os
import re
import shutil
import sys

import pandas as pd
import pytest
import torch
from conftest import REPO, run_script

from nanogns.errors import DirectoryHoldsAnotherRun, DirectoryInUse, NanoGNSError
from nanogns.runlog.lock import LOCK_FILE
from nanogns.runlog.reader import load_csv

sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))

import integrations_worker  # noqa: E402
from common import build_model  # noqa: E402
from test_runlog_lock import hold  # noqa: E402

from nanogns.integrations import sequence_mean_loss  # noqa: E402

FLAGS = ["--steps=2", "--batch_size=2", "--grad_accum=2", "--max_grad_norm=1.0", "--dtype=float64"]
GA, MAX_NORM = 2, 1.0
pytestmark = pytest.mark.filterwarnings("ignore")


@functools.cache
def gns_analysis():
    spec = importlib.util.spec_from_file_location("gns_analysis", os.path.join(REPO, "gns-analysis.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def labels_of(inputs):
    """The labels of a recorded forward: passed to the model (Trainer), else the example's rule (ids, -100 on pads)."""
    if "labels" in inputs:
        return inputs["labels"]
    return inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def brute_force(model_name, params, rows, token_weighted, counts_shifted_labels=True):
    """{parameter: (||G||^2, mean_i ||h_i||^2)} by one backward per example, h_i = B x example i's part of G.

    rows: [(inputs of one example, its labels)] of one step (all micro-batches and ranks). token_weighted: the
    step's loss is the sum of its n_i token losses over N (Trainer's default), so example i's part is n_i / N
    times the gradient of its mean token loss; else the loss is the mean over examples of that. N is the number
    of labels Trainer counts: the shifted ones (the loss's terms), or, for a model whose config names no
    loss_type (GPT-2 from a config), every label (one more per sequence whose first label is not -100)."""
    model = build_model(
        model_name,
        vocab_size=params["model.embed_tokens.weight" if model_name == "llama" else "transformer.wte.weight"].shape[0],
        block_size=32,
    ).double()
    model.load_state_dict(params, strict=False)
    B = len(rows)
    tokens = [int(labels[1:].ne(-100).sum()) for _, labels in rows]
    N = sum(tokens) if counts_shifted_labels else sum(int(labels.ne(-100).sum()) for _, labels in rows)
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    pe_sqnorm = {n: 0.0 for n in total}
    for (inputs, labels), n_i in zip(rows, tokens):
        model.zero_grad(set_to_none=True)
        sequence_mean_loss(model(**{k: v[None] for k, v in inputs.items()}).logits, labels[None]).backward()
        weight = B * n_i / N if token_weighted else 1.0
        for n, p in model.named_parameters():
            h = weight * p.grad
            total[n] += h / B
            pe_sqnorm[n] += h.pow(2).sum().item() / B
    return {n: (total[n].pow(2).sum().item(), pe_sqnorm[n]) for n in total}


def check_run(out_dir, name, model_name, token_weighted, ranks=1, clipping=True):
    """Compare out_dir/log.csv with the brute force over the recorded steps; check clipping; run gns-analysis."""
    records = [torch.load(os.path.join(out_dir, f"records_rank{r}.pt"), weights_only=False) for r in range(ranks)]
    log = load_csv(str(out_dir))
    steps = len(records[0]["forwards"]) // GA
    assert steps == 2 and len(log) == 2, (steps, len(log))
    for step in range(steps):
        rows = []
        for rec in records:
            for forward in rec["forwards"][GA * step : GA * (step + 1)]:
                inputs = {
                    k: v for k, v in forward["inputs"].items() if k in ("input_ids", "attention_mask", "position_ids")
                }
                labels = labels_of(forward["inputs"])
                rows += [({k: v[i] for k, v in inputs.items()}, labels[i]) for i in range(labels.shape[0])]
        assert len({int(labels.ne(-100).sum()) for _, labels in rows}) > 1  # padded: token weighting matters
        want = brute_force(
            model_name,
            records[0]["forwards"][GA * step]["params"],
            rows,
            token_weighted,
            records[0].get("counts_shifted_labels", True),
        )
        logged = [
            c[len("train/gns/") : -len("/norm")]
            for c in log.columns
            if c.startswith("train/gns/") and c.endswith("/norm")
        ]
        inner = "model." if name == "lightning_gpt" else ""  # Lightning logs names in the LightningModule
        assert {n.split("+")[0].removeprefix(inner) for n in logged} == set(want)
        total_sq = 0.0
        for n in logged:
            sq_norm, pe_sqnorm = want[n.split("+")[0].removeprefix(inner)]
            row = log.iloc[step]
            assert row[f"train/gns/{n}/batch_size"] == len(rows)
            assert row[f"train/gns/{n}/norm"] ** 2 == pytest.approx(sq_norm, rel=1e-5), (step, n)
            assert row[f"train/gns/{n}/pegn"] ** 2 == pytest.approx(pe_sqnorm, rel=1e-5), (step, n)
            total_sq += row[f"train/gns/{n}/norm"] ** 2
        # clipping at 1.0 was active: the norms read are the unclipped ones, the optimizer got a gradient of norm 1
        assert math.sqrt(total_sq) > 1.5 * MAX_NORM
        for rec in records:
            assert rec["clipped"][step] == pytest.approx(MAX_NORM if clipping else math.sqrt(total_sq), rel=1e-5)
    assert math.isfinite(log["gns"].iloc[-1])
    assert gns_analysis().main([str(out_dir), "--no-plots"]) == 0
    return records


RUNS = [
    ("hf_trainer", "llama"),
    ("hf_trainer", "gpt2"),
    ("lightning_gpt", "llama"),
    ("lightning_gpt", "gpt2"),
    ("accelerate_gpt", "llama"),
    ("accelerate_gpt", "gpt2"),
]


@pytest.mark.parametrize("name,model_name", RUNS, ids=["-".join(r) for r in RUNS])
def test_one_process_exact_before_clipping(name, model_name, tmp_path, capsys):
    records = integrations_worker.run(name, [*FLAGS, f"--model={model_name}", f"--out_dir={tmp_path}"])
    check_run(tmp_path, name, model_name, token_weighted=name == "hf_trainer")
    if name == "hf_trainer":  # the running GNS in Trainer's log, beside its own (unclipped) grad_norm
        history = records["trainer_log"]
        assert [e["step"] for e in history if "gns" in e] == [1, 2]
        grad_norms = [e["grad_norm"] for e in history if "grad_norm" in e]
        log = load_csv(str(tmp_path))
        norms = [math.sqrt(sum(log[c].iloc[s] ** 2 for c in log.columns if c.endswith("/norm"))) for s in range(2)]
        assert grad_norms == pytest.approx(norms, rel=1e-6)
    if name == "lightning_gpt":  # the running GNS in Lightning's logger
        metrics = pd.read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
        assert metrics["gns"].notna().sum() == 2
        assert metrics["gns"].dropna().iloc[-1] == pytest.approx(load_csv(str(tmp_path))["gns"].iloc[-1])


def test_trainer_sequence_mean_loss_is_the_per_sequence_definition(tmp_path):
    """--loss=sequences (compute_loss overridden): each example's gradient is that of its own mean token loss."""
    integrations_worker.run("hf_trainer", [*FLAGS, "--model=llama", "--loss=sequences", f"--out_dir={tmp_path}"])
    check_run(tmp_path, "hf_trainer", "llama", token_weighted=False)


def test_trainer_without_clipping_reads_the_step_too(tmp_path):
    """max_grad_norm=0: Trainer calls clip_grad_norm_ with an infinite norm (for its grad_norm log); read there."""
    flags = [f for f in FLAGS if not f.startswith("--max_grad_norm")]
    integrations_worker.run("hf_trainer", [*flags, "--max_grad_norm=0", "--model=llama", f"--out_dir={tmp_path}"])
    check_run(tmp_path, "hf_trainer", "llama", token_weighted=True, clipping=False)


DDP_RUNS = [("hf_trainer", "llama"), ("accelerate_gpt", "gpt2"), ("lightning_gpt", "llama")]


@pytest.mark.slow
@pytest.mark.parametrize("name,model_name", DDP_RUNS, ids=["-".join(r) for r in DDP_RUNS])
def test_two_processes_exact_before_clipping(name, model_name, tmp_path):
    out = run_script(
        "tests/scripts/integrations_worker.py", name, *FLAGS, f"--model={model_name}", f"--out_dir={tmp_path}", nproc=2
    )
    assert out.returncode == 0, out.stderr[-8000:]
    check_run(tmp_path, name, model_name, token_weighted=name == "hf_trainer", ranks=2)


def test_examples_run_as_the_readme_says(tmp_path, monkeypatch, capsys):
    """Each example's main(), as `python examples/<name>.py` runs it (its default out_dir, in a fresh directory):
    it trains, prints its final running GNS and leaves a log gns-analysis reads. In this process: the scripts'
    imports are what the runs above load."""
    monkeypatch.chdir(tmp_path)
    scripts = {"hf_trainer": "out-hf-trainer", "lightning_gpt": "out-lightning", "accelerate_gpt": "out-accelerate"}
    for name, out_dir in scripts.items():
        integrations_worker.example(name).main(["--steps=2", "--batch_size=2"])
        assert re.search(
            rf"{name}: llama, 2 steps, 21 parameters tracked: final running GNS \d", capsys.readouterr().out
        )
        assert gns_analysis().main([str(tmp_path / out_dir), "--no-plots"]) == 0


def test_trainer_resume_continues_the_log_and_the_running_gns(tmp_path):
    """A Trainer run checkpointed every 2 steps, killed after step 4 before its second checkpoint (removed here),
    resumed from step 2: its log holds steps 0-3 once, equal to the uninterrupted run's, rows 2-3 of the killed
    run set aside, and the running GNS rebuilt from the rows kept (the logged gns of step 3 is the uninterrupted
    one's). A new run into the same directory is refused and the log kept."""
    trainer_example = integrations_worker.example("hf_trainer")
    flags = ["--steps=4", "--batch_size=2", "--dtype=float64", "--save_steps=2", f"--out_dir={tmp_path}"]
    trainer_example.main(flags)
    whole = load_csv(str(tmp_path))
    shutil.rmtree(tmp_path / "checkpoint-4")
    trainer_example.main([*flags, "--resume"])
    resumed = load_csv(str(tmp_path))
    measured = [c for c in whole.columns if c.endswith(("/norm", "/pegn", "/batch_size")) or c == "gns"]
    assert list(resumed["step"]) == [0, 1, 2, 3] and len(measured) > 3
    pd.testing.assert_frame_equal(resumed[measured], whole[measured], rtol=1e-9, atol=0)
    set_aside = pd.read_csv(tmp_path / "log_after_step_2.csv")
    assert list(set_aside["step"]) == [2, 3]
    with pytest.raises(DirectoryHoldsAnotherRun, match="already holds the GNS log of another run"):
        trainer_example.main(flags)
    pd.testing.assert_frame_equal(load_csv(str(tmp_path)), resumed)


def test_lightning_and_accelerate_keep_another_runs_log_and_accelerate_resumes(tmp_path):
    """Lightning and Accelerate refuse to start a new run over another run's log (kept as it was); Accelerate's
    resume_step continues the log from that step and rebuilds the running GNS from the rows before it."""
    from accelerate import Accelerator

    from nanogns.integrations import AccelerateGNS

    for name in ("lightning_gpt", "accelerate_gpt"):
        out_dir = tmp_path / name
        flags = ["--steps=2", "--batch_size=2", "--dtype=float64", f"--out_dir={out_dir}"]
        integrations_worker.example(name).main(flags)
        before = load_csv(str(out_dir))
        with pytest.raises(DirectoryHoldsAnotherRun, match="already holds the GNS log of another run"):
            integrations_worker.example(name).main(flags)
        pd.testing.assert_frame_equal(load_csv(str(out_dir)), before)
    model = build_model("llama", vocab_size=256, block_size=32).double()
    gns = AccelerateGNS(Accelerator(cpu=True), model, out_dir=str(out_dir), resume_step=1)
    assert gns.steps == 1 and gns.gns == pytest.approx(before["gns"].iloc[0], rel=1e-12)
    gns.close()
    assert list(load_csv(str(out_dir))["step"]) == [0]
    assert list(pd.read_csv(out_dir / "log_after_step_1.csv")["step"]) == [1]


def test_lightning_resume_continues_the_log_and_the_running_gns(tmp_path):
    """A Lightning run checkpointed every 2 steps, resumed from its step-2 checkpoint after step 4: its log holds
    steps 0-3 once, rows 2-3 of the first run set aside, and the running GNS of the resumed steps continues the
    one before the checkpoint (the last logged gns is gns-analysis's EMA over all four rows; without the replay
    it would start afresh at step 2)."""
    lightning_example = integrations_worker.example("lightning_gpt")
    flags = ["--steps=4", "--batch_size=2", "--dtype=float64", "--save_steps=2", f"--out_dir={tmp_path}"]
    lightning_example.main(flags)
    first = load_csv(str(tmp_path))
    lightning_example.main([*flags, f"--ckpt_path={tmp_path / 'checkpoints' / 'step=2.ckpt'}"])
    resumed = load_csv(str(tmp_path))
    assert list(resumed["step"]) == [0, 1, 2, 3]
    pd.testing.assert_frame_equal(resumed.iloc[:2], first.iloc[:2])
    assert list(pd.read_csv(tmp_path / "log_after_step_2.csv")["step"]) == [2, 3]
    from nanogns.analysis.analyze import analyze_gns

    results = analyze_gns(str(tmp_path), alpha=0.95)
    assert resumed["gns"].iloc[-1] == pytest.approx(results["gns"].iloc[-1], rel=1e-9)


def test_a_refused_directory_is_one_line_under_the_trainers(tmp_path):
    """A new run over another run's log stops with one line naming the directory and the fix, also under
    Lightning, which runs callbacks inside its own exception handling; a directory another process is training
    in is refused with that process's pid."""
    from accelerate import Accelerator
    from test_runlog_lock import hold

    from nanogns.integrations import AccelerateGNS

    (tmp_path / "log.csv").write_text("step,gns\n0,1.0\n")
    flags = ["--steps=2", "--batch_size=2", "--dtype=float64", f"--out_dir={tmp_path}"]
    proc = run_script("examples/lightning_gpt.py", *flags)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "GNS" in line] == [
        f"lightning_gpt.py: {str(tmp_path)!r} already holds the GNS log of another run (log.csv), which this new "
        "run would replace: give this run another output directory, or move the old log away (to continue that "
        "run's log instead, resume it from a checkpoint it saved)"
    ]
    holder = hold(tmp_path / "held")
    model = build_model("llama", vocab_size=256, block_size=32).double()
    with pytest.raises(DirectoryInUse, match=rf"^'{tmp_path}/held' is in use by another run \(pid {holder.pid} "):
        AccelerateGNS(Accelerator(cpu=True), model, out_dir=str(tmp_path / "held"))
    holder.stdin.close()
    assert holder.wait() == 0


# -----------------------------------------------------------------------------
# however a run ends, its directory is released; a refusal is an exception, never an exit of the process


def test_a_trainer_run_that_raises_releases_its_directory_and_a_second_train_continues(tmp_path):
    """Trainer.train() interrupted after step 3 (KeyboardInterrupt, as Ctrl-C in a notebook) writes its log and
    releases the lock: train(resume_from_checkpoint=...) on the same trainer, in the same process, runs and
    continues the log from checkpoint-2; a new train() over that log is refused as another run's log, not as a
    directory in use by this very process."""
    from transformers import TrainerCallback

    class InterruptAt(TrainerCallback):
        def __init__(self, step):
            self.step, self.done = step, False

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step and not self.done:
                self.done = True
                raise KeyboardInterrupt

    trainer_example = integrations_worker.example("hf_trainer")
    args = trainer_example.parse_args(
        ["--steps=4", "--batch_size=2", "--dtype=float64", "--save_steps=2", f"--out_dir={tmp_path}"]
    )
    trainer = trainer_example.make_trainer(args, callbacks=[InterruptAt(3)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert not (tmp_path / LOCK_FILE).exists() and (tmp_path / "log.csv").exists()
    assert list(load_csv(str(tmp_path))["step"]) == [0, 1, 2]
    trainer.train(resume_from_checkpoint=True)
    assert list(load_csv(str(tmp_path))["step"]) == [0, 1, 2, 3] and not (tmp_path / LOCK_FILE).exists()
    assert list(pd.read_csv(tmp_path / "log_after_step_2.csv")["step"]) == [2]  # logged after checkpoint-2
    try:
        trainer.train()
    except Exception as e:  # what a script that runs several trainings catches
        assert isinstance(e, DirectoryHoldsAnotherRun) and "already holds the GNS log of another run" in str(e)
    else:
        raise AssertionError("a new run over another run's log was not refused")
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lightning_fit_that_raises_releases_its_directory_and_a_second_fit_continues(tmp_path):
    """fit() raising after step 3 (on_exception closes the log), then a second fit from the step-2 checkpoint in the
    same process runs and continues the log."""
    import lightning as L

    class FailAt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("out of memory (simulated)")

    lightning_example = integrations_worker.example("lightning_gpt")
    flags = ["--steps=4", "--batch_size=2", "--dtype=float64", "--save_steps=2", f"--out_dir={tmp_path}"]
    trainer, module, loader = lightning_example.make_trainer(lightning_example.parse_args(flags), callbacks=[FailAt()])
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.fit(module, loader)
    assert not (tmp_path / LOCK_FILE).exists()
    assert list(load_csv(str(tmp_path))["step"]) == [0, 1, 2]
    lightning_example.main([*flags, f"--ckpt_path={tmp_path / 'checkpoints' / 'step=2.ckpt'}"])
    assert list(load_csv(str(tmp_path))["step"]) == [0, 1, 2, 3] and not (tmp_path / LOCK_FILE).exists()


def test_accelerate_with_block_releases_its_directory_when_the_loop_raises(tmp_path):
    from accelerate import Accelerator

    from nanogns.integrations import AccelerateGNS

    model = build_model("llama", vocab_size=256, block_size=32).double()
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(ZeroDivisionError):
        with AccelerateGNS(Accelerator(cpu=True), model, out_dir=str(tmp_path)) as monitor:
            sequence_mean_loss(model(input_ids=ids).logits, ids).backward()
            monitor.step()
            1 / 0  # the loop fails after one logged step
    assert not (tmp_path / LOCK_FILE).exists() and list(load_csv(str(tmp_path))["step"]) == [0]
    model.zero_grad()
    with AccelerateGNS(Accelerator(cpu=True), model, out_dir=str(tmp_path), resume_step=1) as monitor:
        sequence_mean_loss(model(input_ids=ids).logits, ids).backward()
        monitor.step()
    assert list(load_csv(str(tmp_path))["step"]) == [0, 1] and not (tmp_path / LOCK_FILE).exists()


def test_a_directory_in_use_is_refused_through_every_trainer_as_an_exception(tmp_path):
    """Another process holds out_dir: Trainer, Lightning and Accelerate each raise DirectoryInUse naming its pid,
    caught by `except Exception` (no SystemExit reaches the caller), and nothing is left behind."""
    from accelerate import Accelerator

    from nanogns.integrations import AccelerateGNS

    holder = hold(tmp_path)
    flags = ["--steps=2", "--batch_size=2", "--dtype=float64", f"--out_dir={tmp_path}"]
    runs = {
        "Trainer": lambda: integrations_worker.example("hf_trainer").main(flags),
        "Lightning": lambda: integrations_worker.example("lightning_gpt").main(flags),
        "Accelerate": lambda: AccelerateGNS(
            Accelerator(cpu=True), build_model("llama", vocab_size=256, block_size=32), out_dir=str(tmp_path)
        ),
    }
    for name, run in runs.items():
        try:
            run()
        except Exception as e:
            assert isinstance(e, DirectoryInUse) and isinstance(e, NanoGNSError), (name, e)
            assert f"is in use by another run (pid {holder.pid} holds" in str(e), (name, e)
        else:
            raise AssertionError(f"{name}: a directory in use was not refused")
    holder.stdin.close()
    assert holder.wait() == 0
    assert sorted(os.listdir(tmp_path)) in ([], ["lightning_logs"]), os.listdir(tmp_path)


def test_no_module_of_the_package_exits_its_callers_process():
    """Beside the refusals driven above: no `raise SystemExit`, sys.exit(), exit() or quit() anywhere in nanogns/,
    entry points included (the scripts at the checkout's root and the installed `nanogns-analysis` command, whose
    wrapper pip writes, turn main()'s return code into the exit)."""
    import ast

    found = []
    for folder, _, names in os.walk(os.path.join(REPO, "nanogns")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                text = ast.unparse(node) if isinstance(node, (ast.Raise, ast.Call)) else ""
                if text.startswith("raise SystemExit") or re.match(r"(sys\.exit|exit|quit)\(", text):
                    found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {text[:60]}")
    assert not found, found
