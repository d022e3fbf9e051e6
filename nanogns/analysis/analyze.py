"""
Gradient noise scale (GNS) of a run, from the per-parameter norms in its log: the logic of
gns-analysis.py, importable (`import gns_analysis; gns_analysis.analyze_gns(out_dir)`).

    python gns-analysis.py OUT_DIR [--alpha 0.95] [--prefix train/gns]
                           [--approx-prefix train/sogns] [--no-plots]
                           [--output-dir DIR]

For each step, over the chosen parameters p (columns `<prefix>/<p>/norm`,
`/pegn`, `/batch_size`):
    sgn   = sum_p norm_p^2            squared norm of the batch gradient
    spegn = sum_p pegn_p^2            mean squared norm of the per-example gradients
    gtg, trsigma = estimator.unbiased_stats(sgn, spegn, B)      (arXiv 1812.06162 eq. A.2)
    gtg_ema, trsigma_ema = EMAs with decay alpha, i.e. pandas
        ewm(alpha=1 - alpha, adjust=False, ignore_na=True)
    gns = estimator.gns_from_emas(gtg_ema, trsigma_ema) = trsigma_ema / gtg_ema
Rows with no norm value (eval-only rows; steps a fp16 GradScaler skipped, whose
GNS cells are empty; a step whose every norm is nan) are dropped first. A step whose gtg or trsigma is not
finite (B = 1, a parameter not logged that step, a norm logged as nan/inf) is
skipped: both EMAs keep their previous value, exactly as estimator.EMA does
online. Steps with a norm logged as nan/inf are counted (a warning) apart from
steps that lack a parameter's columns.

Groups and blocks come from the run's record of what each parameter is
(`gns_parameters.json` beside the log, written by gnstracking.GNSMonitor: the
layer kind and the index of the first ModuleList/Sequential entry on its module
path): LayerNorm (LayerNorm and RMSNorm weights and biases), Linear, Embedding
(an exactly logged tied Embedding/Linear tensor included), Other (a kind the
record does not know). Logs without a record (the paper's reference code, or a
loop that wrote none) are grouped by name, from the dotted components of the
module path (the name without its last component such as `weight`):
    LayerNorm   a component is ln, ln_f or ln_<digits>, or contains "norm"
                (transformer.h.0.ln_1.weight, transformer.ln_f.bias)
    Embedding   otherwise, a component is wte or wpe, or contains "emb"
    Linear      everything else (attn.c_attn.weight, mlp.c_proj.bias, ...)
and blocks by name: the integer component after `h` (transformer.h.3.attn.c_attn.weight
is in block 3), else the first integer component (layers.2.mlp.w1.weight: block 2);
a name with neither (transformer.wpe.weight) is in no block.

Tied weights: nanoGPT ties transformer.wte.weight and lm_head.weight. train.py
logs the tied tensor exactly, once, under its names joined by "+"
(`transformer.wte.weight+lm_head.weight`): such a parameter is used like any
other (Embedding, no block), and the GNS without it is reported too. In a log
without a record, a name without "+" that contains `wte` or `lm_head` is a tied
column as the paper's reference code logs it (one use's per-example norm with
the whole gradient's norm): it is left out. With a record, every recorded
parameter counts (an untied wte or lm_head is an ordinary parameter).

The log is read as steps, not lines (analysis/steps.py): rows in step order, a
step logged twice taken from its last row (as a resume rewrites it), a last line
cut off mid-write dropped, and a step with a bad cell (text for a number, a
negative norm, a batch size below 2) skipped; each with a warning naming the
step, the column and the file. A malformed gns_parameters.json is refused in
one line naming it.

DDP: train.py logs each step's raw cross-rank quantities under ddp/; the DDP
GNS is formed here from them with the same --alpha (estimator.two_batch_stats).
It covers every trainable parameter, the per-example GNS only the tracked ones
(e.g. LayerNorm only): the summary says what each covers (with the tracked
elements, from the record).
(A log of the paper's reference code has only its own `ddp/gns`: shown as logged.)

The x-axis is tokens (`tokens_processed`) where the log has them, else examples
(the running sum of the batch sizes).

What the GNS means for the batch size (McCandlish et al. 2018, with B_crit ~
B_noise = the final GNS): a batch of B examples needs S ~ S_min (1 + B_noise / B)
optimizer steps and E ~ E_min (1 + B / B_noise) examples to reach a given loss;
both overheads are printed for the run's last batch size, with the batch sizes
that keep each under 10%.

Compatibility with the paper's reference script (CerebrasResearch/nanoGNS
exact/gns-analysis.py): on its logs this gives the same numbers. Two differences,
both only where its numbers are meaningless: the GNS is NaN where the gtg EMA is
not positive (the reference clips the denominator at 1e-6), and non-finite
steps are skipped rather than propagated.

Approximate norms: a run may also log `<approx-prefix>/<p>/norm`, `/pegn`,
`/batch_size` (default train/sogns: exact batch norm, SOGNS approximation of the
per-example norm). Their GNS, by the same estimator, is compared with the exact
GNS over the same parameters when `<prefix>` has them all, else with the exact
all-parameter GNS.

Prints the final GNS and EMAs, the GNS without the tied tensor (if logged
exactly), the batch-size trade-off, tables by group and by block, LayerNorm-only
against all parameters and approximate against exact. Writes OUT_DIR/gns_analysis.csv and the PNG
figures gns_emas.png, gns_phase.png, gns_over_tokens.png, gns_groups.png,
gns_layernorm_vs_all.png (when LayerNorms are logged) and gns_sogns_vs_exact.png
(when approximate norms are logged). With --output-dir they go there instead; when
OUT_DIR is read-only, to a new temporary directory, with a note naming it. OUT_DIR
may be given as the path of its log.csv.
"""

