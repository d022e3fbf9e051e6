"""
What issue 45's checks cost, beside a training step of the same model (forward, backward, the monitor's read, AdamW;
every layer gns): the first step's mixing check (monitor/mixing.py: the step's forward once more and two backward
passes to the examples' first rows, once per training mode), nanogns.verify (one forward and B + 1 backward passes,
in float64: once, on demand or at a trainer's first step), and the monitor's look at the model at each step
(monitor/following.py: ModelShape.same(), at the first forward and at the read). The per-step Python calls and ops
the following adds are counted by tests/test_bench_call_overhead.py.

    python bench/mixing_check.py                          # baby GPT (model.py), 6 blocks, B = 8, T = 64
    python bench/mixing_check.py --n_layer=12 --batch=16 --threads=1 --clock=cpu

Times: the median of `--repeat` runs of each (wall clock at torch's default threads, or one-thread CPU time with
--threads=1 --clock=cpu); the ratios divide by the median step of the same run.
"""

import argparse
import contextlib
import io
import os
import statistics
import sys

import timing  # bench/timing.py
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nanogns as lc  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from nanogns.monitor.mixing import examples_mixed  # noqa: E402


def build(n_layer, block):
    torch.manual_seed(0)
    with (
        lc.set_contextual_config(**lc.layer_classes("nn", "nn", "nn")),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=128, block_size=block, vocab_size=65, dropout=0.0))


def per_example_loss(model, batch):
    x, y = batch
    logits, _ = model(x, y)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def timed(fn, repeat, clock):
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", type=int, default=6, help="blocks (default: 6)")
    p.add_argument("--batch", type=int, default=8, help="examples per step, B (default: 8)")
    p.add_argument("--block", type=int, default=64, help="tokens per example (default: 64)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each, median taken (default: 5)")
    timing.add_options(p)
    args = p.parse_args(argv)
    clock = timing.apply(args)
    model = build(args.n_layer, args.block)
    plain = build(args.n_layer, args.block)
    monitor = lc.convert(model, check_mixing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randint(0, 65, (2, args.batch, args.block))
    captured = []
    model.register_forward_pre_hook(lambda m, a, k: captured.append((a, k)) if not captured else None, with_kwargs=True)

    def step():
        _, loss = model(x, y)
        loss.backward()
        monitor.step(batch_size=args.batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step_time = timed(step, args.repeat, clock)
    a, k = captured[0]
    check_time = timed(lambda: examples_mixed(model, a, k, monitor.row_map, monitor.table), args.repeat, clock)
    verify_time = timed(lambda: lc.verify(model, (x, y), per_example_loss, show=False), max(1, args.repeat // 2), clock)
    verify_plain = timed(
        lambda: lc.verify(plain, (x, y), per_example_loss, show=False), max(1, args.repeat // 2), clock
    )
    look_time = timed(lambda: [monitor.shape.same() for _ in range(1000)], args.repeat, clock) / 1000
    print(
        f"baby GPT {args.n_layer} blocks, 128 wide, B={args.batch}, T={args.block}, threads={torch.get_num_threads()}, "
        f"clock={args.clock}"
    )
    print("| what | when | time | / step |")
    print("|---|---|---|---|")
    print(f"| training step (all layers gns, monitor read) | every step | {step_time * 1e3:.1f} ms | 1.00 |")
    print(f"| mixing check | first step per training mode | {check_time * 1e3:.1f} ms | {check_time / step_time:.2f} |")
    print(
        f"| verify, converted model (float64) | on demand | {verify_time * 1e3:.1f} ms | {verify_time / step_time:.1f} |"
    )
    print(
        f"| verify, model not converted (copied, float64) | on demand | {verify_plain * 1e3:.1f} ms | {verify_plain / step_time:.1f} |"
    )
    print(f"| following: ModelShape.same() | twice a step | {look_time * 1e6:.1f} us | {look_time / step_time:.5f} |")


if __name__ == "__main__":
    main()
