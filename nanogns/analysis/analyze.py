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

from dataclasses import dataclass
from typing import Callable, Optional

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
from nanogns.analysis.steps import read_steps, step_ranges, taken
from nanogns.errors import LogNotUsable
from nanogns.estimator import gns_from_emas, two_batch_stats, unbiased_stats
from nanogns.runlog.reader import log_source
from nanogns.runlog.record import GROUPS, read_parameter_record

DDP_RAW = ("ddp/sq_norm_small", "ddp/sq_norm_large", "ddp/small_batch_size", "ddp/big_batch_size")
# columns kept as they are for each step (besides the sums): the x-axis, the DDP GNS
PLAIN = ("tokens_processed", *DDP_RAW, "ddp/gns")
# a row holding any of these is a training step (an eval-only row of the reference's logs holds none)
TRAINING = ("train/lossf", "lr", "iter_num", "tokens_processed", "grad_norm")
MEASURED, TRAINED, NONFINITE, LACKING, UNEVEN = "_measured", "_trained", "_nonfinite", "_lacking", "_uneven"
OWN_BATCH_SIZE = ("all", "sogns")  # the sums with batch-size columns of their own


def ema(series, alpha):
    """EMA with decay alpha that skips NaN entries (previous value carried over)."""
    return series.ewm(alpha=1 - alpha, adjust=False, ignore_na=True).mean()


def _stats(sgn, spegn, batch_size, alpha):
    """Per-step sgn, spegn, gtg, trsigma, their EMAs and the GNS, from the summed squared norms."""
    out = pd.DataFrame({"sgn": sgn, "spegn": spegn})
    gtg, trsigma = unbiased_stats(out["sgn"], out["spegn"], batch_size)
    finite = np.isfinite(gtg) & np.isfinite(trsigma)
    out["gtg"] = gtg.where(finite)
    out["trsigma"] = trsigma.where(finite)
    out["gtg_ema"] = ema(out["gtg"], alpha)
    out["trsigma_ema"] = ema(out["trsigma"], alpha)
    out["gns"] = gns_from_emas(out["gtg_ema"], out["trsigma_ema"])
    return out


def estimate(df, params, alpha):
    """Per-step sgn, spegn, gtg, trsigma and their EMAs and GNS, summed over `params`.

    Args:
        df: log rows (only those with GNS columns).
        params: {name: {metric: column}}, every metric present.
    """
    batch_size = df[[params[p]["batch_size"] for p in params]].max(axis=1)
    # skipna=False: a step missing any parameter is not a measurement of the sum
    sgn = df[[params[p]["norm"] for p in params]].pow(2).sum(axis=1, skipna=False)
    spegn = df[[params[p]["pegn"] for p in params]].pow(2).sum(axis=1, skipna=False)
    return _stats(sgn, spegn, batch_size, alpha)


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


def _nothing_usable_message(params, prefix):
    """Why no parameter under `prefix` can be summed: its columns are incomplete, or only reference-style tied."""
    incomplete = {p: [m for m in METRICS if m not in cols] for p, cols in params.items() if len(cols) < len(METRICS)}
    if incomplete:
        lacking = sorted({m for missing in incomplete.values() for m in missing})
        return (
            f"no parameter under '{prefix.rstrip('/')}' has all three columns norm, pegn and batch_size: "
            f"{len(incomplete)} of {len(params)} lack {' and '.join(lacking)} (e.g. "
            f"'{prefix.rstrip('/')}/{next(iter(incomplete))}/{incomplete[next(iter(incomplete))][0]}'); the GNS "
            "needs each step's batch size and both norms of every parameter (a log that names its batch size "
            "elsewhere needs a batch_size column per parameter)"
        )
    return (
        f"only tied-weight columns ({', '.join(sorted(params))}) under '{prefix}': each holds one use's "
        "per-example norm, not the tied tensor's, so it is left out (an exactly logged tied tensor is "
        "named by all its names joined by '+')"
    )


def _columns_of(members):
    return [cols[m] for cols in members.values() for m in METRICS]


