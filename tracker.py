"""
The reference implementation's `tracker` module, kept as a face over the nanogns package: the crash-safe CSV
log (nanogns/runlog/writer.py).
"""

from nanogns.runlog.writer import LogWrapper  # noqa: F401