import argparse
import os
import re
import sys
import tempfile

import numpy as np
import pandas as pd

from nanogns.analysis.plots import save_png, terminal_plot
from nanogns.analysis.steps import in_step_order
from nanogns.estimator import gns_from_emas, two_batch_stats, unbiased_stats
from nanogns.runlog.reader import load_csv
from nanogns.runlog.record import GROUPS, read_parameter_record
from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV

OVERHEAD = 0.10  # the batch-size trade-off reports the batches that keep each overhead under this
METRICS = ("norm", "pegn", "batch_size")
TIED_MARKERS = ("wte", "lm_head")
TIED_JOIN = "+"
DDP_RAW = ("ddp/sq_norm_small", "ddp/sq_norm_large", "ddp/small_batch_size", "ddp/big_batch_size")
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


def ema(series, alpha):
    """EMA with decay alpha that skips NaN entries (previous value carried over)."""
    return series.ewm(alpha=1 - alpha, adjust=False, ignore_na=True).mean()


def estimate(df, params, alpha):
    """Per-step sgn, spegn, gtg, trsigma and their EMAs and GNS, summed over `params`.

    Args:
        df: log rows (only those with GNS columns).
        params: {name: {metric: column}}, every metric present.
    """
    norm_cols = [params[p]["norm"] for p in params]
    pegn_cols = [params[p]["pegn"] for p in params]
    batch_size = df[[params[p]["batch_size"] for p in params]].max(axis=1)
    # skipna=False: a step missing any parameter is not a measurement of the sum
    out = pd.DataFrame(index=df.index)
    out["sgn"] = df[norm_cols].pow(2).sum(axis=1, skipna=False)
    out["spegn"] = df[pegn_cols].pow(2).sum(axis=1, skipna=False)
    gtg, trsigma = unbiased_stats(out["sgn"], out["spegn"], batch_size)
    finite = np.isfinite(gtg) & np.isfinite(trsigma)
    out["gtg"] = gtg.where(finite)
    out["trsigma"] = trsigma.where(finite)
    out["gtg_ema"] = ema(out["gtg"], alpha)
    out["trsigma_ema"] = ema(out["trsigma"], alpha)
    out["gns"] = gns_from_emas(out["gtg_ema"], out["trsigma_ema"])
    return out


