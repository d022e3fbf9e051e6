"""
A small logger for training loops: caches the values of one step, writes one CSV
row per step (and forwards the same dict to wandb or any `logf`), and survives
being killed.

Usage:

    tracker = LogWrapper(logf=run.log if wandb_log else None, config=config, out_dir=out_dir)
    for it in range(max_iters):
        ...
        tracker.log({"train/lossf": lossf, "lr": lr})      # later keys overwrite earlier ones
        tracker.print("{train_lossf=:.4f}, dt={dt:.3f}s")    # '/' in a key is written '_'
        tracker.step()                                     # one row, then the cache is cleared
    tracker.close()                                        # also runs at exit; safe to repeat

Files in out_dir (nothing is written when out_dir is None):

    config.json           the run's config (values json cannot encode are written with str)
    log_header.csv.tmp    while running: the column names, rewritten when a column appears
    log_data.csv.tmp      while running: one row per step, appended, flushed and fsync'd
    log.csv               after close(): header + every row padded to full width;
                          the two .tmp files are then removed

close() and a resume's rewrite stream the rows, one line at a time, so their
memory does not grow with the log (bench/log_writer_memory.py). A write that
fails (a full disk, an unwritable directory) raises nanogns.errors.WriteFailed,
one line naming the file; logging stops and the rows written before stay in the
.tmp files. A log that logged no row writes no log.csv (a run that failed before
its first step leaves nothing that a rerun would take for another run's log).

`with LogWrapper(...) as log:` closes it when the block ends, an exception
included.

Columns are `step` (this tracker's counter: the number of step() calls before
this one, plus the last step of a resumed log) and then every key ever logged,
in first-seen order. A key not logged in a step is an empty cell. Rows written
before a column first appeared are shorter than the header. Floats are written
with repr precision; non-finite ones as nan, inf, -inf; None as an empty cell.

Recovering a killed run: nanogns.load_csv(out_dir) reads the two .tmp files
directly (short rows padded with NaN, a truncated last line dropped). To turn
them into a log.csv by hand:

    python -c "from nanogns import load_csv; load_csv('OUT_DIR').to_csv('OUT_DIR/log.csv', index=False)"
    rm OUT_DIR/log_header.csv.tmp OUT_DIR/log_data.csv.tmp

or, with no Python at hand, `cat log_header.csv.tmp log_data.csv.tmp > log.csv`
after deleting any unfinished last line of log_data.csv.tmp (short rows are
then read as trailing empty cells by pandas).

A new log never replaces another run's: LogWrapper(out_dir=...) refuses a
directory that holds a log (log.csv, or a running or killed run's .tmp files)
with nanogns.errors.DirectoryHoldsAnotherRun, one line, as train.py refuses it.
LogWrapper(..., replace=True) starts afresh there instead: the old log, its
record (gns_parameters.json), the rows a resume set aside and the analysis's
results of it (gns_analysis.csv and its figures) are removed first.

LogWrapper(..., resume=True) continues an existing log in out_dir (a finished
log.csv or a killed run's .tmp files): old rows are kept and `step` goes on
from the last one.
With resume_step=N as well (train.py passes the step count its checkpoint
recorded), the log continues at step N so that log and weights agree: rows with
step >= N, written after the checkpoint by a run that then crashed, are moved
to out_dir/log_after_step_N.csv (log_after_step_N_1.csv, ... if it exists),
kept for inspection but out of the log. Where the log lacks steps before N (it
was lost, or the checkpoint comes from nanoGPT, which writes none), the rows still
start at step N, with a printed warning naming the missing steps: a row's step is
always the optimizer step its weights had taken (gns-analysis names the gap too).
A log that cannot be continued raises nanogns.errors.LogNotContinuable.
"""

import atexit
import contextlib
import csv
import io
import json
import math
import numbers
import os
import string
import sys
from typing import Any, Callable, Dict, Optional

