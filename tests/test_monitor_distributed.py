"""
Per-example norms under DDP and FSDP2 (torchrun, gloo on CPU) against one process on the same global batch.

    python -m pytest tests/test_monitor_distributed.py -q
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "scripts", "monitor_worker.py")


def run_worker(tmp_path, name, nproc=None, engine="ddp", n_layer=2):
    out = tmp_path / f"{name}.json"
    if nproc is None:
        cmd = [sys.executable, WORKER, str(out), engine, str(n_layer)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            WORKER,
            str(out),
            engine,
            str(n_layer),
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


MAX_STEP_OPS = 40  # a step's read and zeroing: a handful of ops whatever the number of layers (issue 23)


def assert_same_numbers(got, single):
    assert set(got) == set(single) and len(single) > 30
    for key, value in single.items():
        if key.endswith("/batch_size"):
            assert got[key] == value == 8
        else:
            assert got[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.slow
def test_two_ranks_log_the_same_norms_as_one_process(tmp_path):
    """Each rank's buffer only sees its own examples; the monitor's all-reduce makes pegn the mean over all
    examples of the global batch, and p.grad is DDP's average. A 12-block GPT: the step reads every buffer and
    gradient in a few ops (counted as dispatched ops, each about one GPU launch)."""
    single = run_worker(tmp_path, "single", n_layer=12)
    ddp = run_worker(tmp_path, "ddp", nproc=2, n_layer=12)
    assert single.pop("step_ops") <= MAX_STEP_OPS and ddp.pop("step_ops") <= MAX_STEP_OPS
    assert_same_numbers(ddp, single)


@pytest.mark.slow
def test_unequal_shares_of_the_batch_are_exact(tmp_path):
    """5 + 3 examples on two ranks, each loss scaled so that DDP's averaged gradient is the mean over the 8 (as
    token-budget batching gives): every norm and pegn equals one process on the same 8 examples."""
    single = run_worker(tmp_path, "single")
    unequal = run_worker(tmp_path, "unequal", nproc=2, engine="ddp-unequal")
    single.pop("step_ops"), unequal.pop("step_ops")
    assert_same_numbers(unequal, single)


@pytest.mark.slow
def test_fsdp2_trackers_made_before_and_after_sharding_match_one_process(tmp_path):
    """fully_shard replaces every Parameter with a sharded DTensor: the monitor finds the parameters on their
    modules at each read, adds the shards' squared gradient norms and the ranks' per-example sums in one
    all-reduce; a 24-block GPT's step still takes a few ops."""
    single = run_worker(tmp_path, "single", n_layer=24)
    fsdp = run_worker(tmp_path, "fsdp", nproc=2, engine="fsdp", n_layer=24)
    assert fsdp["inf_on_rank_1_seen"]  # a GradScaler's skip is decided on every rank's shards
    assert single.pop("step_ops") <= MAX_STEP_OPS and fsdp.pop("step_ops") <= MAX_STEP_OPS
    for when in ("before", "after"):
        assert_same_numbers(fsdp[when], single)


@pytest.mark.slow
def test_tensor_parallel_layers_are_refused_with_the_reason(tmp_path):
    """Weights sharded by tensor parallelism (a DTensor in the forward): the step is refused, naming it."""
    tp = run_worker(tmp_path, "tp", nproc=2, engine="tp")
    assert "tensor parallelism" in tp["error"] and "DDP, FSDP2, HSDP" in tp["error"], tp
