"""
Gradient noise scale (GNS) of a run, from the per-parameter norms in its log.

    python gns-analysis.py OUT_DIR [--alpha 0.95] [--prefix train/gns] [--no-plots]

For each step, over the chosen parameters p (columns `<prefix>/<p>/norm`,
`/pegn`, `/batch_size`):
    sgn   = sum_p norm_p^2            squared norm of the batch gradient
    spegn = sum_p pegn_p^2            mean squared norm of the per-example gradients
    gtg, trsigma = gnstracking.unbiased_stats(sgn, spegn, B)      (arXiv 1812.06162 eq. A.2)
    gtg_ema, trsigma_ema = EMAs with decay alpha, i.e. pandas
        ewm(alpha=1 - alpha, adjust=False, ignore_na=True)
    gns = gnstracking.gns_from_emas(gtg_ema, trsigma_ema) = trsigma_ema / gtg_ema
Rows without any GNS column (eval-only rows) are dropped first. A step whose gtg
or trsigma is not finite (B = 1, a missing parameter, an inf) is skipped: both
EMAs keep their previous value, exactly as gnstracking.EMA does online.

Groups, by parameter name (the dotted components of its module path, i.e. the
name without its last component such as `weight`):
    LayerNorm   a component is ln, ln_f or ln_<digits>, or contains "norm"
                (transformer.h.0.ln_1.weight, transformer.ln_f.bias)
    Embedding   otherwise, a component is wte or wpe, or contains "emb"
    Linear      everything else (attn.c_attn.weight, mlp.c_proj.bias, ...)

Tied weights: parameters whose name contains `wte` or `lm_head` are left out of
every group, because nanoGPT ties the two and a plain log mixes one use's
per-example norm with the whole gradient. A run whose config.json sets
"gns_tied_exact": true logged the tied matrix exactly; they are kept then.

Compatibility with the paper's reference script (CerebrasResearch/nanoGNS
exact/gns-analysis.py): on its logs this gives the same numbers. Two differences,
both only where its numbers are meaningless: the GNS is NaN where the gtg EMA is
not positive (the reference clips the denominator at 1e-6), and non-finite
steps are skipped rather than propagated.

Writes OUT_DIR/gns_analysis.csv and the PNG figures gns_emas.png,
gns_phase.png, gns_over_tokens.png and gns_groups.png.
"""

import argparse
import json
import os
import re
import sys

import numpy as np
import pandas as pd

from csv_tools import load_csv
from gnstracking import gns_from_emas, unbiased_stats
from plot import save_png, terminal_plot

GROUPS = ("LayerNorm", "Linear", "Embedding")
METRICS = ("norm", "pegn", "batch_size")
TIED_MARKERS = ("wte", "lm_head")
_LN_COMPONENT = re.compile(r"ln(_f|_\d+)?")


def param_group(name):
    """'LayerNorm', 'Embedding' or 'Linear' for a parameter name (see module docstring)."""
    components = [c.lower() for c in name.split(".")[:-1]]
    if any(_LN_COMPONENT.fullmatch(c) or "norm" in c for c in components):
        return "LayerNorm"
    if any(c in ("wte", "wpe") or "emb" in c for c in components):
        return "Embedding"
    return "Linear"


def is_tied(name):
    return any(marker in name for marker in TIED_MARKERS)


