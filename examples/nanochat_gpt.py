"""
A nanochat-style GPT: RMSNorm WITHOUT weights, untied token embedding and
output head, rotary position embeddings, relu^2 MLP, and a Muon-like optimizer
(orthogonalised momentum) for the block matrices with AdamW for the rest. It
is built with plain torch layers and given per-example norms by
layer_config.convert; GNS is logged to a CSV for gns-analysis.py.

    python examples/nanochat_gpt.py --out_dir=out-nanochat [--steps=20]

No norm weights means no normalisation-layer parameters at all: the paper's
LayerNorm-only GNS does not exist for this model. Its GNS has to come from the
Linear and Embedding layers, exact here, which costs more than LayerNorm-only
tracking (see README "What it costs"); giving the norms a weight would bring the
cheap LayerNorm-only estimate back.
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


def norm(x):
    return F.rms_norm(x, (x.shape[-1],))  # no weight: nothing to learn, nothing to track


def rotate(x, cos, sin):
    """Rotary embedding on (B, H, T, D): rotate pairs (x1, x2) of the two halves by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_q, self.c_k, self.c_v, self.c_proj = (nn.Linear(n_embd, n_embd, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.c_q, self.c_k, self.c_v))
        q, k = norm(rotate(q, cos, sin)), norm(rotate(k, cos, sin))  # QK norm, as nanochat
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = Attention(n_embd, n_head)
        self.c_fc, self.c_out = nn.Linear(n_embd, 4 * n_embd, bias=False), nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(norm(x), cos, sin)
        return x + self.c_out(F.relu(self.c_fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)  # untied
        head_dim = n_embd // n_head
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(block_size).float(), freqs)  # (T, head_dim / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        cos, sin = self.cos[:T].to(self.wte.weight.dtype), self.sin[:T].to(self.wte.weight.dtype)
        x = norm(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(norm(x))


def newton_schulz(g, iters=5):
    """Approximately orthogonalise g (U S V^T -> U V^T) by a quintic Newton-Schulz iteration, as Muon does."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(iters):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose update for each matrix is its orthogonalised momentum."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.add_(newton_schulz(buf), alpha=-group["lr"] * scale)


def main(argv=None):
    args = parse_args(__doc__, argv)
    batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = GPT(vocab_size=next(batches)[2])

    accumulate = gnstracking.AccumulateMeasurements(prefix="train/gns/")
    tracker = layer_config.convert(model, callback=accumulate)  # Linear and Embedding; no norm weights to convert
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    optimizers = [Muon(matrices), torch.optim.AdamW([model.wte.weight, model.lm_head.weight], lr=3e-3)]
    running = gnstracking.RunningGNS(decay=0.9)
    log = LogWrapper(out_dir=args.out_dir)
    for step in range(args.steps):
        x, y, _ = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        gns = running.update(*gnstracking.summed_sqnorms(tracker.step(batch_size=args.batch_size)))
        zero_sqgradnorm_buffers(model)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        log.log({**accumulate.get_msg(), "train/loss": loss.item(), "gns": gns,
                 "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(f"nanochat_gpt: {args.steps} steps, loss {loss.item():.3f}, running GNS {running.gns:.3f} "
          f"from {len(tracker.tracked)} Linear/Embedding weights; no norm weights, so no LayerNorm-only GNS")


if __name__ == "__main__":
    main()
