"""
Dispatched ops of a training step against those of the GNS read (GNSMonitor.step, buffer zeroing included),
for GPT-2's structure at growing depth: a count, not a time (each op is about one kernel launch on a GPU).

    python bench/read_ops.py                       # 12 and 24 blocks, LayerNorm-only and all layers
    python bench/read_ops.py --n_layer=12,24,48

The model is GPT-2's shape at a tiny width (the counts do not depend on the width): tied head, biases on.
A plain step is forward + backward + AdamW with torch's layers; the read is what per-example norms add after
the backward. The read's count should stay flat as the model gets deeper (tests/test_monitor_distributed.py holds it at most 40).
The reference API's read (`MeasurementTracker.step`, then `zero_sqgradnorm_buffers(model)` as the reference's
train.py calls them, nanogns/monitor/reference.py) is counted the same way, on the same model and step
(tests/test_reference_api.py holds it at the monitor's count).
"""

import argparse
import collections
import contextlib
import io
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nanogns as lc  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from nanogns import monitor as gnstracking  # noqa: E402
from nanogns.core.buffers import zero_pe_sqnorm_buffers  # noqa: E402
from nanogns.monitor.reference import MeasurementTracker  # noqa: E402

CHOICES = {"nn": ("nn", "nn", "nn"), "LayerNorm-only gns": ("nn", "nn", "gns"), "all-layer gns": ("gns", "gns", "gns")}


class OpCounter(TorchDispatchMode):
    """Ops dispatched while active, by name (tests/scripts/monitor_worker.py counts a step's read with it too)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build(choice, n_layer, block=16):
    """GPT-2's structure at a tiny width with the choice's layers."""
    linear, embedding, ln = CHOICES[choice]
    torch.manual_seed(0)
    # (model.py prints its size: kept out of the tables)
    with (
        lc.set_contextual_config(**lc.layer_classes(linearclass=linear, embeddingclass=embedding, lnclass=ln)),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        return GPT(
            GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=block, vocab_size=64, dropout=0.0, bias=True)
        )


def counts(choice, n_layer, batch=4, block=16, reference=False):
    """(ops of forward + backward + AdamW, ops of the GNS read or None, the read's most frequent ops); `reference`:
    the read is the reference API's MeasurementTracker.step and zero_sqgradnorm_buffers instead of GNSMonitor.step."""
    model = build(choice, n_layer, block)
    monitor = None
    if choice != "nn":
        monitor = MeasurementTracker.from_model(model) if reference else gnstracking.GNSMonitor(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randint(0, 64, (batch, block + 1))
    for warm in (True, False):  # the first step builds what later steps reuse (optimizer state, read plans)
        step, read = OpCounter(), OpCounter()
        with step:
            _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            loss.backward()
        if monitor is not None:
            with read:
                monitor.step(batch_size=batch)
                if reference:
                    zero_pe_sqnorm_buffers(model)
        with step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    read_total = sum(read.ops.values()) if monitor is not None else None
    return sum(step.ops.values()), read_total, read.ops.most_common(4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", default="12,24", help="comma-separated depths (default: 12,24)")
    args = p.parse_args(argv)
    print(
        f"{'blocks':>6}  {'layers':<20}{'step ops':>9}{'read ops':>9}{'reference read':>15}  most frequent in the read"
    )
    for n_layer in (int(n) for n in args.n_layer.split(",")):
        for choice in CHOICES:
            step, read, common = counts(choice, n_layer)
            reference = counts(choice, n_layer, reference=True)[1] if read is not None else "-"
            shown = ", ".join(f"{name} {n}" for name, n in common) if read is not None else ""
            print(f"{n_layer:>6}  {choice:<20}{step:>9}{read if read is not None else '-':>9}{reference:>15}  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
