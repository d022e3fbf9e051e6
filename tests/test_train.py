"""
End-to-end runs of train.py and gns-analysis.py on the bundled Shakespeare data (CPU, tiny model).

    python -m pytest tests/test_train.py -q
"""

import os
import subprocess
import sys

import pytest

from csv_tools import load_csv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32", "--device_name=cpu",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--gradient_accumulation_steps=2",
        "--max_iters=6", "--eval_interval=3", "--eval_iters=2", "--log_interval=1", "--dropout=0.0"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def shakespeare_data():
    if not os.path.exists(os.path.join(REPO, "data/shakespeare_char/train.bin")):
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=REPO, check=True, capture_output=True)


def run(script, *args):
    return subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_gns_run_logs_every_tracked_parameter_and_analysis_reads_it(tmp_path):
    out = run("train.py", *TINY, "--linearclass=gns", "--embeddingclass=gns", "--lnclass=gns", f"--out_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "gns=" in out.stdout  # the running estimate in the status line
    df = load_csv(tmp_path)
    assert list(df["iter_num"]) == [0, 1, 2, 3, 4, 5, 6]  # six steps and the final evaluation
    assert df["tokens_processed"].iloc[-1] == 6 * 8 * 16
    norms = [c for c in df.columns if c.startswith("train/gns/") and c.endswith("/norm")]
    names = {c.split("/")[2] for c in norms}
    assert "transformer.h.0.ln_1.weight" in names and "transformer.h.1.mlp.c_fc.weight" in names
    assert "transformer.wpe.weight" in names
    assert "transformer.wte.weight+lm_head.weight" in names  # the tied matrix, once, exactly (tied.py)
    assert "transformer.wte.weight" not in names and "lm_head.weight" not in names
    assert (df["train/gns/transformer.h.0.attn.c_attn.weight/batch_size"].dropna() == 8).all()
    assert df[norms].iloc[:6].notna().all().all() and df["val/loss"].notna().iloc[-1]
    analysis = run("gns-analysis.py", str(tmp_path), "--no-plots")
    assert analysis.returncode == 0, analysis.stderr
    final = [line for line in analysis.stdout.splitlines() if line.startswith("Final GNS:")]
    assert final and float(final[0].split(":")[1]) > 0
    assert "Average batch size: 8.0" in analysis.stdout
    assert os.path.exists(tmp_path / "gns_analysis.csv")


def test_plain_run_writes_no_gns_columns(tmp_path):
    out = run("train.py", *TINY, f"--out_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    df = load_csv(tmp_path)
    assert not [c for c in df.columns if "gns" in c]
    assert "GNS" not in out.stderr and "gns=" not in out.stdout
    assert df["grad_norm"].notna().sum() == 6


@pytest.mark.parametrize("flag, message", [
    ("--linearclass=fast", "unknown linearclass 'fast'; choose from ['fused', 'gns', 'gns+sogns', 'nn', 'shim', 'sogns']"),
    ("--lnclass=Shim", "unknown lnclass 'Shim'"),
])
def test_unknown_layer_class_is_a_clear_error(tmp_path, flag, message):
    out = run("train.py", *TINY, flag, f"--out_dir={tmp_path}")
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_batch_of_one_with_gns_is_refused(tmp_path):
    out = run("train.py", *TINY, "--batch_size=1", "--gradient_accumulation_steps=1", "--lnclass=gns", f"--out_dir={tmp_path}")
    assert out.returncode != 0
    assert "at B = 1 it is undefined" in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "log.csv")