# the group of each layer kind in records of format 1, which did not write it (nanogns.layers' registry has it)
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


def _usable(params, prefix, record=None):
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


def _no_columns_message(columns, prefix, approx_prefix):
    if approx_prefix and approx_prefix != prefix and find_params(columns, approx_prefix):
        return (
            f"no '{prefix.rstrip('/')}/<param>/norm' columns in the log, but it has approximate "
            f"'{approx_prefix.rstrip('/')}/<param>/norm' columns: analyse those with "
            f"--prefix {approx_prefix.rstrip('/')}"
        )
    shown = ", ".join(map(str, columns[:40])) + (", ..." if len(columns) > 40 else "")
    return (
        f"no '{prefix.rstrip('/')}/<param>/norm' columns in the log; its columns are: {shown}. "
        "Was the run trained with all layer classes 'nn'? Use --linearclass=gns "
        "(and --embeddingclass, --lnclass) to record per-example norms, or pass the right --prefix."
    )


def _count_bad_steps(df, chosen):
    """Warn about steps with a norm logged as nan/inf, and apart from them, steps lacking a parameter.

    A parameter is logged at a step when any of its cells has a value; a step
    none of whose parameters is logged (eval-only, skipped by a GradScaler) is
    not a step here.
    """
    logged = pd.DataFrame({p: df[list(cols.values())].notna().any(axis=1) for p, cols in chosen.items()})
    finite = pd.DataFrame({p: np.isfinite(df[[cols["norm"], cols["pegn"]]]).all(axis=1) for p, cols in chosen.items()})
    steps = logged.any(axis=1)
    nonfinite = int((logged & ~finite).any(axis=1).sum())
    lacking = int((steps & ~logged.all(axis=1)).sum())
    if nonfinite:
        print(f"warning: {nonfinite} step(s) have non-finite norms (logged as nan/inf); skipped by the EMAs")
    if lacking:
        print(f"warning: {lacking} step(s) lack some parameter's columns (not logged at that step); skipped")


def load_measurements(out_dir, prefix="train/gns", approx_prefix="train/sogns"):
    """The log's measured rows and its parameters under `prefix`.

    Returns:
        (rows, params, chosen, facts): rows with at least one logged norm (eval-only
        and skipped steps dropped), every {name: {metric: column}} found, those
        the GNS sums over (see _usable), and {name: (group, block)} for those.
    Raises ValueError when there is nothing to sum over; approx_prefix only
    shapes that message.
    """
    print(f"Loading data from {out_dir}")
    df = load_csv(out_dir)
    path = df.attrs.get("path", out_dir)
    if df.attrs.get("cut_line"):
        print(f"warning: {path}: its last line was cut off mid-write (it ends {df.attrs['cut_line']!r}); dropped")
    record = read_parameter_record(out_dir)
    params = find_params(df.columns, prefix)
    if not params:
        raise ValueError(_no_columns_message(df.columns, prefix, approx_prefix))
    numbers = ["tokens_processed", *DDP_RAW] + [
        column
        for p in (prefix, approx_prefix)
        if p
        for columns in find_params(df.columns, p).values()
        for column in columns.values()
    ]
    df = in_step_order(df, numbers, path, df.attrs.get("first_line", 2))
    chosen = _usable(params, prefix, record)
    if not chosen:
        raise ValueError(
            f"only tied-weight columns ({', '.join(sorted(params))}) under '{prefix}': each holds one use's "
            "per-example norm, not the tied tensor's, so it is left out (an exactly logged tied tensor is "
            "named by all its names joined by '+')"
        )
    _count_bad_steps(df, chosen)
    all_norms = [cols["norm"] for cols in params.values() if "norm" in cols]
    rows = df[df[all_norms].notna().any(axis=1)]
    if rows.empty:
        raise ValueError(f"the log has '{prefix}' columns but no row with a value in them")
    return rows, params, chosen, parameter_facts(chosen, record)


