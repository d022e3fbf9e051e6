"""
What the package raises when it refuses: one class per refusal a caller may want to tell apart, all under
NanoGNSError. Each message is one line naming the problem (the directory, file or value) and the fix.

    from nanogns import NanoGNSError
    try:
        trainer.train()
    except NanoGNSError as e:      # the directory is in use, holds another run's log, a write failed, ...
        print(f"not trained: {e}")

The package never exits its caller's process: a script (train.py, sample.py, gns-analysis) turns these into one
line on stderr and a non-zero exit code; a notebook or a loop over several trainings catches them.

    NanoGNSError              the base: every refusal below
      DirectoryInUse          another process holds the run directory's lock (runlog/lock.py); .pid names it
      DirectoryHoldsAnotherRun  a new run would replace another run's log in its directory
      WriteFailed             a write of the log, the parameter record or a checkpoint failed (a full disk, an
                              unwritable directory); .path names the file
      LogNotContinuable       a log a resume cannot continue (a row without a step number, a first column that
                              is not `step`). Also a ValueError
      CheckpointNotUsable     a checkpoint a resume (or sample.py) cannot use: missing, damaged, holding more than
                              data, or with model_args that build no model. Also a ValueError
      StepNotMeasured         GNSMonitor.step refused the step (a batch size the layers did not count, no backward
                              since the last step, a parameter with no gradient, a layer that mixes the examples,
                              rows it cannot map, the log's previous row not written). Also a ValueError, as these
                              were before
      LogNotUsable            a log (or the record beside it) that cannot be read or gives no GNS: not text, UTF-16,
                              no rows, no per-parameter columns, every batch size 1. Also a ValueError
      LogNotFound             no log in the directory named. Also a FileNotFoundError
      DataNotUsable           a dataset's meta.json (or meta.pkl) that cannot be used. Also a ValueError
      SettingNotValid         an argument or setting out of its range or unknown: a layer class, a strategy, a
                              convert() option, a batch-size schedule (its file too) or controller. Also a ValueError
      NotSupported            a model or setup whose per-example norms cannot be measured exactly: a layer option,
                              tensor parallelism, a trainer that keeps its own gradients, an unconverted model.
                              Also a ValueError
      CallNotValid            a call at a moment or with an input the package cannot serve: a log written after
                              close(), a step read before a trainer clipped, a fused kernel's input shape. Also a
                              RuntimeError, as these were before

Each keeps the built-in class it replaced as a second base, so `except ValueError` (or RuntimeError) code written
before still catches it. What else the package raises, by Python's own meaning (tests/test_errors.py holds this
list to every raise statement of the package):

    ImportError               an optional dependency is not installed (the message names the extra to install)
    AttributeError            nanogns.<name> or a layer kind looked up by attribute that does not exist
    KeyError                  LogWrapper.print's format names a key not logged this step (as str.format does)
    NotImplementedError       a method a subclass must define (core/uses.py's Factor)

No import here: the log, the analysis and the scripts raise these without torch.
"""


class NanoGNSError(Exception):
    """A refusal of the package: str(error) is one line naming the problem and the fix."""

    def __reduce__(self):  # picklable whatever a subclass's __init__ takes (errors cross processes under DDP)
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls, args, state):
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class DirectoryInUse(NanoGNSError, RuntimeError):
    """Another process holds the run directory's lock. `out_dir` is the directory, `pid` the holder's pid (None
    where it cannot be found)."""

    def __init__(self, out_dir: str, pid, lock_path: str):
        self.out_dir, self.pid = out_dir, pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"{out_dir!r} is in use by another run ({holder} holds {lock_path}): one run writes a directory at a "
            "time; wait for it to end (or stop it), then resume, or choose another out_dir"
        )


class DirectoryHoldsAnotherRun(NanoGNSError):
    """A new run (at step 0) into a directory that holds another run's log, which it would replace. `out_dir` is
    the directory, `files` the log files found."""

    def __init__(self, message: str, out_dir: str, files):
        self.out_dir, self.files = out_dir, list(files)
        super().__init__(message)


class WriteFailed(NanoGNSError):
    """A write of a run's files failed (a full disk, an unwritable directory): `path` is the file, `reason` the
    system's reason. What was written before stays (see each writer's docstring)."""

    def __init__(self, message: str, path: str, reason: str = ""):
        super().__init__(message)
        self.path, self.reason = path, reason


class LogNotContinuable(NanoGNSError, ValueError):
    """A resume cannot continue the log in its directory (the message names the file and the row)."""


class CheckpointNotUsable(NanoGNSError, ValueError):
    """A checkpoint cannot be used (the message names the file, what is wrong and what to do)."""


class StepNotMeasured(NanoGNSError, ValueError):
    """GNSMonitor.step (or measure) refused the step: the message names the parameter or the call, what was observed
    and the fix. The buffers are zeroed all the same: the next step starts afresh."""


class LogNotUsable(NanoGNSError, ValueError):
    """A log, or the record of parameters beside it, that cannot be read or gives no GNS (the message names the
    file, what is wrong and the fix)."""


class LogNotFound(NanoGNSError, FileNotFoundError):
    """No log in the directory named (the message names the files looked for)."""


class DataNotUsable(NanoGNSError, ValueError):
    """A dataset's meta.json or meta.pkl that cannot be used (the message names the file and what to run)."""


class SettingNotValid(NanoGNSError, ValueError):
    """An argument or a setting out of its range, or unknown (the message names it and the valid choices)."""


class NotSupported(NanoGNSError, ValueError):
    """A model or setup whose per-example norms cannot be measured exactly (the message says what was found and what
    works instead)."""


class CallNotValid(NanoGNSError, RuntimeError):
    """A call at a moment, or with an input, the package cannot serve (the message names the call and the order or
    shape that works)."""
