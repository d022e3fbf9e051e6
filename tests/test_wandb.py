"""
--wandb_log=True sends the same metrics as the CSV to wandb (offline mode: no account, no network).

    python -m pytest tests/test_wandb.py -q
"""

import glob
import os
import subprocess
import sys

import pytest

from csv_tools import load_csv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32", "--device_name=cpu",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--max_iters=4",
        "--eval_interval=2", "--eval_iters=2", "--log_interval=1", "--dropout=0.0", "--lnclass=gns", "--linearclass=gns"]


@pytest.mark.slow
def test_wandb_offline_run_gets_the_logged_metrics(tmp_path):
    if not os.path.exists(os.path.join(REPO, "data/shakespeare_char/train.bin")):
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=REPO, check=True, capture_output=True)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    out = subprocess.run([sys.executable, "train.py", *TINY, "--wandb_log=True", f"--out_dir={tmp_path / 'out'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    # the offline run is a binary protobuf log (read back by `wandb sync`); every key of the
    # CSV log must be in it as a history key
    recorded = open(runs[0], "rb").read()
    log = load_csv(tmp_path / "out")
    keys = [c for c in log.columns if c != "step"]
    assert any(k.startswith("train/gns/") for k in keys) and "train/lossf" in keys and "val/loss" in keys
    missing = [k for k in keys if k.encode() not in recorded]
    assert not missing