def _approximate(df, chosen, prefix, approx_prefix, alpha):
    """The GNS from approximate norms, and the exact one over the same parameters when `prefix` has them all.

    Returns ({results column: series}, what was compared), or ({}, None) when
    the log has no approximate norms.
    """
    if not approx_prefix or approx_prefix.rstrip("/") == prefix.rstrip("/"):
        return {}, None
    approx = _usable(find_params(df.columns, approx_prefix), approx_prefix)
    if not approx:
        return {}, None
    columns = {"gns_sogns": estimate(df, approx, alpha)["gns"]}
    lacking = sorted(p for p in approx if p not in chosen)
    if not lacking:
        columns["gns_exact_same_params"] = estimate(df, {p: chosen[p] for p in approx}, alpha)["gns"]
    return columns, {
        "prefix": approx_prefix.rstrip("/"),
        "exact_prefix": prefix.rstrip("/"),
        "params": sorted(approx),
        "exact_lacks": lacking,
        "n_exact": len(chosen),
    }


def analyze_gns(out_dir, alpha=0.95, prefix="train/gns", approx_prefix="train/sogns"):
    """The GNS estimate for every step of the run in out_dir, as a DataFrame.

    Columns: step, tokens_processed (or examples_processed, the running sum of
    the batch sizes, for a log without tokens; `results.attrs["x"]` names it),
    batch_size, sgn, spegn, gtg, trsigma, gtg_ema, trsigma_ema, gns,
    gns_layernorm, gns_linear, gns_embedding, gns_other (a group's column is NaN
    when it has no parameter), then when present in the log: ddp_gns (from the
    raw ddp/ columns, with the same alpha), gns_without_tied (all parameters but
    the exactly logged tied tensor), gns_block_<N> per block, gns_sogns
    (approximate norms under approx_prefix) and gns_exact_same_params (exact GNS
    over the approximate parameters, when `prefix` has them all).
    `results.attrs` holds the parameters per group and block, the tied and
    excluded names, and what the approximate GNS was compared with.
    Raises FileNotFoundError / ValueError with a message for the user.
    """
    df, params, chosen, facts = load_measurements(out_dir, prefix, approx_prefix)
    excluded = sorted(p for p in params if p not in chosen and len(params[p]) == len(METRICS))
    tied = [p for p in chosen if is_exact_tied(p)]
    notes = ([f"tied weights logged exactly, included: {', '.join(tied)}"] if tied else []) + (
        [f"tied weights left out (one use's norm, not exact): {', '.join(excluded)}"] if excluded else []
    )
    print(f"Processing {len(chosen)} parameters" + (f" ({'; '.join(notes)})" if notes else ""))

    bs = df[[chosen[p]["batch_size"] for p in chosen]]
    uneven = bs.nunique(axis=1) > 1
    if uneven.any():
        steps = df.loc[uneven, "step"].tolist()[:10] if "step" in df else list(df.index[uneven][:10])
        raise ValueError(f"batch sizes differ across parameters within a step (steps {steps})")
    batch_size = bs.max(axis=1)
    if not (batch_size > 1).any():
        raise ValueError("every step has batch size 1: the GNS is undefined at B=1 (it needs 2+ examples per step)")

    step = df["step"] if "step" in df else pd.Series(np.arange(len(df)), index=df.index)
    x = "tokens_processed" if "tokens_processed" in df else "examples_processed"
    results = pd.DataFrame({"step": step, x: df[x] if x in df else batch_size.cumsum(), "batch_size": batch_size})
    results = pd.concat([results, estimate(df, chosen, alpha)], axis=1)

    groups = {g: {p: chosen[p] for p in chosen if facts[p][0] == g} for g in GROUPS}
    for g, members in groups.items():
        results[f"gns_{g.lower()}"] = estimate(df, members, alpha)["gns"] if members else np.nan
    if all(c in df for c in DDP_RAW):
        gtg, trsigma = two_batch_stats(*(df[c] for c in DDP_RAW))
        finite = np.isfinite(gtg) & np.isfinite(trsigma)
        results["ddp_gns"] = gns_from_emas(ema(gtg.where(finite), alpha), ema(trsigma.where(finite), alpha))
    elif "ddp/gns" in df:  # the paper's reference code logs only its own EMA's GNS: shown as logged
        results["ddp_gns"] = df["ddp/gns"]
    if tied:
        untied = {p: cols for p, cols in chosen.items() if p not in tied}
        results["gns_without_tied"] = estimate(df, untied, alpha)["gns"] if untied else np.nan
    blocks = blocks_of(chosen, facts)
    for index, members in blocks.items():
        results[f"gns_block_{index}"] = estimate(df, members, alpha)["gns"]
    approx_columns, approx = _approximate(df, chosen, prefix, approx_prefix, alpha)
    for name, series in approx_columns.items():
        results[name] = series

    results = results.reset_index(drop=True)
    results.attrs["groups"] = {g: sorted(m) for g, m in groups.items()}
    results.attrs["blocks"] = {index: sorted(members) for index, members in blocks.items()}
    results.attrs["tied"] = tied
    results.attrs["excluded"] = excluded
    results.attrs["approx"] = approx
    results.attrs["x"] = x
    record = read_parameter_record(out_dir)
    results.attrs["grouped_by"] = "record" if record is not None else "name"
    numel = [record[p].get("numel") for p in chosen if p in record] if record else []
    results.attrs["elements"] = sum(numel) if numel and None not in numel and len(numel) == len(chosen) else None
    return results


