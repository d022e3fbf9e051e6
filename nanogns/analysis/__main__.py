"""`python -m nanogns.analysis OUT_DIR [--alpha 0.95] [--no-plots]`: the GNS of a run from its log (the same as the
checkout's gns-analysis.py, for an installed package)."""

import sys

from nanogns.analysis.cli import main

sys.exit(main())
