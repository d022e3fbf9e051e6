"""
Read the CSV log that tracker.LogWrapper writes, finished or not.

    df = load_csv(out_dir)     # pandas DataFrame, one row per logged step

A finished run has out_dir/log.csv. A run still in progress, or one that was
killed, has log_header.csv.tmp and log_data.csv.tmp instead; those are read
when present (they are newer than any log.csv left by an earlier run). Rows
written before a column first appeared are padded with NaN, and a last line
cut off mid-write (no newline at its end) is dropped.

df.attrs says where the rows come from, for messages: "path" (the file of the
rows), "first_line" (the line number of the first row in it) and "cut_line"
(the end of a last line that was dropped, or None).
"""

import csv
import io
import os

import pandas as pd

from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV


def _read(source, path, **options):
    try:
        return pd.read_csv(source, **options)
    except pd.errors.ParserError as e:  # a row with more cells than the header, an unclosed quote
        raise ValueError(f"{path} is not a log that can be read: {str(e).strip()}") from None


def _cut_last_line(path):
    """The end of the file's last line if it has no newline at its end (a write cut off), else ''."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 256))
        tail = f.read()
    if not tail or tail.endswith(b"\n"):
        return ""
    return tail[tail.rfind(b"\n") + 1 :].decode("utf-8", "replace")


def _described(df, path, first_line, cut):
    df.attrs.update(path=path, first_line=first_line, cut_line=cut[-40:] if cut else None)
    return df


def load_csv(out_dir: str) -> pd.DataFrame:
    """The run's log as a DataFrame.

    Raises:
        FileNotFoundError: neither log.csv nor the tmp header exists in out_dir.
        ValueError: the log has a header but no rows.
    """
    header_path = os.path.join(out_dir, HEADER_TMP)
    data_path = os.path.join(out_dir, DATA_TMP)
    log_path = os.path.join(out_dir, LOG_CSV)
    if os.path.exists(header_path):
        with open(header_path, newline="") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise ValueError(f"{header_path} is empty: the run has not logged anything yet")
        text = ""
        if os.path.exists(data_path):
            with open(data_path, newline="") as f:
                text = f.read()
        complete = text[: text.rfind("\n") + 1]  # a last line without newline was cut off
        cut = text[len(complete) :]
        if not complete.strip():
            raise ValueError(f"{data_path} has no rows: the run has not logged a step yet")
        # names= pads rows shorter than the header with NaN
        df = _read(io.StringIO(complete), data_path, header=None, names=header)
        return _described(df, data_path, 1, cut)
    if os.path.exists(log_path):
        cut = _cut_last_line(log_path)
        try:
            df = _read(log_path, log_path)
        except pd.errors.EmptyDataError:
            raise ValueError(f"{log_path} is empty") from None
        if cut:
            df = df.iloc[:-1]
        if df.empty:
            raise ValueError(f"{log_path} has a header but no rows")
        return _described(df, log_path, 2, cut)
    raise FileNotFoundError(
        f"no log in {out_dir!r}: expected {log_path} (finished run) "
        f"or {header_path} and {data_path} (run in progress or killed)"
    )
