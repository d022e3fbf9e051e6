"""
A modded-nanogpt-style model whose linear layer, CastedLinear, stores its
weight TRANSPOSED (in x out, applied as x @ W) and casts it to the input's
dtype, and whose MLP matrices live in one parameter bank, `mlp_bank`
(n_layer, 2, 4 * dim, dim), sliced per layer (modded-nanogpt banks matrices so
that its optimizer can shard whole matrices). Neither is an nn.Linear, so
convert() cannot swap them; their forwards call the functional API (one changed
line each) with buffers registered once, and the GNSMonitor finds the buffers by
name. The bank's buffer has one row per slice: disjoint slices have no cross
terms, so the bank's per-example squared norm is the sum of its slices', and
the bank is logged once, exactly. Trained a few steps under bf16 autocast on the
bundled Shakespeare characters, with the GNS logged to a CSV that
gns-analysis.py reads.

    python examples/modded_block.py [--out_dir=out-modded] [--steps=20]
    python gns-analysis.py out-modded --no-plots

The token embedding is a plain nn.Embedding, left untracked on purpose: the
monitor lists it in `monitor.untracked`, and the GNS comes from the
CastedLinear weights and the bank. (functional.embedding would track it the same way.)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import EMA_DECAY, parse_args, shakespeare_batches

from nanogns import GNSMonitor, LogWrapper
from nanogns.core.buffers import PerExampleNormLayer
from nanogns.kinds import functional


class CastedLinear(PerExampleNormLayer, nn.Module):
    """y = x @ W, W stored (in, out) and cast to x's dtype. The mixin keeps the
    per-example norm buffer float32 when the model is cast to bf16."""

    def __init__(self, in_features, out_features):
        super().__init__()
        bound = in_features**-0.5
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        functional.register_buffers(self, "weight", kind="Linear")  # -> self.weight_pe_sqnorm

    def forward(self, x):
        # was: x @ self.weight.type_as(x)
        return functional.linear(x, self.weight.t().type_as(x), weight_buffer=self.weight_pe_sqnorm)


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
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            for t in self.qkv(x).split(C, dim=-1)
        )
        y = F.scaled_dot_product_attention(norm(q), norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def mlp(x, weights, buffers):
    """An MLP from one layer's slice of the bank: weights[0] is c_fc (4 * dim, dim), weights[1] is c_proj
    stored transposed; buffers[j] is the bank buffer's row for weights[j]."""
    h = F.relu(functional.linear(x, weights[0].type_as(x), weight_buffer=buffers[0])).square()
    return functional.linear(h, weights[1].t().type_as(x), weight_buffer=buffers[1])


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.attn = Attention(dim, n_head)

    def forward(self, x, mlp_weights, mlp_buffers):
        x = x + self.attn(norm(x))
        return x + mlp(norm(x), mlp_weights, mlp_buffers)


class GPT(PerExampleNormLayer, nn.Module):
    def __init__(self, vocab_size, dim=32, n_layer=2, n_head=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)  # plain torch: not tracked
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        bound = dim**-0.5
        self.mlp_bank = nn.Parameter(torch.empty(n_layer, 2, 4 * dim, dim).uniform_(-bound, bound))
        # one [sum, count] row per slice, indexed like the bank: buffer (n_layer, 2, 2)
        functional.register_buffers(self, "mlp_bank", kind="Linear", bank_dims=2)
        self.lm_head = CastedLinear(dim, vocab_size)

    def forward(self, idx):
        x = norm(self.embed(idx))
        for i, block in enumerate(self.blocks):
            x = block(x, self.mlp_bank[i], self.mlp_bank_pe_sqnorm[i])  # this layer's slices and buffer rows
        return self.lm_head(norm(x))


def main(argv=None):
    args = parse_args(__doc__, argv, name="modded")
    vocab_size, batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = GPT(vocab_size)

    # gns: the CastedLinear and bank buffers are found by name; the plain embedding is listed as skipped
    log = LogWrapper(out_dir=args.out_dir)
    monitor = GNSMonitor(model, log=log, ema_decay=EMA_DECAY)

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(batch_size=x.size(0))  # gns: measure, zero the buffers, log the row (before the optimizer step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({"train/loss": loss.item(), "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(
        f"modded_block: {args.steps} steps under bf16 autocast, loss {loss.item():.3f}, from "
        f"{len(monitor.tracked)} tensors (CastedLinear weights and the {model.mlp_bank.shape[0] * 2}-slice "
        f"mlp_bank): final running GNS {monitor.gns:.4f}"
    )
    print(f"not tracked: {', '.join(monitor.untracked)} (a plain nn.Embedding)")


if __name__ == "__main__":
    main()
