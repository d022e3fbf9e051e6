"""
The GNS of a run, from its log: the command line of gns_analysis.py, where the logic lives
(import that module from a notebook or a script).

    python gns-analysis.py OUT_DIR [--alpha 0.95] [--prefix train/gns]
                           [--approx-prefix train/sogns] [--no-plots]
                           [--output-dir DIR]
"""

import sys

from nanogns.analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())
