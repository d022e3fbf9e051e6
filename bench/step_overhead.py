"""
Cost of per-example gradient norms on a whole training step, as a ratio to
plain torch layers measured in the same run, plus peak memory.

    python bench/step_overhead.py                      # baby Shakespeare GPT on the CPU
    python bench/step_overhead.py --device=cuda --dtype=bfloat16 --compile=True \
        --n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=16 --vocab_size=50304

A step is what train.py does: forward + backward of each micro-batch, reading
and zeroing the per-example norm buffers, clipping and AdamW. Times: every
layer choice is built in this one process (same initial weights) and the
choices take turns, one step each, for --steps rounds, so that drift of the
machine hits them alike; reported are the median step time and the median
over rounds of each step's time divided by nn's in the same round, with the
quartiles of that ratio (how noisy the machine was). Peak memory: each
choice runs a few steps alone in a subprocess, so the peak is its own; on a GPU
with --memory=False, the CUDA allocator's peak during each choice's steps above
what was live before them, measured in this process (no subprocess, no second compile).
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402  (bench/timing.py)
import train_settings  # noqa: E402  (bench/train_settings.py)

# name -> (linearclass, embeddingclass, lnclass)
CHOICES = {
    "nn": ("nn", "nn", "nn"),
    "LayerNorm-only gns": ("nn", "nn", "gns"),
    "LayerNorm-only fused": ("nn", "nn", "fused"),
    "all-layer shim": ("shim", "shim", "shim"),
    "all-layer gns": ("gns", "gns", "gns"),
    "all-layer fused": ("fused", "gns", "fused"),
    "arithmetic floor": ("nn", "nn", "nn"),  # plain layers doing the gns layers' per-example arithmetic, bare
}
FLOOR = "arithmetic floor"  # bench/arithmetic_floor.py: what the step would cost with no bookkeeping at all
DEFAULT_CPU = ["nn", "LayerNorm-only gns", "all-layer shim", "all-layer gns"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    timing.add_options(p)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="autocast dtype (default: float32)",
    )
    p.add_argument(
        "--compile", default="False", choices=["True", "False"], help="torch.compile the model (default: False)"
    )
    p.add_argument(
        "--choices", default=None, help="comma-separated layer choices (default: the four CPU ones, or all six on cuda)"
    )
    p.add_argument("--n_layer", type=int, default=6, help="transformer blocks (default: 6, the baby GPT)")
    p.add_argument("--n_head", type=int, default=6, help="attention heads (default: 6)")
    p.add_argument("--n_embd", type=int, default=384, help="model width (default: 384)")
    p.add_argument("--block_size", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--batch_size", type=int, default=64, help="sequences per micro-batch (default: 64)")
    p.add_argument("--vocab_size", type=int, default=65, help="vocabulary (default: 65, Shakespeare's characters)")
    p.add_argument("--bias", default="False", choices=["True", "False"], help="biases in Linears and LayerNorms")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per step (default: 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per choice (default: 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per choice, interleaved (default: 10)")
    p.add_argument("--memory", default="True", choices=["True", "False"], help="measure peak memory (default: True)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: peak memory of one choice, as JSON
    return p.parse_args(argv)


def build(args, name):
    """Model, optimizer, scaler and a `step()` closure for one layer choice."""
    import torch

    import nanogns as lc
    from nanogns import monitor as gnstracking
    from nanogns.core.buffers import zero_pe_sqnorm_buffers

    linearclass, embeddingclass, lnclass = CHOICES[name]
    torch.manual_seed(0)
    device_type = "cuda" if "cuda" in args.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype, enabled=args.dtype != "float32")
    # (model.py prints its size: kept out of the tables)
    with (
        lc.set_contextual_config(**lc.layer_classes(linearclass, embeddingclass, lnclass)),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        from model import GPT, GPTConfig

        model = GPT(
            GPTConfig(
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
                block_size=args.block_size,
                vocab_size=args.vocab_size,
                bias=args.bias == "True",
                dropout=0.0,
            )
        ).to(args.device)
    import arithmetic_floor  # (bench/arithmetic_floor.py)

    floor_sink = arithmetic_floor.install(model) if name == FLOOR else None
    with contextlib.redirect_stdout(io.StringIO()):  # (and its optimizer's groups)
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=args.dtype == "float16")
    tracked = lc.tracks_per_example_norms(linearclass, embeddingclass, lnclass)
    tracker = gnstracking.GNSMonitor(model, scaler=scaler) if tracked else None
    ga = args.gradient_accumulation_steps
    generator = torch.Generator().manual_seed(1)  # the same batches for every choice
    batches = [
        torch.randint(0, args.vocab_size, (2, args.batch_size, args.block_size), generator=generator).to(args.device)
        for _ in range(ga)
    ]
    graphs, break_reasons = None, []
    if args.compile == "True":  # what Dynamo makes of the model's forward: (graphs, graph breaks)
        with ctx:
            explained = torch._dynamo.explain(model)(*batches[0])
        graphs = (explained.graph_count, explained.graph_break_count)
        break_reasons = list(dict.fromkeys(str(r.reason).splitlines()[0] for r in explained.break_reasons))
        torch._dynamo.reset()
    step_model = torch.compile(model) if args.compile == "True" else model

    def step():
        for x, y in batches:
            with ctx:
                _, loss = step_model(x, y)
            scaler.scale(loss / ga).backward()
        if tracked:
            tracker.measure(batch_size=args.batch_size * ga)
            zero_pe_sqnorm_buffers(model)
        if floor_sink is not None:
            floor_sink.zero_()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if device_type == "cuda":
            torch.cuda.synchronize()

    step.graphs, step.break_reasons = graphs, break_reasons
    return step


def peak_memory_mb(args):
    """Peak memory of --one's choice running alone: the GPU allocator's peak, or on the
    CPU the process's peak RSS minus its RSS after importing torch."""
    import torch

    rss_before_mb = _current_rss_mb()  # torch's own import is not the layers' memory
    step = build(args, args.one)
    if "cuda" in args.device:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup + 1):
        step()
    if "cuda" in args.device:
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before_mb  # Linux reports KiB


