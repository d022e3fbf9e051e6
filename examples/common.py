"""
What the examples share that is not the point of any of them: the command lines
and a stream of Shakespeare character batches. Each example's model and
training loop are written out in full in its own file, since they are what it
shows.
"""

import argparse
import os
import sys

import torch

from nanogns.errors import NanoGNSError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMA_DECAY = 0.95  # the running GNS's decay: gns-analysis.py's default --alpha, so both print the same final GNS


def run_script(main):
    """Run an example's main() as a script: a refusal of the package (a NanoGNSError: the directory in use or
    holding another run's log, a failed write) is one line on stderr and exit status 1, as train.py does."""
    try:
        main()
    except NanoGNSError as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")


def parse_args(doc, argv=None, name=None):
    """--out_dir (default out-<name>, as train.py's out-... directories), --steps, --batch_size."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out_dir",
        default=f"out-{name}",
        help=f"where log.csv goes (default: out-{name}); then: python gns-analysis.py OUT_DIR",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--batch_size", type=int, default=8, help="examples (sequences) per step (default: 8)")
    return parser.parse_args(argv)


def trainer_parser(doc, out_dir, out_dir_help="where log.csv goes", clip_help="clipping"):
    """The trainers' examples' shared flags (hf_trainer.py, lightning_gpt.py, accelerate_gpt.py): --model, --out_dir,
    --steps, --batch_size, --grad_accum, --max_grad_norm, --dtype; each adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2"], help="default: llama")
    parser.add_argument("--out_dir", default=out_dir, help=f"{out_dir_help} (default: {out_dir})")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--batch_size", type=int, default=4, help="examples per micro-batch per rank (default: 4)")
    parser.add_argument("--grad_accum", type=int, default=2, help="micro-batches per step (default: 2)")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help=f"{clip_help} (default: 1.0)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="default: float32")
    return parser


def shakespeare_batches(block_size, batch_size, seed=0):
    """(vocab_size, an endless iterator of (x, y) random windows of the bundled Shakespeare, as character ids)."""
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        text = f.read()
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[c] for c in text[:200_000]], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=gen)
            yield (
                torch.stack([data[s : s + block_size] for s in starts]),
                torch.stack([data[s + 1 : s + 1 + block_size] for s in starts]),
            )

    return len(stoi), batches()


def padded_examples(count, block_size, seed=0, min_length=None):
    """`count` causal-LM examples for the trainers' examples: windows of the bundled Shakespeare of random lengths
    (min_length..block_size), right-padded to block_size; each a dict of (block_size,) tensors: input_ids,
    attention_mask, labels (the ids; -100 on padding: no loss there) and position_ids (0..block_size-1, so a
    batch's are (B, T), one row per example)."""
    min_length = min_length or block_size // 2
    vocab_size, windows = shakespeare_batches(block_size, batch_size=1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    examples = []
    for _ in range(count):
        ids = next(windows)[0][0]
        length = int(torch.randint(min_length, block_size + 1, (), generator=gen))
        mask = (torch.arange(block_size) < length).long()
        examples.append(
            {
                "input_ids": ids * mask,
                "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100),
                "position_ids": torch.arange(block_size),
            }
        )
    return vocab_size, examples


def build_model(name, vocab_size, **sizes):
    """A tiny transformers model from a config: 'llama' (examples/hf_llama.py) or 'gpt2' (examples/hf_gpt2.py)."""
    import hf_gpt2
    import hf_llama

    builders = {"llama": hf_llama.build, "gpt2": hf_gpt2.build}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(builders)}")
    return builders[name](vocab_size, **sizes)
