"""
A GPT-2 written the way a notebook writes one (nn.LayerNorm, nn.Linear,
nn.Embedding, token embedding tied to the output layer, causal attention),
given per-example gradient norms AFTER construction by nanogns.convert,
then trained a few steps on the bundled Shakespeare characters with the GNS
logged to a CSV that gns-analysis.py reads.

    python examples/gpt2_notebook.py [--out_dir=out-gpt2nb] [--steps=20]
    python gns-analysis.py out-gpt2nb --no-plots

The cells (`# %%`) run top to bottom in Jupyter/VS Code too. The optimizer is
made before convert(): the converted layers keep the very same Parameter
objects, so it, the weight tying and the initialisation all carry over. The
tied matrix is logged once, exactly, as `wte.weight+lm_head.weight`.

The model reads its layer classes from nanogns.config when it is built
(torch's classes unless set), so the same class can instead be built with the
per-example norm layers from the start (`build_in_context`); the tests check
that both routes give the same losses, gradients and measurements.
"""

# %% imports

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import EMA_DECAY, parse_args, shakespeare_batches

import nanogns
from nanogns import GNSMonitor, LogWrapper, convert


# %% the model: layer classes read from nanogns.config at construction (torch's by default)
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        L = nanogns.config
        self.n_head = n_head
        self.c_attn = L.Linear(n_embd, 3 * n_embd)
        self.c_proj = L.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        L = nanogns.config
        self.c_fc = L.Linear(n_embd, 4 * n_embd)
        self.c_proj = L.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        L = nanogns.config
        self.ln_1 = L.LayerNorm(n_embd)  # (ndim) only: the per-example LayerNorm's signature is (ndim, bias, eps)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = L.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        L = nanogns.config
        self.wte = L.Embedding(vocab_size, n_embd)
        self.wpe = L.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = L.LayerNorm(n_embd)
        self.lm_head = L.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):  # the per-example classes subclass these
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        B, T = idx.size()
        # positions as (B, T), not (T,): dim 0 of an embedding's input is the example, so each
        # example's lookups count as that example's (a (T,) input would count T "examples")
        pos = torch.arange(T, device=idx.device).expand(B, T)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# %% two ways to get per-example norms
def build_converted(vocab_size, seed=0, **kwargs):
    """Built with torch layers, then converted in place: (model, its GNSMonitor)."""
    torch.manual_seed(seed)
    model = GPT2(vocab_size, **kwargs)
    return model, convert(model)


def build_in_context(vocab_size, seed=0, **kwargs):
    """Built with the per-example norm layers from the start: (model, its GNSMonitor)."""
    torch.manual_seed(seed)
    with nanogns.set_contextual_config(**nanogns.layer_classes("gns", "gns", "gns")):
        model = GPT2(vocab_size, **kwargs)
    return model, GNSMonitor(model)


# %% train
def main(argv=None):
    args = parse_args(__doc__, argv, name="gpt2nb")
    vocab_size, batches = shakespeare_batches(block_size=32, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = GPT2(vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # made before convert(): still the right parameters

    # gns: a later cell converts the finished model (a tied pair is found and logged once); one object per step
    log = LogWrapper(out_dir=args.out_dir)
    monitor = convert(model, log=log, ema_decay=EMA_DECAY)

    for step in range(args.steps):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(batch_size=x.size(0))  # gns: measure, zero the buffers, log the row (before the optimizer step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({"train/loss": loss.item(), "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    tied = [entry.name for entry in monitor.tracked if "+" in entry.name]
    print(
        f"gpt2_notebook: {args.steps} steps, loss {loss.item():.3f}, from {len(monitor.tracked)} tensors "
        f"(tied: {', '.join(tied)}): final running GNS {monitor.gns:.4f}"
    )


if __name__ == "__main__":
    main()
