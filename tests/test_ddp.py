"""
Per-example norms under DDP and FSDP2 (torchrun, gloo on CPU) against one process on the same global batch.

    python -m pytest tests/test_ddp.py -q
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "scripts", "tracker_worker.py")


def run_worker(tmp_path, name, nproc=None, engine="ddp"):
    out = tmp_path / f"{name}.json"
    if nproc is None:
        cmd = [sys.executable, WORKER, str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER,
               str(out), engine]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_two_ranks_log_the_same_norms_as_one_process(tmp_path):
    """Each rank's buffer only sees its own examples; the tracker's all-reduce makes
    pegn the mean over all examples of the global batch, and p.grad is DDP's average."""
    single = run_worker(tmp_path, "single")
    ddp = run_worker(tmp_path, "ddp", nproc=2)
    assert set(ddp) == set(single) and len(single) > 30
    for key, value in single.items():
        if key.endswith("/batch_size"):
            assert ddp[key] == value == 8
        else:
            assert ddp[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.slow
def test_fsdp2_trackers_made_before_and_after_sharding_match_one_process(tmp_path):
    """fully_shard replaces every Parameter with a sharded DTensor: the tracker finds the parameters on their
    modules at each read, adds the shards' squared gradient norms and the ranks' per-example sums in one all-reduce."""
    single = run_worker(tmp_path, "single")
    fsdp = run_worker(tmp_path, "fsdp", nproc=2, engine="fsdp")
    assert fsdp["inf_on_rank_1_seen"]  # a GradScaler's skip is decided on every rank's shards
    for when in ("before", "after"):
        assert set(fsdp[when]) == set(single) and len(single) > 30, when
        for key, value in single.items():
            assert fsdp[when][key] == pytest.approx(value, rel=1e-4), (when, key)
