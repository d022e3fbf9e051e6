"""
The examples/ scripts: each runs, logs GNS columns that gns-analysis.py reads,
and its per-example norms match a brute-force loop over examples; the notebook
GPT-2 converted after construction equals the same model built under the
context manager.

    python -m pytest -q tests/test_examples.py
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from buffered import zero_sqgradnorm_buffers
from csv_tools import load_csv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def load_example(name):
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, expected, absent", [
    # nanochat: untied, and its weightless RMSNorms have nothing to log
    ("nanochat_gpt", ["wte.weight", "lm_head.weight", "blocks.1.attn.c_q.weight", "blocks.0.c_out.weight"], []),
    ("modded_block", ["blocks.0.qkv.weight", "head.weight"], ["embed.weight"]),
    ("gpt2_notebook", ["tok.weight+head.weight", "pos.weight", "blocks.0.ln1.weight", "blocks.1.mlp.2.bias"],
     ["tok.weight", "head.weight"]),
])
def test_example_runs_and_logs_gns(tmp_path, name, expected, absent):
    out = subprocess.run([sys.executable, f"examples/{name}.py", f"--out_dir={tmp_path}", "--steps=4"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "running GNS" in out.stdout
    df = load_csv(tmp_path)
    names = {c[len("train/gns/"):-len("/pegn")] for c in df.columns if c.startswith("train/gns/") and c.endswith("/pegn")}
    assert set(expected) <= names, sorted(names)
    assert not names & set(absent)
    if name == "nanochat_gpt":
        assert len(names) == 2 + 2 * 6  # embedding, head, 6 matrices per block: nothing else has parameters
    assert df[[f"train/gns/{n}/pegn" for n in expected]].notna().all().all() and len(df) == 4
    analysis = subprocess.run([sys.executable, "gns-analysis.py", str(tmp_path), "--no-plots"], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    assert analysis.returncode == 0, analysis.stderr
    assert "Final GNS:" in analysis.stdout


def brute_force(model, x, y):
    """(||batch-mean grad||^2, mean_i ||g_i||^2) per parameter name (first name of a tied tensor)."""
    def loss_fn(xs, ys):
        return F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())

    model.zero_grad(set_to_none=True)
    loss_fn(x, y).backward()
    batch = {n: p.grad.pow(2).sum().item() for n, p in model.named_parameters() if p.grad is not None}
    per_example = dict.fromkeys(batch, 0.0)
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(x[i:i + 1], y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            if n in per_example:
                per_example[n] += p.grad.pow(2).sum().item() / x.shape[0]
    model.zero_grad(set_to_none=True)
    zero_sqgradnorm_buffers(model)
    return batch, per_example


def accumulated_step(model, tracker, x, y):
    """Backward of two micro-batches (mean over the whole batch), then one tracker step."""
    B = x.shape[0]
    for part in (slice(0, B // 2), slice(B // 2, B)):
        n = x[part].shape[0]
        (F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten()) * n / B).backward()
    measurements = {m.metadata["name"]: m for m in tracker.step(batch_size=B)}
    zero_sqgradnorm_buffers(model)
    return measurements


@pytest.mark.parametrize("name", ["nanochat_gpt", "gpt2_notebook"])
def test_converted_example_models_match_brute_force(name):
    example = load_example(name)
    torch.manual_seed(0)
    model_class = example.GPT if name == "nanochat_gpt" else example.GPT2
    model = model_class(vocab_size=29, block_size=12, n_layer=2, n_head=2, n_embd=16).double()
    tracker = example.layer_config.convert(model)
    x, y = torch.randint(0, 29, (2, 5, 12), generator=torch.Generator().manual_seed(1))
    measurements = accumulated_step(model, tracker, x, y)
    batch, per_example = brute_force(model, x, y)
    assert len(measurements) == len(batch)  # named_parameters lists a tied tensor once, as the tracker does
    for tracked_name, m in measurements.items():
        key = tracked_name.split("+")[0]
        assert m.small_batch_norm ** 2 == pytest.approx(per_example[key], rel=1e-6), tracked_name
        assert m.big_batch_norm ** 2 == pytest.approx(batch[key], rel=1e-9), tracked_name


def test_modded_block_casted_linear_matches_brute_force():
    example = load_example("modded_block")
    torch.manual_seed(0)
    model = example.Model(vocab_size=23, dim=16, n_layer=1, n_head=2).double()
    from gnstracking import MeasurementTracker
    tracker = MeasurementTracker.from_model(model)
    assert "embed.weight" in tracker.skipped
    x, y = torch.randint(0, 23, (2, 3, 10), generator=torch.Generator().manual_seed(2))
    measurements = accumulated_step(model, tracker, x, y)
    _, per_example = brute_force(model, x, y)
    assert set(measurements) == {"blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.fc.weight",
                                 "blocks.0.out.weight", "head.weight"}
    for name, m in measurements.items():
        assert m.small_batch_norm ** 2 == pytest.approx(per_example[name], rel=1e-6), name


def test_notebook_gpt2_converted_equals_context_manager():
    example = load_example("gpt2_notebook")
    kwargs = dict(block_size=12, n_layer=2, n_head=2, n_embd=16)
    converted, converted_tracker = example.build_converted(31, **kwargs)
    built, built_tracker = example.build_in_context(31, **kwargs)
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in built.named_parameters()]
    assert [type(m).__name__ for m in converted.modules()] == [type(m).__name__ for m in built.modules()]
    x, y = torch.randint(0, 31, (2, 4, 12), generator=torch.Generator().manual_seed(3))
    for model in (converted, built):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    a = converted_tracker.step(batch_size=4)
    b = built_tracker.step(batch_size=4)
    assert len(a) == len(b) > 20
    for ma, mb in zip(a, b):
        assert ma.metadata["name"] == mb.metadata["name"]
        assert (ma.big_batch_norm, ma.small_batch_norm) == (mb.big_batch_norm, mb.small_batch_norm)
