"""
Checkpoints are data (nanogns/engines.py): what train.py saves loads with torch.load(weights_only=True), every
random state restored exactly; a checkpoint of an earlier version (numpy's random state as a numpy array) still
loads; one holding an object whose unpickling runs code is refused unrun (a marker file never appears); a save
that fails (a full disk) is one line and keeps the previous checkpoint.

    python -m pytest -q tests/test_engines.py
"""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanogns import engines


class WritesAFile:
    """Unpickling this runs os.system: what a checkpoint received from someone else could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def draws():
    return torch.rand(3), np.random.rand(3), random.random(), np.random.standard_normal()


def test_rank_state_is_plain_data_and_restores_every_generator(tmp_path):
    np.random.standard_normal()  # numpy's cached gaussian is part of its state
    batch = (torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.long))
    engines.save_checkpoint(str(tmp_path / "ckpt.pt"), {"ranks": [engines.rank_state("cpu", batch)]})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "ckpt.pt")) == []
    expected = draws()
    checkpoint = engines.read_checkpoint(str(tmp_path / "ckpt.pt"))
    restored = engines.restore_rank_state(checkpoint["ranks"][0], "cpu")
    for got, want in zip(draws(), expected):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(restored, batch):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_checkpoint_of_an_earlier_version_still_loads(tmp_path):
    """Earlier versions saved numpy's random state as numpy.random.get_state(), a numpy array inside."""
    state = dict(engines.rank_state("cpu", (torch.zeros(1),)), numpy=np.random.get_state())
    torch.save({"ranks": [state]}, tmp_path / "old.pt")
    expected = draws()
    engines.restore_rank_state(engines.read_checkpoint(str(tmp_path / "old.pt"))["ranks"][0], "cpu")
    for got, want in zip(draws(), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy-format"])
def test_a_checkpoint_that_would_run_code_is_refused_unrun(tmp_path, zipfile):
    marker = tmp_path / "marker"
    checkpoint = {"model": {"w": torch.zeros(2)}, "config": WritesAFile(marker)}
    torch.save(checkpoint, tmp_path / "ckpt.pt", _use_new_zipfile_serialization=zipfile)
    with pytest.raises(ValueError) as refused:
        engines.read_checkpoint(str(tmp_path / "ckpt.pt"))
    assert str(refused.value) == (
        f"{tmp_path / 'ckpt.pt'} holds objects other than tensors and plain data (posix.system): it was not loaded, "
        "as loading them could run code (a checkpoint train.py writes never holds them)"
    )
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not a zip"], ids=["empty", "garbage"])
def test_a_damaged_checkpoint_is_not_readable(tmp_path, content):
    (tmp_path / "ckpt.pt").write_bytes(content)
    with pytest.raises(ValueError, match=r"ckpt.pt is not a readable checkpoint \("):
        engines.read_checkpoint(str(tmp_path / "ckpt.pt"))


FULL_DISK = """
import resource, sys, torch
from nanogns import engines
path = sys.argv[1]
engines.save_checkpoint(path, {"model": torch.zeros(10)})
resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))  # files stop growing at 100 kB, as on a full disk
try:
    engines.save_checkpoint(path, {"model": torch.zeros(100000)})
except Exception as e:  # what a caller catches: the library raised, it did not exit
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1)
"""


def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"WriteFailed: cannot write the checkpoint {path} (")
    assert "the previous checkpoint and the log are kept; free some space, then continue with --init_from=resume" in (
        proc.stderr
    )
    assert engines.read_checkpoint(str(path))["model"].shape == (10,) and os.listdir(tmp_path) == ["ckpt.pt"]
