"""Worker for tests/test_integrations.py: one run of a trainer example (examples/hf_trainer.py,
lightning_gpt.py, accelerate_gpt.py) with what a brute-force check needs recorded: the inputs and parameters
of every training forward of the transformers model, and the gradient norm each optimizer step used (after
clipping). Each rank saves OUT_DIR/records_rank<r>.pt; the example writes OUT_DIR/log.csv as usual.

    torchrun --standalone --nproc_per_node=2 tests/scripts/integrations_worker.py hf_trainer --out_dir=OUT [flags]

Without torchrun it runs in one process; tests call run() directly.
"""

import importlib.util
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from nanogns.core import layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))


def example(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name, argv):
    """Run examples/<name>.py with argv; returns {"forwards": [{"inputs", "params"}], "clipped": [norm]}."""
    records = {"forwards": [], "clipped": []}

    def record(module, args, kwargs):
        # (the monitor's mixing check runs the first step's forward again inside layout.replay(): not a step's)
        if torch.is_grad_enabled() and module.training and not layout.replaying():
            records["forwards"].append(
                {
                    "inputs": {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)},
                    "params": {n: p.detach().clone() for n, p in module.named_parameters()},
                }
            )

    def watch(model):
        model.register_forward_pre_hook(record, with_kwargs=True)

    def clipped(optimizer, args, kwargs):  # after the step: .grad is what the optimizer used
        grads = {id(p): p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        records["clipped"].append(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads.values()])).item()
        )

    module = example(name)
    args = module.parse_args(argv)
    handle = register_optimizer_step_post_hook(clipped)
    try:
        if name == "hf_trainer":
            trainer = module.make_trainer(args)
            watch(trainer.model)
            trainer.train()
            records["trainer_log"] = trainer.state.log_history
            records["counts_shifted_labels"] = trainer._loss_shifts_labels  # how Trainer counts num_items_in_batch
        elif name == "lightning_gpt":
            trainer, lightning_module, loader = module.make_trainer(args)
            watch(lightning_module.model)
            trainer.fit(lightning_module, loader)
        else:
            module.train(args, watch=watch)
    finally:
        handle.remove()
    torch.save(records, os.path.join(args.out_dir, f"records_rank{os.environ.get('RANK', '0')}.pt"))
    return records


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
