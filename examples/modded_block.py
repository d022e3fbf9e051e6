"""
A modded-nanogpt-style model whose linear layer, CastedLinear, stores its
weight TRANSPOSED (in x out, used as x @ W) and casts it to the input's dtype.
It is not an nn.Linear, so convert() cannot swap it; its forward calls the
functional API instead, one line, and the tracker finds the buffer by name.
Trained a few steps under bf16 autocast with GNS logged to a CSV.

    python examples/modded_block.py --out_dir=out-modded [--steps=20]
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import functional  # noqa: E402
import gnstracking  # noqa: E402
from buffered import PESqNormBuffersMixin, zero_sqgradnorm_buffers  # noqa: E402
from tracker import LogWrapper  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, shakespeare_batches  # noqa: E402


class CastedLinear(PESqNormBuffersMixin, nn.Module):
    """y = x @ W with W (in, out) cast to x's dtype; the mixin keeps the buffer float32 under .bfloat16()."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-1, 1) * in_features ** -0.5)
        functional.register_buffers(self, "weight")  # -> weight_upegsqnorm

    def forward(self, x):
        # the one changed line: x @ self.weight.type_as(x) becomes
        return functional.linear(x, self.weight.type_as(x).t(), weight_buffer=self.weight_upegsqnorm)


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv, self.proj = CastedLinear(dim, 3 * dim), CastedLinear(dim, dim)
        self.fc, self.out = CastedLinear(dim, 4 * dim), CastedLinear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        h = F.rms_norm(x, (C,))
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(h).split(C, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.relu(self.fc(F.rms_norm(x, (C,)))).square())


class Model(nn.Module):
    def __init__(self, vocab_size, dim=32, n_layer=2, n_head=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)  # plain: the tracker reports it as not tracked
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.head = CastedLinear(dim, vocab_size)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(F.rms_norm(x, (x.shape[-1],)))


def main(argv=None):
    args = parse_args(__doc__, argv)
    batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = Model(vocab_size=next(batches)[2])

    accumulate = gnstracking.AccumulateMeasurements(prefix="train/gns/")
    tracker = gnstracking.MeasurementTracker.from_model(model, callback=accumulate)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    running = gnstracking.RunningGNS(decay=0.9)
    log = LogWrapper(out_dir=args.out_dir)
    for step in range(args.steps):
        x, y, _ = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        gns = running.update(*gnstracking.summed_sqnorms(tracker.step(batch_size=args.batch_size)))
        zero_sqgradnorm_buffers(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({**accumulate.get_msg(), "train/loss": loss.item(), "gns": gns,
                 "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(f"modded_block: {args.steps} steps, loss {loss.item():.3f}, running GNS {running.gns:.3f} "
          f"from {len(tracker.tracked)} CastedLinear weights (bf16 autocast)")


if __name__ == "__main__":
    main()
