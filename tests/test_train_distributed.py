"""
train.py under torchrun (2 ranks, gloo, CPU), with DDP and with FSDP2 (--fsdp=True): the
ddp/ columns of the cross-rank GNS (nanogns/monitor/ddp.py), and the per-parameter norms against one
process that sees the same global batch (--data_seed makes the data order independent of
the number of ranks).

    python -m pytest tests/test_train_distributed.py -q
"""

import json
import math
import os
import re
import socket

import numpy as np
import pytest
from conftest import GNS_LAYERS, REPO, TINY, run_script

from nanogns.estimator import two_batch_stats, unbiased_stats
from nanogns.runlog.reader import load_csv

FLAGS = [*TINY, *GNS_LAYERS, "--max_iters=3", "--eval_interval=100", "--gradient_accumulation_steps=4", "--data_seed=7"]
pytestmark = pytest.mark.usefixtures("shakespeare_data")


def train(out_dir, *args, nproc=None):
    out = run_script("train.py", *FLAGS, *args, f"--out_dir={out_dir}", nproc=nproc)
    assert out.returncode == 0, out.stderr[:4000] + "\n...\n" + out.stderr[-4000:]  # a rank's error, then torchrun's
    assert "still referenced when its process group is destroyed" not in out.stderr
    df = load_csv(out_dir)
    df.attrs["output"] = out
    return df


@pytest.mark.slow
def test_two_ranks_log_ddp_gns_and_match_one_process(tmp_path):
    ddp = train(tmp_path / "ddp", "--backend=gloo", nproc=2)
    single = train(tmp_path / "single")
    assert len(ddp) == len(single) == 3
    assert (ddp["batch_size"] == 16).all() and (ddp["gradient_accumulation_steps"] == 4).all()

    # ddp/ columns: each rank's 8 examples against the global 16, raw (gns-analysis forms the EMAs)
    assert (ddp["ddp/small_batch_size"] == 8).all() and (ddp["ddp/big_batch_size"] == 16).all()
    assert not [c for c in ddp.columns if c in ("ddp/gns", "ddp/gtg", "ddp/trsigma")]
    for col in ("ddp/sq_norm_small", "ddp/sq_norm_large"):
        assert np.isfinite(ddp[col]).all(), col
    assert (ddp["ddp/sq_norm_small"] > ddp["ddp/sq_norm_large"]).all()  # a rank's gradient is noisier
    # the averaged buckets are the whole (unclipped) gradient: grad_norm^2
    np.testing.assert_allclose(ddp["ddp/sq_norm_large"], ddp["grad_norm"] ** 2, rtol=1e-5)
    assert not [c for c in single.columns if c.startswith("ddp/")]

    # per-parameter columns: finite, B = the global batch, and equal to one process on the same examples
    cols = [c for c in ddp.columns if c.startswith("train/gns/")]
    assert len(cols) > 30 and set(cols) == {c for c in single.columns if c.startswith("train/gns/")}
    for c in cols:
        assert np.isfinite(ddp[c]).all(), c
        if c.endswith("/batch_size"):
            assert (ddp[c] == 16).all() and (single[c] == 16).all()
        else:
            np.testing.assert_allclose(ddp[c].to_numpy(), single[c].to_numpy(), rtol=1e-4, err_msg=c)
    np.testing.assert_allclose(ddp["grad_norm"].to_numpy(), single["grad_norm"].to_numpy(), rtol=1e-4)
    # rank 0 alone prints the config; torch 2.13's FutureWarning for DDP's broadcast_buffers is not raised
    output = ddp.attrs["output"]
    for line in ("Overriding config with", "tokens per iteration", "number of parameters", "found vocab_size"):
        assert output.stdout.count(line) == 1, line
    assert "broadcast_buffers" not in output.stderr and "FutureWarning" not in output.stderr
    # gns-analysis says what each GNS covers: here every parameter is tracked, by per-example norms
    analysis = run_script("gns-analysis.py", str(tmp_path / "ddp"), "--no-plots")
    assert analysis.returncode == 0, analysis.stderr
    n_params = len(cols) // 3
    record = json.load(open(tmp_path / "ddp" / "gns_parameters.json"))["parameters"]
    elements = sum(entry["numel"] for entry in record.values())
    assert re.search(
        rf"^Final DDP GNS: \S+\n  \(what each covers: Final GNS the {n_params} tracked parameters "
        rf"\(LayerNorm \d+, Linear \d+, Embedding \d+, {elements:,} elements\), from per-example norms; "
        r"Final DDP GNS every trainable parameter",
        analysis.stdout,
        re.MULTILINE,
    ), analysis.stdout


@pytest.mark.slow
def test_a_bad_setting_under_torchrun_is_one_line_above_the_launchers_report(tmp_path):
    out = run_script(
        "train.py", *FLAGS, "--backend=gloo", "--gradient_accumulation_steps=3", f"--out_dir={tmp_path}", nproc=2
    )
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("train.py: ")]
    assert len(ours) == 1 and "multiple of the number of ranks" in lines[ours[0]]
    assert "use --gradient_accumulation_steps=2 or 4" in lines[ours[0]]
    launcher = [i for i, line in enumerate(lines) if "ChildFailedError" in line or "Traceback" in line]
    assert all(i > ours[0] for i in launcher)  # torchrun's report comes after our line
    assert out.stdout.count("Overriding config with") == 1 and not (tmp_path / "log.csv").exists()