def _current_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def interleaved_times(args, names):
    """({name: [step seconds]}, {name: (graphs, graph breaks) or None}, {name: step peak MiB}): all choices in this
    process, one step each per round; a step's peak is the CUDA allocator's peak during it above what was live
    before it (nan on the CPU)."""
    import torch

    nan = float("nan")
    steps = {name: build(args, name) for name in names}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in names}
    step_peaks = {name: [] for name in names}  # CUDA: the allocator's peak during a step above what was live before
    cuda = "cuda" in args.device
    clock = timing.CLOCKS[args.clock]
    for r in range(args.steps):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            if cuda:
                live = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
            if cuda:
                step_peaks[name].append((torch.cuda.max_memory_allocated() - live) / 2**20)
        print(
            f"round {r + 1}/{args.steps}: " + ", ".join(f"{n} {times[n][-1] * 1000:.0f} ms" for n in names),
            file=sys.stderr,
        )
    return (
        times,
        {name: step.graphs for name, step in steps.items()},
        {n: max(p, default=nan) for n, p in step_peaks.items()},
    )


def main(argv=None):
    args = parse_args(argv)
    train_settings.set_training_precision()  # TF32 as train.py: the torch strategies timed as they train
    import torch

    timing.apply(args)
    if args.one:
        print(json.dumps({"peak_mb": peak_memory_mb(args)}))
        return
    names = args.choices.split(",") if args.choices else (list(CHOICES) if "cuda" in args.device else DEFAULT_CPU)
    unknown = [n for n in names if n not in CHOICES]
    if unknown:
        raise SystemExit(f"step_overhead.py: unknown choice(s) {unknown}; choose from {list(CHOICES)}")
    if FLOOR in names and args.dtype != "float32":
        raise SystemExit(f"step_overhead.py: {FLOOR!r} runs in float32 only (no autocast); drop it or --dtype")
    if "nn" not in names:
        names = ["nn"] + names  # ratios need the plain baseline
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--choices")]
    peaks = {name: float("nan") for name in names}
    for name in names if args.memory == "True" else []:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *passthrough, f"--one={name}"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if out.returncode != 0:
            raise SystemExit(f"step_overhead.py: {name!r} failed:\n{out.stderr[-3000:]}")
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    times, graphs, step_peaks = interleaved_times(args, names)
    memory_label = "peak GPU MiB" if "cuda" in args.device else "peak RSS MiB above import"
    if "cuda" in args.device and args.memory != "True":  # no subprocesses: the steps' own peaks, measured in this one
        peaks, memory_label = step_peaks, "step's peak GPU MiB above live"
    base_peak = peaks["nn"]
    compiled = args.compile == "True"
    print(
        f"\n{args.device}, {args.dtype}, {torch.get_num_threads()} threads, {args.clock} clock, compile={args.compile}, "
        f"n_layer={args.n_layer} n_embd={args.n_embd} "
        f"block={args.block_size} batch={args.batch_size}x{args.gradient_accumulation_steps}, "
        f"{args.steps} interleaved rounds; ratio: median over rounds of step time / nn's in the same round "
        f"(quartiles in brackets)" + ("; graphs / graph breaks of the forward (Dynamo's explain)" if compiled else "")
    )
    print(
        f"| layers | step ms | ratio to nn | {memory_label} | memory ratio |"
        + (" graphs / breaks |" if compiled else "")
    )
    print("|---|---|---|---|---|" + ("---|" if compiled else ""))
    for name in names:
        ratios = [t / base for t, base in zip(times[name], times["nn"])]
        q1, median, q3 = timing.quartiles(ratios)
        print(
            f"| {name} | {statistics.median(times[name]) * 1000:.1f} | {median:.3f} "
            f"[{q1:.3f}, {q3:.3f}] | {peaks[name]:.0f} | {peaks[name] / base_peak:.3f} |"
            + (f" {graphs[name][0]} / {graphs[name][1]} |" if compiled else "")
        )


if __name__ == "__main__":
    main()