def _fmt_tokens(value):
    return f"{int(value):,}" if np.isfinite(value) else "nan"


def summary(results):
    """The 'GNS Analysis Results' block, as printed."""
    last = results.iloc[-1]
    lines = [
        "GNS Analysis Results:",
        "====================",
        f"Final GNS: {last['gns']:.4f}",
        f"Final G^TG (EMA): {last['gtg_ema']:.4f}",
        f"Final tr(Σ) (EMA): {last['trsigma_ema']:.4f}",
    ]
    tied = results.attrs.get("tied", [])
    if tied:
        without = last["gns_without_tied"]
        noun, verb = ("tied matrix", "changes") if len(tied) == 1 else ("tied matrices", "change")
        lines.append(
            f"GNS without the {noun} ({', '.join(tied)}): {without:.4f} "
            f"({noun} {verb} the final GNS by {(last['gns'] / without - 1) * 100:+.1f}%)"
        )
    if "ddp_gns" in results and results["ddp_gns"].notna().any():
        lines.append(f"Final DDP GNS: {results['ddp_gns'].dropna().iloc[-1]:.4f}")
        groups = {g: len(m) for g, m in results.attrs.get("groups", {}).items() if m}
        covered = ", ".join(f"{g} {n}" for g, n in groups.items())
        elements = results.attrs.get("elements")
        size = f", {elements:,} elements" if elements else ""
        lines.append(
            f"  (what each covers: Final GNS the {sum(groups.values())} tracked parameters ({covered}{size}), "
            "from per-example norms; Final DDP GNS every trainable parameter, from each rank's gradient "
            "against their average)"
        )
    lines.append(f"Average batch size: {results['batch_size'].mean():.1f}")
    x = results.attrs.get("x", "tokens_processed")
    lines.append(
        f"Total {x.split('_')[0]} processed: {_fmt_tokens(float(last[x]))}"
        + ("" if x == "tokens_processed" else " (the log has no tokens_processed column)")
    )
    return "\n".join(lines)


def batch_size_tradeoff(gns, batch_size):
    """What a batch of `batch_size` examples costs at a critical batch ~ gns (McCandlish et al. 2018, arXiv 1812.06162).

    Returns a dict: steps_overhead = S / S_min = 1 + gns / B, examples_overhead = E / E_min = 1 + B / gns, and
    the batch sizes that keep either overhead within OVERHEAD: steps for B >= gns / OVERHEAD, examples for
    B <= gns * OVERHEAD. NaN everywhere when the GNS is not a positive number.
    """
    if not (np.isfinite(gns) and gns > 0):
        nan = float("nan")
        return dict(steps_overhead=nan, examples_overhead=nan, steps_within_b=nan, examples_within_b=nan)
    return dict(
        steps_overhead=1 + gns / batch_size,
        examples_overhead=1 + batch_size / gns,
        steps_within_b=gns / OVERHEAD,
        examples_within_b=gns * OVERHEAD,
    )


