"""
A noise-dominated language task that fits a CPU: an endless stream sampled from a fixed random teacher (issue 48).

Inputs are i.i.d. uniform tokens of a small vocabulary (16), so every context is common; the target at position t is
drawn from P(y | x[t-1], x[t]), a fixed table given by a random MLP teacher (two token embeddings -> tanh hidden
layer -> logits, times `sharpness`). Position 0 has no x[-1] and no target (-1, which model.GPT's loss ignores), so
every example contributes block_size - 1 targets. The teacher's entropy is known exactly (the contexts are
uniform), so the metric is the student's excess loss over the teacher: the mean over fixed validation windows of
KL(P(. | context) || student), computed against the teacher's probabilities (no sampling noise in the metric).

No sample repeats (the stream is endless), so a target excess loss small against the label noise (entropy) puts the
end of a run in the regime where the gradient is mostly noise: the gradient noise scale grows by orders of
magnitude, a constant learning rate stalls at a noise floor, and lowering the noise temperature (the LR, or the
LR over the square root of the batch for Adam) is what reaches the target. bench/controller.py certifies that
before it scores anything.
"""

import math

import torch


class Teacher:
    """P(y | a, b) for every context (a, b) of the vocabulary: `probs[a * vocab + b]`, and its entropy."""

    def __init__(self, vocab: int = 16, hidden: int = 64, width: int = 16, sharpness: float = 8.0, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        emb = torch.randn(vocab, width, generator=g, dtype=torch.float64)
        w1 = torch.randn(2 * width, hidden, generator=g, dtype=torch.float64) / math.sqrt(2 * width)
        w2 = torch.randn(hidden, vocab, generator=g, dtype=torch.float64) / math.sqrt(hidden)
        a, b = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
        h = torch.tanh(torch.cat([emb[a.reshape(-1)], emb[b.reshape(-1)]], 1) @ w1)
        self.vocab = vocab
        self.probs = torch.softmax(sharpness * (h @ w2), -1)  # (vocab^2, vocab), float64
        self.cdf = self.probs.cumsum(-1)
        self.cdf[:, -1] = 1.0  # no rounding gap above the last class
        self.entropy = float(-(self.probs * self.probs.log()).sum(-1).mean())  # nats per target, contexts uniform
        # the first plateau: the best a student that ignores x[t-1] can do is P(y | x[t]), this far above the teacher
        p = self.probs.reshape(vocab, vocab, vocab)  # [x[t-1], x[t], y]
        self.plateau_excess = float((p * (p.log() - p.mean(0, keepdim=True).log())).sum(-1).mean())  # I(y; a | b)

    def contexts(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) inputs -> (B, T - 1) context ids of positions 1..T-1."""
        return x[:, :-1] * self.vocab + x[:, 1:]


class TeacherStream:
    """Training batches for one seed, drawn on demand: `take(B)` -> (x, y), y[:, 0] = -1 (no target)."""

    def __init__(self, teacher: Teacher, block_size: int, seed: int):
        self.teacher, self.block = teacher, block_size
        self.gen = torch.Generator().manual_seed(10_000 + seed)

    def take(self, batch_size: int):
        t = self.teacher
        x = torch.randint(t.vocab, (batch_size, self.block), generator=self.gen)
        u = torch.rand(batch_size, self.block - 1, 1, generator=self.gen, dtype=torch.float64)
        y = torch.searchsorted(t.cdf[t.contexts(x)], u).squeeze(-1)
        return x, torch.cat([torch.full((batch_size, 1), -1, dtype=torch.long), y], 1)


class ExcessLoss:
    """The student's excess loss over the teacher on fixed validation windows (the same for every run and seed):
    mean over windows and positions 1..T-1 of KL(P(. | x[t-1], x[t]) || the student's softmax)."""

    def __init__(self, teacher: Teacher, block_size: int, windows: int = 256, seed: int = 999):
        self.x = torch.randint(teacher.vocab, (windows, block_size), generator=torch.Generator().manual_seed(seed))
        self.p = teacher.probs[teacher.contexts(self.x)]  # (windows, T - 1, vocab), float64
        self.plogp = (self.p * self.p.log()).sum(-1)

    @torch.no_grad()
    def __call__(self, model) -> float:
        was_training = model.training
        model.eval()
        logits, _ = model(self.x, self.x)  # targets given: every position's logits come back
        model.train(was_training)
        logq = torch.log_softmax(logits[:, 1:].double(), -1)
        return float((self.plogp - (self.p * logq).sum(-1)).mean())
