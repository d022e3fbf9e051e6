"""
A GPT-2 written the way a notebook writes one (nn.LayerNorm, nn.Linear,
nn.Embedding, tied token embedding / output matrix), given per-example
gradient norms AFTER construction with layer_config.convert, then trained for a
few steps on the bundled Shakespeare characters with GNS logged to a CSV.

    python examples/gpt2_notebook.py --out_dir=out-gpt2nb [--steps=20]
    python gns-analysis.py out-gpt2nb

The model reads its layer classes from layer_config.config (torch's unless set),
so the same code can also be built under the context manager; tests check
that both routes give the same numbers.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import gnstracking  # noqa: E402
import layer_config  # noqa: E402
from buffered import zero_sqgradnorm_buffers  # noqa: E402
from tracker import LogWrapper  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, shakespeare_batches  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        L = layer_config.config
        self.n_head = n_head
        self.qkv = L.Linear(n_embd, 3 * n_embd)
        self.out = L.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        L = layer_config.config
        self.ln1, self.ln2 = L.LayerNorm(n_embd), L.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(L.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), L.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    def __init__(self, vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        L = layer_config.config
        self.tok = L.Embedding(vocab_size, n_embd)
        self.pos = L.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = L.LayerNorm(n_embd)
        self.head = L.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2 does
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        B, T = idx.shape
        positions = torch.arange(T, device=idx.device).expand(B, T)  # a batch dim: per-example norms of pos too
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_converted(vocab_size, seed=0, **kwargs):
    """Built with torch layers, then converted: (model, tracker)."""
    torch.manual_seed(seed)
    model = GPT2(vocab_size, **kwargs)
    return model, layer_config.convert(model)


def build_in_context(vocab_size, seed=0, **kwargs):
    """Built with the per-example classes from the start: (model, tracker)."""
    torch.manual_seed(seed)
    with layer_config.set_contextual_config(**layer_config.layer_classes("gns", "gns", "gns")):
        model = GPT2(vocab_size, **kwargs)
    return model, gnstracking.MeasurementTracker.from_model(model)


def main(argv=None):
    args = parse_args(__doc__, argv)
    batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    vocab_size = next(batches)[2]
    model, tracker = build_converted(vocab_size)

    # the loop: tracker.step after backward, buffers zeroed, one CSV row per step
    accumulate = gnstracking.AccumulateMeasurements(prefix="train/gns/")
    tracker.callbacks.append(accumulate)
    running = gnstracking.RunningGNS(decay=0.9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = LogWrapper(out_dir=args.out_dir)
    for step in range(args.steps):
        x, y, _ = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        gns = running.update(*gnstracking.summed_sqnorms(tracker.step(batch_size=args.batch_size)))
        zero_sqgradnorm_buffers(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({**accumulate.get_msg(), "train/loss": loss.item(), "gns": gns,
                 "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(f"gpt2_notebook: {args.steps} steps, loss {loss.item():.3f}, running GNS {running.gns:.3f}; "
          f"tracked {len(tracker.tracked)} tensors incl. {tracker.tracked[0][0]}")


if __name__ == "__main__":
    main()
