"""
The exact per-example gradient of a tensor used several times in one forward: a layer shared across depth
(ALBERT), a matrix shared by the encoder's and the decoder's embeddings and the head (T5, BART), a table read
through several projections (DeBERTa), a slice of a parameter bank used twice.

Example i's gradient of a tensor used k times is the sum over its uses, g_i = sum_u g_{u,i}, so

    ||g_i||^2 = sum_u ||g_{u,i}||^2 + sum_{u != v} <g_{u,i}, g_{v,i}>

and no use's own norm gives it. Each use's backward therefore hands over, instead of its norms, a Factor: what it
needs to form g_{u,i} for any example (a Linear's input rows and output gradient, an Embedding's ids and output
gradient, a norm's normalised input and output gradient, or the per-example gradients themselves). When the last
use's backward has handed its factor over, the examples are taken a chunk at a time: g_i is formed in a
(chunk, *shape) workspace as the sum of every use's g_{u,i}, and ||g_i||^2 added to the tensor's buffer, which
counts the forward's examples once. Uses of one tensor may differ in kind and rows (T5's encoder ids, decoder ids
and head), as long as they serve the same examples.

Which tensors are used more than once: every layer's forward counts its buffers (layout.note_uses) while the
model's own forward runs. A recompute by activation checkpointing runs in backward, outside it, so it is no use,
and a reentrant checkpoint's forward, run without gradients, still counts. A tensor recorded by several modules'
buffers (tied between an embedding and a head) is one tensor (SharedTensor): its uses add up across them,
except that an embedding and a head used once each keep tied.py's cheaper cross term. A use whose backward never
comes (its output unused) adds nothing: its tensor is recorded when the next forward starts, or when the monitor
reads the step. A layer kind that gives no factors (a convolution, attention, the fused kernels) records its own
norms as before; its tensor then counts k examples per example and the monitor stops measuring it, saying why.

Cost, per tensor used k times and per step: the factors are held from each use's backward until the last one's
(a Linear's input rows and output gradient: what its backward reads anyway); forming g_{u,i} takes a Linear's
2*T*K*L FLOPs per example (its weight gradient's FLOPs again), an embedding's T*D; the workspace holds
GATHER_CHUNK_ELEMENTS elements at most (at least one example). Under torch.compile uses are not counted.
"""

import math

import torch

from nanogns.core import layout

GATHER_CHUNK_ELEMENTS = 2**24  # elements of per-example gradients formed at once (64 MB in float32)


def _dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# -----------------------------------------------------------------------------
# what one use hands over


class Factor:
    """One use's per-example gradients, formed on demand. `examples`: N; `shape`: one example's gradient's."""

    examples = 0
    shape = ()
    dtype = torch.float32

    def add_into(self, work, start):
        """work (n, *shape) += this use's gradients of examples start .. start + n."""
        raise NotImplementedError

    def pe_sqnorms(self):
        """(N,) this use's own per-example squared norms."""
        total = torch.zeros(self.examples, dtype=self.dtype)
        chunk = _chunk(self.examples, math.prod(self.shape))
        for start in range(0, self.examples, chunk):
            n = min(chunk, self.examples - start)
            work = torch.zeros(n, *self.shape, dtype=self.dtype, device=self.device)
            self.add_into(work, start)
            total[start : start + n] = work.reshape(n, -1).pow(2).sum(1).cpu()  # (a 0-d tensor's too)
        return total


class LinearWeightFactor(Factor):
    """A Linear's weight (L, K) as it was used: dW_i = sum_t g_t x_t^T over example i's rows."""

    def __init__(self, x, g, rows):
        self.dtype = _dtype(g)
        self.x, self.g = rows.per_example(x.detach()), rows.per_example(g.detach())  # (N, T, K), (N, T, L)
        self.examples, self.shape, self.device = rows.examples, (g.shape[-1], x.shape[-1]), g.device

    def add_into(self, work, start):
        n = work.shape[0]
        x, g = self.x[start : start + n].to(work.dtype), self.g[start : start + n].to(work.dtype)
        work.baddbmm_(g.transpose(1, 2), x)


