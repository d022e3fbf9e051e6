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

LogWrapper(..., resume=True) continues an existing log in out_dir (a finished
log.csv or a killed run's .tmp files): old rows are kept and `step` goes on
from the last one. Without it, a new run replaces the old log when it closes.
With resume_step=N as well (train.py passes the step count its checkpoint
recorded), the log continues at step N so that log and weights agree: rows with
step >= N, written after the checkpoint by a run that then crashed, are moved
to out_dir/log_after_step_N.csv (log_after_step_N_1.csv, ... if it exists),
kept for inspection but out of the log.
"""

import atexit
import csv
import io
import json
import math
import numbers
import os
import string

HEADER_TMP = "log_header.csv.tmp"
DATA_TMP = "log_data.csv.tmp"
LOG_CSV = "log.csv"
CONFIG_JSON = "config.json"


def format_value(value):
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


def _complete_lines(text):
    """Drop a last line that was cut off (no trailing newline)."""
    return text[: text.rfind("\n") + 1]


class LogWrapper:
    """Caches one step's values, writes them as one CSV row, forwards them to `logf`.

    Args:
        logf: callable taking a dict (e.g. wandb's run.log), or None.
        config: dict written to out_dir/config.json, or None.
        out_dir: directory for the CSV files; None writes no files at all.
        resume: continue the log already in out_dir instead of replacing it.
        resume_step: with resume, the step to continue at (rows from it on are set aside).
    """

    def __init__(self, logf=None, config=None, out_dir=None, resume=False, resume_step=None):
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
            os.makedirs(out_dir, exist_ok=True)
            if config is not None:
                _write_atomic(self._path(CONFIG_JSON), json.dumps(config, indent=2, default=str) + "\n")
            rows = self._read_existing() if resume else []
            self._known = set(self.columns)
            if rows:
                self.step_count = int(float(rows[-1][0])) + 1
            if resume and resume_step is not None:
                rows = self._set_aside(rows, int(resume_step))
                self.step_count = int(resume_step)
            # data first: a kill between the two leaves the old header (or log.csv) with the same columns
            _write_atomic(self._path(DATA_TMP), "".join(_csv_line(r) for r in rows))
            _write_atomic(self._path(HEADER_TMP), _csv_line(self.columns))
            self._data = open(self._path(DATA_TMP), "a", newline="")
        atexit.register(self.close)

    def _path(self, name):
        return os.path.join(self.out_dir, name)

    def _read_existing(self):
        """Rows of the log already in out_dir (tmp files first), setting self.columns."""
        if os.path.exists(self._path(HEADER_TMP)):
            header_path, data_path = self._path(HEADER_TMP), self._path(DATA_TMP)
        elif os.path.exists(self._path(LOG_CSV)):
            header_path, data_path = self._path(LOG_CSV), None
        else:
            return []
        with open(header_path, newline="") as f:
            lines = list(csv.reader(io.StringIO(_complete_lines(f.read()))))
        if not lines:
            return []
        self.columns, rows = lines[0], lines[1:]
        assert self.columns[0] == "step", f"{header_path} does not start with a step column"
        if data_path is not None and os.path.exists(data_path):
            with open(data_path, newline="") as f:
                rows = list(csv.reader(io.StringIO(_complete_lines(f.read()))))
        return [r for r in rows if r]

    def _set_aside(self, rows, resume_step):
        """Rows before resume_step; later ones are written to a side file first."""
        keep = [r for r in rows if int(float(r[0])) < resume_step]
        later = [r for r in rows if int(float(r[0])) >= resume_step]
        if later:
            name = f"log_after_step_{resume_step}"
            path, n = self._path(name + ".csv"), 0
            while os.path.exists(path):
                n += 1
                path = self._path(f"{name}_{n}.csv")
            width = len(self.columns)
            _write_atomic(
                path, _csv_line(self.columns) + "".join(_csv_line(r + [""] * (width - len(r))) for r in later)
            )
            print(f"log: {len(later)} row(s) written after the checkpoint (step >= {resume_step}) moved to {path}")
        last = int(float(keep[-1][0])) if keep else -1
        if last != resume_step - 1:
            print(
                f"log: warning: the log ends at step {last} but the checkpoint was saved at step {resume_step}; "
                f"steps {last + 1}..{resume_step - 1} are missing from the log"
            )
        return keep

    def log(self, values):
        """Cache values for the current step; a key logged twice keeps the later value."""
        if self.closed:
            raise RuntimeError("LogWrapper.log() after close()")
        self.log_dict.update(values)

    def step(self):
        """Write the cached values as one row (if any), call logf, clear the cache."""
        if self.closed:
            raise RuntimeError("LogWrapper.step() after close()")
        if self.log_dict:
            if self.out_dir is not None:
                new = [k for k in self.log_dict if k not in self._known]
                if new:
                    # header first: a kill between the two writes leaves a short row, which loads
                    self.columns.extend(new)
                    self._known.update(new)
                    _write_atomic(self._path(HEADER_TMP), _csv_line(self.columns))
                cells = [str(self.step_count)] + [format_value(self.log_dict.get(k)) for k in self.columns[1:]]
                self._data.write(_csv_line(cells))  # one write call per row
                self._data.flush()
                os.fsync(self._data.fileno())
            if self.logf is not None:
                self.logf(dict(self.log_dict))
            self.log_dict = {}
        self.step_count += 1

    def print(self, fmt, prefix=None):
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

    def close(self):
        """Write pending values as a last row, then log.csv atomically; remove the tmp files.

        Registered with atexit; calling it again does nothing."""
        if self.closed:
            return
        if self.log_dict:
            self.step()
        self.closed = True
        atexit.unregister(self.close)
        if self.out_dir is None:
            return
        self._data.close()
        with open(self._path(DATA_TMP), newline="") as f:
            rows = [r for r in csv.reader(io.StringIO(_complete_lines(f.read()))) if r]
        width = len(self.columns)
        body = "".join(_csv_line(r + [""] * (width - len(r))) for r in rows)
        _write_atomic(self._path(LOG_CSV), _csv_line(self.columns) + body)
        for name in (HEADER_TMP, DATA_TMP):
            os.remove(self._path(name))
