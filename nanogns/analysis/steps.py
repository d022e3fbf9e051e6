"""
A log's rows as optimizer steps, before any number is computed from them: the analysis reads steps, not lines.

    df = in_step_order(df, columns, path)      # prints a warning for each thing it changes

- A row whose `step` is not an integer is dropped (no step to put it at).
- A bad cell in `columns` (the numbers the analysis uses) is reported in one line naming the step, the column
  and the file, and its step is skipped (never a silently wrong number): text where a number belongs, a
  negative norm, pegn or token count, a batch_size that is not an integer >= 2 (the GNS needs two examples).
  nan and inf are numbers: a step logged non-finite stays, and the estimator skips it.
- A step logged more than once keeps its last row in file order: a later write replaces an earlier one, as
  a resume's rewrite does. A warning names the steps.
- Rows are put in step order (with a note when the file had them otherwise).
"""

import numpy as np
import pandas as pd

SHOWN = 20  # bad cells reported one per line; beyond this, one line counts the rest
NONNEGATIVE = ("/norm", "/pegn", "tokens_processed")
BATCH_SIZE = "/batch_size"


def _steps(values, limit=10):
    values = sorted(set(int(v) for v in values))
    return ", ".join(map(str, values[:limit])) + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def _numbers(column):
    """(the column as floats, where a non-empty cell is not a number)."""
    if pd.api.types.is_numeric_dtype(column):
        return column.astype(float), pd.Series(False, index=column.index)
    numbers = pd.to_numeric(column, errors="coerce")
    text = column.astype(str).str.strip().str.lower()
    return numbers.astype(float), column.notna() & numbers.isna() & ~text.isin(["nan", ""])


def _bad_value(column, values):
    """Where a (numeric) cell of `column` is a value the analysis cannot use, and why."""
    if column.endswith(BATCH_SIZE):
        bad = values.notna() & ~((values >= 2) & np.isfinite(values) & (values == values.round()))
        return bad, "batch_size {:g} is not an integer >= 2 (the GNS compares 2 or more examples)"
    if column.endswith(NONNEGATIVE):
        return values < 0, "{:g} is negative, which a norm or a token count never is"
    return pd.Series(False, index=values.index), ""


def in_step_order(df, columns, path, first_line=2):
    """The rows of `df` (a load_csv frame) as steps: one row per step, in step order, the checked `columns`
    as floats, steps with a bad cell in them skipped; each change reported in one line (see module docstring).

    Args:
        columns: the columns whose cells the analysis uses as numbers (those present are checked).
        path: the file the rows come from, named in the messages.
        first_line: the line number of the file's first row (2 under a header), for rows without a step.
    Raises ValueError when every step's batch size is 1 (the GNS is undefined there).
    """
    df = df.copy()
    if "step" in df:
        step, text = _numbers(df["step"])
        no_step = step.isna() | ~np.isfinite(step) | (step != step.round())
        for index in df.index[no_step]:
            print(
                f"warning: {path}, line {index + first_line}: step {df.at[index, 'step']!r} is not a step number; "
                "row skipped"
            )
        df, step = df[~no_step], step[~no_step]
        df["step"] = step.astype(np.int64)

    def at(index):
        return f"step {df.at[index, 'step']}" if "step" in df else f"line {index + first_line}"

    bad_rows, reports, batch_sizes = set(), [], []
    for column in [c for c in columns if c in df]:
        values, text = _numbers(df[column])
        for index in df.index[text]:
            reports.append(f"{at(index)}, column {column}: {df.at[index, column]!r} is not a number")
        bad_rows.update(df.index[text])
        bad, why = _bad_value(column, values)
        for index in df.index[bad]:
            reports.append(f"{at(index)}, column {column}: " + why.format(float(values[index])))
        bad_rows.update(df.index[bad])
        if column.endswith(BATCH_SIZE):
            batch_sizes.append(values[~text])
        df[column] = values
    if batch_sizes:
        logged = pd.concat(batch_sizes).dropna()
        if len(logged) and (logged <= 1).all():
            raise ValueError(
                f"{path}: every step has batch size {int(logged.max())}: the GNS is undefined at B=1 "
                "(it needs 2+ examples per step)"
            )
    for line in reports[:SHOWN]:
        print(f"warning: {path}: {line}; step skipped")
    if len(reports) > SHOWN:
        print(f"warning: {path}: {len(reports) - SHOWN} more bad cells like these; their steps skipped")
    df = df.drop(index=sorted(bad_rows))

    if "step" not in df:
        return df.reset_index(drop=True)
    repeated = df["step"].duplicated(keep="last")
    if repeated.any():
        print(
            f"warning: {path}: step(s) {_steps(df.loc[repeated, 'step'])} logged more than once; the last row of "
            "each is used (a later write replaces an earlier one, as a resume does)"
        )
        df = df[~repeated]
    if not df["step"].is_monotonic_increasing:
        print(f"note: {path}: the rows are not in step order; analysed in step order")
        df = df.sort_values("step", kind="stable")
    return df.reset_index(drop=True)
