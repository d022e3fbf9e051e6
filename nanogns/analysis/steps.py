"""
A log's rows as optimizer steps, before any number is computed from them: the analysis reads steps, not lines,
and reads them in pieces, so its memory follows the steps' few sums, not the log's width or length in bytes.

    steps = read_steps(source, checked, reduce, usecols)     # prints a warning for each thing it changes

- A row whose `step` is not an integer is dropped (no step to put it at).
- A step logged more than once is its last row in file order: a later write replaces an earlier one, as a resume's
  rewrite does. This is decided first, before any cell is judged: an earlier row of the step is never used, even
  when the last one is bad. A warning names the steps.
- A bad cell in `checked` (the numbers the analysis uses) in a step's last row is reported in one line naming the
  step, the column and the file, and the step is skipped (never a silently wrong number, never the superseded
  row): text where a number belongs, a negative norm, pegn or token count, a batch_size that is not an integer
  >= 2 (the GNS needs two examples; nan, inf or empty beside a logged norm included). A non-finite norm or pegn
  is a number: a step logged non-finite stays, and the estimator skips it (and counts it).
- Rows are put in step order (with a note when the file had them otherwise).

Each piece of rows is reduced by the caller (`reduce`: the few per-step sums it needs) as soon as it is read: only
the reduced rows are kept.
"""

import numpy as np
import pandas as pd

from nanogns.errors import LogNotUsable

SHOWN = 20  # bad cells reported one per line; beyond this, one line counts the rest
NONNEGATIVE = ("/norm", "/pegn", "tokens_processed")
BATCH_SIZE = "/batch_size"
LINE, BAD = "_line", "_bad"  # columns the reduced rows carry besides the caller's: the file line, a bad cell


def step_ranges(steps, limit=6):
    """'0-19, 25, 40-41' for a sorted run of integer steps (the first `limit` ranges, then how many in all)."""
    steps = np.unique(np.asarray(steps, dtype=np.int64))
    if not len(steps):
        return ""
    breaks = np.flatnonzero(np.diff(steps) != 1)
    starts, ends = np.r_[steps[0], steps[breaks + 1]], np.r_[steps[breaks], steps[-1]]
    ranges = [f"{a}" if a == b else f"{a}-{b}" for a, b in zip(starts[:limit], ends[:limit])]
    more = f", ... ({len(starts)} ranges, {len(steps)} steps in all)" if len(starts) > limit else ""
    return ", ".join(ranges) + more


def _steps(values, limit=10):
    values = sorted(set(int(v) for v in values))
    return ", ".join(map(str, values[:limit])) + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _numbers(column):
    """(the column as floats, where a non-empty cell is not a number)."""
    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        return column.astype(float), pd.Series(False, index=column.index)
    numbers = pd.to_numeric(column, errors="coerce")
    text = column.astype(str).str.strip().str.lower()
    return numbers.astype(float), column.notna() & numbers.isna() & ~text.isin(["nan", ""])


def _bad_value(column, values, measured=None):
    """Where a (numeric) cell of `column` is a value the analysis cannot use, and why. measured: for a batch_size
    column, the rows where its parameter's norm or pegn is logged (there, an empty or nan batch size is bad too;
    elsewhere it is a step without a measurement)."""
    if column.endswith(BATCH_SIZE):
        logged = values.notna() if measured is None else values.notna() | measured
        bad = logged & ~((values >= 2) & np.isfinite(values) & (values == values.round()))
        return bad, "batch_size {:g} is not an integer >= 2 (the GNS compares 2 or more examples)"
    if column.endswith(NONNEGATIVE):
        return values < 0, "{:g} is negative, which a norm or a token count never is"
    return pd.Series(False, index=values.index), ""


