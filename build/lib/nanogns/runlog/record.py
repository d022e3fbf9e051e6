"""
The record beside a run's log (gns_parameters.json) of what each tracked parameter is: its layer kind, the
analysis group that kind sums in, its block, every name of the tensor, its elements. Written by whoever tracks
the parameters (GNSMonitor), read by the analysis, which groups by these facts rather than by names.

    {"format": 2, "parameters": {logged name: {"kind", "group", "layer", "block", "names", "numel", "bank_slices"}}}

Format 1 (before "group") is read too: the analysis then derives the group from the kind.
"""

import json
import os

PARAMETERS_JSON = "gns_parameters.json"  # beside log.csv
RECORD_FORMAT = 2


def write_parameter_record(out_dir, record):
    """out_dir/PARAMETERS_JSON, written atomically (a resumed run rewrites the same facts)."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": RECORD_FORMAT, "parameters": record}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def read_parameter_record(out_dir):
    """{logged name: facts} from out_dir/PARAMETERS_JSON, or None for a log without one (e.g. the paper's code)."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["parameters"]
