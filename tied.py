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
B*S*T*D work and B*T*D memory plus G for a chunk of examples at a time. The output layer runs its backward
first, so it computes P; the embedding's backward then finishes the cross term
and adds it to a third buffer, `<param>_tiecross_upegsqnorm` on the embedding.

`link_tied_parameters(model)` finds such pairs and attaches forward hooks that
insert two identity autograd nodes (one on each layer's output), so any
Embedding/Linear class that records per-example norms works unchanged.
MeasurementTracker.from_model calls it; the tracker then logs the tensor once,
under all its names joined by "+" (e.g. `transformer.wte.weight+lm_head.weight`).
"""

import torch
import torch.nn as nn

from buffered import BUFFER_SUFFIX, accumulate_pe_sqnorm, norm_dtype

GATHER_CHUNK_ELEMENTS = 2**24  # elements of G held at once (64 MB in fp32); examples are processed in chunks
CROSS_BUFFER_INFIX = "_tiecross"  # buffer `<param>_tiecross_upegsqnorm`: ends in BUFFER_SUFFIX, so zeroed with the rest


class _ForwardPass:
    """What one forward of the embedding leaves for the output layer: the ids, and P once it is computed."""

    def __init__(self, ids, padding_idx):
        self.ids = ids
        self.padding_idx = padding_idx  # tokens the embedding gives no gradient: no cross term either
        self.p = None


class _TiedEmbeddingNode(torch.autograd.Function):
    """Identity on the embedding output; backward adds sum_t delta_t . P_t per example to the cross buffer."""

    @staticmethod
    def forward(ctx, out, forward_pass, cross_buffer):
        ctx.forward_pass, ctx.cross_buffer = forward_pass, cross_buffer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        p, ctx.forward_pass.p = ctx.forward_pass.p, None
        if p is not None:  # None: the output layer took no part in this backward, so the cross term is 0
            delta = grad_out.reshape(p.shape).to(p.dtype)
            if ctx.forward_pass.padding_idx is not None:
                delta = delta.masked_fill((ctx.forward_pass.ids == ctx.forward_pass.padding_idx).unsqueeze(-1), 0)
            accumulate_pe_sqnorm(ctx.cross_buffer, (delta * p).sum(dim=(1, 2)))
        return grad_out, None, None


class _TiedHeadNode(torch.autograd.Function):
    """Identity on the output layer's logits; backward computes P = G^T x for the embedding's node."""

    @staticmethod
    def forward(ctx, logits, x, forward_pass):
        ctx.save_for_backward(x)
        ctx.forward_pass = forward_pass
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad_logits):
        (x,) = ctx.saved_tensors
        forward_pass = ctx.forward_pass
        ids = forward_pass.ids  # (N, T)
        N, T = ids.shape
        dtype = norm_dtype(grad_logits)
        dlogits = grad_logits.reshape(N, -1, grad_logits.shape[-1])  # (N, S, V)
        S = dlogits.shape[1]
        x = x.reshape(N, S, -1)
        p = torch.empty(N, T, x.shape[-1], dtype=dtype, device=x.device)
        chunk = max(1, GATHER_CHUNK_ELEMENTS // (S * T))  # bounds G's memory: (chunk, S, T)
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            n = ids[rows].shape[0]
            # G[n, s, t] = dlogits[n, s, ids[n, t]]
            gathered = torch.gather(dlogits[rows], 2, ids[rows].unsqueeze(1).expand(n, S, T)).to(dtype)
            p[rows] = torch.bmm(gathered.transpose(1, 2), x[rows].to(dtype))  # (n, T, D)
        forward_pass.p = p if forward_pass.p is None else forward_pass.p + p  # a head used twice adds up
        return grad_logits, None, None


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
        # float32 like the other buffers (PESqNormBuffersMixin keeps it so under .to(bf16))
        embedding.register_buffer(buffer_name, torch.zeros(2, device=embedding.weight.device), persistent=False)
        self._cross_buffer_name = buffer_name
        self._param_name = param_name
        self.handles = [embedding.register_forward_hook(self._after_embedding),
                        linear.register_forward_hook(self._after_linear)]

    @property
    def terms(self):
        """[(module, buffer name, coefficient)], the tracker's format (gnstracking.find_tracked_parameters)."""
        return [(self.embedding, self._param_name + BUFFER_SUFFIX, 1.0),
                (self.linear, self._param_name + BUFFER_SUFFIX, 1.0),
                (self.embedding, self._cross_buffer_name, 2.0)]

    def _after_embedding(self, module, args, out):
        ids = args[0]
        if not torch.is_grad_enabled():
            return None
        ids = ids.reshape(ids.shape[0], -1) if ids.dim() > 1 else ids.reshape(-1, 1)
        self._current = _ForwardPass(ids, module.padding_idx)
        return _TiedEmbeddingNode.apply(out, self._current, self.embedding._buffers[self._cross_buffer_name])

    def _after_linear(self, module, args, out):
        forward_pass = self._current
        if forward_pass is None or not torch.is_grad_enabled():
            return None
        x = args[0]
        if x.shape[0] != forward_pass.ids.shape[0]:
            raise ValueError(
                f"tied weight {'+'.join(self.names)}: the output layer's input has shape {tuple(x.shape)} but the "
                f"embedding saw ids of shape {tuple(forward_pass.ids.shape)}; both must keep the examples on dim 0 "
                "(do not flatten (B, T, D) to (B*T, D) before the output layer), or untie the weights")
        return _TiedHeadNode.apply(out, x.detach(), forward_pass)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _has_pe_buffer(module, param_name):
    return module._buffers.get(param_name + BUFFER_SUFFIX) is not None


def link_tied_parameters(model):
    """Attach cross-term hooks to every tensor shared by one Embedding and one Linear (idempotent).

    Returns:
        {id(parameter): TiedParameter} for the tensors linked (now or earlier).
        Tensors shared in any other way (two Linears, a plain torch layer on one
        side) are not linked; the tracker reports them as skipped.
    """
    users = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append((module_name, module, param_name))
    linked = {}
    for key, uses in users.items():
        modules = {id(m): (n, m, p) for n, m, p in uses}
        if len(modules) != 2:
            continue  # not shared, or one module registered twice (a shared module: one use)
        if not getattr(uses[0][1], uses[0][2]).requires_grad:
            continue  # frozen: no gradient, so no cross term to pay for (the tracker skips it as frozen)
        (_, a, pa), (_, b, pb) = modules.values()
        embedding, linear = (a, b) if isinstance(a, nn.Embedding) else (b, a)
        p_emb, p_lin = (pa, pb) if embedding is a else (pb, pa)
        if not (isinstance(embedding, nn.Embedding) and isinstance(linear, nn.Linear) and p_emb == p_lin == "weight"):
            continue
        if not (_has_pe_buffer(embedding, "weight") and _has_pe_buffer(linear, "weight")):
            continue
        existing = getattr(embedding, "_pe_tied_parameter", None)
        if existing is None:
            names = [(n + "." if n else "") + p for n, _, p in uses]
            names = [n for n, _ in model.named_parameters(remove_duplicate=False) if n in names]
            existing = TiedParameter(names, "weight", embedding, linear)
            embedding._pe_tied_parameter = existing
        linked[key] = existing
    return linked
