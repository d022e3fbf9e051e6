"""
Read the CSV log that tracker.LogWrapper writes, finished or not.

    df = load_csv(out_dir)                         # pandas DataFrame, one row per logged step
    row = last_row_of_step(out_dir, step)          # {column: cell text} of the step's last row, or None
    source = log_source(out_dir)                   # or in pieces, memory not growing with the log:
    for chunk in source.chunks(usecols=[...]):     #   DataFrames of up to CHUNK_ROWS rows, the chosen columns
        ...

A finished run has out_dir/log.csv. A run still in progress, or one that was
killed, has log_header.csv.tmp and log_data.csv.tmp instead; those are read
when present (they are newer than any log.csv left by an earlier run). Rows
written before a column first appeared are padded with NaN, and a last line
cut off mid-write (no newline at its end) is dropped.

df.attrs (and a LogSource's fields) say where the rows come from, for messages:
"path" (the file of the rows), "first_line" (the line number of the first row in
it; a chunk's index counts rows from 0, so row i is on line first_line + i) and
"cut_line" (the end of a last line that was dropped, or None).

A log saved again by a spreadsheet or an editor is read as written: a UTF-8 byte
order mark is skipped (a spreadsheet's "CSV UTF-8"), lines ended by CR LF are lines;
UTF-16 or UTF-32 text is refused in one line giving the command that converts it
(runlog/encoding.py). A file that is not a text CSV log (a binary file, a row with
more cells than the header) raises ValueError naming the file.
"""

import csv
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import pandas as pd

from nanogns.errors import LogNotFound, LogNotUsable
from nanogns.runlog.encoding import text_start
from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV

CHUNK_ROWS = 2000  # rows per piece: a few MB of a wide log, whatever its length


def _cut_last_line(path):
    """The end of the file's last line if it has no newline at its end (a write cut off), else b''."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        tail = f.read()
    if not tail or tail.endswith(b"\n"):
        return b""
    start = tail.rfind(b"\n") + 1
    if start == 0 and len(tail) == 4096:  # a last line longer than we read: find its start
        with open(path, "rb") as f:
            data, last_newline, offset = f.read(1 << 20), -1, 0
            while data:
                if b"\n" in data:
                    last_newline = offset + data.rfind(b"\n")
                offset += len(data)
                data = f.read(1 << 20)
        with open(path, "rb") as f:
            f.seek(last_newline + 1)
            return f.read()
    return tail[start:]


class _Bytes:
    """A file's bytes from `start`, stopping `limit` bytes on: pandas reads the complete rows only."""

    def __init__(self, path, start, limit):
        self.file = open(path, "rb")
        self.file.seek(start)
        self.left = limit

    def readline(self):
        if self.left <= 0:
            return b""
        line = self.file.readline(self.left)
        self.left -= len(line)
        return line

    def read(self, size=-1):
        if self.left <= 0:
            return b""
        size = self.left if size is None or size < 0 else min(size, self.left)
        data = self.file.read(size)
        self.left -= len(data)
        return data

    def close(self):
        self.file.close()


def _not_text(path, e):
    return LogNotUsable(
        f"{path} is not a text CSV log ({type(e).__name__}: {str(e)[:120]}): a log is the log.csv (or the "
        "log_header.csv.tmp and log_data.csv.tmp) that a run writes"
    )


@dataclass
class LogSource:
    """Where a run's log rows are: `path` (the file of the rows), `columns` (the header), the rows' bytes from
    `start` to `end` (a cut last line left out), `first_line` (line number of the first row), `cut_line` (the end
    of the dropped last line, or None)."""

    path: str
    columns: List[str]
    start: int
    end: int
    first_line: int
    cut_line: Optional[str]

    def chunks(self, usecols: Optional[Sequence[str]] = None, chunk_rows: int = CHUNK_ROWS) -> Iterator[pd.DataFrame]:
        """The rows in pieces of up to chunk_rows, only the columns `usecols` (all when None) present in the
        header; each piece's index counts rows from 0 over the whole log. Raises ValueError naming the file when
        a row has more cells than the header or the file is not text."""
        wanted = list(self.columns) if usecols is None else [c for c in self.columns if c in set(usecols)]
        if self.end <= self.start or not wanted:
            return
        stream = _Bytes(self.path, self.start, self.end - self.start)
        try:
            # names= pads rows shorter than the header with NaN; index_col=False keeps the first cell a column
            reader = pd.read_csv(
                stream,
                header=None,
                names=self.columns,
                usecols=wanted,
                index_col=False,
                chunksize=chunk_rows,
                encoding="utf-8",
                skip_blank_lines=True,
            )
            with reader:
                yield from reader
        except pd.errors.ParserError as e:  # a row with more cells than the header, an unclosed quote
            raise LogNotUsable(f"{self.path} is not a log that can be read: {str(e).strip()}") from None
        except UnicodeDecodeError as e:
            raise _not_text(self.path, e) from None
        finally:
            stream.close()


