"""
Cost of per-example gradient norms on one mixture-of-experts block (transformers'
MixtralSparseMoeBlock: router + expert banks), as a ratio to the same block with
plain layers, measured in the same run, plus peak memory.

    python bench/moe_block.py                  # CPU, float32
    python bench/moe_block.py --device=cuda --dtype=bfloat16 --hidden=1024 --intermediate=2816 --tokens=4096

A step is forward and backward of the block on B examples of T tokens, then
(converted block) reading and zeroing its per-example norm buffers. Choices:

    plain default    transformers' default experts implementation (grouped matmuls where they run)
    plain eager      transformers' experts loop (experts_implementation="eager")
    per-example      the block converted by nanogns.convert (router kept with its own forward,
                     experts grouped as the default implementation runs them, one grouped GEMM per
                     projection, each (expert, example) segment's norms by the Gram trick)

All choices are built in this one process with the same weights and take turns,
one step each, for --steps rounds; reported are the median step time and the
median over rounds of each step's time divided by plain default's in the same
round, with its quartiles. Peak memory: each choice runs alone in a subprocess
(the GPU allocator's peak, or the CPU process's peak RSS above its RSS after
building the block).
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402  (bench/timing.py)
import train_settings  # noqa: E402  (bench/train_settings.py)

CHOICES = ("plain default", "plain eager", "per-example")  # ratios to the first: transformers' default experts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    timing.add_options(p)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype (default: float32)"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--intermediate", type=int, default=512, help="each expert's intermediate size (default: 512)")
    p.add_argument("--experts", type=int, default=8, help="experts (default: 8)")
    p.add_argument("--top_k", type=int, default=2, help="experts per token (default: 2)")
    p.add_argument("--batch_size", type=int, default=8, help="examples B (default: 8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per example T (default: 128)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per choice (default: 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per choice, interleaved (default: 10)")
    p.add_argument("--memory", default="True", choices=["True", "False"], help="measure peak memory (default: True)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: peak memory of one choice, as JSON
    return p.parse_args(argv)


def build(args, name):
    """A step() closure running one choice."""
    import torch
    import torch.nn as nn
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import nanogns as lc
    from nanogns.core.buffers import zero_pe_sqnorm_buffers

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    config._experts_implementation = (
        "eager" if name in ("plain eager", "per-example") else _default_implementation(config)
    )
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    model = nn.Sequential(block).to(args.device)
    monitor = None
    if name == "per-example":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monitor = lc.convert(model)  # the Sequential around the block maps its (B*T, D) rows to the B examples
    device_type = "cuda" if "cuda" in args.device else "cpu"
    ctx = torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    x = torch.randn(args.batch_size, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(
        args.device
    )

    def step():
        with ctx:
            out = model(x)
        out.float().pow(2).mean().backward()
        if monitor is not None:
            monitor.measure(batch_size=args.batch_size)
            zero_pe_sqnorm_buffers(model)
        model.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize()

    return step


def _default_implementation(config):
    """transformers' default experts implementation here (grouped matmuls, or eager where they cannot run)."""
    from transformers import MixtralForCausalLM

    small = copy.deepcopy(config)
    small.num_hidden_layers, small.vocab_size = 1, 8
    return MixtralForCausalLM(small).config._experts_implementation


def peak_memory_mb(args):
    import resource

    import torch

    if "cuda" in args.device:
        step = build(args, args.one)
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup + 1):
            step()
        return torch.cuda.max_memory_allocated() / 2**20
    step = build(args, args.one)
    with open("/proc/self/status") as f:
        built_mb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    for _ in range(args.warmup + 1):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - built_mb


def main(argv=None):
    args = parse_args(argv)
    train_settings.set_training_precision()  # TF32 as train.py: the torch strategies timed as they train
    import torch

    timing.apply(args)
    if args.one:
        print(json.dumps({"peak_mb": peak_memory_mb(args)}))
        return
    passthrough = list(argv if argv is not None else sys.argv[1:])
    peaks = {name: float("nan") for name in CHOICES}
    for name in CHOICES if args.memory == "True" else []:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *passthrough, f"--one={name}"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if out.returncode != 0:
            raise SystemExit(f"moe_block.py: {name!r} failed:\n{out.stderr[-3000:]}")
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    steps = {name: build(args, name) for name in CHOICES}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in CHOICES}
    names = list(CHOICES)
    clock = timing.CLOCKS[args.clock]
    for r in range(args.steps):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
    base = CHOICES[0]
    memory_label = "peak GPU MiB" if "cuda" in args.device else "peak RSS MiB above build"
    print(
        f"{args.device}, {args.dtype}, {torch.get_num_threads()} threads, {args.clock} clock, MixtralSparseMoeBlock "
        f"hidden={args.hidden} intermediate={args.intermediate} "
        f"experts={args.experts} top_k={args.top_k}, B={args.batch_size} x T={args.tokens}, {args.steps} interleaved "
        f"rounds; ratio: median over rounds of step time / {base}'s in the same round (quartiles)"
    )
    print(f"| block | step ms | ratio to {base} | {memory_label} | memory ratio |")
    print("|---|---|---|---|---|")
    for name in CHOICES:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        q1, median, q3 = timing.quartiles(ratios)
        print(
            f"| {name} | {statistics.median(times[name]) * 1000:.1f} | {median:.3f} "
            f"[{q1:.3f}, {q3:.3f}] | {peaks[name]:.0f} | {peaks[name] / peaks[base]:.3f} |"
        )


if __name__ == "__main__":
    main()
