"""
The text a log may come back as after a spreadsheet or an editor saved it, told apart by its first bytes, so that
the reader and a resume read it as written or refuse it in one line, never losing a column:

    start = text_start(path)     # 3 after a UTF-8 byte order mark ("CSV UTF-8" of a spreadsheet), else 0

- UTF-8 with a byte order mark: read from after the mark (else the first column would be '\\ufeffstep', not step).
- Lines ended by CR LF (Windows): read as lines (the reader and the writer drop the CR).
- UTF-16 or UTF-32 (a spreadsheet's "Unicode text", an editor's "UTF-16"), and lines ended by a carriage return
  alone (classic Mac OS): refused, with the command that converts the file.

A log this package writes is UTF-8 without a mark, lines ended by LF.
"""

import codecs

from nanogns.errors import LogNotUsable

UTF8_BOM = codecs.BOM_UTF8
_WIDE_BOMS = (  # longest first: UTF-32-LE's mark begins with UTF-16-LE's
    (codecs.BOM_UTF32_LE, "UTF-32LE"),
    (codecs.BOM_UTF32_BE, "UTF-32BE"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"),
    (codecs.BOM_UTF16_BE, "UTF-16BE"),
)
_SNIFF = 1 << 16  # bytes read to tell the encoding and the line ends


def _wide_without_mark(head):
    """The UTF-16 byte order of ASCII text without a mark (every other byte NUL), or None."""
    pairs = head[: len(head) // 2 * 2][:64]
    if len(pairs) < 4:
        return None
    even, odd = pairs[0::2], pairs[1::2]
    if not odd.strip(b"\x00") and even.strip(b"\x00"):
        return "UTF-16LE"
    if not even.strip(b"\x00") and odd.strip(b"\x00"):
        return "UTF-16BE"
    return None


def text_start(path: str) -> int:
    """The byte offset where the text of the log file at `path` starts: 3 after a UTF-8 byte order mark, else 0.

    Raises:
        ValueError: one line naming the file, what its text is and the command that converts it: UTF-16 or UTF-32
            text, or lines ended by a carriage return alone.
    """
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    codec = next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None) or _wide_without_mark(head)
    if codec:
        return _refuse(
            path,
            f"{codec} text (as a spreadsheet's \"Unicode text\" or an editor's UTF-16 saves it)",
            f"iconv -f {codec} -t UTF-8 {path} > {path}.utf8 && mv {path}.utf8 {path}",  # a mark becomes UTF-8's
        )
    if b"\r" in head and b"\n" not in head:
        return _refuse(
            path,
            "lines ended by a carriage return alone (classic Mac OS)",
            f"tr '\\r' '\\n' < {path} > {path}.lf && mv {path}.lf {path}",
        )
    return len(UTF8_BOM) if head.startswith(UTF8_BOM) else 0


def _refuse(path, what, command):
    raise LogNotUsable(
        f"{path} holds {what}, not the UTF-8 lines a log is written in: convert it with `{command}` (or save it "
        "from the spreadsheet as \"CSV UTF-8\")"
    )
