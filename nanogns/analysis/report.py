"""
The analysis's results in words and tables: the summary (final GNS, EMAs, the GNS without the tied tensor), the
batch-size trade-off (McCandlish et al. 2018), the tables by group and by block, and the comparisons (LayerNorm
only against all parameters, approximate against exact). Pure functions of analyze_gns's results.
"""

import numpy as np
import pandas as pd

from nanogns.runlog.record import GROUPS

OVERHEAD = 0.10  # the batch-size trade-off reports the batches that keep each overhead under this


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
    changes = batch_size_changes(results)
    if changes:
        lines.append(changes)
    x = results.attrs.get("x", "tokens_processed")
    end = results.attrs.get("log_end") or {}
    total = end.get("tokens_processed") if x == "tokens_processed" else None
    lines.append(
        f"Total {x.split('_')[0]} processed: {_fmt_tokens(float(last[x]) if total is None else total)}"
        + ("" if x == "tokens_processed" else " (the log has no tokens_processed column)")
    )
    if end.get("step") is not None and end["step"] > end["measured_step"]:
        at = f" ({_fmt_tokens(float(last[x]))} {x.split('_')[0]})"
        lines.append(
            f"  (the GNS above is at step {end['measured_step']}{at}, the last step with per-example norms; the "
            f"log goes on to step {end['step']} without them, and the total counts those steps too)"
        )
    return "\n".join(lines)


def batch_size_changes(results, limit=4):
    """A line saying how the batch size changed over the measured steps (a resume with another batch size, a
    schedule), or None when it stayed the same."""
    bs, step = results["batch_size"].to_numpy(), results["step"].to_numpy()
    starts = np.r_[0, np.flatnonzero(bs[1:] != bs[:-1]) + 1]
    if len(starts) < 2:
        return None
    ends = np.r_[starts[1:] - 1, len(bs) - 1]
    if len(starts) > limit:
        return (
            f"Batch size changed {len(starts) - 1} times, between {np.nanmin(bs):.0f} and {np.nanmax(bs):.0f} "
            f"(steps {step[0]}-{step[-1]}: a batch-size schedule)"
        )
    segments = [
        f"{bs[a]:.0f} (step{f's {step[a]}-{step[b]}' if a != b else f' {step[a]}'})" for a, b in zip(starts, ends)
    ]
    return f"Batch size changed {len(starts) - 1} time(s): " + ", then ".join(segments)


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
