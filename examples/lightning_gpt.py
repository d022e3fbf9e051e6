"""
Lightning with the GNS: one callback (integrations.LightningGNSCallback) on a LightningModule holding a tiny
transformers Llama or GPT-2 (from a config, nothing downloaded), with accumulate_grad_batches and
gradient_clip_val. The loss is the mean over sequences of each one's mean token loss (right-padded Shakespeare
windows of random lengths).

    python examples/lightning_gpt.py [--model=llama|gpt2] [--steps=20] [--out_dir=out-lightning]
    python examples/lightning_gpt.py --save_steps=10 --out_dir=out-pl   # then resume: --ckpt_path=out-pl/checkpoints/step=10.ckpt
    torchrun --standalone --nproc_per_node=2 examples/lightning_gpt.py   # DDP (gloo on CPUs)
    python gns-analysis.py out-lightning --no-plots
"""

import os

import lightning as L
import torch
from common import EMA_DECAY, build_model, padded_examples, run_script, trainer_parser
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from nanogns.integrations import LightningGNSCallback, sequence_mean_loss

BLOCK_SIZE = 32


class CausalLM(L.LightningModule):
    def __init__(self, model, lr=1e-3):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        labels = batch.pop("labels")
        loss = sequence_mean_loss(self.model(**batch).logits, labels)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def parse_args(argv=None):
    parser = trainer_parser(__doc__, "out-lightning", clip_help="gradient_clip_val")
    parser.add_argument(
        "--save_steps", type=int, default=0, help="checkpoint every N steps into OUT_DIR/checkpoints (default: 0, none)"
    )
    parser.add_argument("--ckpt_path", default=None, help="resume from this checkpoint, and the GNS log with it")
    return parser.parse_args(argv)


def make_trainer(args, callbacks=()):
    """(lightning.Trainer with the GNS callback, the LightningModule, the training DataLoader)."""
    vocab_size, examples = padded_examples(256, BLOCK_SIZE)
    torch.manual_seed(0)
    module = CausalLM(build_model(args.model, vocab_size, block_size=BLOCK_SIZE))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun Lightning joins the launched ranks
    saving = (
        [
            ModelCheckpoint(
                dirpath=os.path.join(args.out_dir, "checkpoints"),
                filename="{step}",
                save_top_k=-1,
                every_n_train_steps=args.save_steps,
            )
        ]
        if args.save_steps
        else []
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=args.grad_accum,
        gradient_clip_val=args.max_grad_norm,
        precision="64-true" if args.dtype == "float64" else "32-true",
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        default_root_dir=args.out_dir,
        logger=CSVLogger(args.out_dir, name="lightning_logs"),  # gets "gns" and "train/loss" every step
        enable_checkpointing=bool(args.save_steps),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[
            LightningGNSCallback(ema_decay=EMA_DECAY),
            *callbacks,  # gns: the one line
            *saving,
        ],
    )
    loader = DataLoader(examples, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    return trainer, module, loader


def main(argv=None):
    args = parse_args(argv)
    trainer, module, loader = make_trainer(args)
    trainer.fit(module, loader, ckpt_path=args.ckpt_path)
    monitor = next(c for c in trainer.callbacks if isinstance(c, LightningGNSCallback)).monitor
    if trainer.is_global_zero:
        print(
            f"lightning_gpt: {args.model}, {args.steps} steps, {len(monitor.tracked)} parameters tracked: "
            f"final running GNS {monitor.gns:.4f}"
        )


if __name__ == "__main__":
    run_script(main)