def tradeoff_lines(results):
    """The batch-size trade-off of the final GNS at the run's last batch size, as printed."""
    gns, B = float(results["gns"].iloc[-1]), float(results["batch_size"].iloc[-1])
    t = batch_size_tradeoff(gns, B)
    if not np.isfinite(t["steps_overhead"]):
        return [
            f"Batch size: the final GNS ({gns:.4f}) is not a positive number yet, so it says nothing about the batch size"
        ]
    # a GNS below OVERHEAD puts every batch within the steps bound; one below 1 / OVERHEAD, no batch within the other
    steps = f"B >= {t['steps_within_b']:.0f}" if t["steps_within_b"] >= 1 else "every batch (B >= 1)"
    examples = (
        f"B <= {t['examples_within_b']:.1f}"
        if t["examples_within_b"] >= 1
        else f"no batch (it would take B <= {t['examples_within_b']:.2g}: the GNS is that small)"
    )
    return [
        f"Batch size (McCandlish et al. 2018, critical batch ~ GNS = {gns:.1f} examples):",
        f"  at this run's B = {B:.0f}: {t['steps_overhead']:.2f}x the minimum number of optimizer steps "
        f"(S = S_min (1 + GNS/B)) and {t['examples_overhead']:.2f}x the minimum number of examples (E = E_min (1 + B/GNS))",
        f"  within {OVERHEAD:.0%} of the fewest steps: {steps}; within {OVERHEAD:.0%} of the fewest examples: {examples}",
    ]


_TABLE_HEADER = f"{'params':>8}{'final GNS':>14}{'corr w/ all':>14}"


def _table_row(label, n_params, gns, all_gns):
    if n_params == 0 or gns.isna().all():
        return f"{label:<12}{n_params:>8}{'-':>14}{'-':>14}"
    return f"{label:<12}{n_params:>8}{gns.iloc[-1]:>14.4f}{all_gns.corr(gns):>14.4f}"


def group_table(results):
    """Final GNS per group and the Pearson correlation of its series with the all-parameter GNS."""
    groups = results.attrs.get("groups", {})
    lines = [
        "GNS by parameter group:",
        f"{'group':<12}{_TABLE_HEADER}",
        _table_row("all", sum(len(m) for m in groups.values()), results["gns"], results["gns"]),
    ]
    for g in GROUPS:
        if g != "Other" or groups.get(g):  # Other: parameters of a kind the record does not know
            lines.append(_table_row(g, len(groups.get(g, [])), results[f"gns_{g.lower()}"], results["gns"]))
    return "\n".join(lines)


def block_table(results):
    """Final GNS per block and the Pearson correlation of its series with the all-parameter GNS."""
    blocks = results.attrs.get("blocks", {})
    if not blocks:
        return "GNS by block: no parameter name has a block index"
    lines = ["GNS by block:", f"{'block':<12}{_TABLE_HEADER}"]
    for index, names in blocks.items():
        lines.append(_table_row(str(index), len(names), results[f"gns_block_{index}"], results["gns"]))
    return "\n".join(lines)


