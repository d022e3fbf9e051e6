"""
Peak memory and time of the analysis on logs of growing length: analyze_gns (the numbers), gns-analysis whole
(the numbers, the terminal plots, the PNG figures and gns_analysis.csv; and with --no-plots), beside the log
writer's close() on the same log (bench/log_writer_memory.py measures the writer alone). The analysis reads the
log in pieces and keeps each step's sums and results, so its memory should follow the number of steps times a few
dozen numbers, not the log's size in bytes.

    python bench/analysis_memory.py                           # 14,000 and 140,000 rows x 731 columns (1 GB)
    python bench/analysis_memory.py --shape=narrow --rows=20,370000 --calls=cli,cli-no-plots
                                                              # a one-block GPT's log, 200 MB
    python bench/analysis_memory.py --old=8cad151             # and the analysis of an earlier commit, for scale
                                                              # (on the logs under 256 MiB only)

The log is a finished run's log.csv as train.py writes it, in a temporary directory (--dir) removed at the end:
--shape=wide (step, iter_num, tokens_processed, train/lossf, lr and norm, pegn and batch_size of 242 parameters in
12 blocks: 7.5 KB a row) or --shape=narrow (train.py's columns for a GPT of one block with every layer tracked, 9
parameters: about 560 bytes a row, so many more steps per byte). Each measurement runs in its own process: its
peak resident memory during the call (VmHWM, reset just before it through /proc/self/clear_refs: the whole
process's, the interpreter, pandas and matplotlib imported before it included), how much the call added above the
memory right before it, the call's wall time and its process's CPU time (all threads: less sensitive than the wall
time to other work on a shared machine). Linux only (/proc).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ["ln_1.weight", "ln_2.weight", *(f"mlp.w{i}.weight" for i in range(18))]  # 2 LayerNorms, 18 Linears a block
WIDE = [f"transformer.h.{b}.{k}" for b in range(12) for k in KINDS]
WIDE += ["transformer.ln_f.weight", "transformer.wte.weight+lm_head.weight"]  # 242 parameters, the tied one exactly
BLOCK = [
    "ln_1.weight",
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "ln_2.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
]
NARROW = ["transformer.wte.weight+lm_head.weight", "transformer.wpe.weight", *(f"transformer.h.0.{k}" for k in BLOCK)]
NARROW += ["transformer.ln_f.weight"]  # train.py's GPT with n_layer=1, bias=False, every layer tracked: 9 parameters
CALLS = ("analyze", "cli", "cli-no-plots", "writer")

MEASURE = r"""
import contextlib, io, json, sys, time
sys.path.insert(0, sys.argv[1])

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024  # MiB

what, out_dir = sys.argv[2], sys.argv[3]
if what == "analyze":
    from nanogns.analysis.analyze import analyze_gns as call
elif what.startswith("cli"):
    import os, tempfile
    from nanogns.analysis import cli
    from nanogns.analysis.plots import HAS_MATPLOTLIB
    if HAS_MATPLOTLIB:  # imported before the measurement, as the interpreter is: what the call adds is measured
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot
    results_dir = tempfile.mkdtemp(prefix="analysis-results-", dir=os.path.dirname(out_dir))
    flags = ["--no-plots"] if what == "cli-no-plots" else []
    def call(out_dir):
        code = cli.main([out_dir, "--output-dir", results_dir, *flags])
        assert code == 0, code
        pngs = [f for f in os.listdir(results_dir) if f.endswith(".png")]
        print(json.dumps({"pngs": len(pngs)}), file=sys.stderr)