class RowSumFactor(Factor):
    """A bias, or a norm's weight: the sum over example i's rows of g_t (times xhat_t when `xhat` is given)."""

    def __init__(self, g, rows, xhat=None):
        self.dtype = _dtype(g)
        self.g = rows.per_example(g.detach())
        self.xhat = rows.per_example(xhat.detach()) if xhat is not None else None
        self.examples, self.shape, self.device = rows.examples, (g.shape[-1],), g.device

    def add_into(self, work, start):
        n = work.shape[0]
        g = self.g[start : start + n].to(work.dtype)
        if self.xhat is not None:
            g = g * self.xhat[start : start + n].to(work.dtype)
        work.add_(g.sum(dim=1))


class EmbeddingFactor(Factor):
    """An Embedding's weight (V, D): example i's rows scattered to the tokens it looked up (none for padding)."""

    def __init__(self, ids, g, rows, num_embeddings, padding_idx=None):
        self.dtype = _dtype(g)
        self.ids = rows.per_example(ids.unsqueeze(-1)).squeeze(-1)  # (N, P), padding rows 0
        self.g = rows.per_example(g.detach())  # (N, P, D), zero rows padding a ragged layout
        if padding_idx is not None:
            self.g = self.g.masked_fill((self.ids == padding_idx).unsqueeze(-1), 0)
        self.examples, self.shape, self.device = rows.examples, (num_embeddings, g.shape[-1]), g.device

    def add_into(self, work, start):
        n, V, D = work.shape
        ids = self.ids[start : start + n] + torch.arange(n, device=work.device).unsqueeze(1) * V
        work.view(n * V, D).index_add_(0, ids.reshape(-1), self.g[start : start + n].reshape(-1, D).to(work.dtype))


class DenseFactor(Factor):
    """Per-example gradients already formed, (N, *shape)."""

    def __init__(self, grads):
        self.dtype = _dtype(grads)
        self.grads = grads.detach()
        self.examples, self.shape, self.device = grads.shape[0], tuple(grads.shape[1:]), grads.device

    def add_into(self, work, start):
        work.add_(self.grads[start : start + work.shape[0]].to(work.dtype))


class _Direct:
    """A use whose layer recorded its own norms (no factor): the tensor is then measured as before, per use."""


