"""
A modded-nanogpt-style model whose linear layer, CastedLinear, stores its
weight TRANSPOSED (in x out, applied as x @ W) and casts it to the input's
dtype. It is no nn.Linear, so convert() cannot swap it; instead its forward
calls the functional API (one changed line) with a buffer registered once, and
MeasurementTracker.from_model finds the buffers by name. Trained a few steps
under bf16 autocast on the bundled Shakespeare characters, with the GNS logged
to a CSV that gns-analysis.py reads.

    python examples/modded_block.py --out_dir=out-modded [--steps=20]
    python gns-analysis.py out-modded --no-plots

The token embedding is a plain nn.Embedding, left untracked on purpose: the
tracker lists it in `tracker.skipped`, and the GNS comes from the CastedLinear
weights. (functional.embedding would track it the same way.)
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/

import functional  # noqa: E402
import gnstracking  # noqa: E402
from buffered import PESqNormBuffersMixin, zero_sqgradnorm_buffers  # noqa: E402
from common import EMA_DECAY, parse_args, shakespeare_batches  # noqa: E402
from tracker import LogWrapper  # noqa: E402


class CastedLinear(PESqNormBuffersMixin, nn.Module):
    """y = x @ W, W stored (in, out) and cast to x's dtype. The mixin keeps the
    per-example norm buffer float32 when the model is cast to bf16."""

    def __init__(self, in_features, out_features):
        super().__init__()
        bound = in_features ** -0.5
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        functional.register_buffers(self, "weight")  # -> self.weight_upegsqnorm

    def forward(self, x):
        # was: x @ self.weight.type_as(x)
        return functional.linear(x, self.weight.t().type_as(x), weight_buffer=self.weight_upegsqnorm)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Attention(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = CastedLinear(dim, 3 * dim)
        self.c_proj = CastedLinear(dim, dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.qkv(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(norm(q), norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.attn = Attention(dim, n_head)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(norm(x))
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, dim=32, n_layer=2, n_head=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)  # plain torch: not tracked
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.lm_head = CastedLinear(dim, vocab_size)

    def forward(self, idx):
        x = norm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(norm(x))


def main(argv=None):
    args = parse_args(__doc__, argv)
    vocab_size, batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = GPT(vocab_size)

    # gns: the CastedLinear buffers are found by name; the plain embedding is listed as skipped
    accumulate = gnstracking.AccumulateMeasurements(prefix="train/gns/")
    tracker = gnstracking.MeasurementTracker.from_model(model, callback=accumulate)

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    running = gnstracking.RunningGNS(decay=EMA_DECAY)
    log = LogWrapper(out_dir=args.out_dir)
    for step in range(args.steps):
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        gns = running.update(*gnstracking.summed_sqnorms(tracker.step(batch_size=x.size(0))))
        zero_sqgradnorm_buffers(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({**accumulate.get_msg(), "train/loss": loss.item(), "gns": gns,
                 "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(f"modded_block: {args.steps} steps under bf16 autocast, loss {loss.item():.3f}, "
          f"from {len(tracker.tracked)} CastedLinear weights: final running GNS {running.gns:.4f}")
    print(f"not tracked: {', '.join(tracker.skipped)} (a plain nn.Embedding)")


if __name__ == "__main__":
    main()
