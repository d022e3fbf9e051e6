"""
One run per output directory (nanogns/runlog/lock.py): a second holder is refused with the first one's pid, the
lock goes with its process however it ends (SIGKILL included), and a released or stale lock file is taken over.
No test waits on time: each holder is a subprocess that blocks reading a pipe until the test closes it.

    python -m pytest -q tests/test_runlog_lock.py
"""

import os
import signal
import subprocess
import sys

import pytest

from nanogns.runlog.lock import LOCK_FILE, DirectoryInUse, RunLock

HOLDER = """
import sys
from nanogns.runlog.lock import RunLock
lock = RunLock(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


def hold(directory):
    """A subprocess that holds the lock of `directory` until its stdin is closed (or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_holder_is_refused_naming_the_first_ones_pid_until_it_releases(tmp_path):
    holder = hold(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == f"{holder.pid}\n"
    with pytest.raises(DirectoryInUse) as refused:
        RunLock(str(tmp_path))
    assert refused.value.pid == holder.pid
    assert str(refused.value).startswith(f"{str(tmp_path)!r} is in use by another run (pid {holder.pid} holds ")
    holder.stdin.close()
    assert holder.wait() == 0
    assert not (tmp_path / LOCK_FILE).exists()  # removed at release
    lock = RunLock(str(tmp_path))
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    lock.release()
    lock.release()  # safe to repeat
    assert os.listdir(tmp_path) == []


def test_a_killed_holder_releases_the_lock_and_its_stale_file_is_taken_over(tmp_path):
    holder = hold(tmp_path)
    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    assert (tmp_path / LOCK_FILE).read_text() == f"{holder.pid}\n"  # left behind, but no longer held
    lock = RunLock(str(tmp_path))
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    lock.release()


def test_the_pid_comes_from_the_kernel_before_the_holder_has_written_it(tmp_path):
    """A refusal in the instant between the holder's flock and its writing its pid still names it."""
    holder = hold(tmp_path)
    (tmp_path / LOCK_FILE).write_text("")  # as if not written yet
    with pytest.raises(DirectoryInUse) as refused:
        RunLock(str(tmp_path))
    assert refused.value.pid == holder.pid
    holder.stdin.close()
    holder.wait()


def test_a_directory_the_lock_made_goes_with_it_when_nothing_was_written(tmp_path):
    lock = RunLock(str(tmp_path / "new" / "run"))
    assert os.listdir(tmp_path / "new" / "run") == [LOCK_FILE]
    lock.release()
    assert not (tmp_path / "new" / "run").exists()
    lock = RunLock(str(tmp_path / "kept"))
    (tmp_path / "kept" / "log.csv").write_text("step\n")
    lock.release()
    assert os.listdir(tmp_path / "kept") == ["log.csv"]


def test_the_with_form_releases_the_lock_when_the_block_raises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunLock(str(tmp_path)):
            assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
            1 / 0
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(str(tmp_path)):  # this process takes it again: not "in use by another run"
        pass
