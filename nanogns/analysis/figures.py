"""
The paper's figures from run directories (the plotting behind "Replicating Figures.ipynb").

    from nanogns.analysis import figures
    fig = figures.gns_by_layer_type("out-cgpt-openwebtext")
    fig.savefig("gns_by_layer_type.png")

Every function takes out_dirs written by train.py, returns a matplotlib Figure
and leaves saving to the caller. The numbers come from analysis/analyze.py's
`analyze_gns` (the same estimator and EMA), so figures and printed results agree.
"""

import os

import matplotlib

matplotlib.use("Agg")  # figures are saved, never shown: works headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from nanogns.analysis import analyze as gns_analysis  # noqa: E402
from nanogns.analysis.parameters import blocks_of  # noqa: E402
from nanogns.runlog.reader import load_csv  # noqa: E402

GROUP_COLUMNS = {
    "all parameters": "gns",
    "LayerNorm only": "gns_layernorm",
    "Linear only": "gns_linear",
    "Embedding only": "gns_embedding",
}


def readable_ticks(ax, x=True, y=True):
    """A few labelled ticks on the chosen axes: linear ones at most 5 (counts as 20k, 1.2M), log ones at
    1, 2, 5 x 10^k over up to two decades, at powers of ten beyond (4 evenly spaced under one decade); minor
    ticks unlabelled."""
    engineering = EngFormatter(sep="")
    plain = FuncFormatter(lambda value, _: f"{value:g}" if abs(value) < 1e4 else engineering(value))
    chosen = [(ax.xaxis, ax.get_xscale(), ax.get_xlim())] * x + [(ax.yaxis, ax.get_yscale(), ax.get_ylim())] * y
    for axis, scale, limits in chosen:
        if scale == "log":
            low, high = sorted(limits)
            decades = np.log10(high / low) if low > 0 else np.inf
            locator = (
                MaxNLocator(4)
                if decades < 1
                else LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2 else (1.0,), numticks=6)
            )
            axis.set_major_locator(locator)
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
        else:
            axis.set_major_locator(MaxNLocator(5))
            if max(abs(v) for v in limits) >= 1e4:  # counts: 20k, not 20000 or an offset label
                axis.set_major_formatter(engineering)
    return ax


def gns_by_layer_type(out_dir, alpha=0.95):
    """GNS over tokens from all parameters, LayerNorm only, and each layer type (the paper's Fig. 1 idea)."""
    results = gns_analysis.analyze_gns(out_dir, alpha=alpha)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, column in GROUP_COLUMNS.items():
        if results[column].notna().any():
            ax.plot(results[results.attrs["x"]], results[column], label=label, lw=2 if column == "gns" else 1.2)
    ax.set(
        xlabel=results.attrs["x"].split("_")[0],
        ylabel="GNS",
        yscale="log",
        title=f"GNS by layer type ({os.path.basename(os.path.normpath(out_dir))})",
    )
    ax.legend()
    readable_ticks(ax)
    fig.tight_layout()
    return fig


def phase_plot(out_dir, alpha=0.95):
    """tr(Sigma) EMA against |G|^2 EMA, log-log, coloured by tokens: lines of constant GNS are diagonals."""
    results = gns_analysis.analyze_gns(out_dir, alpha=alpha)
    ok = (results["gtg_ema"] > 0) & (results["trsigma_ema"] > 0)
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    points = ax.scatter(
        results.loc[ok, "gtg_ema"], results.loc[ok, "trsigma_ema"], c=results.loc[ok, results.attrs["x"]], s=8
    )
    fig.colorbar(points, ax=ax, label=results.attrs["x"].split("_")[0], format=EngFormatter(sep=""))
    ax.set(xscale="log", yscale="log", xlabel="|G|² (EMA)", ylabel="tr(Σ) (EMA)", title="phase plot")
    readable_ticks(ax)
    fig.tight_layout()
    return fig


def per_layer_gns(out_dir, alpha=0.95):
    """DataFrame: GNS over steps for every tracked parameter and for every transformer block.

    Columns: the x-axis (tokens_processed, or examples_processed for a log without tokens, as gns-analysis.py;
    `table.attrs["x"]` names it), one per parameter name, and `block <i>` for the sum over block i's parameters
    (the blocks gns-analysis.py uses, the same numbers as its gns_block_<i> columns). `table.attrs["groups"]`:
    {name: group}.
    """

    def sets(chosen, facts, approx):  # one sum per parameter and per block
        blocks = {f"block {index}": members for index, members in blocks_of(chosen, facts).items()}
        return {**{f"param {name}": {name: columns} for name, columns in chosen.items()}, **blocks}

    m = gns_analysis.load_measurements(out_dir, sets=sets)
    df, chosen, facts = m.steps[m.steps[gns_analysis.MEASURED]].reset_index(drop=True), m.chosen, m.facts
    x = "tokens_processed" if "tokens_processed" in df else "examples_processed"
    out = {x: df[x] if x in df else df["bs:all"].cumsum()}
    for name in chosen:
        out[name] = gns_analysis.gns_of(df, f"param {name}", alpha)["gns"]
    for index in blocks_of(chosen, facts):
        out[f"block {index}"] = gns_analysis.gns_of(df, f"block {index}", alpha)["gns"]
    table = pd.DataFrame(out).reset_index(drop=True)
    table.attrs["groups"] = {name: group for name, (group, _) in facts.items()}
    table.attrs["x"] = x
    return table


def per_layer_figure(out_dir, alpha=0.95):
    """Left: GNS of each block over tokens. Right: the final GNS of every parameter."""
    table = per_layer_gns(out_dir, alpha)
    blocks = [c for c in table.columns if c.startswith("block ")]
    params = [c for c in table.columns if c != table.attrs["x"] and c not in blocks]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, max(4, 0.22 * len(params))), gridspec_kw={"width_ratios": [1, 1.3]}
    )
    for column in blocks:
        left.plot(table[table.attrs["x"]], table[column], label=column)
    left.set(xlabel=table.attrs["x"].split("_")[0], ylabel="GNS", yscale="log", title="GNS per block")
    if blocks:
        left.legend(fontsize=8)
    readable_ticks(left)
    final = table[params].ffill().iloc[-1]
    right.barh(
        np.arange(len(params)),
        final.to_numpy(),
        color=["C1" if table.attrs["groups"][p] == "LayerNorm" else "C0" for p in params],
    )
    right.set_yticks(np.arange(len(params)), params, fontsize=7)
    right.set(xscale="log", xlabel="final GNS", title="per parameter (orange: LayerNorm)")
    right.invert_yaxis()
    readable_ticks(right, y=False)
    fig.tight_layout()
    return fig


def schedule_comparison(runs, loss_column="train/lossf"):
    """Loss against tokens and against wall time for several runs (e.g. fixed vs linear vs gns batch-size schedules).

    Args:
        runs: {label: out_dir}. Wall time is the running sum of each run's logged `dt`.
    """
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for label, out_dir in runs.items():
        df = load_csv(out_dir)
        rows = df[df[loss_column].notna()]
        wall = df["dt"].fillna(0).cumsum().loc[rows.index]
        by_tokens.plot(rows["tokens_processed"], rows[loss_column], label=label)
        by_time.plot(wall, rows[loss_column], label=label)
    by_tokens.set(xlabel="tokens", ylabel=loss_column, title="loss against tokens")
    by_time.set(xlabel="wall time (s)", ylabel=loss_column, title="loss against wall time")
    by_tokens.legend()
    readable_ticks(by_tokens)
    readable_ticks(by_time)
    fig.tight_layout()
    return fig
