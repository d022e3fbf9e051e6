"""
Where a training step's time goes, per layer choice: torch.profiler over a few steps of the model that
bench/step_overhead.py times, built the same way (same weights, batches, monitor), so a ratio it reports can be
taken apart. On a GPU it says whether the step is bound by the GPU (kernel time close to the wall clock) or by
the host (Python and launches: wall clock well above kernel time), and which kernels and host ops take the time.

    python bench/step_profile.py                                     # baby Shakespeare GPT on the CPU
    python bench/step_profile.py --device=cuda --dtype=bfloat16 --n_layer=12 --n_head=12 --n_embd=768 \\
        --block_size=1024 --batch_size=12 --vocab_size=50304 --bias=True     # GPT-2 124M on a GPU

Per choice: the wall clock of a step, the device's kernel time in it (CUDA: the kernels' own time; the CPU has
no separate device time), kernels launched per step, then the --top kernels by device time and host ops by their
own CPU time. With --compile=True, the forward's graph breaks (Dynamo's explain) and their first reasons.
Arguments are step_overhead.py's (model size, --choices, --dtype, --compile, --device).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step_overhead  # noqa: E402  (bench/step_overhead.py: the model, batches and step of each choice)


def profile_choice(args, name, steps, top):
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = step_overhead.build(args, name)
    for _ in range(args.warmup + 1):
        step()
    cuda = "cuda" in args.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps  # unprofiled: the profiler's own cost stays out
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        device_ms = sum(e.self_device_time_total for e in kernels) / 1000 / steps
        launches = sum(e.count for e in kernels) / steps
    else:
        kernels, device_ms, launches = [], float("nan"), sum(e.count for e in events) / steps
    print(f"\n### {name}\n")
    print(
        f"step {wall_ms:.1f} ms wall clock (unprofiled), device kernel time {device_ms:.1f} ms, "
        f"{launches:.0f} {'kernels' if cuda else 'ops'} per step"
    )
    if step.graphs is not None:
        print(f"forward: {step.graphs[0]} graphs, {step.graphs[1]} graph breaks")
        for reason in getattr(step, "break_reasons", [])[:5]:
            print(f"  break: {reason}")
    if kernels:
        print(f"\n| kernel (top {top} by device time) | calls/step | ms/step |\n|---|---|---|")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_device_time_total / 1000 / steps:.2f} |")
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"\n| host op (top {top} by own CPU time) | calls/step | ms/step |\n|---|---|---|")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_cpu_time_total / 1000 / steps:.2f} |")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--profile_steps=")), 3))
    top = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--top=")), 12))
    argv = [a for a in argv if not a.startswith(("--profile_steps=", "--top="))]
    args = step_overhead.parse_args(argv)
    step_overhead.train_settings.set_training_precision()
    names = args.choices.split(",") if args.choices else step_overhead.DEFAULT_CPU
    print(
        f"## step profile: {args.device}, {args.dtype}, compile={args.compile}, n_layer={args.n_layer} "
        f"n_embd={args.n_embd} block={args.block_size} batch={args.batch_size}, {steps} profiled steps\n"
        f"`python bench/step_profile.py {' '.join(argv)}`"
    )
    for name in names:
        profile_choice(args, name, steps, top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