def compare(series, reference):
    """How `series` tracks `reference` over the steps where both are finite.

    Returns a dict: steps (how many such steps), corr (Pearson), log10_corr
    (Pearson of the log10s, over those steps where both are positive),
    median_rel_diff (median |series / reference - 1|), and final and
    final_reference (the values at the last row, as every 'final' printed).
    """
    a = pd.Series(np.asarray(series, dtype=np.float64))
    b = pd.Series(np.asarray(reference, dtype=np.float64))
    both = np.isfinite(a) & np.isfinite(b)
    positive = both & (a > 0) & (b > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (a[both] / b[both] - 1).abs()
    return {
        "steps": int(both.sum()),
        "corr": a[both].corr(b[both]),
        "log10_corr": np.log10(a[positive]).corr(np.log10(b[positive])),
        "median_rel_diff": rel[np.isfinite(rel)].median(),
        "final": a.iloc[-1],
        "final_reference": b.iloc[-1],
    }


def layernorm_line(results):
    """LayerNorm-only GNS against the all-parameter GNS (the paper's claim), or a note that there is none."""
    if not results.attrs.get("groups", {}).get("LayerNorm"):
        return "LayerNorm-only vs all parameters: no LayerNorm columns in the log; comparison and plot skipped"
    c = compare(results["gns_layernorm"], results["gns"])
    return (
        f"LayerNorm-only vs all parameters: corr {c['corr']:.3f} (log10: {c['log10_corr']:.3f}) "
        f"over {c['steps']} steps, final ratio LN/all {c['final'] / c['final_reference']:.3f}"
    )


def approx_line(results):
    """Approximate (SOGNS) GNS against the exact one, or None when the log has no approximate norms."""
    approx = results.attrs.get("approx")
    if not approx:
        return None
    n = len(approx["params"])
    if "gns_exact_same_params" in results:
        head = f"Approximate (SOGNS) vs exact GNS over the same {n} parameters"
        c = compare(results["gns_sogns"], results["gns_exact_same_params"])
    else:
        head = (
            f"Approximate (SOGNS) GNS over {n} parameters vs exact GNS over all {approx['n_exact']} parameters "
            f"(not the same parameters: {approx['exact_prefix']} lacks {len(approx['exact_lacks'])} of the {n})"
        )
        c = compare(results["gns_sogns"], results["gns"])
    return (
        f"{head}: final {c['final']:.4f} vs {c['final_reference']:.4f} "
        f"({(c['final'] / c['final_reference'] - 1) * 100:+.1f}%), "
        f"median |relative difference| {c['median_rel_diff'] * 100:.1f}% over {c['steps']} steps, "
        f"corr {c['corr']:.3f}"
    )


def _log10(series):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log10(series.to_numpy(dtype=np.float64))


def _figures(results):
    """(file stem, title, series, x_label, y_label, scatter) for every figure the results allow."""
    x_column = results.attrs.get("x", "tokens_processed")
    tokens, x_label = results[x_column], x_column.split("_")[0]
    gns = [("GNS (estimated)", tokens, results["gns"])]
    if "gns_without_tied" in results:
        gns.append(("GNS without the tied matrix", tokens, results["gns_without_tied"]))
    if "ddp_gns" in results:
        gns.append(("GNS (ddp)", tokens, results["ddp_gns"]))
    groups = [("all", tokens, results["gns"])] + [
        (g, tokens, results[f"gns_{g.lower()}"]) for g in GROUPS if results[f"gns_{g.lower()}"].notna().any()
    ]
    figures = [
        (
            "gns_emas",
            f"log_10(tr(Σ)) and log_10(G^TG) over {x_label}",
            [
                ("G^TG (EMA)", tokens, _log10(results["gtg_ema"])),
                ("tr(Σ) (EMA)", tokens, _log10(results["trsigma_ema"])),
            ],
            x_label,
            "log10",
            False,
        ),
        (
            "gns_phase",
            "Phase plot: log_10(tr(Σ)) vs log_10(G^TG)",
            [("EMAs", _log10(results["gtg_ema"]), _log10(results["trsigma_ema"]))],
            "log10 G^TG (EMA)",
            "log10 tr(Σ) (EMA)",
            True,
        ),
        ("gns_over_tokens", f"GNS over {x_label}", gns, x_label, "GNS", False),
        ("gns_groups", f"GNS per parameter group over {x_label}", groups, x_label, "GNS", False),
    ]
    if results.attrs.get("groups", {}).get("LayerNorm"):
        figures.append(
            (
                "gns_layernorm_vs_all",
                f"GNS from LayerNorm only vs all parameters, over {x_label}",
                [("all parameters", tokens, results["gns"]), ("LayerNorm only", tokens, results["gns_layernorm"])],
                x_label,
                "GNS",
                False,
            )
        )
    if "gns_sogns" in results:
        exact = (
            ("exact, same parameters", tokens, results["gns_exact_same_params"])
            if "gns_exact_same_params" in results
            else ("exact, all parameters", tokens, results["gns"])
        )
        figures.append(
            (
                "gns_sogns_vs_exact",
                f"GNS from approximate (SOGNS) vs exact norms, over {x_label}",
                [exact, ("approximate (SOGNS)", tokens, results["gns_sogns"])],
                x_label,
                "GNS",
                False,
            )
        )
    return figures


def print_plots(results):
    for _, title, series, x_label, y_label, scatter in _figures(results):
        print(f"\n{title}:")
        print("=" * (len(title) + 1))
        print(terminal_plot(series, x_label=x_label, y_label=y_label, scatter=scatter))


def save_plots(results, out_dir):
    """The same figures as PNG files in out_dir; returns their paths."""
    return [
        save_png(
            os.path.join(out_dir, f"{name}.png"), series, x_label=x_label, y_label=y_label, title=title, scatter=scatter
        )
        for name, title, series, x_label, y_label, scatter in _figures(results)
    ]


def _run_dir(path):
    """The run directory named by `path`: itself, or the directory of a log file given instead."""
    if os.path.isfile(path):
        if os.path.basename(path) in (LOG_CSV, HEADER_TMP, DATA_TMP):
            return os.path.dirname(path) or "."
        raise ValueError(
            f"{path} is a file: gns-analysis.py reads a run directory (the one holding log.csv and "
            "gns_parameters.json, e.g. out-shakespeare-char)"
        )
    return path


def _writable(directory):
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _output_dir(run_dir, output_dir):
    """(where the results go, a note or None): output_dir if given (made if absent), else the run directory,
    or a new temporary directory when the run directory cannot be written."""
    if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        return output_dir, None
    if _writable(run_dir):
        return run_dir, None
    elsewhere = tempfile.mkdtemp(prefix="gns-analysis-")
    return elsewhere, f"note: {run_dir} is read-only: the results go to {elsewhere} instead (choose with --output-dir)"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Gradient noise scale of a run from its CSV log.")
    parser.add_argument(
        "out_dir",
        help="run directory holding log.csv (or the .tmp files of a running/killed run); a path to its log.csv "
        "is read as its directory",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.95,
        help="EMA decay of G^TG and tr(Σ); the EMA weight of a new step is 1 - alpha (default: 0.95)",
    )
    parser.add_argument(
        "--prefix", default="train/gns", help="column prefix of the per-parameter norms (default: train/gns)"
    )
    parser.add_argument(
        "--approx-prefix",
        default="train/sogns",
        help="column prefix of approximate (SOGNS) per-parameter norms, compared with the exact "
        "ones when the log has them (default: train/sogns)",
    )
    parser.add_argument(
        "--no-plots", action="store_true", help="skip the terminal plots (PNG figures are always written)"
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where gns_analysis.csv and the PNG figures go (default: the run directory, or a new temporary "
        "directory, with a note, when the run directory is read-only)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.alpha < 1:
        parser.error(f"--alpha must be in [0, 1), got {args.alpha}")

    try:
        run_dir = _run_dir(args.out_dir)
        results = analyze_gns(run_dir, args.alpha, args.prefix, args.approx_prefix)
    except (FileNotFoundError, ValueError) as e:
        print(f"gns-analysis.py: error: {e}", file=sys.stderr)
        return 1

    print()
    print(summary(results))
    print()
    print("\n".join(tradeoff_lines(results)))
    print()
    print(group_table(results))
    print()
    print(block_table(results))
    print()
    for line in (layernorm_line(results), approx_line(results)):
        if line:
            print(line)
    if not args.no_plots:
        print_plots(results)
    output_dir, note = _output_dir(run_dir, args.output_dir)
    if note:
        print(f"\n{note}")
    paths = save_plots(results, output_dir)
    output_path = os.path.join(output_dir, "gns_analysis.csv")
    results.to_csv(output_path, index=False)
    print(f"\nFigures saved to: {', '.join(paths)}")
    print(f"Detailed results saved to: {output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
