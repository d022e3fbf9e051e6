"""
`python gns-analysis.py OUT_DIR` (or `nanogns-analysis`, the installed command): analyze_gns's results
printed (report.py), plotted in the terminal and saved as PNGs, and written to gns_analysis.csv. See
analyze.py's docstring for the numbers, and `--help` for the flags.
"""

import os
import sys
import tempfile

import numpy as np

from nanogns.analysis.analyze import analyze_gns
from nanogns.analysis.commandline import Parser, prog_name
from nanogns.analysis.plots import HAS_MATPLOTLIB, HAS_PLOTILLE, PLOT_EXTRA, save_png, terminal_plot
from nanogns.analysis.report import approx_line, block_table, group_table, layernorm_line, summary, tradeoff_lines
from nanogns.errors import LogNotUsable
from nanogns.runlog.record import GROUPS
from nanogns.runlog.writer import DATA_TMP, HEADER_TMP, LOG_CSV


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
        raise LogNotUsable(
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
    """gns-analysis's command line (argv: its arguments, sys.argv's when None); returns the exit code."""
    prog = prog_name(argv, "gns-analysis.py")
    parser = Parser(prog, description="Gradient noise scale of a run from its CSV log.")
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
        "--no-plots",
        action="store_true",
        help="no plots: neither the terminal plots nor the PNG figures (gns_analysis.csv is written)",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where gns_analysis.csv and the PNG figures go (default: the run directory, or a new temporary "
        "directory, with a note, when the run directory is read-only)",
    )
    args = parser.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument (usage printed)
        return args
    if not 0 <= args.alpha < 1:
        print(f"{prog}: error: --alpha must be in [0, 1), got {args.alpha}", file=sys.stderr)
        return 2

    try:
        run_dir = _run_dir(args.out_dir)
        results = analyze_gns(run_dir, args.alpha, args.prefix, args.approx_prefix)
    except (OSError, ValueError) as e:  # FileNotFoundError, a file that cannot be read, a log that is not one
        reason = f"cannot read {e.filename} ({e.strerror})" if isinstance(e, OSError) and e.filename else str(e)
        print(f"{prog}: error: {reason}", file=sys.stderr)
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
    try:
        output_dir, note = _output_dir(run_dir, args.output_dir)
        if note:
            print(f"\n{note}")
        if not args.no_plots and HAS_PLOTILLE:
            print_plots(results)
        # without the plot extra, or with --no-plots: the CSV alone
        paths = save_plots(results, output_dir) if HAS_MATPLOTLIB and not args.no_plots else []
        output_path = os.path.join(output_dir, "gns_analysis.csv")
        _write_csv(results, output_path)  # last: a write that fails before it leaves no results file
    except OSError as e:  # a full disk, an unwritable --output-dir
        where = e.filename or args.output_dir or run_dir
        print(
            f"{prog}: error: cannot write {where} ({e.strerror or e}); free some space, or write the "
            "results elsewhere with --output-dir",
            file=sys.stderr,
        )
        return 1
    if paths:
        print(f"\nFigures saved to: {', '.join(paths)}")
    print(f"Detailed results saved to: {output_path}")
    missing = [
        name
        for name, found in (
            ("plotille", HAS_PLOTILLE or args.no_plots),
            ("matplotlib", HAS_MATPLOTLIB or args.no_plots),
        )
        if not found
    ]
    if missing:
        print(f"No {' or '.join(missing)}: for the plots, {PLOT_EXTRA}")
    return 0


def _write_csv(results, path):
    """results as CSV at `path`, through a temporary file: a write that fails leaves no half-written file."""
    try:
        results.to_csv(path + ".tmp", index=False)
        os.replace(path + ".tmp", path)
    except OSError as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        e.filename = e.filename or path
        raise
