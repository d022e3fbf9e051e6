"""
transformers' GPT-2 (GPT2LMHeadModel from a tiny config: random weights, nothing
downloaded) given exact per-example gradient norms by nanogns.convert,
trained a few steps on the bundled Shakespeare characters with the GNS logged to
a CSV that gns-analysis.py reads.

    python examples/hf_gpt2.py [--out_dir=out-hf-gpt2] [--steps=20]
    python gns-analysis.py out-hf-gpt2 --no-plots

GPT-2's attention and MLP layers are transformers' Conv1D, a Linear whose weight
is stored (in, out); convert() swaps them, the LayerNorms, both embeddings and
the head, whose weight is the token embedding's (logged once, exactly, as
`transformer.wte.weight+lm_head.weight`). Every parameter is tracked.

The position ids are passed expanded to (B, T): GPT-2's default is one (1, T)
row broadcast over the batch, so its position embedding would see one example
where there are B.
"""

import torch
import torch.nn.functional as F
from common import EMA_DECAY, parse_args, shakespeare_batches
from transformers import GPT2Config, GPT2LMHeadModel

from nanogns import LogWrapper, convert, estimator
from nanogns.monitor import summed_squares

BLOCK_SIZE = 32


def build(vocab_size, n_layer=2, n_head=4, n_embd=64, block_size=BLOCK_SIZE):
    """A tiny GPT-2, dropout off (the per-example norms are of the gradient the optimizer gets either way)."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def logits(model, x):
    position_ids = torch.arange(x.size(1), device=x.device).expand(x.size(0), -1)  # (B, T): one row per example
    return model(input_ids=x, position_ids=position_ids).logits


def main(argv=None):
    args = parse_args(__doc__, argv, name="hf-gpt2")
    vocab_size, batches = shakespeare_batches(block_size=BLOCK_SIZE, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = build(vocab_size)

    # gns: swap Conv1D, Linear, Embedding and LayerNorm for per-example norm layers
    log = LogWrapper(out_dir=args.out_dir)
    monitor = convert(model, log=log, ema_decay=EMA_DECAY)  # one object: the conversion report, the steps
    assert not monitor.unconverted and not monitor.untracked, (monitor.unconverted, monitor.untracked)
    norm_names = [name for name, facts in monitor.describe().items() if facts["kind"] == "LayerNorm"]
    norm_gns = estimator.RunningGNS(decay=EMA_DECAY)  # the paper's estimate: normalisation layers only

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = next(batches)
        loss = F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(batch_size=x.size(0))  # gns: measure, zero the buffers, log the row (before the optimizer step)
        norm_gns.update(*summed_squares([m for m in monitor.measurements if m.metadata["name"] in norm_names]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({"train/loss": loss.item(), "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(
        f"hf_gpt2: {args.steps} steps, loss {loss.item():.3f}, all {len(monitor.tracked)} parameters tracked: "
        f"final running GNS {monitor.gns:.4f}, LayerNorm-only {norm_gns.gns:.4f}"
    )


if __name__ == "__main__":
    main()
