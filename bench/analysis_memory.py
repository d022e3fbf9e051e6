"""
Peak memory and time of the analysis (nanogns.analysis.analyze_gns, what gns-analysis runs before its plots) on
logs of growing length, beside the log writer's close() on the same log (bench/log_writer_memory.py measures the
writer alone): the analysis reads the log in pieces and keeps each step's sums, so its memory should follow the
number of steps times a few dozen numbers, not the log's size in bytes.

    python bench/analysis_memory.py                           # 14,000 and 140,000 rows x 731 columns (1 GB)
    python bench/analysis_memory.py --old=8cad151             # and the analysis of an earlier commit, for scale
                                                              # (on the logs under 256 MiB: it held the whole log)

The log is a finished run's log.csv as train.py writes it: step, iter_num, tokens_processed, train/lossf, lr and
norm, pegn and batch_size of 242 parameters in 12 blocks, in a temporary directory (--dir) removed at the end.
Each measurement runs in its own process: its peak resident memory during the call (VmHWM, reset just before it
through /proc/self/clear_refs: the whole process's, the interpreter and pandas included), how much the call added
above the memory right before it, and the call's wall time. Linux only (/proc).
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
PARAMS = [f"transformer.h.{b}.{k}" for b in range(12) for k in KINDS]
PARAMS += ["transformer.ln_f.weight", "transformer.wte.weight+lm_head.weight"]  # 242 parameters, the tied one exactly

MEASURE = r"""
import contextlib, io, json, sys, time
sys.path.insert(0, sys.argv[1])

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024  # MiB

what, out_dir = sys.argv[2], sys.argv[3]
if what == "analysis":
    from nanogns.analysis.analyze import analyze_gns as call
else:
    from nanogns.runlog.writer import LogWrapper
    def call(out_dir):  # the writer on the same log: a resume's rewrite, then close() (log.csv again)
        log = LogWrapper(out_dir=out_dir, resume=True)
        log.close()
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
start = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    result = call(out_dir)
seconds = time.perf_counter() - start
steps = len(result) if result is not None else None
print(json.dumps({"peak_mib": rss("VmHWM:") - before, "rss_mib": rss("VmHWM:"), "seconds": seconds, "steps": steps}))
"""


def write_log(out_dir, rows):
    """A finished run's log.csv of `rows` steps; returns its size in bytes."""
    names = ["step", "iter_num", "tokens_processed", "train/lossf", "lr"]
    names += [f"train/gns/{p}/{m}" for p in PARAMS for m in ("norm", "pegn", "batch_size")]
    norms = [repr(0.5 + (i * 7919 % 10007) / 1e4 + 1e-9) for i in range(len(PARAMS))]  # 17 characters, as logged
    pegns = [repr(3.0 + (i * 104729 % 10007) / 1e4 + 1e-9) for i in range(len(PARAMS))]
    cells = "," + ",".join(f"{n},{g},64" for n, g in zip(norms, pegns)) + "\n"
    with open(os.path.join(out_dir, "log.csv"), "w") as f:
        f.write(",".join(names) + "\n")
        for step in range(rows):
            f.write(f"{step},{step},{(step + 1) * 64 * 1024},2.{step % 997:03d}1234,0.000{step % 89 + 10}" + cells)
    return os.path.getsize(os.path.join(out_dir, "log.csv"))


def measure(repo, what, out_dir):
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, repo, what, out_dir], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", default="14000,140000", help="rows of each log, comma-separated (default: 14000,140000)"
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
        print(f"log: N rows x {5 + 3 * len(PARAMS)} columns ({len(PARAMS)} parameters)")
        print(
            f"{'code':<22}{'call':<26}{'rows':>8}{'log MiB':>9}{'peak RSS MiB':>14}{'of it the call':>16}{'seconds':>9}"
        )
        for rows in (int(r) for r in args.rows.split(",")):
            run_dir = os.path.join(work, "run")
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            size = write_log(run_dir, rows)
            calls = [(name, repo, "analysis") for name, repo in repos.items() if repo == REPO or size < 2**28]
            calls.append(("this checkout", REPO, "writer"))
            for name, repo, what in calls:
                result = measure(repo, what, run_dir)
                if what == "analysis":
                    assert result["steps"] == rows, result
                label = "analyze_gns" if what == "analysis" else "writer: resume + close()"
                print(
                    f"{name:<22}{label:<26}{rows:>8,}{size / 2**20:>9,.0f}{result['rss_mib']:>14,.1f}"
                    f"{result['peak_mib']:>16,.1f}{result['seconds']:>9.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
