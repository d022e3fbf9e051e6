"""
Accelerate with the GNS (integrations.AccelerateGNS): a tiny transformers Llama or GPT-2 (from a config, nothing
downloaded) trained with accelerator.accumulate and accelerator.clip_grad_norm_; the GNS is read in the loop
just before clipping. The loss is the mean over sequences of each one's mean token loss (right-padded
Shakespeare windows of random lengths).

    python examples/accelerate_gpt.py [--model=llama|gpt2] [--steps=20] [--out_dir=out-accelerate]
    torchrun --standalone --nproc_per_node=2 examples/accelerate_gpt.py  # DDP (gloo on CPUs); or accelerate launch
    python gns-analysis.py out-accelerate --no-plots
"""

import torch
from accelerate import Accelerator
from common import EMA_DECAY, build_model, padded_examples, run_script, trainer_parser
from torch.utils.data import DataLoader

from nanogns.integrations import AccelerateGNS, sequence_mean_loss

BLOCK_SIZE = 32


def parse_args(argv=None):
    return trainer_parser(__doc__, "out-accelerate").parse_args(argv)


def train(args, watch=None):
    """Train; `watch(model)` (tests) sees the model once it is built. Returns the AccelerateGNS."""
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=not torch.cuda.is_available())
    vocab_size, examples = padded_examples(256, BLOCK_SIZE)
    torch.manual_seed(0)
    model = build_model(args.model, vocab_size, block_size=BLOCK_SIZE).to(getattr(torch, args.dtype))
    if watch is not None:
        watch(model)
    # gns: convert, log to out_dir; log.csv written and out_dir released however the loop ends
    with AccelerateGNS(accelerator, model, out_dir=args.out_dir, ema_decay=EMA_DECAY) as monitor:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(
            examples, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        model.train()
        steps = 0
        while steps < args.steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    labels = batch.pop("labels")
                    loss = sequence_mean_loss(model(**batch).logits, labels)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        monitor.step()  # gns: after the step's last backward, before clipping
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    steps += 1
                    if steps == args.steps:
                        break
    return monitor


def main(argv=None):
    args = parse_args(argv)
    monitor = train(args)
    if monitor.accelerator.is_main_process:
        print(
            f"accelerate_gpt: {args.model}, {args.steps} steps, {len(monitor.tracked)} parameters tracked: "
            f"final running GNS {monitor.gns:.4f}"
        )


if __name__ == "__main__":
    run_script(main)
