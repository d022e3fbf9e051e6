"""
The GNS of a run, from its log: nanogns/analysis/cli.py's command line (installed as `nanogns-analysis`; from a
notebook or a script, call nanogns.analyze_gns).

    python gns-analysis.py OUT_DIR [--alpha 0.95] [--prefix train/gns]
                           [--approx-prefix train/sogns] [--no-plots]
                           [--output-dir DIR]
"""

import sys

from nanogns.analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())
