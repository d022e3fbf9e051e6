"""
The examples/ scripts: each runs, logs the GNS columns gns-analysis.py reads,
and its per-example norms equal a brute-force loop over examples; the notebook
GPT-2 converted after construction equals the same model built under the
context manager.

    python -m pytest -q tests/test_examples.py
"""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward, per_example_sqnorms_by_loop

from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.monitor import GNSMonitor
from nanogns.runlog.reader import load_csv
from nanogns.runlog.record import read_parameter_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))  # the examples' own helpers (common.py), as a script has them
NAMES = ("nanochat_gpt", "modded_block", "gpt2_notebook")
OUT_DIRS = {"nanochat_gpt": "out-nanochat", "modded_block": "out-modded", "gpt2_notebook": "out-gpt2nb"}  # defaults
STEPS, BATCH = 4, 8


@functools.cache
def example(name):
    """The module examples/<name>.py, imported once (its models and helpers are what the tests use)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tracked_names(name):
    """The names each example should log: every parameter (the tied pair once, '+'-joined; modded's bank once),
    bar modded's embedding."""
    if name == "nanochat_gpt":
        return {n for n, _ in example(name).GPT(vocab_size=65).named_parameters()}
    if name == "modded_block":
        return {n for n, _ in example(name).GPT(vocab_size=65).named_parameters()} - {"embed.weight"}
    names = {n for n, _ in example(name).GPT2(vocab_size=65).named_parameters()} - {"wte.weight"}
    return names - {"lm_head.weight"} | {"wte.weight+lm_head.weight"}


def run_in_parallel(commands, cwd=REPO):
    """{key: CompletedProcess} for {key: argv}, all started at once (the runs are mostly import time)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        key: subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for key, argv in commands.items()
    }
    results = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[key] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (out_dir, script's CompletedProcess, gns-analysis.py's CompletedProcess)}. The scripts run from an
    empty directory without --out_dir: each writes to its default out-<name> there."""
    cwd = tmp_path_factory.mktemp("examples")
    dirs = {name: cwd / OUT_DIRS[name] for name in NAMES}
    scripts = run_in_parallel(
        {
            name: [
                sys.executable,
                os.path.join(REPO, "examples", f"{name}.py"),
                f"--steps={STEPS}",
                f"--batch_size={BATCH}",
            ]
            for name in NAMES
        },
        cwd=cwd,
    )
    analyses = run_in_parallel(
        {name: [sys.executable, "gns-analysis.py", str(dirs[name]), "--no-plots"] for name in NAMES}
    )
    return {name: (dirs[name], scripts[name], analyses[name]) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_and_logs_gns_columns(runs, name):
    out_dir, script, _ = runs[name]
    assert script.returncode == 0, script.stderr
    df = load_csv(out_dir)
    assert len(df) == STEPS
    assert list(df["iter_num"]) == list(range(STEPS))
    assert list(df["tokens_processed"]) == [(i + 1) * BATCH * 32 for i in range(STEPS)]
    logged = {
        c[len("train/gns/") : -len("/norm")] for c in df.columns if c.startswith("train/gns/") and c.endswith("/norm")
    }
    assert logged == tracked_names(name)
    for param in logged:
        norm, pegn, batch = (df[f"train/gns/{param}/{m}"] for m in ("norm", "pegn", "batch_size"))
        assert (batch == BATCH).all()
        assert norm.notna().all() and pegn.notna().all() and (norm > 0).all(), param
        # mean_i |g_i|^2 >= |mean_i g_i|^2 (Jensen); 3% slack for modded's bf16 autocast
        assert (pegn >= 0.97 * norm).all(), param


def test_nanochat_logs_no_norm_columns_and_says_why(runs):
    out_dir, script, _ = runs["nanochat_gpt"]
    params = [c.split("/")[2] for c in load_csv(out_dir).columns if c.startswith("train/gns/")]
    assert params and not [p for p in params if "norm" in p.lower() or ".ln" in p]
    model = example("nanochat_gpt").GPT(vocab_size=65)
    assert not [m for m in model.modules() if "Norm" in type(m).__name__]  # F.rms_norm only: nothing to convert
    assert "LayerNorm-only GNS is unavailable" in script.stdout


def test_modded_reports_its_plain_embedding_untracked_and_logs_its_bank_once(runs):
    out_dir, script, _ = runs["modded_block"]
    assert "not tracked: embed.weight" in script.stdout
    record = read_parameter_record(str(out_dir))
    assert record["mlp_bank"]["kind"] == "Linear" and record["mlp_bank"]["bank_slices"] == 4


def test_gpt2_notebook_logs_the_tied_matrix_once(runs):
    columns = set(load_csv(runs["gpt2_notebook"][0]).columns)
    assert {"train/gns/wte.weight+lm_head.weight/norm", "train/gns/wte.weight+lm_head.weight/pegn"} <= columns
    assert not {"train/gns/wte.weight/norm", "train/gns/lm_head.weight/norm"} & columns


@pytest.mark.parametrize("name", NAMES)
def test_gns_analysis_reads_example_log(runs, name):
    _, _, analysis = runs[name]
    assert analysis.returncode == 0, analysis.stderr
    assert re.search(r"Final GNS: -?[0-9.]+\n", analysis.stdout), analysis.stdout


@pytest.mark.parametrize("name", NAMES)
def test_gns_analysis_final_gns_equals_running_gns(runs, name):
    """Same parameters, same EMA decay (0.95): the script's running GNS is the analysis's final GNS. The run's
    record says nanochat's and modded's lm_head (and nanochat's wte) are untied ordinary parameters, which a
    name rule would drop as reference-style tied columns."""
    _, script, analysis = runs[name]
    running = float(re.search(r"final running GNS (-?[0-9.]+)", script.stdout).group(1))
    final = float(re.search(r"Final GNS: (-?[0-9.]+)", analysis.stdout).group(1))
    assert final == pytest.approx(running, abs=1.5e-4)
    assert f"Processing {len(tracked_names(name))} parameters" in analysis.stdout


# -----------------------------------------------------------------------------
# CastedLinear (weight stored transposed) through functional.linear


@pytest.mark.parametrize("shape", [(1, 7), (5, 7), (1, 3, 7), (4, 5, 7), (2, 3, 5, 7)])
def test_casted_linear_matches_loop_over_examples(shape):
    """float64, odd sizes, batch of 1, 2-D to 4-D input: the buffer's [sum, count] against one backward per example."""
    torch.manual_seed(0)
    layer = example("modded_block").CastedLinear(7, 11).double()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(*shape[:-1], 11, dtype=torch.float64)
    y = layer(x)
    assert torch.allclose(y, x @ layer.weight, rtol=1e-12, atol=1e-12)
    y.backward(grad_out)
    reference = x.detach().reshape(-1, 7).T @ grad_out.reshape(-1, 11)  # dL/dW for W stored (in, out)
    assert torch.allclose(layer.weight.grad, reference, rtol=1e-12, atol=1e-12)
    total, count = layer.weight_pe_sqnorm.tolist()
    loop = per_example_sqnorms_by_loop(layer, x.detach(), grad_out)["weight"]
    assert count == shape[0]
    assert total == pytest.approx(loop.sum().item(), rel=1e-6)  # buffer sums in float32


def test_casted_linear_bf16_autocast_close_to_float32():
    torch.manual_seed(0)
    layer = example("modded_block").CastedLinear(24, 40)
    x, grad_out = torch.randn(6, 9, 24), torch.randn(6, 9, 40)
    layer(x).backward(grad_out)
    want = layer.weight_pe_sqnorm.clone()
    layer.weight_pe_sqnorm.zero_()
    layer.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.backward(grad_out.bfloat16())
    assert layer.weight.grad.dtype == torch.float32 and layer.weight_pe_sqnorm.dtype == torch.float32
    assert layer.weight_pe_sqnorm[1].item() == want[1].item() == 6
    assert layer.weight_pe_sqnorm[0].item() == pytest.approx(want[0].item(), rel=3e-2)
    assert layer.bfloat16().weight_pe_sqnorm.dtype == torch.float32  # PerExampleNormLayer


# -----------------------------------------------------------------------------
# whole models against brute force, with gradient accumulation


def brute_force(model, x, y):
    """{name: (|mean_i g_i|^2, mean_i |g_i|^2)} for every parameter (a tied tensor under its first name), by the
    oracle: each example's gradient (its mean token loss) from one batched forward."""
    losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(dim=1)
    per_example, batch = loss_sqnorms_from_batched_forward(model, losses)
    zero_pe_sqnorm_buffers(model)
    return {n: (batch[n], per_example[n]) for n in batch}


def accumulated_step(model, monitor, x, y, split):
    """Backward of two uneven micro-batches, each loss weighted by its share of the batch; then one monitor step."""
    B = x.size(0)
    losses = []
    for part in (slice(0, split), slice(split, B)):
        loss = F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten())
        (loss * x[part].size(0) / B).backward()
        losses.append(loss.item())
    measurements = monitor.measure(batch_size=B)
    zero_pe_sqnorm_buffers(model)
    return losses, measurements


def converted_nanochat(vocab_size):
    model = example("nanochat_gpt").GPT(vocab_size, block_size=7, n_layer=2, n_head=2, n_embd=12).double()
    return model, example("nanochat_gpt").convert(model)


def converted_gpt2(vocab_size):
    model = example("gpt2_notebook").GPT2(vocab_size, block_size=7, n_layer=2, n_head=2, n_embd=12).double()
    return model, example("gpt2_notebook").convert(model)


def tracked_modded(vocab_size):
    model = example("modded_block").GPT(vocab_size, dim=12, n_layer=2, n_head=2).double()
    return model, GNSMonitor(model)


@pytest.mark.parametrize("build", [converted_nanochat, converted_gpt2, tracked_modded])
def test_example_model_norms_match_brute_force(build):
    torch.manual_seed(0)
    model, monitor = build(vocab_size=23)
    x, y = torch.randint(0, 23, (2, 5, 7), generator=torch.Generator().manual_seed(1))
    _, measurements = accumulated_step(model, monitor, x, y, split=2)
    want = brute_force(model, x, y)
    names = {m.metadata["name"] for m in measurements}
    untracked = {"embed.weight"} if build is tracked_modded else set()
    assert {n.split("+")[0] for n in names} == set(want) - untracked
    if build is converted_gpt2:
        assert "wte.weight+lm_head.weight" in names
    for m in measurements:
        sq_norm, pe_sqnorm = want[m.metadata["name"].split("+")[0]]
        assert m.batch_size == 5
        assert m.norm**2 == pytest.approx(sq_norm, rel=1e-9), m.metadata["name"]
        assert m.rms_pe_norm**2 == pytest.approx(pe_sqnorm, rel=1e-6), m.metadata["name"]  # float32 buffers


def test_notebook_gpt2_converted_equals_context_manager():
    nb = example("gpt2_notebook")
    kwargs = dict(block_size=7, n_layer=2, n_head=2, n_embd=12)
    converted, converted_monitor = nb.build_converted(31, seed=3, **kwargs)
    built, built_monitor = nb.build_in_context(31, seed=3, **kwargs)
    # converted in place: each module an instance of the class built with (nn.LayerNorm's keeps that class too)
    assert all(isinstance(a, type(b)) for a, b in zip(converted.modules(), built.modules(), strict=True))
    assert not any(
        isinstance(m, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm))
        and type(m).__module__.startswith("torch.")
        for m in built.modules()
    )
    for (name_a, a), (name_b, b) in zip(converted.named_parameters(), built.named_parameters(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (converted, built)]
    for step in range(2):
        x, y = torch.randint(0, 31, (2, 5, 7), generator=torch.Generator().manual_seed(step))
        losses_a, measured_a = accumulated_step(converted, converted_monitor, x, y, split=3)
        losses_b, measured_b = accumulated_step(built, built_monitor, x, y, split=3)
        assert losses_a == losses_b
        for (name, a), (_, b) in zip(converted.named_parameters(), built.named_parameters()):
            assert torch.equal(a.grad, b.grad), name
        assert len(measured_a) == len(measured_b) == 28
        assert measured_a == measured_b  # every field of every Measurement, names and steps included
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
