"""
What each logged parameter is, for the analysis: its columns in the log (`<prefix>/<p>/norm`, `/pegn`,
`/batch_size`), its group and block from the run's record (gns_parameters.json, runlog/record.py) or, in a log
without one, from its name (see analyze.py's docstring for the rules), and which tied columns are exact.
"""

import re

METRICS = ("norm", "pegn", "batch_size")


TIED_MARKERS = ("wte", "lm_head")


TIED_JOIN = "+"


_LN_COMPONENT = re.compile(r"ln(_f|_\d+)?")


_INDEX = re.compile(r"[0-9]+")


def _module_path(name):
    """The module path components of a parameter (of its first name, for a tied tensor)."""
    return name.split(TIED_JOIN)[0].split(".")[:-1]


def param_group(name):
    """'LayerNorm', 'Embedding' or 'Linear' for a parameter name, in logs without a record (see module docstring)."""
    components = [c.lower() for c in _module_path(name)]
    if any(_LN_COMPONENT.fullmatch(c) or "norm" in c for c in components):
        return "LayerNorm"
    if any(c in ("wte", "wpe") or "emb" in c for c in components):
        return "Embedding"
    return "Linear"


def param_block(name):
    """Block index of a parameter name, or None, in logs without a record (see module docstring)."""
    path = _module_path(name)
    for before, component in zip(path, path[1:]):
        if before == "h" and _INDEX.fullmatch(component):
            return int(component)
    return next((int(c) for c in path if _INDEX.fullmatch(c)), None)


def is_exact_tied(name):
    """A tied tensor logged exactly, under its names joined by '+'."""
    return TIED_JOIN in name


def is_reference_tied(name):
    """A tied column as the reference code logs it: one use's per-example norm, not the tensor's."""
    return not is_exact_tied(name) and any(marker in name for marker in TIED_MARKERS)


def find_params(columns, prefix):
    """{param name: {metric: column}} for every `<prefix>/<param>/<metric>` column."""
    params = {}
    start = prefix.rstrip("/") + "/"
    for col in columns:
        if not isinstance(col, str) or not col.startswith(start):
            continue
        param, _, metric = col[len(start) :].rpartition("/")
        if param and metric in METRICS:
            params.setdefault(param, {})[metric] = col
    return params


# the group of each layer kind in records of format 1, which did not write it (nanogns.kinds' registry has it)
FORMAT_1_GROUPS = {
    "Linear": "Linear",
    "Conv1D": "Linear",
    "Conv": "Linear",
    "Experts": "Linear",
    "MultiheadAttention": "Linear",
    "Embedding": "Embedding",
    "Embedding+Linear": "Embedding",
    "LayerNorm": "LayerNorm",
    "RMSNorm": "LayerNorm",
}


def record_group(facts):
    """The analysis group of one entry of a run's record: what it says, or (format 1) its kind's group."""
    return facts.get("group") or FORMAT_1_GROUPS.get(facts["kind"], "Other")


def parameter_facts(names, record):
    """{name: (group, block)}: from the run's record where it has the name, else from the name itself."""
    facts = {}
    for name in names:
        if record is not None and name in record:
            facts[name] = (record_group(record[name]), record[name]["block"])
        else:
            facts[name] = (param_group(name), param_block(name))
    return facts


def blocks_of(params, facts):
    """{block index: {name: columns}} for the parameters in a block, in block order."""
    blocks = {}
    for name in params:
        index = facts[name][1]
        if index is not None:
            blocks.setdefault(index, {})[name] = params[name]
    return {index: blocks[index] for index in sorted(blocks)}


def usable_parameters(params, prefix, record=None):
    """The parameters a GNS can sum over: all three metrics logged, and not a reference-style tied column
    (a recorded parameter is what the record says, whatever its name)."""
    usable = {}
    for name in sorted(params):
        if len(params[name]) < len(METRICS):
            missing = [m for m in METRICS if m not in params[name]]
            print(f"warning: parameter {name} under '{prefix}' lacks {missing} columns; skipped")
        elif (record is not None and name in record) or not is_reference_tied(name):
            usable[name] = params[name]
    return usable