def tied_exact(out_dir):
    """True when the run's config.json says the tied matrix was logged exactly."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"warning: cannot read {path} ({e}); treating tied weights as not exact")
        return False
    return isinstance(config, dict) and config.get("gns_tied_exact") is True


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


def _select_params(df, prefix, include_tied):
    params = find_params(df.columns, prefix)
    if not params:
        shown = ", ".join(map(str, df.columns[:40])) + (", ..." if len(df.columns) > 40 else "")
        raise ValueError(
            f"no '{prefix.rstrip('/')}/<param>/norm' columns in the log; its columns are: {shown}. "
            "Was the run trained with all layer classes 'nn'? Use --linearclass=gns "
            "(and --embeddingclass, --lnclass) to record per-example norms, or pass the right --prefix."
        )
    chosen = {}
    for name in sorted(params):
        if len(params[name]) < len(METRICS):
            missing = [m for m in METRICS if m not in params[name]]
            print(f"warning: parameter {name} lacks {missing} columns; skipped")
        elif include_tied or not is_tied(name):
            chosen[name] = params[name]
    if not chosen:
        raise ValueError(
            f"only tied-weight columns ({', '.join(sorted(params))}) under '{prefix}'; their norms are "
            "not exact unless the run's config.json sets \"gns_tied_exact\": true"
        )
    return params, chosen


def analyze_gns(out_dir, alpha=0.95, prefix="train/gns"):
    """The GNS estimate for every step of the run in out_dir, as a DataFrame.

    Columns: step, tokens_processed, batch_size, sgn, spegn, gtg, trsigma,
    gtg_ema, trsigma_ema, gns, gns_layernorm, gns_linear, gns_embedding (a
    group's column is NaN when it has no parameter) and ddp_gns when the log
    has ddp/gns. `tokens_processed` is the log's column, else step * batch_size.
    `results.attrs` holds the parameters used per group and the last ddp/gns.
    Raises FileNotFoundError / ValueError with a message for the user.
    """
    print(f"Loading data from {out_dir}")
    df = load_csv(out_dir)
    include_tied = tied_exact(out_dir)
    params, chosen = _select_params(df, prefix, include_tied)
    excluded = sorted(p for p in params if p not in chosen and len(params[p]) == len(METRICS))
    print(f"Processing {len(chosen)} parameters" + (f" (tied weights left out: {', '.join(excluded)})" if excluded else ""))

    # eval-only rows carry no GNS columns at all
    all_norms = [cols["norm"] for cols in params.values() if "norm" in cols]
    df = df[df[all_norms].notna().any(axis=1)]
    if df.empty:
        raise ValueError(f"the log has '{prefix}' columns but no row with a value in them")

    bs = df[[chosen[p]["batch_size"] for p in chosen]]
    uneven = bs.nunique(axis=1) > 1
    if uneven.any():
        steps = df.loc[uneven, "step"].tolist()[:10] if "step" in df else list(df.index[uneven][:10])
        raise ValueError(f"batch sizes differ across parameters within a step (steps {steps})")
    batch_size = bs.max(axis=1)
    if not (batch_size > 1).any():
        raise ValueError("every step has batch size 1: the GNS is undefined at B=1 (it needs 2+ examples per step)")

    step = df["step"] if "step" in df else pd.Series(np.arange(len(df)), index=df.index)
    tokens = df["tokens_processed"] if "tokens_processed" in df else step * batch_size
    results = pd.DataFrame({"step": step, "tokens_processed": tokens, "batch_size": batch_size})
    est = estimate(df, chosen, alpha)
    results = pd.concat([results, est], axis=1)
    partial = int((est["sgn"].isna() | est["spegn"].isna()).sum())
    if partial:
        print(f"warning: {partial} step(s) lack some parameter's norms; skipped")

    groups = {g: {p: chosen[p] for p in chosen if param_group(p) == g} for g in GROUPS}
    for g, members in groups.items():
        results[f"gns_{g.lower()}"] = estimate(df, members, alpha)["gns"] if members else np.nan
    if "ddp/gns" in df:
        results["ddp_gns"] = df["ddp/gns"]
    results = results.reset_index(drop=True)
    results.attrs["groups"] = {g: sorted(m) for g, m in groups.items()}
    results.attrs["excluded"] = excluded
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
    if "ddp_gns" in results and results["ddp_gns"].notna().any():
        lines.append(f"Final DDP GNS: {results['ddp_gns'].dropna().iloc[-1]:.4f}")
    lines.append(f"Average batch size: {results['batch_size'].mean():.1f}")
    lines.append(f"Total tokens processed: {_fmt_tokens(float(last['tokens_processed']))}")
    return "\n".join(lines)


def group_table(results):
    """Final GNS per group and the Pearson correlation of its series with the all-parameter GNS."""
    groups = results.attrs.get("groups", {})
    n_all = sum(len(m) for m in groups.values())
    lines = [
        "GNS by parameter group:",
        f"{'group':<12}{'params':>8}{'final GNS':>14}{'corr w/ all':>14}",
        f"{'all':<12}{n_all:>8}{results['gns'].iloc[-1]:>14.4f}{1.0:>14.4f}",
    ]
    for g in GROUPS:
        col = results[f"gns_{g.lower()}"]
        n = len(groups.get(g, []))
        if n == 0 or col.isna().all():
            lines.append(f"{g:<12}{n:>8}{'-':>14}{'-':>14}")
            continue
        corr = results["gns"].corr(col)
        lines.append(f"{g:<12}{n:>8}{col.iloc[-1]:>14.4f}{corr:>14.4f}")
    return "\n".join(lines)


def _log10(series):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log10(series.to_numpy(dtype=np.float64))


def _figures(results):
    """(file stem, title, series, x_label, y_label, scatter) for every figure."""
    tokens = results["tokens_processed"]
    gns = [("GNS (estimated)", tokens, results["gns"])]
    if "ddp_gns" in results:
        gns.append(("GNS (ddp)", tokens, results["ddp_gns"]))
    groups = [("all", tokens, results["gns"])] + [
        (g, tokens, results[f"gns_{g.lower()}"]) for g in GROUPS if results[f"gns_{g.lower()}"].notna().any()
    ]
    return [
        ("gns_emas", "log_10(tr(Σ)) and log_10(G^TG) over tokens",
         [("G^TG (EMA)", tokens, _log10(results["gtg_ema"])), ("tr(Σ) (EMA)", tokens, _log10(results["trsigma_ema"]))],
         "tokens", "log10", False),
        ("gns_phase", "Phase plot: log_10(tr(Σ)) vs log_10(G^TG)",
         [("EMAs", _log10(results["gtg_ema"]), _log10(results["trsigma_ema"]))],
         "log10 G^TG (EMA)", "log10 tr(Σ) (EMA)", True),
        ("gns_over_tokens", "GNS over tokens", gns, "tokens", "GNS", False),
        ("gns_groups", "GNS per parameter group over tokens", groups, "tokens", "GNS", False),
    ]


def print_plots(results):
    for _, title, series, x_label, y_label, scatter in _figures(results):
        print(f"\n{title}:")
        print("=" * (len(title) + 1))
        print(terminal_plot(series, x_label=x_label, y_label=y_label, scatter=scatter))


def save_plots(results, out_dir):
    """The same figures as PNG files in out_dir; returns their paths."""
    return [
        save_png(os.path.join(out_dir, f"{name}.png"), series, x_label=x_label, y_label=y_label,
                 title=title, scatter=scatter)
        for name, title, series, x_label, y_label, scatter in _figures(results)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Gradient noise scale of a run from its CSV log.")
    parser.add_argument("out_dir", help="run directory holding log.csv (or the .tmp files of a running/killed run)")
    parser.add_argument("--alpha", type=float, default=0.95,
                        help="EMA decay of G^TG and tr(Σ); the EMA weight of a new step is 1 - alpha (default: 0.95)")
    parser.add_argument("--prefix", default="train/gns",
                        help="column prefix of the per-parameter norms (default: train/gns)")
    parser.add_argument("--no-plots", action="store_true",
                        help="skip the terminal plots (PNG figures are always written)")
    args = parser.parse_args(argv)
    if not 0 <= args.alpha < 1:
        parser.error(f"--alpha must be in [0, 1), got {args.alpha}")

    try:
        results = analyze_gns(args.out_dir, args.alpha, args.prefix)
    except (FileNotFoundError, ValueError) as e:
        print(f"gns-analysis.py: error: {e}", file=sys.stderr)
        return 1

    print()
    print(summary(results))
    print()
    print(group_table(results))
    if not args.no_plots:
        print_plots(results)
    paths = save_plots(results, args.out_dir)
    output_path = os.path.join(args.out_dir, "gns_analysis.csv")
    results.to_csv(output_path, index=False)
    print(f"\nFigures saved to: {', '.join(paths)}")
    print(f"Detailed results saved to: {output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
