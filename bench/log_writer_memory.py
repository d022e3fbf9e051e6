"""
Peak memory and time of the CSV log writer (nanogns/runlog/writer.py) on a long run's log: a resume's rewrite
(LogWrapper(..., resume=True, resume_step=N), which sets the rows from N on aside) and close() (which writes
log.csv from the .tmp files, padding short rows), the two places that read the whole log.

    python bench/log_writer_memory.py                          # 100,000 rows x 727 columns, about 1 GB
    python bench/log_writer_memory.py --rows=10000 --old=8112e34  # and the writer of an earlier commit, for scale

The log is a killed run's .tmp files (header + rows; the first half of the rows written before the last 10% of
the columns appeared, so close() pads them), in a temporary directory (--dir) removed at the end. Each
measurement runs in its own process: its peak resident memory during the call (VmHWM, reset just before it
through /proc/self/clear_refs: the whole process's, the interpreter included), how much of
it the call added above the memory right before it, and the call's wall time. Linux only (/proc).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEASURE = r"""
import importlib.util, json, os, sys, time

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024  # MiB

spec = importlib.util.spec_from_file_location("writer", sys.argv[1])
writer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(writer)
out_dir, what, resume_step = sys.argv[2], sys.argv[3], int(sys.argv[4])

def call():
    if what == "resume":
        return writer.LogWrapper(out_dir=out_dir, resume=True, resume_step=resume_step)
    log.log({"late": 1.0})
    log.step()
    log.close()

if what == "close":
    log = writer.LogWrapper(out_dir=out_dir, resume=True)  # (the rewrite, not measured here)
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
start = time.perf_counter()
call()
seconds = time.perf_counter() - start
print(json.dumps({"peak_mib": rss("VmHWM:") - before, "rss_mib": rss("VmHWM:"), "seconds": seconds}))
"""


def write_log(out_dir, rows, columns):
    """A killed run's log_header.csv.tmp and log_data.csv.tmp; returns the data file's size in bytes."""
    late = columns // 10  # columns that appear half-way: the first half of the rows are shorter
    names = ["step", *[f"train/gns/transformer.h.{i // 30}.p{i}/norm" for i in range(columns - 1)]]
    with open(os.path.join(out_dir, "log_header.csv.tmp"), "w") as f:
        f.write(",".join(names) + "\n")
    values = [repr((i * 7919 % 10007) / 1e4 + 1e-9) for i in range(columns - 1)]  # 17 characters, as logged
    long_row, short_row = "," + ",".join(values) + "\n", "," + ",".join(values[: columns - 1 - late]) + "\n"
    with open(os.path.join(out_dir, "log_data.csv.tmp"), "w") as f:
        for step in range(rows):
            f.write(str(step) + (short_row if step < rows // 2 else long_row))
    return os.path.getsize(os.path.join(out_dir, "log_data.csv.tmp"))


def measure(writer_path, out_dir, what, resume_step):
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, writer_path, out_dir, what, str(resume_step)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the log (default: 100000)")
    parser.add_argument("--columns", type=int, default=727, help="columns of the log, step included (default: 727)")
    parser.add_argument("--dir", default=None, help="where the temporary log goes (default: the system's temp dir)")
    parser.add_argument(
        "--old", default=None, help="also measure nanogns/runlog/writer.py as of this git revision (default: no)"
    )
    args = parser.parse_args()
    writers = {"this checkout": os.path.join(REPO, "nanogns", "runlog", "writer.py")}
    work = tempfile.mkdtemp(prefix="log-writer-memory-", dir=args.dir)
    try:
        if args.old:
            old = os.path.join(work, "old_writer.py")
            with open(old, "w") as f:
                f.write(
                    subprocess.check_output(
                        ["git", "-C", REPO, "show", f"{args.old}:nanogns/runlog/writer.py"], text=True
                    )
                )
            writers[f"writer of {args.old}"] = old
        print(f"log: {args.rows:,} rows x {args.columns} columns")
        print(f"{'writer':<20}{'call':<32}{'log MiB':>9}{'peak RSS MiB':>14}{'of it the call':>16}{'seconds':>9}")
        for name, path in writers.items():
            for what in ("resume", "close"):
                run_dir = os.path.join(work, "run")
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
                size = write_log(run_dir, args.rows, args.columns)
                result = measure(path, run_dir, what, args.rows - 100)
                label = "resume rewrite (set aside 100)" if what == "resume" else "close() (writes log.csv)"
                print(
                    f"{name:<20}{label:<32}{size / 2**20:>9,.0f}{result['rss_mib']:>14,.1f}"
                    f"{result['peak_mib']:>16,.1f}{result['seconds']:>9.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