def _reducer(params, chosen, sets, columns):
    """reduce(chunk) for read_steps: per step, each set's summed squared norms and batch size, the PLAIN columns,
    and flags (any norm logged, a training row, a parameter non-finite, some parameters missing, batch sizes that
    differ across parameters)."""
    wanted = sorted({c for members in sets.values() for c in _columns_of(members)} | set(_columns_of(chosen)))
    position = {c: i for i, c in enumerate(wanted)}
    all_norms = [cols["norm"] for cols in params.values() if "norm" in cols]
    index = {
        name: [np.array([position[cols[m]] for cols in members.values()], dtype=np.intp) for m in METRICS]
        for name, members in sets.items()
    }
    norm_at, pegn_at, bs_at = index["all"]
    plain = [c for c in PLAIN if c in columns]
    trained = [c for c in TRAINING if c in columns]

    def reduce(chunk):
        values = chunk[wanted].to_numpy(dtype=np.float64)
        out = {c: pd.to_numeric(chunk[c], errors="coerce") for c in plain}
        with np.errstate(over="ignore", invalid="ignore"):
            for name, (n, g, b) in index.items():
                out[f"sgn:{name}"] = (values[:, n] ** 2).sum(axis=1)  # NaN where a parameter is missing
                out[f"spegn:{name}"] = (values[:, g] ** 2).sum(axis=1)
                if name in OWN_BATCH_SIZE:  # the others' is all's (a step whose parameters differ is refused)
                    out[f"bs:{name}"] = np.fmax.reduce(values[:, b], axis=1)
        norm, pegn, bs = values[:, norm_at], values[:, pegn_at], values[:, bs_at]
        logged = ~np.isnan(norm) | ~np.isnan(pegn) | ~np.isnan(bs)
        finite = np.isfinite(norm) & np.isfinite(pegn)
        out[MEASURED] = chunk[all_norms].notna().any(axis=1)
        out[TRAINED] = chunk[trained].notna().any(axis=1) if trained else pd.Series(False, index=chunk.index)
        out[NONFINITE] = (logged & ~finite).any(axis=1)
        out[LACKING] = logged.any(axis=1) & ~logged.all(axis=1)
        out[UNEVEN] = np.fmax.reduce(bs, axis=1) > np.fmin.reduce(bs, axis=1)
        return pd.DataFrame(out, index=chunk.index)

    return reduce, wanted


def gns_of(steps, name, alpha, drop=False):
    """_stats of the set `name` from read_steps' reduced rows; with drop, its sums are dropped from `steps` (what
    the analysis keeps of a group is its GNS: memory follows what is kept)."""
    batch_size = steps[f"bs:{name}"] if name in OWN_BATCH_SIZE else steps["bs:all"]
    if not drop:
        return _stats(steps[f"sgn:{name}"], steps[f"spegn:{name}"], batch_size, alpha)
    return _stats(steps.pop(f"sgn:{name}"), steps.pop(f"spegn:{name}"), batch_size, alpha)


def analysis_sets(chosen, facts, approx):
    """{name: {param: columns}}: every sum the analysis makes (all, each group and block, without the exactly
    logged tied tensor, the approximate norms and the exact ones over the same parameters)."""
    sets = {"all": chosen}
    for g in GROUPS:
        members = {p: chosen[p] for p in chosen if facts[p][0] == g}
        if members:
            sets[f"group:{g}"] = members
    for index, members in blocks_of(chosen, facts).items():
        sets[f"block:{index}"] = members
    untied = {p: cols for p, cols in chosen.items() if not is_exact_tied(p)}
    if untied and len(untied) < len(chosen):
        sets["untied"] = untied
    if approx:
        sets["sogns"] = approx
        if all(p in chosen for p in approx):
            sets["exact_same"] = {p: chosen[p] for p in approx}
    return sets


@dataclass
class Measurements:
    """A log read as steps (read_steps: duplicates resolved, bad steps skipped, in step order), reduced to sums.

    steps: one row per step of the log (measured or not; `MEASURED` says which), the sums of each set
        (`sgn:<set>`, `spegn:<set>`, `bs:<set>`), the PLAIN columns present; params: every {name: {metric:
        column}} under the prefix; chosen: those the GNS sums over; facts: {name: (group, block)}; approx: the
        usable approximate parameters; path: the file of the rows."""

    steps: pd.DataFrame
    params: dict
    chosen: dict
    facts: dict
    approx: dict
    path: str