def missing_ranges(present, limit=6):
    """The step numbers from 0 to the last of `present` (distinct, sorted) that it lacks, as step_ranges writes
    them, and how many."""
    starts = np.r_[0, present[:-1] + 1]
    ends = present - 1  # [starts[i], ends[i]]: the steps missing before present[i]
    gaps = ends >= starts
    count = int((ends - starts + 1)[gaps].sum())
    starts, ends = starts[gaps], ends[gaps]
    ranges = [f"{a}" if a == b else f"{a}-{b}" for a, b in zip(starts[:limit], ends[:limit])]
    more = f", ... ({len(starts)} ranges)" if len(starts) > limit else ""
    return ", ".join(ranges) + more, count


def _note_missing_steps(path, steps):
    if not len(steps):
        return
    present = np.unique(steps)
    present = present[present >= 0]
    if not len(present):
        return
    ranges, count = missing_ranges(present)
    if count:
        print(
            f"note: {path}: no row for {count} step(s) ({ranges}): a log lost before a resume starts at the "
            "checkpoint's step, rows set aside at a resume are in log_after_step_<N>.csv; the EMAs skip them"
        )


def read_steps(source, checked, reduce, usecols):
    """The log's steps: one reduced row per step, in step order, steps whose last row has a bad cell in `checked`
    skipped; each change reported in one line (see the module docstring).

    Args:
        source: a runlog.reader.LogSource.
        checked: the columns whose cells the analysis uses as numbers (those present are checked, then given to
            `reduce` as floats).
        reduce: reduce(chunk) -> DataFrame with the chunk's index: what the analysis keeps of each row.
        usecols: the columns `reduce` reads (besides step).
    Returns the reduced rows with `step` (when the log has one; int64).
    Raises ValueError when every logged batch size is 1 (the GNS is undefined there).
    """
    path, first_line = source.path, source.first_line
    has_step = "step" in source.columns
    checked = [c for c in checked if c in source.columns]
    table, reasons = _Table(_rows_at_most(source)), {}  # reasons: {line: [why, ...]} of rows with a bad cell
    batch_sizes_logged = batch_sizes_above_1 = False
    for chunk in source.chunks(usecols=["step", *usecols, *checked]):
        line = pd.Series(chunk.index + first_line, index=chunk.index)
        if has_step:
            step, _ = _numbers(chunk["step"])
            no_step = step.isna() | ~np.isfinite(step) | (step != step.round())
            for index in chunk.index[no_step]:
                print(
                    f"warning: {path}, line {line[index]}: step {chunk.at[index, 'step']!r} is not a step number; "
                    "row skipped"
                )
            chunk, line, step = chunk[~no_step], line[~no_step], step[~no_step].astype(np.int64)
        bad = pd.Series(False, index=chunk.index)
        chunk = chunk.copy()
        for column in checked:
            values, text = _numbers(chunk[column])
            where = (lambda i: f"step {step[i]}") if has_step else (lambda i: f"line {line[i]}")
            for index in chunk.index[text]:
                reasons.setdefault(line[index], []).append(
                    f"{where(index)}, column {column}: {chunk.at[index, column]!r} is not a number"
                )
            measured = None
            if column.endswith(BATCH_SIZE):  # its parameter's norms: a measured step needs its batch size
                partners = [column[: -len(BATCH_SIZE)] + m for m in ("/norm", "/pegn")]
                partners = [c for c in partners if c in chunk]
                measured = chunk[partners].notna().any(axis=1) & ~text if partners else None
            wrong, why = _bad_value(column, values, measured)
            for index in chunk.index[wrong]:
                reasons.setdefault(line[index], []).append(
                    f"{where(index)}, column {column}: " + why.format(float(values[index]))
                )
            bad |= text | wrong
            if column.endswith(BATCH_SIZE):
                logged = values[~text].dropna()
                batch_sizes_logged |= bool(len(logged))
                batch_sizes_above_1 |= bool((logged > 1).any())
            chunk[column] = values
        reduced = reduce(chunk)
        if has_step:
            reduced.insert(0, "step", step)
        reduced[LINE], reduced[BAD] = line, bad
        table.append(reduced)
    if batch_sizes_logged and not batch_sizes_above_1:
        raise LogNotUsable(
            f"{path}: every step has batch size 1: the GNS is undefined at B=1 (it needs 2+ examples per step)"
        )
    if not table.rows:
        return pd.DataFrame(columns=["step", LINE, BAD])
    steps = table.frame()

    keep = ~steps[BAD]
    earlier = pd.Series(dtype=np.int64)  # {step: line of its last superseded row}, for steps skipped below
    if has_step:
        repeated = steps["step"].duplicated(keep="last")
        if repeated.any():
            superseded = steps.loc[repeated, ["step", LINE]].drop_duplicates("step", keep="last")
            earlier = pd.Series(superseded[LINE].to_numpy(), index=superseded["step"].to_numpy())
            print(
                f"warning: {path}: step(s) {_steps(steps.loc[repeated, 'step'])} logged more than once; the last row "
                "of each is used (a later write replaces an earlier one, as a resume does)"
            )
        keep &= ~repeated
        _note_missing_steps(path, steps.loc[~repeated, "step"].to_numpy())
    reports = []
    skipped = steps.loc[steps[BAD] & (~repeated if has_step else True)]
    for line, step in zip(skipped[LINE], skipped["step"] if has_step else [None] * len(skipped)):
        reports.extend(reasons[line])
        if step in earlier.index:
            reports[-1] += f" (its last row, line {line}; the earlier row at line {earlier[step]} is not used)"
    for report in reports[:SHOWN]:
        print(f"warning: {path}: {report}; step skipped")
    if len(reports) > SHOWN:
        print(f"warning: {path}: {len(reports) - SHOWN} more bad cells like these; their steps skipped")
    del steps[BAD], steps[LINE]
    rows = None if keep.all() else keep.to_numpy()
    if has_step and not steps["step"][keep].is_monotonic_increasing:
        print(f"note: {path}: the rows are not in step order; analysed in step order")
        kept = np.flatnonzero(keep.to_numpy()) if rows is not None else np.arange(len(steps))
        rows = kept[np.argsort(steps["step"].to_numpy()[kept], kind="stable")]
    return steps if rows is None else taken(steps, rows)


