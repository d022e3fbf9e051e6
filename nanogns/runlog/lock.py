"""
One run per output directory: an exclusive lock on OUT_DIR/run.lock, taken before a run reads or writes
anything there (its checkpoint, its log) and held until it ends.

    lock = RunLock(out_dir)        # or raises nanogns.errors.DirectoryInUse, whose message names the holder's pid
    ...                            # train: nothing else writes this directory meanwhile
    lock.release()                 # also at exit; the kernel releases it however the process ends

    with RunLock(out_dir):         # the same, released when the block ends (an exception included)
        ...

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on the file, so a process that dies (SIGKILL included) releases
it with its file descriptors. The file holds the holder's pid, for people; the pid a refusal names comes from
the kernel's table of locks (/proc/locks) where there is one, so a refusal names the live holder even in the
instant before it has written its pid. At release the holder removes the file; one left by a killed run is
taken over by the next. A waiter that opened the file just before its holder removed it finds it unlinked
once it holds the lock and opens it again, so two processes never hold two files of the same name.
"""

import atexit
import fcntl
import os

from nanogns.errors import DirectoryInUse

LOCK_FILE = "run.lock"
__all__ = ["LOCK_FILE", "DirectoryInUse", "RunLock"]


def _pid_from_kernel(fd):
    """The pid holding a flock on the file open at `fd`, from /proc/locks (Linux), or None."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()  # 1: FLOCK  ADVISORY  WRITE 12694 fe:00:2146388 0 EOF
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
                    return int(fields[4]) or None  # 0: a holder outside this pid namespace
    except OSError:
        pass
    return None


def _pid_from_file(fd):
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class RunLock:
    """The exclusive lock of `out_dir` (made if absent), held by this process from construction to release().

    Raises:
        DirectoryInUse: another process holds it.
        OSError: the directory cannot be made or written (the caller says so in one line).
    """

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.made_dir = not os.path.isdir(out_dir)  # removed at release if still empty (a run that failed to start)
        os.makedirs(out_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _pid_from_kernel(fd) or _pid_from_file(fd)
                os.close(fd)
                raise DirectoryInUse(out_dir, pid, self.path) from None
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)  # its holder removed it as we opened it: the next holder makes a new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        atexit.register(self.release)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self):
        """Remove the lock file and release the lock (safe to repeat); the directory too if this lock made it and
        nothing was written there."""
        if self.fd is None:
            return
        atexit.unregister(self.release)
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)  # while still holding it: see the module docstring
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        if self.made_dir:
            try:
                os.rmdir(self.out_dir)
            except OSError:  # not empty: the run wrote its files
                pass
