"""
Terminal plots of any logged metric, and the plotting helper gns-analysis.py shares.

    python plot.py OUT_DIR train/lossf                       # against step
    python plot.py OUT_DIR train/lossf val/loss --x tokens_processed --logy
    python plot.py OUT_DIR lr --png lr.png                   # also save a PNG (matplotlib)

Reads finished, running and killed runs alike (nanogns.load_csv). Points whose
x or y is missing or non-finite are left out; a series longer than MAX_POINTS is
drawn decimated (each run of points keeps its lowest and highest value).
"""

import difflib
import importlib.util
import sys

import numpy as np
import pandas as pd

from nanogns.analysis.commandline import Parser, prog_name
from nanogns.errors import LogNotUsable
from nanogns.runlog.reader import load_csv

# the plot extra (pip install "nanogns[plot]"): without it the analysis prints and saves its numbers, no figures
HAS_PLOTILLE = importlib.util.find_spec("plotille") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PLOT_EXTRA = 'pip install "nanogns[plot]" (plotille for terminal plots, matplotlib for PNG figures)'

COLORS = (200, 100, 40, 160, 220, 75)  # plotille byte colours, one per series
MARKERS = ("*", "o", "x", "+", "#", "@")  # and a glyph each, so that the series differ without colour too


def _finite_pairs(x, y):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


MAX_POINTS = 4000  # drawn per series: a PNG is 840 pixels wide, a terminal plot 160 dots; a long run has 10^5+ steps


def decimated(x, y, points=MAX_POINTS, scatter=False):
    """(x, y) cut to at most `points` points, drawing the same picture: for a line, each of points / 2 runs of
    consecutive points keeps its lowest and its highest y, in their order (the line's envelope is the whole
    series'); for a scatter, points spread evenly over the series. Memory and time of a plot then follow the
    figure's size, not the run's length."""
    n = len(x)
    if n <= points:
        return x, y
    if scatter:
        keep = np.unique(np.linspace(0, n - 1, points).round().astype(np.int64))
        return x[keep], y[keep]
    runs = points // 2
    size = -(-n // runs)  # ceil: `runs` runs of `size` points, the last one padded with its last point
    padded = np.concatenate([y, np.full(runs * size - n, y[-1])]).reshape(runs, size)
    first = np.arange(runs) * size
    keep = np.unique(np.minimum(np.r_[first + padded.argmin(axis=1), first + padded.argmax(axis=1)], n - 1))
    return x[keep], y[keep]


def _limits(values):
    lo, hi = float(np.min(values)), float(np.max(values))
    if lo == hi:  # plotille needs min < max
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    return lo, hi


def terminal_plot(series, x_label="x", y_label="y", scatter=False, width=80, height=20):
    """A plotille figure as a string.

    Args:
        series: list of (label, x, y), x and y array-like of equal length.
        scatter: points instead of lines.
    Returns:
        The figure (plus a note naming series with no finite point), or a
        one-line note when no series has one.
    """
    import plotille

    pairs = [(label, *decimated(*_finite_pairs(x, y), scatter=scatter)) for label, x, y in series]
    empty = [label for label, x, _ in pairs if not len(x)]
    note = f"\n(no finite points, not drawn: {', '.join(empty)})" if empty else ""
    pairs = [(label, x, y) for label, x, y in pairs if len(x)]
    if not pairs:
        return f"(nothing to plot: no finite values of {y_label})"
    fig = plotille.Figure()
    fig.width, fig.height = width, height
    fig.color_mode = "byte"
    fig.x_label, fig.y_label = x_label, y_label
    fig.set_x_limits(*_limits(np.concatenate([x for _, x, _ in pairs])))
    fig.set_y_limits(*_limits(np.concatenate([y for _, _, y in pairs])))
    for (label, x, y), color, marker in zip(pairs, COLORS * len(pairs), MARKERS * len(pairs)):
        draw = fig.scatter if scatter else fig.plot
        draw(x.tolist(), y.tolist(), lc=color, label=label, marker=marker)
    return fig.show(legend=True) + note


def save_png(path, series, x_label="x", y_label="y", title=None, scatter=False, logy=False):
    """The same figure with matplotlib (Agg backend), saved to path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, x, y in series:
        x, y = decimated(*_finite_pairs(x, y), scatter=scatter)
        if scatter:
            ax.scatter(x, y, s=6, label=label)
        else:
            ax.plot(x, y, label=label)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    if series:
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:  # a full disk: the caller names the file
        e.filename = e.filename or path
        raise
    finally:
        plt.close(fig)
    return path


def unknown_columns_message(unknown, columns):
    """The run's main columns by name, the per-parameter ones (train/gns/<param>/...) as a count and a pattern:
    there are about 90 of those, which would bury the rest."""
    columns = [str(c) for c in columns]
    per_parameter = [c for c in columns if c.startswith("train/gns/") and c.count("/") >= 3]
    main_columns = [c for c in columns if c not in per_parameter]
    close = [m for u in unknown for m in difflib.get_close_matches(u, columns, n=2)]
    lines = [f"unknown column(s) {unknown}; the run's columns:", "  " + ", ".join(main_columns)]
    if per_parameter:
        parameters = sorted({c[len("train/gns/") : c.rindex("/")] for c in per_parameter})
        lines.append(
            f"  and train/gns/<parameter>/{{norm,pegn,batch_size}} for {len(parameters)} parameters, e.g. "
            f"{per_parameter[0]} (all of them: python -c \"from nanogns import load_csv; "
            f"print(list(load_csv('OUT_DIR').columns))\")"
        )
    lines += [f"  did you mean {' or '.join(close)}?"] if close else []
    return "\n".join(lines)


def main(argv=None):
    """plot.py's command line (argv: its arguments, sys.argv's when None); returns the exit code."""
    prog = prog_name(argv, "plot.py")
    parser = Parser(prog, description="Plot logged metrics of a run in the terminal.")
    parser.add_argument("out_dir", help="run directory holding log.csv (or the .tmp files of a running/killed run)")
    parser.add_argument("keys", nargs="+", metavar="KEY", help="column(s) to plot, e.g. train/lossf")
    parser.add_argument("--x", default="step", help="column for the x axis (default: step)")
    parser.add_argument("--logy", action="store_true", help="plot log10 of the values (default: off)")
    parser.add_argument("--png", default=None, help="also save the figure to this PNG file (default: none)")
    parser.add_argument("--width", type=int, default=80, help="plot width in characters (default: 80)")
    parser.add_argument("--height", type=int, default=20, help="plot height in characters (default: 20)")
    args = parser.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument (usage printed)
        return args

    try:
        df = load_csv(args.out_dir)
        unknown = [k for k in [args.x, *args.keys] if k not in df.columns]
        if unknown:
            raise LogNotUsable(unknown_columns_message(unknown, df.columns))
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1

    x = pd.to_numeric(df[args.x], errors="coerce").to_numpy(dtype=np.float64)
    series = []
    for key in args.keys:
        y = pd.to_numeric(df[key], errors="coerce").to_numpy(dtype=np.float64)
        if args.logy:
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.log10(y)
        series.append((f"log10({key})" if args.logy else key, x, y))
    y_label = ", ".join(label for label, _, _ in series)
    print(f"{y_label} vs {args.x}")
    print(terminal_plot(series, x_label=args.x, y_label=y_label, width=args.width, height=args.height))
    if args.png:
        save_png(args.png, series, x_label=args.x, y_label=y_label)
        print(f"saved {args.png}")
    return 0
