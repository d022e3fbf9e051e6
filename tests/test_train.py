"""
End-to-end runs of train.py and gns-analysis.py on the bundled Shakespeare data (CPU, tiny model).

    python -m pytest tests/test_train.py -q
"""

import json
import os
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import GNS_LAYERS, TINY, run_script

from nanogns.estimator import RunningGNS
from nanogns.monitor import Measurement, summed_squares
from nanogns.runlog.reader import load_csv
from nanogns.runlog.record import PARAMETERS_JSON

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shakespeare_data")]
STEPS, EXAMPLES, BLOCK = 6, 8, 16  # 4 sequences x 2 accumulation steps of 16 characters


def test_gns_run_logs_every_tracked_parameter_once_per_step_and_analysis_agrees(tmp_path):
    out = run_script(
        "train.py",
        *TINY,
        *GNS_LAYERS,
        f"--max_iters={STEPS}",
        "--eval_interval=3",
        "--always_save_checkpoint=True",
        f"--out_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr
    assert "gns=" in out.stdout  # the running estimate in the status line
    df = load_csv(tmp_path)
    # one row per optimizer step, tokens counted after the step
    assert df["iter_num"].tolist() == list(range(STEPS))
    assert df["tokens_processed"].tolist() == [(i + 1) * EXAMPLES * BLOCK for i in range(STEPS)]
    # every parameter of the model is tracked, as the run's record says: the tied matrix once, exactly
    with open(tmp_path / PARAMETERS_JSON) as f:
        record = json.load(f)["parameters"]
    logged = {c.split("/")[2] for c in df.columns if c.startswith("train/gns/")}
    assert logged == set(record) and len(record) == 15
    assert record["transformer.wte.weight+lm_head.weight"]["kind"] == "Embedding+Linear"
    assert (
        record["transformer.h.1.ln_2.weight"]["kind"] == "LayerNorm"
        and record["transformer.h.1.ln_2.weight"]["block"] == 1
    )
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=65, bias=False))
    assert sum(r["numel"] for r in record.values()) == sum(p.numel() for p in model.parameters())  # 100% of elements
    batch_size_cols = [f"train/gns/{p}/batch_size" for p in record]
    assert (df[batch_size_cols] == EXAMPLES).all().all()  # in every row, for every parameter
    assert df[[f"train/gns/{p}/{m}" for p in record for m in ("norm", "pegn")]].notna().all().all()
    # the first step learns: nanoGPT's warmup (it + 1) / (warmup_iters + 1), in tokens
    warmup_tokens = 100 * 64 * 256  # config/train_shakespeare_char.py: 100 steps of 64 sequences of 256
    assert df["lr"].iloc[0] == pytest.approx(1e-3 * EXAMPLES * BLOCK / (warmup_tokens + EXAMPLES * BLOCK), rel=1e-9)

    # evaluations are written in the row of the step that made the weights they evaluate
    evals = re.findall(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)$", out.stdout, re.MULTILINE)
    assert [int(s) for s, _, _ in evals] == [0, 3, 6]  # step 0: the untrained model, printed, not a row
    rows = df[df["val/loss"].notna()]
    assert rows["iter_num"].tolist() == [2, 5] and rows["tokens_processed"].tolist() == [3 * 128, 6 * 128]
    assert [f"{v:.4f}" for v in rows["val/loss"]] == [v for _, _, v in evals[1:]]
    checkpoint = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=False)
    assert checkpoint["model"]["tokens_processed"].item() == rows["tokens_processed"].iloc[-1]  # the weights evaluated

    # the analysis: the running GNS of train.py (decay 0.95) and gns-analysis (--alpha 0.95) are the same numbers
    running = RunningGNS(decay=0.95)
    for _, row in df.iterrows():
        running.update(
            *summed_squares(
                [Measurement(row[f"train/gns/{p}/norm"], row[f"train/gns/{p}/pegn"], EXAMPLES) for p in record]
            )
        )
    np.testing.assert_allclose(df["gns"].iloc[-1], running.gns, rtol=1e-9)
    analysis = run_script("gns-analysis.py", str(tmp_path), "--no-plots")
    assert analysis.returncode == 0, analysis.stderr
    assert f"Final GNS: {running.gns:.4f}" in analysis.stdout
    assert f"Average batch size: {EXAMPLES}.0" in analysis.stdout
    assert re.search(r"^all\s+15\s", analysis.stdout, re.MULTILINE)
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert len(results) == STEPS

    # sample.py reads the checkpoint (token counter and all) and writes characters of the dataset's vocabulary
    sample = run_script(
        "sample.py", f"--out_dir={tmp_path}", "--device=cpu", "--num_samples=2", "--max_new_tokens=20", "--start=ROMEO:"
    )
    assert sample.returncode == 0, sample.stderr
    samples = sample.stdout.split("---------------")[:2]
    assert len(samples) == 2 and all("ROMEO:" in s and len(s.strip()) >= len("ROMEO:") + 20 for s in samples), (
        sample.stdout
    )


def test_plain_run_writes_no_gns_columns(tmp_path):
    out = run_script("train.py", *TINY, "--max_iters=4", "--eval_interval=2", f"--out_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    df = load_csv(tmp_path)
    assert not [c for c in df.columns if "gns" in c]
    assert "GNS" not in out.stderr and "gns=" not in out.stdout
    assert df["grad_norm"].notna().sum() == 4 and len(df) == 4
    # the config's token schedule outlasts --max_iters=4 (4 x 128 tokens): the start-up says so and how to decay
    assert (
        "note: max_iters=4 ends the run at 512 tokens, before lr_decay_tokens=81,920,000" in out.stdout
        and "add --lr_decay_tokens=512" in out.stdout
    ), out.stdout
    assert not os.path.exists(tmp_path / PARAMETERS_JSON)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--linearclass=fast"],
            "unknown linearclass 'fast'; choose from ['fused', 'gns', 'gns+sogns', 'nn', 'shim', 'sogns']",
        ),
        (["--lnclass=Shim"], "unknown lnclass 'Shim'"),
        (["--batch_size=1", "--gradient_accumulation_steps=1", "--lnclass=gns"], "at B = 1 it is undefined"),
        (
            ["--linearclass=gns", "--spectral_c_attn=[1]"],
            "spectral_c_attn=[1] with linearclass='gns': the spectral norm makes c_attn compute with W / sigma(W)",
        ),
        (["--device=cuda"], "device='cuda' but this torch"),
        (["--fsdp=True"], "fsdp=True shards the model over the processes of torchrun"),
    ],
    ids=["linearclass", "lnclass", "batch-of-one", "spectral", "no-cuda", "fsdp-without-torchrun"],
)
def test_bad_settings_are_one_line_errors(tmp_path, flags, message):
    if "--device=cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device=cuda is valid here")
    out = run_script("train.py", *TINY, "--max_iters=2", *flags, f"--out_dir={tmp_path / 'o'}")
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "o").exists()


def test_ddp_accumulation_not_divisible_by_the_ranks_names_the_options(tmp_path):
    """The paper's config has 15 accumulation steps; on 2 ranks that is an error with the ways out (checked before
    the process group starts, so the environment of a torchrun rank is enough)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = run_script(
        "train.py", *TINY, "--gradient_accumulation_steps=15", "--backend=gloo", f"--out_dir={tmp_path}", env=env
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert (
        "gradient_accumulation_steps=15 counts micro-batches over all 2 ranks, so it must be a multiple of the "
        "number of ranks"
    ) in out.stderr
    assert "--gradient_accumulation_steps=14 or 16, or a number of ranks in [1, 3, 5, 15]" in out.stderr
