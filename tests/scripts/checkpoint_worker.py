"""Worker for tests/test_conversion_checkpointing.py: a tiny Mixtral (routers, expert banks) with non-reentrant
activation checkpointing, converted, one step of 8 examples (two micro-batches per rank), under FSDP2 on torchrun's
ranks (gloo, CPU: fully_shard on each decoder layer and the root) or in one process. Rank 0 writes the step's
columns as JSON; the one-process run adds the brute-force loop's numbers ("brute_force") and what is untracked.

    torchrun --standalone --nproc_per_node=2 tests/scripts/checkpoint_worker.py OUT.json
    python tests/scripts/checkpoint_worker.py OUT.json
"""

import gc
import json
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import fully_shard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import nanogns as lc  # noqa: E402

EXAMPLES, MICRO_BATCH, T, V = 8, 2, 7, 31


def build():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.MixtralForCausalLM(config)
    model.config._experts_implementation = "eager"
    return model.train()


def batch():
    ids = torch.randint(0, V, (EXAMPLES, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(EXAMPLES, T, dtype=torch.long)
    mask[1, -2:] = 0
    mask[6, -3:] = 0
    return ids, mask


def losses(model, ids, mask):
    """Each example's mean next-token loss over its unpadded tokens."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    kept = mask[:, 1:].float()
    return (per_token.view(len(ids), -1) * kept).sum(1) / kept.sum(1)


def brute_force(model, ids, mask):
    """{column: value} of norm and pegn from one backward per example."""
    params = dict(model.named_parameters())
    per_example = {name: 0.0 for name in params}
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    for i in range(EXAMPLES):
        model.zero_grad(set_to_none=True)
        losses(model, ids[i : i + 1], mask[i : i + 1]).sum().backward()
        for name, p in params.items():
            per_example[name] += p.grad.double().pow(2).sum().item() / EXAMPLES
            total[name] += p.grad / EXAMPLES
    model.zero_grad(set_to_none=True)
    found = {}
    for name in params:
        found[f"{name}/norm"] = total[name].double().pow(2).sum().sqrt().item()
        found[f"{name}/pegn"] = math.sqrt(per_example[name])
    return found


def main(out_path):
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group(backend="gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = build()
    ids, mask = batch()
    exact = None if distributed else brute_force(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: gradient_checkpointing_enable is deprecated, use_cache off
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        monitor = lc.convert(model)
    if distributed:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    mine = slice(rank * EXAMPLES // world, (rank + 1) * EXAMPLES // world)
    for start in range(mine.start, mine.stop, MICRO_BATCH):
        part = slice(start, start + MICRO_BATCH)
        (losses(model, ids[part], mask[part]).sum() * world / EXAMPLES).backward()
    result = {
        f"{m.metadata['name']}/{key}": value
        for m in monitor.measure(batch_size=EXAMPLES)
        for key, value in (("norm", m.norm), ("pegn", m.rms_pe_norm))
    }
    result["untracked"] = monitor.untracked
    if exact is not None:
        result["brute_force"] = exact
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if distributed:
        # gloo aborts at exit ("terminate called without an active exception", seen under load) if the sharded
        # model's DTensors, held by the model and the monitor, outlive the process group
        del model, monitor
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
