"""
Per-Linear cost of exact per-example gradient norms: forward + backward (input
gradient included) + per-example weight norms, as a ratio to plain nn.Linear
forward + backward measured in the same round, plus peak memory.

    python bench/linear_strategies.py                        # docs/results.md's five shapes, CPU, fp32
    python bench/linear_strategies.py --shapes=16,64,384,1536 --rounds=31
    python bench/linear_strategies.py --device=cuda --dtype=bfloat16   # adds the fused kernel

Rows: `gns` is the project's default exact Linear (nanogns.kinds.linear.PerExampleLinear,
strategy chosen per call by nanogns.core.matmul.linear_strategy); `gns gram` and `gns
materialise` force each of its two strategies; `shim` is the plain layer plus a
node computing the norms; on CUDA `fused` (fused_gns) and its kernel forced.
Peers, when importable: Opacus ghost clipping (per-sample norms by its hooks)
and BackPACK's BatchL2Grad. Every layer runs in this one process and the layers
take turns, one forward + backward each, for --rounds rounds (the first layer
rotates), so machine drift hits them alike; a layer's number is the median
over rounds of its time divided by plain nn.Linear's time in the same round,
with the quartiles of that ratio in brackets.
Peak memory: each layer runs alone in a subprocess, one call to warm up, then
the peak RSS of one more (CPU, Linux: VmHWM reset through /proc/self/clear_refs)
or peak allocated (CUDA) above what was live before it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import timing  # noqa: E402  (bench/timing.py)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import train_settings  # noqa: E402  (bench/train_settings.py)

DEFAULT_SHAPES = "16,256,128,512;16,64,384,1536;4,512,768,3072;64,32,256,256;8,256,384,1536"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="B,T,K,L;... (default: the five shapes of docs/results.md's table)"
    )
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default: 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per layer (default: 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    timing.add_options(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="default: float32")
    p.add_argument("--memory", default="True", choices=["True", "False"], help="measure peak memory (default: True)")
    p.add_argument("--layers", default=None, help="comma-separated layer names (default: all available)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: peak memory of one layer and shape
    return p.parse_args(argv)


def _forced(**choices):
    """A callable that runs fn with these strategies forced (nanogns.core.strategy)."""
    from nanogns.core.strategy import forced as forced_strategy

    def run(fn):
        with forced_strategy(**choices):
            return fn()

    return run


def _plain(fn):
    return fn()


def layer_factories(device):
    """{name: (make(K, L) -> module, wrap(fn) -> result, norms(module) -> per-example weight norms)}."""
    from nanogns.kinds import linear as linear_kind

    def buffer_norm(m):
        return m.weight_pe_sqnorm

    layers = {
        "plain nn.Linear": (lambda K, L: nn.Linear(K, L), _plain, None),
        "gns": (lambda K, L: linear_kind.PerExampleLinear(K, L), _plain, buffer_norm),
        "gns gram": (
            lambda K, L: linear_kind.PerExampleLinear(K, L),
            _forced(linear="gram"),
            buffer_norm,
        ),
        "gns materialise": (
            lambda K, L: linear_kind.PerExampleLinear(K, L),
            _forced(linear="materialise"),
            buffer_norm,
        ),
        "shim": (lambda K, L: linear_kind.ShimLinear(K, L), _plain, buffer_norm),
    }
    if device == "cuda":
        from nanogns.kinds.linear import FusedLinear

        layers["fused"] = (lambda K, L: FusedLinear(K, L), _plain, buffer_norm)
        layers["fused kernel"] = (
            lambda K, L: FusedLinear(K, L),
            _forced(fused_linear="kernel"),
            buffer_norm,
        )
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        def make_opacus(K, L):
            return GradSampleModuleFastGradientClipping(
                nn.Linear(K, L), batch_first=True, loss_reduction="sum", max_grad_norm=1.0, use_ghost_clipping=True
            )

        layers["Opacus ghost"] = (make_opacus, _plain, lambda m: m.get_norm_sample())
    except ImportError:
        pass
    try:
        from backpack import backpack, extend
        from backpack.extensions import BatchL2Grad

        def with_backpack(fn):
            with backpack(BatchL2Grad()):
                return fn()

        layers["BackPACK"] = (lambda K, L: extend(nn.Linear(K, L)), with_backpack, lambda m: m.weight.batch_l2)
    except ImportError:
        pass
    return layers


def make_case(name, B, T, K, L, device, dtype):
    """(step closure, module) for one layer: forward + backward of a fixed batch and output gradient."""
    make, wrap, norms = layer_factories(device)[name]
    torch.manual_seed(0)
    module = make(K, L).to(device, dtype)
    x = torch.randn(B, T, K, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(B, T, L, device=device, dtype=dtype)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        for name_, buf in module.named_buffers():
            buf.zero_()

        def fwd_bwd():
            module(x).backward(g)
            return norms(module) if norms else None

        wrap(fwd_bwd)
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def interleaved_ratios(shape, names, args, dtype):
    B, T, K, L = shape
    steps = {n: make_case(n, B, T, K, L, args.device, dtype) for n in names}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {n: [] for n in names}
    clock = timing.CLOCKS[args.clock]
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = clock()
            steps[n]()
            times[n].append(clock() - t0)
    plain = times["plain nn.Linear"]
    ratios = {}
    for n in names:
        per_round = [t / p for t, p in zip(times[n], plain)]
        q1, median, q3 = timing.quartiles(per_round)
        ratios[n] = (median, q1, q3)
    return ratios, {n: statistics.median(v) * 1000 for n, v in times.items()}


def peak_memory_mb(args):
    """Peak memory of --one's layer (name|B,T,K,L) running alone, above what was live before it ran."""
    name, shape = args.one.split("|")
    B, T, K, L = map(int, shape.split(","))
    dtype = getattr(torch, args.dtype)
    step = make_case(name, B, T, K, L, args.device, dtype)
    if args.device == "cuda":
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    step()  # one-time library workspaces are not the layer's
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    base = _status_mb("VmRSS")
    step()
    return _status_mb("VmHWM") - base