def load_measurements(
    out_dir: str,
    prefix: str = "train/gns",
    approx_prefix: Optional[str] = "train/sogns",
    sets: Optional[Callable] = None,
) -> Measurements:
    """The log's steps reduced to the sums the analysis needs, read in pieces: memory grows with the number of
    steps times the number of sums, not with the log's width.

    sets(chosen, facts, approx) -> {name: {param: columns}} picks the sums (default analysis_sets; "all" is always
    the chosen parameters). Raises ValueError when there is nothing to sum over; approx_prefix only shapes that
    message and the approximate sums.
    """
    print(f"Loading data from {out_dir}")
    source = log_source(out_dir)
    if source.cut_line:
        print(f"warning: {source.path}: its last line was cut off mid-write (it ends {source.cut_line!r}); dropped")
    record = read_parameter_record(out_dir)
    columns = source.columns
    params = find_params(columns, prefix)
    if not params:
        raise LogNotUsable(_no_columns_message(columns, prefix, approx_prefix))
    approx_columns = find_params(columns, approx_prefix) if approx_prefix else {}
    approx = {}
    if approx_columns and approx_prefix.rstrip("/") != prefix.rstrip("/"):
        approx = usable_parameters(approx_columns, approx_prefix)
    chosen = usable_parameters(params, prefix, record)
    if not chosen:
        raise LogNotUsable(_nothing_usable_message(params, prefix))
    facts = parameter_facts(chosen, record)
    members = dict((sets or analysis_sets)(chosen, facts, approx), all=chosen)
    reduce, wanted = _reducer(params, chosen, members, columns)
    checked = ["tokens_processed", *DDP_RAW] + [
        c for found in (params, approx_columns) for cols in found.values() for c in cols.values()
    ]
    all_norms = [cols["norm"] for cols in params.values() if "norm" in cols]
    usecols = [*PLAIN, *TRAINING, *wanted, *all_norms]
    steps = read_steps(source, checked, reduce, usecols)
    return Measurements(steps, params, chosen, facts, approx, source.path)


def _report_steps(steps, path):
    """Warn about steps with a norm logged as nan/inf, steps lacking a parameter, and training steps without any
    norm (a GradScaler's skipped steps; a part of a run trained with layers that record none)."""
    nonfinite, lacking = int(steps[NONFINITE].sum()), int(steps[LACKING].sum())
    if nonfinite:
        print(f"warning: {nonfinite} step(s) have non-finite norms (logged as nan/inf); skipped by the EMAs")
    if lacking:
        print(f"warning: {lacking} step(s) lack some parameter's columns (not logged at that step); skipped")
    without = steps[steps[TRAINED] & ~steps[MEASURED]]
    if len(without) and "step" in steps:
        print(
            f"warning: {path}: {len(without)} of the log's {int(steps[TRAINED].sum())} training steps have no "
            f"per-example norms (steps {step_ranges(without['step'])}): the GNS leaves them out, the totals count "
            "them (a step a GradScaler skipped has none; so have steps trained with layer classes 'nn')"
        )