else:
    from nanogns.runlog.writer import LogWrapper
    def call(out_dir):  # the writer on the same log: a resume's rewrite, then close() (log.csv again)
        log = LogWrapper(out_dir=out_dir, resume=True)
        log.close()
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
start, cpu = time.perf_counter(), time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    result = call(out_dir)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
steps = len(result) if what == "analyze" else None
print(json.dumps({"peak_mib": rss("VmHWM:") - before, "rss_mib": rss("VmHWM:"), "seconds": seconds, "cpu": cpu, "steps": steps}))
"""


def write_log(out_dir, rows, shape="wide"):
    """A finished run's log.csv of `rows` steps; returns its size in bytes."""
    params = WIDE if shape == "wide" else NARROW
    names = ["step", "iter_num", "tokens_processed", "train/lossf", "lr"]
    if shape == "narrow":  # the rest of train.py's columns, short as they are logged (the GNS to 4 digits)
        names += ["grad_norm", "dt", "tokens_per_sec", "mfu", "gradient_accumulation_steps", "batch_size", "gns"]
    names += [f"train/gns/{p}/{m}" for p in params for m in ("norm", "pegn", "batch_size")]
    digits = 1e-9 if shape == "wide" else 3.14159e-9  # narrow: every float at its full 17-18 characters
    norms = [repr(0.5 + (i * 7919 % 10007) / 1e4 + digits) for i in range(len(params))]  # 17 characters, as logged
    pegns = [repr(3.0 + (i * 104729 % 10007) / 1e4 + digits) for i in range(len(params))]
    cells = "," + ",".join(f"{n},{g},64" for n, g in zip(norms, pegns)) + "\n"
    with open(os.path.join(out_dir, "log.csv"), "w") as f:
        f.write(",".join(names) + "\n")
        for step in range(rows):
            if shape == "wide":
                row = f"{step},{step},{(step + 1) * 64 * 1024},2.{step % 997:03d}1234,0.000{step % 89 + 10}"
            else:  # floats at repr precision, as train.py logs its loss, lr, grad_norm, dt, tokens_per_sec and gns
                floats = (2 + step % 997 / 1e3 + digits, 1e-3 * (1 - step / 1e6), 0.3 + step % 883 / 1e4 + digits)
                floats += (
                    0.1 + step % 97 / 1e5 + digits,
                    15000.5 + step % 7919 / 7 + digits,
                    7 + step % 13 / 10 + digits,
                )
                floats += (2 + step % 61 + digits,)
                loss, lr, grad_norm, dt, tokens_per_sec, mfu, gns = map(repr, floats)
                row = f"{step},{step},{(step + 1) * 64 * 1024},{loss},{lr},{grad_norm},{dt},{tokens_per_sec},{mfu},2,64,{gns}"
            f.write(row + cells)
    return os.path.getsize(os.path.join(out_dir, "log.csv"))


def measure(repo, what, out_dir):
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, repo, what, out_dir], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    pngs = [json.loads(line)["pngs"] for line in proc.stderr.splitlines() if line.startswith('{"pngs"')]
    result["pngs"] = pngs[0] if pngs else None
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", default="14000,140000", help="rows of each log, comma-separated (default: 14000,140000)"
    )
    parser.add_argument("--shape", choices=("wide", "narrow"), default="wide", help="the log's width (default: wide)")
    parser.add_argument(
        "--calls",
        default="analyze,writer",
        help=f"what to measure, comma-separated, of {', '.join(CALLS)} (default: analyze,writer)",
    )
    parser.add_argument("--dir", default=None, help="where the temporary logs go (default: the system's temp dir)")
    parser.add_argument("--old", default=None, help="also measure the analysis as of this git revision (default: no)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="analysis-memory-", dir=args.dir)
    try:
        repos = {"this checkout": REPO}
        if args.old:
            old = os.path.join(work, "old")
            os.makedirs(old)
            archive = subprocess.run(
                ["git", "-C", REPO, "archive", args.old, "nanogns"], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
            repos[f"analysis of {args.old}"] = old
        wanted = args.calls.split(",")
        unknown = [c for c in wanted if c not in CALLS]
        if unknown:
            parser.error(f"unknown --calls {unknown}; choose from {', '.join(CALLS)}")
        params = WIDE if args.shape == "wide" else NARROW
        print(f"log: N rows x {len(params)} parameters ({args.shape})")
        labels = {
            "analyze": "analyze_gns",
            "cli": "gns-analysis",
            "cli-no-plots": "gns-analysis --no-plots",
            "writer": "writer: resume + close()",
        }
        print(
            f"{'code':<22}{'call':<26}{'rows':>8}{'log MiB':>9}{'peak RSS MiB':>14}{'of it the call':>16}"
            f"{'seconds':>9}{'CPU s':>8}{'PNGs':>6}"
        )
        for rows in (int(r) for r in args.rows.split(",")):
            run_dir = os.path.join(work, "run")
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            size = write_log(run_dir, rows, args.shape)
            calls = [
                (name, repo, what)
                for what in wanted
                for name, repo in repos.items()
                if repo == REPO or (what != "writer" and size < 2**28)
            ]
            for name, repo, what in calls:
                result = measure(repo, what, run_dir)
                if what == "analyze":
                    assert result["steps"] == rows, result
                pngs = "" if result["pngs"] is None else result["pngs"]
                print(
                    f"{name:<22}{labels[what]:<26}{rows:>8,}{size / 2**20:>9,.0f}{result['rss_mib']:>14,.1f}"
                    f"{result['peak_mib']:>16,.1f}{result['seconds']:>9.1f}{result['cpu']:>8.1f}{pngs:>6}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
