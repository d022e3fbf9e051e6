"""
A nanochat-style GPT given exact per-example gradient norms by
nanogns.convert, trained a few steps on the bundled Shakespeare characters
with the GNS logged to a CSV that gns-analysis.py reads.

    python examples/nanochat_gpt.py [--out_dir=out-nanochat] [--steps=20]
    python gns-analysis.py out-nanochat --no-plots

The model, as nanochat writes it: RMSNorm WITHOUT weights (F.rms_norm, no
parameters), an untied token embedding and lm_head, rotary position embeddings
with QK norm, a relu^2 MLP, tanh-softcapped logits, and Muon (momentum
orthogonalised by a Newton-Schulz iteration) for the block matrices with AdamW
for the embedding and head. It is built from plain torch layers; convert()
swaps its nn.Linear and nn.Embedding modules afterwards.

What the weightless norms mean for the GNS: the model has no LayerNorm (or
RMSNorm) parameters at all, so the paper's cheap LayerNorm-only GNS does not
exist for it. Its GNS has to come from the Linear and Embedding weights (exact
here, at the cost of those layers' per-example norms), or the norms must be
given a weight (nn.RMSNorm(n_embd), which convert() swaps too) to track.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import EMA_DECAY, parse_args, shakespeare_batches

from nanogns import LogWrapper, convert


def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # no weight: nothing to learn, nothing to track


def apply_rotary(x, cos, sin):
    """Rotate the pairs (first half, second half) of x (B, nh, T, hs) by angles that grow with the position."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_q = nn.Linear(n_embd, n_embd, bias=False)
        self.c_k = nn.Linear(n_embd, n_embd, bias=False)
        self.c_v = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        q, k, v = (
            lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            for lin in (self.c_q, self.c_k, self.c_v)
        )
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))  # QK norm
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = MLP(n_embd)

    def forward(self, x, cos, sin):
        x = x + self.attn(norm(x), cos, sin)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, softcap=15.0):
        super().__init__()
        self.softcap = softcap
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)  # untied from wte
        head_dim = n_embd // n_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(block_size).float(), inv_freq)  # (T, hs/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx):
        T = idx.size(1)
        dtype = self.lm_head.weight.dtype
        cos, sin = self.cos[:T].to(dtype), self.sin[:T].to(dtype)
        x = norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos, sin)
        logits = self.lm_head(norm(x))
        return self.softcap * torch.tanh(logits / self.softcap)


def orthogonalize(g, steps=5):
    """Newton-Schulz iteration towards U V^T for g = U S V^T: the quintic whose
    coefficients push every singular value into roughly [0.7, 1.2] in 5 steps."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)  # singular values <= 1, where the iteration converges
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T  # iterate on the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


class Muon(torch.optim.Optimizer):
    """Nesterov momentum whose update for each matrix is orthogonalised: every direction moves the same amount."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalize(p.grad.lerp(buf, group["momentum"]))
                p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def main(argv=None):
    args = parse_args(__doc__, argv, name="nanochat")
    vocab_size, batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = GPT(vocab_size)

    # gns: swap nn.Linear / nn.Embedding for per-example norm layers (there are no norm weights to swap)
    log = LogWrapper(out_dir=args.out_dir)
    monitor = convert(model, log=log, ema_decay=EMA_DECAY)
    assert not monitor.untracked, monitor.untracked  # every parameter is a Linear or Embedding weight

    matrices = list(model.transformer.h.parameters())  # all 2-D
    optimizers = [Muon(matrices), torch.optim.AdamW([model.transformer.wte.weight, model.lm_head.weight], lr=3e-3)]
    for step in range(args.steps):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(batch_size=x.size(0))  # gns: measure, zero the buffers, log the row (before the optimizer step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        log.log({"train/loss": loss.item(), "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(
        f"nanochat_gpt: {args.steps} steps, loss {loss.item():.3f}, "
        f"from {len(monitor.tracked)} Linear/Embedding weights: final running GNS {monitor.gns:.4f}"
    )
    print(
        "no norm weights: the RMSNorms have no parameters, so the LayerNorm-only GNS is unavailable for this "
        "model; the GNS above comes from the Linear and Embedding layers (or give the norms a weight to track)"
    )


if __name__ == "__main__":
    main()