def _header(path):
    """The column names on the first line of `path` and the byte offset after it (None when the first line is not
    complete). A UTF-8 byte order mark before it is skipped; UTF-16 or UTF-32 text is refused (ValueError)."""
    start = text_start(path)
    with open(path, "rb") as f:
        f.seek(start)
        first = f.readline(1 << 24)
    try:
        text = first.decode("utf-8")
    except UnicodeDecodeError as e:
        if not first.endswith(b"\n") and e.start >= len(first) - 3:  # a character cut by the read's limit
            text = first[: e.start].decode("utf-8")
        else:
            raise _not_text(path, e) from None
    if "\x00" in text:
        raise _not_text(path, ValueError("a NUL byte in its first line"))
    if not first.endswith(b"\n"):
        return None, start + len(first)
    return next(csv.reader([text]), []), start + len(first)


def log_source(out_dir: str) -> LogSource:
    """Where the run's log rows are (see LogSource), reading only its header and last line.

    Raises:
        LogNotFound (a FileNotFoundError): neither log.csv nor the tmp header exists in out_dir.
        LogNotUsable (a ValueError): the log has a header but no rows, or is not a text CSV log (the message names
            the file).
    """
    header_path = os.path.join(out_dir, HEADER_TMP)
    data_path = os.path.join(out_dir, DATA_TMP)
    log_path = os.path.join(out_dir, LOG_CSV)
    if os.path.exists(header_path):
        columns, _ = _header(header_path)
        if not columns:
            raise LogNotUsable(f"{header_path} is empty: the run has not logged anything yet")
        path, first_line = data_path, 1
        if not os.path.exists(data_path):
            raise LogNotUsable(f"{data_path} has no rows: the run has not logged a step yet")
        start = text_start(data_path)
    elif os.path.exists(log_path):
        columns, start = _header(log_path)
        if columns is None:
            raise LogNotUsable(f"{log_path} is empty" if start == 0 else f"{log_path} has a header but no rows")
        path, first_line = log_path, 2
    else:
        raise LogNotFound(
            f"no log in {out_dir!r}: expected {log_path} (finished run) "
            f"or {header_path} and {data_path} (run in progress or killed)"
        )
    cut = _cut_last_line(path) if os.path.getsize(path) > start else b""
    end = os.path.getsize(path) - len(cut)
    source = LogSource(path, columns, start, end, first_line, cut.decode("utf-8", "replace")[-40:] or None)
    if end <= start or not _has_row(source):
        where = "has no rows: the run has not logged a step yet" if path == data_path else "has a header but no rows"
        raise LogNotUsable(f"{path} {where}")
    return source


def _has_row(source):
    """A non-blank line between start and end (read a little at a time)."""
    stream = _Bytes(source.path, source.start, source.end - source.start)
    try:
        while True:
            data = stream.read(1 << 16)
            if not data:
                return False
            if data.strip():
                return True
    finally:
        stream.close()


def _described(df, source):
    df.attrs.update(path=source.path, first_line=source.first_line, cut_line=source.cut_line)
    return df


def load_csv(out_dir: str) -> pd.DataFrame:
    """The run's log as a DataFrame (all of it in memory: the analysis reads it in pieces, log_source).

    Raises:
        LogNotFound (a FileNotFoundError): neither log.csv nor the tmp header exists in out_dir.
        LogNotUsable (a ValueError): the log has a header but no rows, or is not a text CSV log (the message names
            the file).
    """
    source = log_source(out_dir)
    chunks = list(source.chunks())
    df = pd.concat(chunks) if chunks else pd.DataFrame(columns=source.columns)
    return _described(df, source)


def last_row_of_step(out_dir: str, step: int) -> Optional[Dict[str, str]]:
    """The cells ({column: text}) of the last row logged for `step` (a resume's rewrite may repeat a step), or None
    when the log has no such row (or no row at all). One line at a time: memory does not grow with the log.

    Raises:
        FileNotFoundError: no log in out_dir.
        ValueError: the log is not a text CSV log (the message names the file).
    """
    try:
        source = log_source(out_dir)
    except ValueError as e:
        if "no rows" in str(e):
            return None
        raise
    prefix, found = f"{step},".encode(), None
    stream = _Bytes(source.path, source.start, source.end - source.start)
    try:
        for line in iter(stream.readline, b""):
            if line.startswith(prefix):
                found = line
    finally:
        stream.close()
    if found is None:
        return None
    try:
        cells = next(csv.reader([found.decode("utf-8")]), [])
    except UnicodeDecodeError as e:
        raise _not_text(source.path, e) from None
    return dict(zip(source.columns, cells))