def _rows_at_most(source):
    """The lines between the source's start and end: at least its rows (read a megabyte at a time)."""
    with open(source.path, "rb") as f:
        f.seek(source.start)
        left, lines = source.end - source.start, 1
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            lines += block.count(b"\n")
            left -= len(block)
    return lines


class _Table:
    """The reduced rows, written into columns allocated once for `capacity` rows (a bound from the log's lines):
    no piece is kept and no concatenation copies them, and the untouched end of a column never takes memory."""

    def __init__(self, capacity):
        self.capacity, self.rows, self.columns = capacity, 0, None

    def append(self, piece):
        if self.columns is None:
            self.columns = {c: np.empty(self.capacity, dtype=_dtype(c, piece[c])) for c in piece.columns}
        end = self.rows + len(piece)
        for c, column in self.columns.items():
            column[self.rows : end] = piece[c].to_numpy(dtype=column.dtype)
        self.rows = end

    def frame(self):
        return pd.DataFrame({c: column[: self.rows] for c, column in self.columns.items()}, copy=False)


def _dtype(name, column):
    """A reduced column's type for every piece: flags are bool, step and line numbers int64, the rest float64 (a
    piece's column of integers may be floats in the next, where a cell is empty)."""
    if pd.api.types.is_bool_dtype(column):
        return np.bool_
    return np.int64 if name in ("step", LINE) else np.float64


def taken(frame, rows):
    """frame's rows `rows` (positions or a boolean mask), a column at a time, each of frame's columns dropped from it
    once taken (the caller gives frame up): memory peaks at one frame plus a column, not two frames."""
    columns = {}
    for c in list(frame.columns):
        columns[c] = frame.pop(c).to_numpy()[rows]
    return pd.DataFrame(columns, copy=False)
