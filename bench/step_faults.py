"""
Page faults and system time of a training step, per layer choice, each choice alone in its own process (glibc's
malloc keeps or returns freed blocks by what the process allocated before, so choices sharing a process change
each other's counts). A large block freed and allocated again can be handed back to the system and fault its pages
in anew at each use: on the CPU that is time the step spends in the kernel, seen in the wall clock.

    python bench/step_faults.py --n_layer=4 --n_head=4 --n_embd=256 --block_size=128 --batch_size=8 \\
        --choices="nn,all-layer gns" --steps=20 --runs=3

Model and step are bench/step_overhead.py's (same arguments); per run and choice: minor page faults per step,
system and user CPU ms per step, wall ms per step, over --steps steps after --warmup.
"""

import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step_overhead  # noqa: E402  (bench/step_overhead.py: the model, batches and step of each choice)


def one_choice(argv, name):
    """{faults, sys_ms, user_ms, wall_ms} per step of choice `name`, measured in this process."""
    args = step_overhead.parse_args(argv)
    step = step_overhead.build(args, name)
    for _ in range(args.warmup):
        step()
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.steps):
        step()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    per_step = 1 / args.steps
    return {
        "faults": (after.ru_minflt - before.ru_minflt) * per_step,
        "sys_ms": (after.ru_stime - before.ru_stime) * 1000 * per_step,
        "user_ms": (after.ru_utime - before.ru_utime) * 1000 * per_step,
        "wall_ms": wall * 1000 * per_step,
    }


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    runs = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--runs=")), 3)
    one = next((a.split("=", 1)[1] for a in argv if a.startswith("--one=")), None)
    argv = [a for a in argv if not a.startswith(("--runs=", "--one="))]
    if one is not None:
        print(json.dumps(one_choice(argv, one)))
        return
    names = step_overhead.parse_args(argv).choices
    names = names.split(",") if names else ["nn", "all-layer gns"]
    print("| run | layers | page faults / step | system ms / step | user ms / step | wall ms / step |")
    print("|---|---|---|---|---|---|")
    for run in range(1, runs + 1):
        for name in names:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), *argv, f"--one={name}"], capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"step_faults.py: {name!r} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {run} | {name} | {r['faults']:,.0f} | {r['sys_ms']:.1f} | {r['user_ms']:.1f} | {r['wall_ms']:.1f} |"
            )


if __name__ == "__main__":
    main()