from nanogns.errors import CallNotValid, DirectoryHoldsAnotherRun, LogNotContinuable, SettingNotValid, WriteFailed
from nanogns.runlog.encoding import text_start
from nanogns.runlog.record import PARAMETERS_JSON

HEADER_TMP = "log_header.csv.tmp"
DATA_TMP = "log_data.csv.tmp"
LOG_CSV = "log.csv"
CONFIG_JSON = "config.json"
# what describes a run's log beside it, removed with the log by LogWrapper(..., replace=True): its record
# (PARAMETERS_JSON), and the analysis's results (analysis/cli.py writes them; tests/test_analysis.py holds the two
# lists together)
ANALYSIS_RESULTS = (
    "gns_analysis.csv",
    "gns_emas.png",
    "gns_phase.png",
    "gns_over_tokens.png",
    "gns_groups.png",
    "gns_layernorm_vs_all.png",
    "gns_sogns_vs_exact.png",
)


def format_value(value: Any) -> str:
    """One CSV cell: repr precision for floats, nan/inf/-inf, '' for None."""
    if value is None:
        return ""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        return repr(value) if math.isfinite(value) or math.isnan(value) else ("inf" if value > 0 else "-inf")
    # one row is one line: a newline inside a string would look like a truncated row
    return str(value).replace("\r", " ").replace("\n", " ")


def _csv_line(cells):
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(cells)
    return buf.getvalue()


def _write_atomic(path, text):
    tmp = path + ".writing"
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _NoStepNumber(ValueError):
    """A row whose first cell is not a step number: _continue says so as LogNotContinuable."""


def _rows(lines):
    """(line, its step) for each complete, non-empty row of a log's lines, ended by LF (a CR before it dropped); a
    last line cut off (no trailing newline) is not a row. One line at a time: memory does not grow with the log."""
    for line in lines:
        if not line.endswith("\n"):
            return
        if line.endswith("\r\n"):  # a log saved again with Windows line ends
            line = line[:-2] + "\n"
        if line.strip():
            try:
                step = int(float(line.split(",", 1)[0]))  # the step: an integer, never quoted
            except ValueError:
                raise _NoStepNumber(line[:40]) from None
            yield line, step


def _padded(line, width):
    """A CSV line with empty cells appended up to `width` cells (a row written before later columns appeared)."""
    n = len(next(csv.reader([line]))) if '"' in line else line.count(",") + 1
    return line if n >= width else line.rstrip("\r\n") + "," * (width - n) + "\n"


class _Replacement:
    """A file written beside `path` and moved over it at commit() (fsync'd first): a kill meanwhile keeps the old;
    abort() removes it, leaving the old as it was."""

    def __init__(self, path):
        self.path = path
        self.file = open(path + ".writing", "w", newline="")

    def commit(self):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.path + ".writing", self.path)

    def abort(self):
        self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.path + ".writing")


