"""
The record beside a run's log (gns_parameters.json) of what each tracked parameter is: its layer kind, the
analysis group that kind sums in, its block, every name of the tensor, its elements. Written by whoever tracks
the parameters (GNSMonitor), read by the analysis, which groups by these facts rather than by names.

    {"format": 2, "parameters": {logged name: {"kind", "group", "layer", "block", "names", "numel", "bank_slices"}}}

Format 1 (before "group") is read too: the analysis then derives the group from the kind. A record that is
not valid JSON, or not of this shape, is refused with one line naming the file and what is wrong.
"""

import json
import os
from typing import Any, Dict, Optional

from nanogns.errors import LogNotUsable, WriteFailed

PARAMETERS_JSON = "gns_parameters.json"  # beside log.csv
RECORD_FORMAT = 2


def write_parameter_record(out_dir: str, record: Dict[str, Dict[str, Any]]) -> str:
    """out_dir/PARAMETERS_JSON, written atomically (a resumed run rewrites the same facts).

    Raises WriteFailed (one line naming the file) when the write fails: a full disk, an unwritable directory."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"format": RECORD_FORMAT, "parameters": record}, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as e:  # a full disk, an unwritable directory: one line, as the log's writes
        raise WriteFailed(
            f"cannot write the record of the tracked parameters {path} ({e.strerror or e}); free some space or "
            "choose a writable out_dir",
            path,
            e.strerror or str(e),
        ) from None
    return path


GROUPS = ("LayerNorm", "Linear", "Embedding", "Other")
SHAPE = '{"format": 2, "parameters": {name: {"kind": str, "group": str, "block": int or null, ...}}}'


def _shape_problem(record):
    """What in a loaded record is not of the shape above, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("parameters"), dict):
        return f"it holds a {type(record).__name__}" + (
            " without a 'parameters' object" if isinstance(record, dict) else ""
        )
    for name, facts in record["parameters"].items():
        if not isinstance(facts, dict):
            return f"entry {name!r} is a {type(facts).__name__}, not an object"
        if not isinstance(facts.get("kind"), str) and not isinstance(facts.get("group"), str):
            return f"entry {name!r} has neither a 'kind' nor a 'group' string"
        if "group" in facts and facts["group"] not in GROUPS:
            return f"entry {name!r} has group {facts['group']!r}, not one of {list(GROUPS)}"
        if "block" not in facts or not (facts["block"] is None or type(facts["block"]) is int):
            return f"entry {name!r} has no 'block' (an integer or null)"
        if facts.get("numel") is not None and type(facts["numel"]) is not int:
            return f"entry {name!r} has 'numel' {facts['numel']!r}, not an integer"
    return None


def read_parameter_record(out_dir: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """{logged name: facts} from out_dir/PARAMETERS_JSON, or None for a log without one (e.g. the paper's code).

    Raises ValueError naming the file when it is not valid JSON or not a record of the shape above."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    if not os.path.exists(path):
        return None
    fix = "repair it, or move it away to group the parameters by their names"
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LogNotUsable(f"{path} is not valid JSON ({e}); {fix}") from None
    problem = _shape_problem(record)
    if problem:
        raise LogNotUsable(f"{path} is not a record of the tracked parameters: {problem} (expected {SHAPE}); {fix}")
    return record["parameters"]