def analyze_gns(
    out_dir: str, alpha: float = 0.95, prefix: str = "train/gns", approx_prefix: str = "train/sogns"
) -> pd.DataFrame:
    """The GNS estimate for every measured step of the run in out_dir, as a DataFrame.

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
    excluded names, what the approximate GNS was compared with, and "log_end":
    the whole log's last training step and its tokens (the totals count steps
    without norms too).
    Raises FileNotFoundError / ValueError with a message for the user.
    """
    m = load_measurements(out_dir, prefix, approx_prefix)
    steps, chosen = m.steps, m.chosen
    excluded = sorted(p for p in m.params if p not in chosen and len(m.params[p]) == len(METRICS))
    tied = [p for p in chosen if is_exact_tied(p)]
    notes = ([f"tied weights logged exactly, included: {', '.join(tied)}"] if tied else []) + (
        [f"tied weights left out (one use's norm, not exact): {', '.join(excluded)}"] if excluded else []
    )
    _report_steps(steps, m.path)
    log_end = _log_end(steps)
    # the measured steps; the log's other steps are given up as they are taken (memory: one table, not two)
    df = steps if steps[MEASURED].all() else taken(steps, steps[MEASURED].to_numpy())
    m.steps = steps = None
    if df.empty:
        raise LogNotUsable(f"the log has '{prefix}' columns but no row with a value in them")
    print(f"Processing {len(chosen)} parameters" + (f" ({'; '.join(notes)})" if notes else ""))

    if df[UNEVEN].any():
        where = df["step"] if "step" in df else df.index.to_series()
        raise LogNotUsable(
            f"batch sizes differ across parameters within a step (steps {where[df[UNEVEN]].tolist()[:10]})"
        )
    batch_size = df["bs:all"]
    if not (batch_size > 1).any():
        raise LogNotUsable("every step has batch size 1: the GNS is undefined at B=1 (it needs 2+ examples per step)")

    # every set but "all" first, each set's sums dropped once its GNS is formed (what is kept of a group is its
    # GNS): memory peaks near the steps' sums or the results, not both
    late = {}
    groups = {g: {p: chosen[p] for p in chosen if m.facts[p][0] == g} for g in GROUPS}
    for g, members in groups.items():
        late[f"gns_{g.lower()}"] = gns_of(df, f"group:{g}", alpha, drop=True)["gns"] if members else np.nan
    if all(c in df for c in DDP_RAW):
        gtg, trsigma = two_batch_stats(*(df.pop(c) for c in DDP_RAW))
        finite = np.isfinite(gtg) & np.isfinite(trsigma)
        late["ddp_gns"] = gns_from_emas(ema(gtg.where(finite), alpha), ema(trsigma.where(finite), alpha))
        del gtg, trsigma, finite
    elif "ddp/gns" in df:  # the paper's reference code logs only its own EMA's GNS: shown as logged
        late["ddp_gns"] = df["ddp/gns"]
    if tied:
        late["gns_without_tied"] = gns_of(df, "untied", alpha, drop=True)["gns"] if "sgn:untied" in df else np.nan
    blocks = blocks_of(chosen, m.facts)
    for index in blocks:
        late[f"gns_block_{index}"] = gns_of(df, f"block:{index}", alpha, drop=True)["gns"]
    approx = None
    if m.approx:
        late["gns_sogns"] = gns_of(df, "sogns", alpha, drop=True)["gns"]
        lacking = sorted(p for p in m.approx if p not in chosen)
        if not lacking:
            late["gns_exact_same_params"] = gns_of(df, "exact_same", alpha, drop=True)["gns"]
        approx = {
            "prefix": approx_prefix.rstrip("/"),
            "exact_prefix": prefix.rstrip("/"),
            "params": sorted(m.approx),
            "exact_lacks": lacking,
            "n_exact": len(chosen),
        }

    step = df["step"] if "step" in df else pd.Series(np.arange(len(df)), index=df.index)
    x = "tokens_processed" if "tokens_processed" in df else "examples_processed"
    first = {"step": step, x: df[x] if x in df else batch_size.cumsum(), "batch_size": batch_size}
    overall = gns_of(df, "all", alpha)
    results = pd.DataFrame({**first, **{c: overall[c] for c in overall.columns}, **late}, index=df.index, copy=False)
    del df, first, overall, late
    results = results.reset_index(drop=True)
    results.attrs["groups"] = {g: sorted(members) for g, members in groups.items()}
    results.attrs["blocks"] = {index: sorted(members) for index, members in blocks.items()}
    results.attrs["tied"] = tied
    results.attrs["excluded"] = excluded
    results.attrs["approx"] = approx
    results.attrs["x"] = x
    results.attrs["log_end"] = log_end
    record = read_parameter_record(out_dir)
    results.attrs["grouped_by"] = "record" if record is not None else "name"
    numel = [record[p].get("numel") for p in chosen if p in record] if record else []
    results.attrs["elements"] = sum(numel) if numel and None not in numel and len(numel) == len(chosen) else None
    return results


def _log_end(steps):
    """The whole log's last training step and tokens (measured or not), and the last measured step: the totals
    count the whole log."""
    trained = steps[TRAINED] | steps[MEASURED]
    end = {"step": None, "tokens_processed": None, "measured_step": None}
    if "step" in steps and trained.any() and steps[MEASURED].any():
        end["step"] = int(steps["step"][trained].iloc[-1])
        end["measured_step"] = int(steps["step"][steps[MEASURED]].iloc[-1])
    if "tokens_processed" in steps and steps["tokens_processed"].notna().any():
        end["tokens_processed"] = float(steps["tokens_processed"].max())
    return end