def _status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def main(argv=None):
    args = parse_args(argv)
    train_settings.set_training_precision()  # TF32 as train.py: the torch strategies timed as they train
    timing.apply(args)
    if args.one:
        print(json.dumps({"peak_mb": peak_memory_mb(args)}))
        return
    from nanogns.core import matmul

    dtype = getattr(torch, args.dtype)
    available = list(layer_factories(args.device))
    names = args.layers.split(",") if args.layers else available
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"linear_strategies.py: unknown or unavailable layer(s) {unknown}; choose from {available}")
    if "plain nn.Linear" not in names:
        names = ["plain nn.Linear"] + names
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    print(
        f"{args.device}, {args.dtype}, {torch.get_num_threads()} threads, {args.clock} clock, median of {args.rounds} "
        f"interleaved "
        f"rounds; ratio to plain nn.Linear forward + backward in the same round [quartiles] (peak memory MiB)"
    )
    if "Opacus ghost" not in available or "BackPACK" not in available:
        print("(Opacus / BackPACK not importable: their columns are left out)")
    print("| B, T, K, L | gns picks | " + " | ".join(names[1:]) + " | plain ms |")
    print("|---|---|" + "---|" * (len(names) - 1) + "---|")
    for shape in shapes:
        ratios, ms = interleaved_ratios(shape, names, args, dtype)
        peaks = {}
        if args.memory == "True":
            for n in names:
                out = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        f"--device={args.device}",
                        f"--dtype={args.dtype}",
                        f"--threads={args.threads}",
                        f"--one={n}|{','.join(map(str, shape))}",
                    ],
                    capture_output=True,
                    text=True,
                    cwd=REPO,
                )
                ok = out.returncode == 0
                peaks[n] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"] if ok else float("nan")
        B, T, K, L = shape
        pick = matmul.linear_strategy(T, K, L, 4, args.device.split(":")[0])  # its norms work in float32
        cells = [
            f"{ratios[n][0]:.2f} [{ratios[n][1]:.2f}, {ratios[n][2]:.2f}]" + (f" ({peaks[n]:.0f})" if peaks else "")
            for n in names[1:]
        ]
        plain = f"{ms['plain nn.Linear']:.1f}" + (f" ({peaks['plain nn.Linear']:.0f})" if peaks else "")
        print(f"| {B}, {T}, {K}, {L} | {pick} | " + " | ".join(cells) + f" | {plain} |", flush=True)


if __name__ == "__main__":
    main()
