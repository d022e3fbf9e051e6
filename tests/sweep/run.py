"""
Run the architecture sweep, writing each verdict as it is found (a crash or a kill loses nothing; a rerun resumes).

    python tests/sweep/run.py --out sweep.jsonl                    # every architecture of every library
    python tests/sweep/run.py --out sweep.jsonl --library=timm     # one library
    python tests/sweep/run.py --out sweep.jsonl --only=bloom,clip  # cases whose id contains one of these
    python tests/sweep/run.py --golden sweep.jsonl                 # rewrite tests/sweep/verdicts.csv from a run
    python tests/sweep/run.py --docs                               # rewrite docs/results.md's sweep section

Each case runs in a worker process; a worker that dies (a segfault, memory) is replaced and the case it was
running gets CRASH with how it died. Run it in the background, niced, on a shared machine:
    nice python tests/sweep/run.py --out /tmp/sweep.jsonl > /tmp/sweep.log 2>&1 &
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

from sweep import cases as sweep_cases  # noqa: E402
from sweep import golden  # noqa: E402


def done_ids(path):
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


def worker(out, ids):
    """Check `ids` in order, appending each result to `out` (one JSON line each, flushed)."""
    import torch

    from sweep.check import check

    torch.set_num_threads(int(os.environ.get("SWEEP_THREADS", "1")))
    known = sweep_cases.by_id()
    for case_id in ids:
        case = known[case_id]
        with open(out + ".running", "w") as f:
            f.write(case_id)
        result = check(case.prepare, seconds=case.seconds)
        row = dict(
            case.row(),
            verdict=result.verdict,
            reason=result.reason,
            inputs=result.inputs,
            seconds=round(result.seconds, 2),
        )
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{result.verdict:14s} {case_id} {result.seconds:.1f}s {result.reason[:200]}", flush=True)
    if os.path.exists(out + ".running"):
        os.remove(out + ".running")


def run(out, library, only):
    """Every selected case not yet in `out`, in worker processes replaced when one dies."""
    wanted = [c.id for c in sweep_cases.all_cases(library) if not only or any(o in c.id for o in only)]
    while True:
        todo = [i for i in wanted if i not in done_ids(out)]
        if not todo:
            return
        listing = out + ".todo"
        with open(listing, "w") as f:
            f.write("\n".join(todo))
        code = subprocess.call([sys.executable, __file__, "--worker", listing, "--out", out])
        if code != 0 and os.path.exists(out + ".running"):
            with open(out + ".running") as f:
                case_id = f.read().strip()
            case = sweep_cases.by_id()[case_id]
            how = f"the worker process died (exit code {code}) while checking it"
            with open(out, "a") as f:
                f.write(json.dumps(dict(case.row(), verdict="CRASH", reason=how, inputs="", seconds=0)) + "\n")
            os.remove(out + ".running")
        elif code != 0:
            raise SystemExit(f"the sweep's worker failed (exit code {code}) outside a case")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the results file (JSON lines), appended to; a rerun skips what it holds")
    parser.add_argument("--library", default=None, help="transformers, timm, diffusers or torchvision (default: all)")
    parser.add_argument("--only", default="", help="comma-separated parts of case ids")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--golden", help="rewrite the golden file from this results file")
    parser.add_argument(
        "--docs", action="store_true", help="rewrite docs/results.md's sweep section from the golden file"
    )
    args = parser.parse_args()
    if args.worker:
        with open(args.worker) as f:
            worker(args.out, [line.strip() for line in f if line.strip()])
        return 0
    if args.golden:
        golden.write(golden.read_results(args.golden))
        return 0
    if args.docs:
        golden.write_docs()
        return 0
    if not args.out:
        parser.error("--out is required to run the sweep")
    start = time.time()
    run(args.out, args.library, [o for o in args.only.split(",") if o])
    print(f"sweep done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
