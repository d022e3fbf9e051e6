"""
--wandb_log=True sends the same metrics as the CSV to wandb (offline mode: no account, no network).

    python -m pytest tests/test_train_wandb.py -q
"""

import glob
import os

import pytest
from conftest import TINY, run_script

from nanogns.runlog.reader import load_csv


@pytest.mark.slow
def test_wandb_offline_run_gets_the_logged_metrics(tmp_path, shakespeare_data):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    out = run_script(
        "train.py",
        *TINY,
        "--max_iters=4",
        "--eval_interval=2",
        "--lnclass=gns",
        "--linearclass=gns",
        "--wandb_log=True",
        f"--out_dir={tmp_path / 'out'}",
        env=env,
    )
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


@pytest.mark.slow
def test_wandb_without_a_login_is_one_line_before_anything_is_made(tmp_path, shakespeare_data):
    """No API key, no ~/.netrc, not offline: one line naming the fix, and no out_dir left behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_DIR=str(tmp_path))
    out = run_script(
        "train.py",
        *TINY,
        "--max_iters=2",
        "--lnclass=gns",
        "--wandb_log=True",
        f"--out_dir={tmp_path / 'out'}",
        env=env,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "train.py: wandb_log=True but wandb has no login (no WANDB_API_KEY, no `wandb login`); log in with "
        "`wandb login`, or log offline with WANDB_MODE=offline (upload later with `wandb sync`), or drop --wandb_log"
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_wandb_not_installed_is_one_line(tmp_path, shakespeare_data):
    """wandb is not in the quick start's requirements.txt: --wandb_log=True without it is one line, not an
    ImportError traceback (a wandb that cannot be imported stands in for none)."""
    (tmp_path / "hidden" / "wandb").mkdir(parents=True)
    (tmp_path / "hidden" / "wandb" / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "hidden"), os.environ.get("PYTHONPATH")]))
    out = run_script(
        "train.py", *TINY, "--wandb_log=True", f"--out_dir={tmp_path / 'out'}", env=dict(os.environ, PYTHONPATH=path)
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        "train.py: wandb_log=True needs wandb, which is not installed (it is not in the quick start's "
        "requirements.txt): pip install wandb, or drop --wandb_log"
    )
    assert not (tmp_path / "out").exists()