@pytest.mark.slow
def test_ddp_gns_needs_no_per_example_layers(tmp_path):
    """The cross-rank GNS compares gradients DDP already has: with torch's layers it is still logged."""
    plain = train(
        tmp_path / "plain", "--backend=gloo", "--linearclass=nn", "--embeddingclass=nn", "--lnclass=nn", nproc=2
    )
    assert not [c for c in plain.columns if c.startswith("train/gns/")]
    assert (plain["ddp/small_batch_size"] == 8).all() and np.isfinite(plain["ddp/sq_norm_small"]).all()


@pytest.mark.slow
def test_two_ranks_follow_a_gns_batch_schedule_together(tmp_path):
    """Rank 0 decides each step's accumulation steps and broadcasts them; a mismatch would hang or fail."""
    df = train(
        tmp_path,
        "--backend=gloo",
        "--bs_schedule=gns",
        "--bs_min_accum_steps=2",
        "--bs_max_accum_steps=8",
        "--max_iters=6",
        nproc=2,
    )
    accum = df["gradient_accumulation_steps"].tolist()
    assert accum[0] == 2 and all(a % 2 == 0 and 2 <= a <= 8 for a in accum)
    assert all(abs(a - b) <= 2 for a, b in zip(accum, accum[1:]))  # one micro-batch per rank per step at most
    assert len(set(accum)) > 1  # the measured GNS (~10) asks for more than 2 x 4 examples
    assert (df["batch_size"] == df["gradient_accumulation_steps"] * 4).all()
    assert (df["ddp/big_batch_size"] == df["batch_size"]).all()
    assert (df["ddp/small_batch_size"] == df["batch_size"] / 2).all()


@pytest.mark.slow
def test_two_ranks_follow_a_batch_size_controller_together(tmp_path):
    """--bs_schedule=sqrt: rank 0's decision (the batch, its LR) is every rank's; the batch moves in whole
    micro-batches of 2 x 4 examples (one per rank)."""
    df = train(
        tmp_path,
        "--backend=gloo",
        "--bs_schedule=sqrt",
        "--bs_gns_factor=4.0",
        "--bs_min_accum_steps=2",
        "--bs_max_accum_steps=16",
        "--max_iters=6",
        nproc=2,
    )
    accum = df["gradient_accumulation_steps"].tolist()
    assert all(a % 2 == 0 and 2 <= a <= 16 for a in accum) and len(set(accum)) > 1, accum
    assert (df["batch_size"] == df["gradient_accumulation_steps"] * 4).all()
    assert (df["ddp/big_batch_size"] == df["batch_size"]).all()


def test_gradient_noise_scale_estimator_recovers_known_statistics():
    """E|g_b|^2 = |G|^2 + tr(Sigma) / b: with |G|^2 = 2, tr(Sigma) = 8, b = 4, B = 16 the inputs are 4 and 2.5."""
    gtg, trsigma = two_batch_stats(4.0, 2.5, 4, 16)
    assert gtg == pytest.approx(2.0) and trsigma == pytest.approx(8.0)
    assert all(math.isnan(v) for v in two_batch_stats(4.0, 2.5, 16, 16))  # one rank: no small batch
    # with small batches of one example it is the per-example estimator
    assert two_batch_stats(10.0, 2.0, 1, 4) == unbiased_stats(2.0, 10.0, 4)


@pytest.mark.slow
def test_fsdp2_run_matches_one_process_and_resumes(tmp_path):
    """--fsdp=True: every block and the root sharded over 2 ranks. Each per-parameter norm and pegn equals one
    process on the same global batch; a checkpoint written at step 2 resumes to the same steps 3 and 4."""
    single = train(tmp_path / "single", "--max_iters=4")
    sharded_dir = tmp_path / "fsdp"
    train(
        sharded_dir,
        "--backend=gloo",
        "--fsdp=True",
        "--max_iters=2",
        "--eval_interval=2",
        "--always_save_checkpoint=True",
        nproc=2,
    )
    sharded = train(
        sharded_dir,
        "--backend=gloo",
        "--fsdp=True",
        "--max_iters=4",
        "--eval_interval=2",
        "--always_save_checkpoint=True",
        "--init_from=resume",
        nproc=2,
    )
    assert sharded["iter_num"].tolist() == single["iter_num"].tolist() == [0, 1, 2, 3]
    cols = [c for c in single.columns if c.startswith("train/gns/")]
    assert len(cols) > 30 and set(cols) == {c for c in sharded.columns if c.startswith("train/gns/")}
    for c in cols + ["grad_norm", "lr"]:  # (train/lossf is rank 0's own last micro-batch)
        np.testing.assert_allclose(sharded[c].to_numpy(), single[c].to_numpy(), rtol=1e-4, err_msg=c)
    assert not [c for c in sharded.columns if c.startswith("ddp/")]  # no DDP comm hook under FSDP2


def test_closing_a_process_group_while_the_model_lives_warns(tmp_path):
    """A DDP or FSDP2 module alive at destroy_process_group() lives on to interpreter exit, where a gloo rank can
    abort ("terminate called without an active exception"); close() says so, and is quiet once the model is freed."""
    script = tmp_path / "close.py"
    script.write_text(
        "import sys, warnings, torch\nfrom nanogns import engines\n"
        "engine = engines.start('cpu', 'gloo', fsdp=False)\n"
        "model = engine.wrap(torch.nn.Linear(3, 2))\n"
        "if sys.argv[1] == 'free':\n"
        "    model = None\n"
        "engine.close()\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=REPO,
    )
    kept = run_script(str(script), "keep", env=env)
    assert kept.returncode == 0, kept.stderr
    assert "DDP: the model is still referenced when its process group is destroyed" in kept.stderr
    freed = run_script(str(script), "free", env=env)
    assert freed.returncode == 0 and "still referenced" not in freed.stderr, freed.stderr
