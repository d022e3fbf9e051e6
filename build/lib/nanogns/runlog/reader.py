"""
Read the CSV log that tracker.LogWrapper writes, finished or not.

    df = load_csv(out_dir)     # pandas DataFrame, one row per logged step

A finished run has out_dir/log.csv. A run still in progress, or one that was
killed, has log_header.csv.tmp and log_data.csv.tmp instead; those are read
when present (they are newer than any log.csv left by an earlier run). Rows
written before a column first appeared are padded with NaN, and a last line
cut off by the kill is dropped.
"""

import csv
import io
import os

import pandas as pd

from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV


def load_csv(out_dir):
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
        text = text[: text.rfind("\n") + 1]  # a last line without newline was cut off
        if not text.strip():
            raise ValueError(f"{data_path} has no rows: the run has not logged a step yet")
        # names= pads rows shorter than the header with NaN
        return pd.read_csv(io.StringIO(text), header=None, names=header)
    if os.path.exists(log_path):
        try:
            df = pd.read_csv(log_path)
        except pd.errors.EmptyDataError:
            raise ValueError(f"{log_path} is empty") from None
        if df.empty:
            raise ValueError(f"{log_path} has a header but no rows")
        return df
    raise FileNotFoundError(
        f"no log in {out_dir!r}: expected {log_path} (finished run) "
        f"or {header_path} and {data_path} (run in progress or killed)"
    )
