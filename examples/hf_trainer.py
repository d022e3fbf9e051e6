"""
transformers.Trainer with the GNS: one callback (integrations.TrainerGNSCallback) on a tiny Llama or GPT-2
(from a config, nothing downloaded), with Trainer's defaults: gradient accumulation, clipping at max_grad_norm,
its DDP under torchrun. Right-padded Shakespeare windows of random lengths.

    python examples/hf_trainer.py [--model=llama|gpt2] [--steps=20] [--out_dir=out-hf-trainer]
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py      # DDP (gloo on CPUs)
    python gns-analysis.py out-hf-trainer --no-plots

--loss=tokens (Trainer's default) divides the step's summed token losses by their number: an example's gradient
then weighs by its label tokens. --loss=sequences takes the mean over sequences of each one's mean token loss
(the per-example gradient of docs/log-format.md) by overriding compute_loss.
"""

import torch
from common import EMA_DECAY, build_model, padded_examples, run_script, trainer_parser
from transformers import Trainer, TrainingArguments

from nanogns.integrations import TrainerGNSCallback, sequence_mean_loss

BLOCK_SIZE = 32


class SequenceMeanTrainer(Trainer):
    """Trainer whose loss is the mean over sequences of each one's mean token loss."""

    loss_is_scaled_for_ga = False  # a micro-batch mean: Trainer divides it by the accumulation steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = sequence_mean_loss(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


def parse_args(argv=None):
    parser = trainer_parser(__doc__, "out-hf-trainer", out_dir_help="Trainer's output_dir, where log.csv goes")
    parser.add_argument("--loss", default="tokens", choices=["tokens", "sequences"], help="default: tokens")
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (default: 0, none)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in out_dir, and its GNS log with it"
    )
    return parser.parse_args(argv)


def make_trainer(args, callbacks=()):
    """The Trainer of this example: a tiny model, its dataset and arguments, with the GNS callback added."""
    vocab_size, examples = padded_examples(256, BLOCK_SIZE)
    torch.manual_seed(0)
    model = build_model(args.model, vocab_size, block_size=BLOCK_SIZE).to(getattr(torch, args.dtype))
    training_args = TrainingArguments(
        output_dir=args.out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    trainer_class = SequenceMeanTrainer if args.loss == "sequences" else Trainer
    trainer = trainer_class(model=model, args=training_args, train_dataset=examples, callbacks=list(callbacks))
    trainer.add_callback(TrainerGNSCallback(trainer, ema_decay=EMA_DECAY))  # gns: the one line
    return trainer


def main(argv=None):
    args = parse_args(argv)
    trainer = make_trainer(args)
    trainer.train(resume_from_checkpoint=args.resume or None)
    monitor = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TrainerGNSCallback)).monitor
    if trainer.is_world_process_zero():
        print(
            f"hf_trainer: {args.model}, {args.steps} steps, {len(monitor.tracked)} parameters tracked: "
            f"final running GNS {monitor.gns:.4f}"
        )


if __name__ == "__main__":
    run_script(main)
