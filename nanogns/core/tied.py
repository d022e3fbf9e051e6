"""
Exact per-example gradient norms of a tensor shared by an Embedding and a
Linear layer (weight tying: nanoGPT's transformer.wte.weight is lm_head.weight).

Example i's gradient of the shared V x D matrix is the sum of its two uses,
e_i (through the embedding) + h_i (through the output layer), so

    ||e_i + h_i||^2 = ||e_i||^2 + ||h_i||^2 + 2 <e_i, h_i>.

Each layer's own buffer already holds the first two terms. The cross term needs
neither V x D gradient: with ids_t the token at position t, delta_t the
embedding output's gradient and x_s, dlogits_s the output layer's input and
output gradient at position s,

    e_i[v] = sum_{t: ids_t = v} delta_t          h_i[v] = sum_s dlogits_s[v] x_s
    <e_i, h_i> = sum_t delta_t . P_t,   P_t = sum_s dlogits_s[ids_t] x_s,

i.e. gather the (S, T) matrix G[s, t] = dlogits_s[ids_t] and form P = G^T x:
B*S*T*D work and B*T*D memory plus G for a chunk of examples at a time. With a
vocabulary smaller than the sequence (V < T: character models), the head's
per-example gradient itself is cheaper: H_i = dlogits_i^T x_i (V x D), B*S*V*D
work, and P_t = H_i[ids_t] (strategy.forced(cross_term=...) picks either way). The output layer runs its backward
first, so it computes P; the embedding's backward then finishes the cross term
and adds it to a third buffer, `<param>_tiecross_pe_sqnorm` on the embedding.

`link_tied_parameters(model)` finds such pairs and marks the two layers' forwards;
each per-example norm layer reports its raw output (`note_embedding`,
`note_head`: the lookup itself, before a scale such as Gemma's), which passes
through an autograd Function that changes nothing in forward (marked as modified
in place, so it is the same tensor, not a view, and in-place ops on it still
work). The embedding's tap also returns a carrier tensor that the head's tap takes
as an input: the head's backward hands P to the embedding's as the carrier's
gradient, so the cross term is autograd's own dataflow (no state kept between the
two backward calls; torch.compile traces it into the graph).
GNSMonitor calls it (through find_tracked_parameters); the monitor then logs the tensor once,
under all its names joined by "+" (e.g. `transformer.wte.weight+lm_head.weight`).
"""

import torch
import torch.nn as nn

from nanogns.core import strategy, uses
from nanogns.core.buffers import BUFFER_SUFFIX, add_pe_sqnorm, norm_dtype, refuse_step
from nanogns.core.module_state import state_of
from nanogns.errors import NotSupported

GATHER_CHUNK_ELEMENTS = 2**24  # elements of G held at once (64 MB in fp32); examples are processed in chunks
CROSS_BUFFER_INFIX = "_tiecross"  # buffer `<param>_tiecross_pe_sqnorm`: ends in BUFFER_SUFFIX, so zeroed with the rest


class _ForwardPass:
    """What one forward of the embedding leaves for the output layer: its ids per example and the carrier of P."""

    def __init__(self, ids, rows, carrier):
        self.ids = ids  # (N, T) per example (Rows)
        self.rows = rows
        self.carrier = carrier  # (N, T, D): its gradient is P (the head's tap returns it)

    def __deepcopy__(self, memo):
        return None  # a copy of the model (an EMA twin, a reference copy) starts before its first forward: the
        # carrier, an autograd output, cannot be deep-copied, and belongs to the original's graph


class _EmbeddingTap(torch.autograd.Function):
    """_EmbeddingTap.apply(out, ids, rows, padding_idx, cross_buffer) -> (out, carrier): out unchanged (the same
    tensor), and a carrier (N, T, D) whose gradient, P from the output layer's backward, this backward turns
    into the cross term sum_t delta_t . P_t per example (nothing when the output layer took no part: no P)."""

    @staticmethod
    def forward(ctx, out, ids, rows, padding_idx, cross_buffer):
        ctx.mark_dirty(out)  # unchanged, but marked: the same tensor comes back, not a view of it
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, ctx.cross_buffer = rows, padding_idx, cross_buffer
        N, T = ids.shape  # the carrier's values are never read; a real tensor, not a view (compiled graphs
        return out, out.new_empty(N, T, out.shape[-1], dtype=norm_dtype(out))  # return views as their base)

    @staticmethod
    def backward(ctx, grad_out, p):
        # (a tensor used more than twice per forward: uses.py sums its uses, with no cross term here)
        if p is not None and grad_out is not None and not uses.multiple(ctx.cross_buffer):
            (ids,) = ctx.saved_tensors
            delta = ctx.rows.per_example(grad_out).to(p.dtype)
            if ctx.padding_idx is not None:  # tokens the embedding gives no gradient: no cross term either
                delta = delta.masked_fill((ids == ctx.padding_idx).unsqueeze(-1), 0)
            add_pe_sqnorm(ctx.cross_buffer, (delta * p).sum(dim=(1, 2)))
        return grad_out, None, None, None, None


