"""
What the flat table behind the buffers saves (core/table.py's BufferTable): a step's read of every per-example norm
buffer and its zeroing, through the table (one gather of the sums, one of the counts, one zero per device) beside
the same work buffer by buffer (one stack of the buffers, one torch._foreach_zero_ of them: the best a read without
the table can do), on GPT-2's structure at growing depth, every layer gns.

    python bench/buffer_table.py                          # 12, 24 and 48 blocks; ops and one-thread CPU time
    python bench/buffer_table.py --n_layer=12,96 --repeat=2000

Ops: aten ops dispatched (a TorchDispatchMode: on a GPU, about one launch each). Time: one-thread CPU time per
read + zero (time.process_time over `--repeat` reads, median of 5), with the per-buffer read's Python work in it
(a list of the buffers, as a reader without the table must build each step; "list kept": the list of an earlier
step reused, which would miss a buffer replaced since). The reads return the same numbers (checked). The table's
own upkeep is in its column: `current()`, the check that no buffer was replaced, runs at every read. Ratios: by
buffer / table, list kept / table.
"""

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nanogns as lc  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from nanogns.core.buffers import BUFFER_SUFFIX  # noqa: E402
from nanogns.core.table import buffer_table  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from read_ops import OpCounter  # noqa: E402


def build(n_layer):
    torch.manual_seed(0)
    with (
        lc.set_contextual_config(**lc.layer_classes("gns", "gns", "gns")),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=16, vocab_size=64, dropout=0.0))


def read_by_table(table, slots, count_slots):
    """The table's read: every buffer's sum and count in one gather each, then one zero per device."""
    if not table.current():
        table.build()
    flat = next(iter(table.flats.values()))
    values = torch.stack([flat[slots], flat[count_slots]])
    table.zero()
    return values


def read_by_buffer(model):
    """The same read without the table: the buffers found on their modules, stacked, zeroed by one foreach op."""
    buffers = [b for m in model.modules() for n, b in m._buffers.items() if n.endswith(BUFFER_SUFFIX)]
    values = torch.stack(buffers)
    torch._foreach_zero_(buffers)
    return values.T


def read_by_kept_buffers(buffers):
    """read_by_buffer with the list of buffers kept from an earlier step (no walk; a buffer replaced since, by
    model.to(...), would be missed: what the table's `current()` pays to notice)."""
    values = torch.stack(buffers)
    torch._foreach_zero_(buffers)
    return values.T


def measure(read, repeat):
    times = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(repeat):
            read()
        times.append((time.process_time() - start) / repeat)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", default="12,24,48", help="comma-separated depths (default: 12,24,48)")
    p.add_argument("--repeat", type=int, default=500, help="reads per timing (default: 500)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{'blocks':>6}{'buffers':>9}  {'ops: table':>10}{'by buffer':>11}  {'us: table':>10}{'by buffer':>11}"
        f"{'list kept':>11}  {'ratios':>11}"
    )
    for n_layer in (int(n) for n in args.n_layer.split(",")):
        model = build(n_layer)
        table = buffer_table(model)
        buffers = [b for m in model.modules() for n, b in m._buffers.items() if n.endswith(BUFFER_SUFFIX)]
        for b in buffers:
            b.copy_(torch.rand(2))  # numbers to read back
        slots = torch.arange(0, 2 * len(buffers), 2)
        expected = torch.stack(buffers).T.clone()
        torch.testing.assert_close(read_by_table(table, slots, slots + 1), expected)
        for b in buffers:
            b.copy_(torch.rand(2))
        expected = torch.stack(buffers).T.clone()
        torch.testing.assert_close(read_by_buffer(model), expected)
        ops = []
        for read in (lambda: read_by_table(table, slots, slots + 1), lambda: read_by_kept_buffers(buffers)):
            with OpCounter() as counter:
                read()
            ops.append(sum(counter.ops.values()))
        t_table = measure(lambda: read_by_table(table, slots, slots + 1), args.repeat)
        t_buffer = measure(lambda: read_by_buffer(model), args.repeat)
        t_kept = measure(lambda: read_by_kept_buffers(buffers), args.repeat)
        print(
            f"{n_layer:>6}{len(buffers):>9}  {ops[0]:>10}{ops[1]:>11}  {1e6 * t_table:>10.1f}{1e6 * t_buffer:>11.1f}"
            f"{1e6 * t_kept:>11.1f}  {t_buffer / t_table:>5.2f} {t_kept / t_table:>5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
