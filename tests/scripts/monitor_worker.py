"""Worker for tests/test_monitor_distributed.py: run under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/scripts/monitor_worker.py OUT.json ddp|ddp-unequal|fsdp|tp [N_LAYER]

Every rank builds the same tiny GPT with per-example norm layers, takes its share
of one fixed global batch (two micro-batches per rank), runs one optimizer step's
backward under DDP, or under FSDP2 (fully_shard on each block and the root), and
reads the monitor; rank 0 writes the measurements as JSON. Under FSDP2 two
monitors read the same step: one made before sharding (it must find the new,
sharded parameters) and one after, written as {"before": ..., "after": ...}.
Without torchrun (no RANK in the environment) the same global batch runs in one
process with twice the accumulation steps, which is what the numbers must equal.
'ddp-unequal' gives rank 0 five of the 8 examples and rank 1 three, each rank's loss scaled so
that DDP's averaged gradient is the mean over the 8. 'tp' shards the MLPs over the ranks with
tensor parallelism (refused: the JSON holds the error). Every run also counts the ops one
GNSMonitor.step dispatches ("step_ops").
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
sys.path.insert(0, os.path.join(REPO, "bench"))
from read_ops import OpCounter  # noqa: E402  (bench/read_ops.py: ops by name)

import nanogns as lc  # noqa: E402
from nanogns import monitor as gnstracking  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH, BLOCK, VOCAB = 8, 2, 12, 29


class FakeScaler:
    """What the monitor asks of a GradScaler: on, scale 1."""

    def is_enabled(self):
        return True

    def get_scale(self):
        return 1.0


def inf_seen(model):
    """An inf in rank 1's shard of an untracked parameter's gradient (ln_f's, treated as untracked here): the
    scaler would skip the step on every rank, so every rank's reader must see it (it is all-reduced)."""
    tracked = [t for t in gnstracking.find_tracked_parameters(model)[0] if "ln_f" not in t.name]
    others = lambda: [p.grad for n, p in model.named_parameters() if "ln_f" in n and p.grad is not None]  # noqa: E731
    reader = gnstracking.StepReader(gnstracking.buffer_table(model), tracked, others)
    if dist.get_rank() == 1:
        model.transformer.ln_f.weight.grad.to_local()[0] = float("inf")
    _, finite, _ = reader.read(scaler_on=True)
    return not finite


def columns(measurements):
    """The log columns of a step's Measurements."""
    return {
        f"train/gns/{m.metadata['name']}/{key}": value
        for m in measurements
        for key, value in (("norm", m.norm), ("pegn", m.rms_pe_norm), ("batch_size", m.batch_size))
    }


def step_ops(monitor, batch_size):
    """The number of ops dispatched by monitor.step (each about one launch on a GPU)."""
    counter = OpCounter()
    with counter:
        monitor.step(batch_size=batch_size)
    return sum(counter.ops.values())


def shares(rank, world, engine):
    """This rank's slice of the global batch: equal shares, or 5 + 3 of 8 examples ('ddp-unequal')."""
    if engine == "ddp-unequal" and world == 2:
        return slice(0, 5) if rank == 0 else slice(5, 8)
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def main(out_path, engine="ddp", n_layer="2"):
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group(backend="gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", embeddingclass="gns", lnclass="gns")):
        from model import GPT, GPTConfig

        model = GPT(
            GPTConfig(
                n_layer=int(n_layer), n_head=2, n_embd=24, block_size=BLOCK, vocab_size=VOCAB, dropout=0.0, bias=True
            )
        )
    monitor = gnstracking.GNSMonitor(model)
    step_model, after = model, None
    if ddp and engine.startswith("ddp"):
        step_model = DDP(model, broadcast_buffers=False)
    elif ddp and engine == "fsdp":
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        after = gnstracking.GNSMonitor(model)
    elif ddp and engine == "tp":  # one tensor-parallel group over the ranks: the MLPs' matrices sharded
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            parallelize_module(block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    mine = data if engine == "tp" else data[shares(rank, world, engine)]  # tensor parallel ranks share the batch
    micro_batches = mine.split(MICRO_BATCH)
    for i, xy in enumerate(micro_batches):
        if ddp and engine.startswith("ddp"):
            step_model.require_backward_grad_sync = i == len(micro_batches) - 1
        _, loss = step_model(xy[:, :-1].contiguous(), xy[:, 1:].contiguous())
        # weighted so that the averaged gradient is the mean over the global batch, whatever this rank's share
        ranks = world if ddp and engine != "tp" else 1
        (loss * len(xy) * ranks / GLOBAL_BATCH).backward()
    try:
        result = columns(monitor.measure(batch_size=GLOBAL_BATCH))
    except ValueError as e:
        result = {"error": str(e)}
    if after is not None:
        result = {
            "before": result,
            "after": columns(after.measure(batch_size=GLOBAL_BATCH)),
            "inf_on_rank_1_seen": inf_seen(model),
        }
    if "error" not in result:
        result["step_ops"] = step_ops(after or monitor, GLOBAL_BATCH)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if ddp:
        # gloo aborts at exit ("terminate called without an active exception") if a DDP model, or a sharded
        # model's DTensors (held by the model and both monitors), outlive its process group
        del step_model, model, monitor, after
        import gc

        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
