"""
Any logged metric of a run, in the terminal (plotille) or as a PNG: the command line of
nanogns/analysis/plots.py, where the logic lives.

    python plot.py OUT_DIR KEY [KEY ...] [--x tokens_processed] [--logy] [--png FILE]
"""

import sys

from nanogns.analysis.plots import main

if __name__ == "__main__":
    sys.exit(main())
