"""
--wandb_log=True sends the same metrics as the CSV to wandb (offline mode: no account, no network).

    python -m pytest tests/test_wandb.py -q
"""

import glob
import os

import pytest

from conftest import TINY, run_script
from csv_tools import load_csv


@pytest.mark.slow
def test_wandb_offline_run_gets_the_logged_metrics(tmp_path, shakespeare_data):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    out = run_script("train.py", *TINY, "--max_iters=4", "--eval_interval=2", "--lnclass=gns", "--linearclass=gns",
                     "--wandb_log=True", f"--out_dir={tmp_path / 'out'}", env=env)
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