class LogWrapper:
    """Caches one step's values, writes them as one CSV row, forwards them to `logf`.

    Args:
        logf: callable taking a dict (e.g. wandb's run.log), or None.
        config: dict written to out_dir/config.json, or None.
        out_dir: directory for the CSV files; None writes no files at all.
        resume: continue the log already in out_dir.
        resume_step: with resume, the step to continue at (rows from it on are set aside).
        replace: start a new log in an out_dir that holds another run's, removing it and what describes it.

    Raises:
        WriteFailed: a write failed (a full disk, an unwritable directory): one line naming the file. Logging
            stops; the rows written before stay in the .tmp files, which load_csv reads and a resume continues.
        LogNotContinuable: resume=True and the log in out_dir cannot be continued (the message names the row).
        DirectoryHoldsAnotherRun: out_dir holds another run's log, and neither resume nor replace was given.
    """

    def __init__(
        self,
        logf: Optional[Callable[[Dict[str, Any]], Any]] = None,
        config: Optional[Dict[str, Any]] = None,
        out_dir: Optional[str] = None,
        resume: bool = False,
        resume_step: Optional[int] = None,
        replace: bool = False,
    ):
        self.logf = logf
        self.config = config
        self.out_dir = out_dir
        self.log_dict = {}  # the current step's values; train.py checks it
        self.columns = ["step"]
        self._known = {"step"}
        self.step_count = 0
        self.closed = False
        self._data = None  # open handle to log_data.csv.tmp
        if out_dir is not None:
            if resume and replace:
                raise SettingNotValid(
                    "LogWrapper: resume=True continues the log in out_dir, replace=True removes it: pass one"
                )
            if not resume:
                self._leave_other_runs(replace)
            with self._writing(out_dir):
                os.makedirs(out_dir, exist_ok=True)
            with self._writing(self._path(DATA_TMP)):
                # data first: a kill between the two leaves the old header (or log.csv) with the same columns
                if resume:  # and before config.json: a log that cannot be continued is refused with nothing changed
                    self._continue(int(resume_step) if resume_step is not None else None)
                else:
                    _write_atomic(self._path(DATA_TMP), "")
            if config is not None:
                with self._writing(self._path(CONFIG_JSON)):
                    _write_atomic(self._path(CONFIG_JSON), json.dumps(config, indent=2, default=str) + "\n")
            with self._writing(self._path(HEADER_TMP)):
                _write_atomic(self._path(HEADER_TMP), _csv_line(self.columns))
                self._data = open(self._path(DATA_TMP), "a", newline="")
            self._known = set(self.columns)
        atexit.register(self._close_at_exit)

    def _path(self, name):
        return os.path.join(self.out_dir, name)

    def _leave_other_runs(self, replace):
        """Refuse an out_dir holding another run's log (DirectoryHoldsAnotherRun), or with replace, remove that log
        and what describes it (see the module docstring)."""
        found = [name for name in (LOG_CSV, HEADER_TMP, DATA_TMP) if os.path.exists(self._path(name))]
        if not found:
            return
        if not replace:
            raise DirectoryHoldsAnotherRun(
                f"{self.out_dir!r} already holds the log of another run ({', '.join(found)}), which this new log would "
                "replace: choose another out_dir, continue that log with LogWrapper(..., resume=True), or start "
                "afresh there with LogWrapper(..., replace=True)",
                self.out_dir,
                found,
            )
        aside = [name for name in os.listdir(self.out_dir) if name.startswith("log_after_step_")]
        for name in (*found, PARAMETERS_JSON, *ANALYSIS_RESULTS, *aside):
            with self._writing(self._path(name)), contextlib.suppress(FileNotFoundError):
                os.remove(self._path(name))

    @contextlib.contextmanager
    def _writing(self, path):
        """Turn a failed write of `path` into WriteFailed (one line); logging stops, the rows so far are kept."""
        try:
            yield
        except OSError as e:
            self.closed = True
            atexit.unregister(self._close_at_exit)
            if self._data is not None:
                try:
                    self._data.close()
                except OSError:
                    pass
            raise WriteFailed(
                f"cannot write the log {path} ({e.strerror or e}): logging stopped; the rows logged before are "
                f"kept in {self.out_dir} ({HEADER_TMP} and {DATA_TMP}, which load_csv reads and a resumed run "
                "continues); free some space or choose a writable out_dir",
                path,
                e.strerror or str(e),
            ) from None

    def _source(self):
        """(header file, data file or None) of the log already in out_dir: a running or killed run's .tmp files
        first, else a finished log.csv (its rows follow its header); None without a log."""
        if os.path.exists(self._path(HEADER_TMP)):
            data = self._path(DATA_TMP)
            return self._path(HEADER_TMP), data if os.path.exists(data) else None
        if os.path.exists(self._path(LOG_CSV)):
            return self._path(LOG_CSV), None
        return None

    def _continue(self, resume_step):
        """Rewrite the log already in out_dir as this run's data file, row by row (memory does not grow with the
        log), setting self.columns and self.step_count. With resume_step, rows from that step on are moved to a
        side file first (see the module docstring)."""
        source = self._source()
        data = _Replacement(self._path(DATA_TMP))
        if source is None:
            data.commit()
            if resume_step:  # the rows still carry the checkpoint's steps: a row's step is what its weights took
                print(
                    f"log: warning: no log in {self.out_dir} to continue, but the checkpoint was saved at step "
                    f"{resume_step}: the log starts at step {resume_step}, steps 0..{resume_step - 1} are not in it"
                )
                self.step_count = resume_step
            return
        header_path, data_path = source
        for path in filter(None, source):  # a log saved again as UTF-16 (say) is refused before anything is written
            try:
                text_start(path)
            except ValueError as e:
                data.abort()
                raise LogNotContinuable(f"cannot continue the log: {e}") from None
        aside, last, last_kept, n_aside = None, None, -1, 0
        try:
            # utf-8-sig: a byte order mark a spreadsheet put before the header is not part of the column `step`
            with open(header_path, newline="", encoding="utf-8-sig") as header:
                first = header.readline()
                columns = next(csv.reader([first]), None) if first.endswith("\n") else None
                if columns:
                    if columns[0] != "step":
                        raise LogNotContinuable(
                            f"cannot continue the log {header_path}: its first column is {columns[0][:40]!r}, not "
                            "step (not a log this package wrote); move it away to start the log afresh"
                        )
                    self.columns = columns
                # log.csv: its rows follow its header
                lines = open(data_path, newline="", encoding="utf-8-sig") if data_path else header
                try:
                    for line, step in _rows(lines if columns else []):
                        last = step
                        if resume_step is None or step < resume_step:
                            data.file.write(line)
                            last_kept = step
                            continue
                        if aside is None:
                            aside = _Replacement(self._aside_path(resume_step))
                            aside.file.write(_csv_line(self.columns))
                        aside.file.write(_padded(line, len(self.columns)))
                        n_aside += 1
                finally:
                    if lines is not header:
                        lines.close()
        except (LogNotContinuable, _NoStepNumber, UnicodeDecodeError) as e:  # nothing written stays: the log as it was
            for replacement in filter(None, (data, aside)):
                replacement.abort()
            if isinstance(e, LogNotContinuable):
                raise
            if isinstance(e, UnicodeDecodeError):
                raise LogNotContinuable(
                    f"cannot continue the log {data_path or header_path}: it holds bytes that are not UTF-8 "
                    f"({e.object[e.start : e.start + 4]!r}), the text a log is written in; save it again as UTF-8 "
                    '("CSV UTF-8"), or move it away to start the log afresh'
                ) from None
            raise LogNotContinuable(
                f"cannot continue the log in {self.out_dir}: a row of {data_path or header_path} has no step number "
                f"in its first cell ({str(e)!r}); repair or move the file"
            ) from None
        if aside is not None:  # side file first: a kill before the data's commit keeps every row somewhere
            aside.commit()
            print(f"log: {n_aside} row(s) written after the checkpoint (step >= {resume_step}) moved to {aside.path}")
        data.commit()
        if resume_step is None:
            self.step_count = last + 1 if last is not None else 0
            return
        if last_kept < resume_step - 1:
            print(
                f"log: warning: the log ends at step {last_kept} but the checkpoint was saved at step {resume_step}; "
                f"steps {last_kept + 1}..{resume_step - 1} are missing from the log"
            )
        self.step_count = resume_step

    def _aside_path(self, resume_step):
        name = f"log_after_step_{resume_step}"
        path, n = self._path(name + ".csv"), 0
        while os.path.exists(path):
            n += 1
            path = self._path(f"{name}_{n}.csv")
        return path

    def log(self, values: Dict[str, Any]) -> None:
        """Cache values for the current step; a key logged twice keeps the later value."""
        if self.closed:
            raise CallNotValid("LogWrapper.log() after close()")
        self.log_dict.update(values)

    def step(self) -> None:
        """Write the cached values as one row (if any), call logf, clear the cache."""
        if self.closed:
            raise CallNotValid("LogWrapper.step() after close()")
        if self.log_dict:
            if self.out_dir is not None:
                new = [k for k in self.log_dict if k not in self._known]
                if new:
                    # header first: a kill between the two writes leaves a short row, which loads
                    self.columns.extend(new)
                    self._known.update(new)
                    with self._writing(self._path(HEADER_TMP)):
                        _write_atomic(self._path(HEADER_TMP), _csv_line(self.columns))
                cells = [str(self.step_count)] + [format_value(self.log_dict.get(k)) for k in self.columns[1:]]
                with self._writing(self._path(DATA_TMP)):
                    self._data.write(_csv_line(cells))  # one write call per row
                    self._data.flush()
                    os.fsync(self._data.fileno())
            if self.logf is not None:
                self.logf(dict(self.log_dict))
            self.log_dict = {}
        self.step_count += 1

    def print(self, fmt: str, prefix: Optional[str] = None) -> str:
        """Print `fmt` formatted against the cached values, and return the line.

        `{name:spec}` prints the value, `{name=:spec}` prints `key=value`. A '/'
        in a key is written '_' in `fmt` (`{train_lossf=:.4f}` -> `train/lossf=2.1234`);
        `step` is this tracker's counter unless a value named step was logged.
        """
        out = [] if prefix is None else [prefix]
        for literal, field, spec, conversion in string.Formatter().parse(fmt):
            out.append(literal)
            if field is None:
                continue
            show_name = field.endswith("=")
            key = self._resolve(field[:-1] if show_name else field)
            value = self.step_count if key == "step" and "step" not in self.log_dict else self.log_dict[key]
            if conversion:
                value = {"r": repr, "s": str, "a": ascii}[conversion](value)
            text = format(value, spec)
            out.append(f"{key}={text}" if show_name else text)
        line = "".join(out)
        print(line)
        return line

    def _resolve(self, name):
        if name in self.log_dict:
            return name
        matches = [k for k in self.log_dict if k.replace("/", "_") == name]
        if len(matches) == 1:
            return matches[0]
        if name == "step":
            return name
        raise KeyError(
            f"tracker.print: {name!r} was not logged this step (write '/' in a key as '_'); "
            f"available: {sorted(self.log_dict)}"
        )

    def __enter__(self) -> "LogWrapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Write pending values as a last row, then log.csv atomically, row by row (memory does not grow with the
        log); remove the tmp files. A log without a row writes no log.csv (and leaves none an earlier run left).

        Runs at exit too; calling it again does nothing."""
        if self.closed:
            return
        if self.log_dict:
            self.step()
        self.closed = True
        atexit.unregister(self._close_at_exit)
        if self.out_dir is None:
            return
        self._data.close()
        width = len(self.columns)
        if os.path.getsize(self._path(DATA_TMP)) == 0 and not os.path.exists(self._path(LOG_CSV)):
            for name in (HEADER_TMP, DATA_TMP):  # no row: nothing a rerun would take for another run's log
                os.remove(self._path(name))
            return
        with self._writing(self._path(LOG_CSV)):
            log = _Replacement(self._path(LOG_CSV))
            log.file.write(_csv_line(self.columns))
            with open(self._path(DATA_TMP), newline="") as data:
                for line, _ in _rows(data):
                    log.file.write(_padded(line, width))
            log.commit()
        for name in (HEADER_TMP, DATA_TMP):
            os.remove(self._path(name))

    def _close_at_exit(self):
        try:
            self.close()
        except WriteFailed as e:  # an exception in an atexit function would print a traceback: the line alone
            print(f"log: {e}", file=sys.stderr)
