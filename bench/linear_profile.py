"""
Where one gns Linear's time goes beside plain nn.Linear's (forward + backward of a fixed batch and output
gradient), and the same ratio measured by a second harness.

    python bench/linear_profile.py                                  # B=64, T=32, K=L=256 (the README's short rows)
    python bench/linear_profile.py --shape=16,256,128,512 --rounds=15

Three parts, all on --threads threads (default 1) and timed by the process's CPU time (so other jobs on a
shared machine count little):
  ratio     torch.utils.benchmark's Timer (blocked_autorange: its own warm-up and block sizes, not
            bench/linear_strategies.py's per-call loop) on plain and gns in turn, --rounds rounds; the median
            over rounds of gns / plain, with quartiles.
  ops       every op each layer dispatches (a TorchDispatchMode timing each op), by op and input shapes: the
            median over --rounds calls of its CPU time in ms per call, plain beside gns. Ops that only the gns
            layer runs are its extra arithmetic; the rest is shared work.
  per call  the same two layers at a tiny shape (B=2, T=2, K=L=8), where the arithmetic is nothing: what is left
            is the Python and dispatch work of one call (its microseconds, its Python calls and ops).
"""

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.utils.benchmark as benchmark  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nanogns.core import matmul  # noqa: E402
from nanogns.kinds.linear import PerExampleLinear  # noqa: E402


class OpTimer(TorchDispatchMode):
    """CPU time of each dispatched op, by (op, input shapes)."""

    def __init__(self):
        super().__init__()
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        key = (str(func.overloadpacket.__name__), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        self.seconds[key] += time.process_time() - start
        self.calls[key] += 1
        return out


def make_layers(B, T, K, L):
    """{name: step()} running one forward + backward of plain nn.Linear and of the gns Linear, same weights."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(K, L)
    gns = PerExampleLinear(K, L)
    gns.load_state_dict(plain.state_dict())
    x = torch.randn(B, T, K, requires_grad=True)
    g = torch.randn(B, T, L)

    def stepper(layer):
        def step():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(g)

        return step

    return {"plain": stepper(plain), "gns": stepper(gns)}


def ratio(steps, rounds):
    """(median, q1, q3) over rounds of gns / plain, each timed by torch.utils.benchmark (CPU time)."""
    timers = {
        name: benchmark.Timer(
            "step()", globals={"step": step}, timer=time.process_time, num_threads=torch.get_num_threads()
        )
        for name, step in steps.items()
    }
    ratios, medians = [], {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        found = {name: timers[name].blocked_autorange(min_run_time=0.2).median for name in order}
        ratios.append(found["gns"] / found["plain"])
        for name, seconds in found.items():
            medians[name].append(seconds)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3, {name: statistics.median(v) * 1e3 for name, v in medians.items()}


def op_profile(steps, rounds):
    """{layer: {(op, shapes): (median ms per call, calls per call)}}."""
    found = {}
    for name, step in steps.items():
        step()
        per_round = collections.defaultdict(list)
        for _ in range(rounds):
            timer = OpTimer()
            with timer:
                step()
            for key, seconds in timer.seconds.items():
                per_round[key].append(seconds)
        found[name] = {key: (statistics.median(v) * 1e3, timer.calls[key]) for key, v in per_round.items()}
    return found


def per_call(B=2, T=2, K=8, L=8, repeat=2000):
    """{layer: (microseconds per call, Python calls, ops)} at a tiny shape: the work of a call beside its maths."""
    found = {}
    for name, step in make_layers(B, T, K, L).items():
        for _ in range(10):
            step()
        start = time.process_time()
        for _ in range(repeat):
            step()
        micros = (time.process_time() - start) / repeat * 1e6
        profile = cProfile.Profile()
        profile.enable()
        step()
        profile.disable()
        timer = OpTimer()
        with timer:
            step()
        found[name] = (micros, pstats.Stats(profile).total_calls - 1, sum(timer.calls.values()))
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="64,32,256,256", help="B,T,K,L (default: 64,32,256,256)")
    p.add_argument("--rounds", type=int, default=11, help="rounds of each part (default: 11)")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, T, K, L = (int(v) for v in args.shape.split(","))
    steps = make_layers(B, T, K, L)
    pick = matmul.linear_strategy(T, K, L, 4, "cpu")
    gemm = 3 * 2 * B * T * K * L  # forward, input gradient and weight gradient
    extra = 2 * B * T * T * (K + L) if pick == "gram" else 0
    print(
        f"Linear B={B} T={T} K={K} L={L}, cpu float32, {torch.get_num_threads()} thread(s), CPU time; gns picks "
        f"{pick}; its extra FLOPs {extra / gemm:.1%} of plain forward + backward ({gemm / 1e6:.0f} MFLOP)"
    )
    median, q1, q3, ms = ratio(steps, args.rounds)
    print(
        f"\nratio (torch.utils.benchmark, {args.rounds} rounds): gns / plain {median:.3f} [{q1:.3f}, {q3:.3f}]; "
        f"plain {ms['plain']:.2f} ms, gns {ms['gns']:.2f} ms"
    )
    profile = op_profile(steps, args.rounds)
    keys = sorted(set(profile["plain"]) | set(profile["gns"]), key=lambda k: -profile["gns"].get(k, (0, 0))[0])
    print(f"\nops (median of {args.rounds} calls, ms per call; calls in brackets)")
    print("| op | input shapes | plain ms | gns ms |")
    print("|---|---|---|---|")
    totals = {"plain": 0.0, "gns": 0.0}
    for key in keys:
        cells = []
        for name in ("plain", "gns"):
            ms_, calls = profile[name].get(key, (0.0, 0))
            totals[name] += ms_
            cells.append(f"{ms_:.3f} ({calls})" if calls else "-")
        print(f"| {key[0]} | {' '.join(str(list(s)) for s in key[1])} | {cells[0]} | {cells[1]} |")
    print(f"| all ops | | {totals['plain']:.3f} | {totals['gns']:.3f} |")
    tiny = per_call()
    print("\nper call at B=2, T=2, K=L=8 (the work beside the maths)")
    print("| layer | us per call | Python calls | ops |")
    print("|---|---|---|---|")
    for name, (micros, calls, ops) in tiny.items():
        print(f"| {name} | {micros:.1f} | {calls} | {ops} |")


if __name__ == "__main__":
    main()
