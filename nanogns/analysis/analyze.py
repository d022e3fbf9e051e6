"""
Gradient noise scale (GNS) of a run, from the per-parameter norms in its log: importable as
`from nanogns.analysis.analyze import analyze_gns` (the command line is cli.py).

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

import numpy as np
import pandas as pd

from nanogns.analysis.parameters import (
    METRICS,
    blocks_of,
    find_params,
    is_exact_tied,
    parameter_facts,
    usable_parameters,
)
from nanogns.analysis.steps import in_step_order
from nanogns.estimator import gns_from_emas, two_batch_stats, unbiased_stats
from nanogns.runlog.reader import load_csv
from nanogns.runlog.record import GROUPS, read_parameter_record

DDP_RAW = ("ddp/sq_norm_small", "ddp/sq_norm_large", "ddp/small_batch_size", "ddp/big_batch_size")


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
    rms_pe_norm_cols = [params[p]["pegn"] for p in params]
    batch_size = df[[params[p]["batch_size"] for p in params]].max(axis=1)
    # skipna=False: a step missing any parameter is not a measurement of the sum
    out = pd.DataFrame(index=df.index)
    out["sgn"] = df[norm_cols].pow(2).sum(axis=1, skipna=False)
    out["spegn"] = df[rms_pe_norm_cols].pow(2).sum(axis=1, skipna=False)
    gtg, trsigma = unbiased_stats(out["sgn"], out["spegn"], batch_size)
    finite = np.isfinite(gtg) & np.isfinite(trsigma)
    out["gtg"] = gtg.where(finite)
    out["trsigma"] = trsigma.where(finite)
    out["gtg_ema"] = ema(out["gtg"], alpha)
    out["trsigma_ema"] = ema(out["trsigma"], alpha)
    out["gns"] = gns_from_emas(out["gtg_ema"], out["trsigma_ema"])
    return out


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
        the GNS sums over (see usable_parameters), and {name: (group, block)} for those.
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
    chosen = usable_parameters(params, prefix, record)
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
    approx = usable_parameters(find_params(df.columns, approx_prefix), approx_prefix)
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


def analyze_gns(
    out_dir: str, alpha: float = 0.95, prefix: str = "train/gns", approx_prefix: str = "train/sogns"
) -> pd.DataFrame:
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