class _HeadTap(torch.autograd.Function):
    """_HeadTap.apply(logits, x, rows, ids, carrier, cross_buffer) -> logits unchanged (the same tensor); its backward passes the
    logits' gradient on and returns P = G^T x per example as the carrier's gradient (a head used twice: autograd
    adds the two)."""

    @staticmethod
    def forward(ctx, logits, x, rows, ids, carrier, cross_buffer):
        ctx.mark_dirty(logits)
        ctx.save_for_backward(x, ids)
        ctx.rows, ctx.cross_buffer = rows, cross_buffer
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        if uses.multiple(ctx.cross_buffer):  # used more than twice: uses.py sums the uses, no P needed
            return grad_logits, None, None, None, None, None
        x, ids = ctx.saved_tensors
        return grad_logits, None, None, None, _head_cross_term(ids, x, ctx.rows, grad_logits), None


def _head_cross_term(ids, x, rows, grad_logits):
    """In the output layer's backward: P (N, T, D), P_t = sum_s dlogits_s[ids_t] x_s per example."""
    N, T = ids.shape
    dtype = norm_dtype(grad_logits)
    dlogits = rows.per_example(grad_logits)  # (N, S, V)
    S, V = dlogits.shape[1:]
    x = rows.per_example(x)  # (N, S, D)
    if (strategy.current().cross_term or ("table" if V < T else "gather")) == "table":
        table = torch.bmm(dlogits.transpose(1, 2).to(dtype), x.to(dtype))  # H_i = dlogits_i^T x_i (N, V, D)
        return torch.gather(table, 1, ids.unsqueeze(-1).expand(N, T, x.shape[-1]))  # P_t = H_i[ids_t]
    p = torch.empty(N, T, x.shape[-1], dtype=dtype, device=x.device)
    # bounds G's memory: (chunk, S, T); one chunk asks torch.compile for one guard, not one graph per length
    chunk = N if N * S * T <= GATHER_CHUNK_ELEMENTS else max(1, GATHER_CHUNK_ELEMENTS // max(1, S * T))
    for start in range(0, N, chunk):
        part = slice(start, start + chunk)
        n = ids[part].shape[0]
        # G[n, s, t] = dlogits[n, s, ids[n, t]]
        gathered = torch.gather(dlogits[part], 2, ids[part].unsqueeze(1).expand(n, S, T)).to(dtype)
        p[part] = torch.bmm(gathered.transpose(1, 2), x[part].to(dtype))  # (n, T, D)
    return p


class TiedParameter:
    """One tensor used by an Embedding and a Linear; hooks that record the cross term.

    Attributes:
        names: the tensor's names in `named_parameters(remove_duplicate=False)` order.
        terms: [(module, buffer name, coefficient)] whose weighted sum is sum_i ||e_i + h_i||^2 / B^2.
    """

    def __init__(self, names, param_name, embedding, linear):
        self.names = names
        self.embedding, self.linear = embedding, linear
        self._current = None
        buffer_name = param_name + CROSS_BUFFER_INFIX + BUFFER_SUFFIX
        # float32 like the other buffers (PerExampleNormLayer keeps it so under .to(bf16))
        embedding.register_buffer(buffer_name, torch.zeros(2, device=embedding.weight.device), persistent=False)
        self._cross_buffer_name = buffer_name
        self._param_name = param_name
        self.handles = [module.register_forward_pre_hook(self._enter) for module in (embedding, linear)] + [
            module.register_forward_hook(self._leave, always_call=True) for module in (embedding, linear)
        ]

    @property
    def terms(self):
        """[(module, buffer name, coefficient)], the monitor's format (gnstracking.find_tracked_parameters)."""
        return [
            (self.embedding, self._param_name + BUFFER_SUFFIX, 1.0),
            (self.linear, self._param_name + BUFFER_SUFFIX, 1.0),
            (self.embedding, self._cross_buffer_name, 2.0),
        ]

    def _enter(self, module, args):
        """While the embedding or the output layer runs, its buffer names this tie (see note_embedding)."""
        buffer = module._buffers.get(self._param_name + BUFFER_SUFFIX)
        if buffer is not None:
            _in_forward[id(buffer)] = self

    def _leave(self, module, args, out):
        buffer = module._buffers.get(self._param_name + BUFFER_SUFFIX)
        if buffer is not None:
            _in_forward.pop(id(buffer), None)

    def embedding_used(self, ids, rows, out):
        """The embedding looked up `ids` into `out` (before anything its module does after, such as a scale)."""
        cross_buffer = self.embedding._buffers[self._cross_buffer_name]
        if rows is None:  # the embedding refuses the step (rows not mapped); so does the cross term
            refuse_step("the tied embedding's rows could not be mapped to examples", [cross_buffer])
            self._current = None
            return out
        ids_per_example = rows.per_example(ids.unsqueeze(-1)).squeeze(-1)
        out, carrier = _EmbeddingTap.apply(out, ids_per_example, rows, self.embedding.padding_idx, cross_buffer)
        self._current = _ForwardPass(ids_per_example, rows, carrier)
        return out

    def head_used(self, x, rows, out):
        """The output layer computed `out` from `x` (before anything its module does after)."""
        forward_pass = self._current
        if forward_pass is None:
            return out
        if rows is None or rows.examples != forward_pass.rows.examples:
            raise NotSupported(
                f"tied weight {'+'.join(self.names)}: the output layer's input has shape {tuple(x.shape)} but the "
                f"embedding saw ids of shape {tuple(forward_pass.ids.shape)} per example; the rows of both must map "
                "to the same examples (keep the examples on dim 0, or flatten (B, T, D) to (B*T, D) in that order), "
                "or untie the weights"
            )
        cross_buffer = self.embedding._buffers[self._cross_buffer_name]
        return _HeadTap.apply(out, x.detach(), rows, forward_pass.ids, forward_pass.carrier, cross_buffer)

    def remove(self):
        for handle in self.handles:
            handle.remove()


_in_forward = {}  # id(a tied layer's weight buffer) -> its TiedParameter, while that layer's forward runs


def note_embedding(weight_buffer, ids, rows, out):
    """Called by every embedding that records norms, with its raw lookup `out`: a tied weight's cross term starts
    here (nothing happens for an untied one, or without gradients). Returns `out` (the same tensor, its autograd
    history now through the tie's tap)."""
    tie = _in_forward.get(id(weight_buffer)) if weight_buffer is not None else None
    if tie is not None and torch.is_grad_enabled() and out.requires_grad:
        return tie.embedding_used(ids, rows, out)
    return out


def note_head(weight_buffer, x, rows, out):
    """Called by every Linear that records norms, with its input and raw output: a tied weight's output layer.
    Returns `out` (the same tensor)."""
    tie = _in_forward.get(id(weight_buffer)) if weight_buffer is not None else None
    if tie is not None and torch.is_grad_enabled() and out.requires_grad:
        return tie.head_used(x, rows, out)
    return out


def _has_pe_buffer(module, param_name):
    return module._buffers.get(param_name + BUFFER_SUFFIX) is not None


def link_tied_parameters(model):
    """Attach cross-term hooks to every tensor shared by one Embedding and one Linear (idempotent).

    Returns:
        {id(parameter): TiedParameter} for the tensors linked (now or earlier).
        Tensors shared in any other way (two Linears, a plain torch layer on one
        side) are not linked; the monitor lists them as untracked.
    """
    users = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append((module_name, module, param_name))
    linked = {}
    for key, using in users.items():
        modules = {id(m): (n, m, p) for n, m, p in using}
        if len(modules) != 2:
            continue  # not shared, or one module registered twice (a shared module: one use)
        if not getattr(using[0][1], using[0][2]).requires_grad:
            continue  # frozen: no gradient, so no cross term to pay for (the monitor skips it as frozen)
        (_, a, pa), (_, b, pb) = modules.values()
        embedding, linear = (a, b) if isinstance(a, nn.Embedding) else (b, a)
        p_emb, p_lin = (pa, pb) if embedding is a else (pb, pa)
        if not (isinstance(embedding, nn.Embedding) and isinstance(linear, nn.Linear) and p_emb == p_lin == "weight"):
            continue
        if not (_has_pe_buffer(embedding, "weight") and _has_pe_buffer(linear, "weight")):
            continue
        if any(state_of(m).kinds.get("weight") == "Replayed" for m in (embedding, linear)):
            continue  # recorded by the replay of a module above it (replay.py), whose forward taps no cross term: the
            # two uses' per-example gradients are summed as any shared tensor's (uses.py)
        existing = state_of(embedding).tied
        if existing is None:
            names = [(n + "." if n else "") + p for n, _, p in using]
            names = [n for n, _ in model.named_parameters(remove_duplicate=False) if n in names]
            existing = TiedParameter(names, "weight", embedding, linear)
            state_of(embedding).tied = existing
        linked[key] = existing
    return linked
