"""Worker for tests/test_ddp.py: run under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/scripts/tracker_worker.py OUT.json ddp|fsdp

Every rank builds the same tiny GPT with per-example norm layers, takes its share
of one fixed global batch (two micro-batches per rank), runs one optimizer step's
backward under DDP, or under FSDP2 (fully_shard on each block and the root), and
reads the tracker; rank 0 writes the measurements as JSON. Under FSDP2 two
trackers read the same step: one made before sharding (it must find the new,
sharded parameters) and one after, written as {"before": ..., "after": ...}.
Without torchrun (no RANK in the environment) the same global batch runs in one
process with twice the accumulation steps, which is what the numbers must equal.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import gnstracking  # noqa: E402
import layer_config as lc  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH, BLOCK, VOCAB = 8, 2, 12, 29


class FakeScaler:
    """What the tracker asks of a GradScaler: on, scale 1."""

    def is_enabled(self):
        return True

    def get_scale(self):
        return 1.0


def inf_seen(model):
    """An inf in rank 1's shard of an untracked parameter's gradient (ln_f's, treated as untracked here): the
    scaler would skip the step on every rank, so every rank's reader must see it (it is all-reduced)."""
    tracked = [t for t in gnstracking.find_tracked_parameters(model)[0] if "ln_f" not in t.name]
    others = lambda: [p.grad for n, p in model.named_parameters() if "ln_f" in n and p.grad is not None]  # noqa: E731
    reader = gnstracking.StepReader(gnstracking.BufferTable(model), tracked, others)
    if dist.get_rank() == 1:
        model.transformer.ln_f.weight.grad.to_local()[0] = float("inf")
    _, finite, _ = reader.read(scaler_on=True)
    return not finite


def columns(measurements):
    """The log columns of a step's Measurements."""
    return {f"train/gns/{m.metadata['name']}/{key}": value for m in measurements
            for key, value in (("norm", m.big_batch_norm), ("pegn", m.small_batch_norm), ("batch_size", m.big_batch_size))}


def main(out_path, engine="ddp"):
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group(backend="gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", embeddingclass="gns", lnclass="gns")):
        from model import GPT, GPTConfig
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=24, block_size=BLOCK, vocab_size=VOCAB, dropout=0.0, bias=True))
    tracker = gnstracking.GNSMonitor(model)
    step_model, after = model, None
    if ddp and engine == "ddp":
        step_model = DDP(model, broadcast_buffers=False)
    elif ddp and engine == "fsdp":
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        after = gnstracking.GNSMonitor(model)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    mine = data[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]  # this rank's examples
    micro_batches = mine.split(MICRO_BATCH)
    for i, xy in enumerate(micro_batches):
        if ddp and engine == "ddp":
            step_model.require_backward_grad_sync = i == len(micro_batches) - 1
        _, loss = step_model(xy[:, :-1].contiguous(), xy[:, 1:].contiguous())
        (loss / len(micro_batches)).backward()
    result = columns(tracker.measure(batch_size=GLOBAL_BATCH))
    if after is not None:
        result = {"before": result, "after": columns(after.measure(batch_size=GLOBAL_BATCH)),
                  "inf_on_rank_1_seen": inf_seen(model)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if ddp:
        del step_model  # gloo aborts at exit if a DDP model outlives its process group
        import gc
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