def _chunk(examples, numel):
    return max(1, min(examples, GATHER_CHUNK_ELEMENTS // max(1, numel)))


class Gathered:
    """The factors of one tensor's uses in one forward, and the buffer their sum is recorded in."""

    def __init__(self, buffer, expected):
        self.buffer, self.expected = buffer, expected
        self.factors = []

    def add(self, factor):
        self.factors.append(factor)
        return len(self.factors) >= self.expected

    def finish(self):
        factors = [f for f in self.factors if not isinstance(f, _Direct)]
        if not factors:
            return
        buffer = self.buffer
        if len(factors) < len(self.factors):  # some use recorded its own norms: record these per use too
            with torch.no_grad():
                for factor in factors:
                    buffer[0] += factor.pe_sqnorms().sum().to(buffer.dtype)
                    buffer[1] += factor.examples
            return
        examples = factors[0].examples
        if any(f.examples != examples for f in factors):
            layout.note_refusal(
                f"its uses in one forward served different numbers of examples ({[f.examples for f in factors]})",
                [buffer],
            )
            with torch.no_grad():
                buffer[..., 1] = math.nan
            return
        shape = max((f.shape for f in factors), key=len)  # a flattened use's gradient takes another's shape
        dtype = torch.float64 if any(f.dtype == torch.float64 for f in factors) else torch.float32
        device = factors[0].device
        chunk = _chunk(examples, math.prod(shape))
        total = torch.zeros((), dtype=dtype, device=device)
        for start in range(0, examples, chunk):
            n = min(chunk, examples - start)
            work = torch.zeros(n, *shape, dtype=dtype, device=device)
            try:
                for factor in factors:
                    _add_oriented(factor, work, start, shape)
            except _Mismatch as e:
                layout.note_refusal(f"it is used several times per forward, but {e}", [buffer])
                with torch.no_grad():
                    buffer[..., 1] = math.nan
                return
            total += work.pow(2).sum()
        with torch.no_grad():
            buffer[0] += total.to(buffer.dtype)
            buffer[1] += examples


def _add_oriented(factor, work, start, shape):
    """Add a factor whose gradient may be the transpose of the first use's (a matrix used as W and as W.t()), or
    flattened (a parameter broadcast over the examples, intercept.py)."""
    if tuple(factor.shape) == tuple(shape):
        factor.add_into(work, start)
    elif len(shape) == 2 and tuple(factor.shape) == tuple(shape[::-1]) and not isinstance(factor, EmbeddingFactor):
        factor.add_into(work.transpose(1, 2), start)
    elif math.prod(factor.shape) == math.prod(shape) and len(factor.shape) == 1:
        factor.add_into(work.view(work.shape[0], -1), start)
    else:
        raise _Mismatch(f"its uses' per-example gradients have shapes {tuple(factor.shape)} and {tuple(shape)}")


class _Mismatch(Exception):
    pass


# -----------------------------------------------------------------------------
# what layers call in backward


def _key(this, address):
    shared = this.groups.get(address)
    return ("shared", id(shared)) if shared is not None else address


def _uses(this, address):
    """(uses of the tensor whose buffer is at `address` in this forward, whether it keeps tied.py's path)."""
    shared = this.groups.get(address)
    if shared is None:
        return this.uses.get(address, 0), False
    counts = [this.uses.get(a, 0) for a in shared.addresses()]
    return sum(counts), shared.pairwise and all(c <= 1 for c in counts)


def multiple(buffer):
    """True in a use's backward when the forward used this buffer's tensor more than once: the use must then hand
    its factor to `add` instead of recording its own norms. Asked only in a backward function."""
    if buffer is None or torch.compiler.is_compiling():
        return False
    this = layout.backward_pass()
    if this is None or not this.uses:
        return False
    this.backward_seen = True
    address = buffer.data_ptr()
    if address not in this.groups:  # (_uses's common case, inline: this runs in every layer's backward)
        return this.uses.get(address, 0) > 1
    count, pairwise = _uses(this, address)
    return count > 1 and not pairwise


def add(buffer, factor):
    """Hand over one use's factor (in its backward); the tensor is recorded once every use has handed its own."""
    this = layout.current_pass()
    address = buffer.data_ptr()
    if this.interleaved:  # two forwards before one backward: whose uses these are cannot be told
        shared = this.groups.get(address)
        target = shared.target() if shared is not None else buffer
        layout.note_refusal(
            "it is used several times per forward, and a forward began before the backward of the one before it: "
            "their uses cannot be told apart (run each forward's backward before the next forward)",
            [target],
        )
        with torch.no_grad():
            target[..., 1] = math.nan
        return
    key = _key(this, address)
    gathered = this.pending.get(key)
    if gathered is None:
        shared = this.groups.get(address)
        target = shared.target() if shared is not None else buffer
        gathered = this.pending[key] = Gathered(target, _uses(this, address)[0])
    if gathered.add(factor):
        del this.pending[key]
        gathered.finish()


def hand_over(buffer, make_factor):
    """In a use's backward: when the forward used this buffer's tensor more than once, hand make_factor() over
    (`add`) and return True: the caller then records no norms of its own."""
    if not multiple(buffer):
        return False
    add(buffer, make_factor())
    return True


def add_direct(buffer):
    """A use of a tensor used more than once whose layer records its own norms (no factor): noted, so that the
    tensor's other uses are recorded per use as well (the monitor then stops measuring it, saying why)."""
    add(buffer, _Direct())
