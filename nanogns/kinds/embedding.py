"""
The Embedding kind: torch's nn.Embedding (with or without a padding row).

For y_t = E[id_t] over the rows t of example i, with g_t = dL/dy_t:

    dE_i[v] = sum_{t: id_t = v} g_t,     ||dE_i||^2 = sum_v ||dE_i[v]||^2

Rows of one example that look up the same token add up before squaring. With a
vocabulary no larger than an example's rows (V <= T: characters, positions), each
example's dE_i is formed whole, an (N*V, D) table filled by one index_add. Else
each (example, token) pair is gathered: the rows sorted by pair, a segment per
distinct pair (cumsum of where the sorted keys change), one index_add into (N*T, D)
(segments past the last distinct pair stay zero): memory O(N*T*D), no one-hot over
the vocabulary, no loop over examples, and every shape known before the data
(torch.unique's output size is not, which breaks a torch.compile graph). As in torch, the padding
row (padding_idx) gets no gradient, so padding tokens add nothing to any
example's norm. max_norm (which renormalises rows in place in forward),
scale_grad_by_freq and sparse gradients are not converted.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import shared, uses
from nanogns.core.buffers import PerExampleNormLayer, add_pe_sqnorm, norm_dtype, on_output_grad
from nanogns.core.ids import untagged
from nanogns.core.registry import LayerKind, Probe
from nanogns.core.rowmaps import Rows
from nanogns.core.tied import note_embedding
from nanogns.errors import NotSupported


def embedding_pe_sqnorm(ids, g, num_embeddings, padding_idx=None):
    """Per-example squared norms of an Embedding's weight gradient.

    Args:
        ids: token ids per example (N, T).
        g: output gradient per example (N, T, D).
        num_embeddings: vocabulary size V.
        padding_idx: the row that gets no gradient (nn.Embedding's padding_idx), or None.
    Returns:
        weight_pe_sqnorms (N,), float32 (float64 for float64 grads).
    """
    dtype = norm_dtype(g)
    N, T = ids.shape
    g = g.to(dtype)
    if padding_idx is not None:
        g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
    D = g.shape[-1]
    example = torch.arange(N, device=ids.device).unsqueeze(1).expand_as(ids)
    pair = (example * num_embeddings + ids).reshape(-1)  # one key per (example, token)
    if num_embeddings <= T:  # each example's whole gradient (N, V, D) is no larger than its rows
        table = torch.zeros(N * num_embeddings, D, dtype=dtype, device=g.device)
        table.index_add_(0, pair, g.reshape(-1, D))
        return torch.linalg.vector_norm(table.view(N, -1), dim=1).pow(2)
    sorted_pairs, order = torch.sort(pair)
    changes = torch.ones_like(sorted_pairs, dtype=torch.bool)
    changes[1:] = sorted_pairs[1:] != sorted_pairs[:-1]
    segment_of_sorted = torch.cumsum(changes, 0) - 1  # (R,) the distinct pair of each sorted row
    segment = torch.empty_like(segment_of_sorted).scatter_(0, order, segment_of_sorted)  # of each row
    summed = torch.zeros(pair.numel(), D, dtype=dtype, device=g.device)
    summed.index_add_(0, segment, g.reshape(-1, D))  # (R, D): one row per distinct pair, zero rows after
    example_of_segment = torch.zeros_like(segment).scatter_(0, segment_of_sorted, sorted_pairs // num_embeddings)
    weight_pe_sqnorms = torch.zeros(N, dtype=dtype, device=g.device)
    weight_pe_sqnorms.index_add_(0, example_of_segment, summed.pow(2).sum(dim=1))
    return weight_pe_sqnorms


def ids_per_example(rows, ids):
    """Token ids (N, P) of each example, as rows.per_example arranges output rows (padding ids are 0)."""
    return rows.per_example(ids.unsqueeze(-1)).squeeze(-1)


def record_embedding_norms(ids, rows, num_embeddings, padding_idx, weight_buffer):
    """A hook for the output gradient that adds the weight's per-example squared norms to the buffer."""

    def record(g):
        factor = lambda: uses.EmbeddingFactor(ids, g, rows, num_embeddings, padding_idx)  # noqa: E731
        if not uses.hand_over(weight_buffer, factor):
            weight_pe_sqnorms = embedding_pe_sqnorm(
                ids_per_example(rows, ids), rows.per_example(g), num_embeddings, padding_idx
            )
            add_pe_sqnorm(weight_buffer, weight_pe_sqnorms)

    return record


def embedding(ids, weight, padding_idx, weight_buffer, rows):
    """F.embedding recording per-example norms (EmbeddingFunction); torch's own where there is nothing to record."""
    if weight_buffer is None:
        return F.embedding(ids, weight, padding_idx)
    return EmbeddingFunction.apply(ids, weight, (padding_idx, weight_buffer, rows))


class EmbeddingFunction(torch.autograd.Function):
    """EmbeddingFunction.apply(ids, weight, (padding_idx, weight_buffer, rows)): F.embedding whose backward scatters
    the weight gradient and records its per-example norms (the buffer may be None: then no norms). What is not a
    tensor autograd differentiates comes as one argument: autograd.Function.apply looks at each argument in Python."""

    @staticmethod
    def forward(ctx, ids, weight, recording):
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        ctx.padding_idx, ctx.weight_buffer, ctx.rows = recording
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:  # a frozen embedding: no gradient, no norms
            return None, None, None
        (ids,) = ctx.saved_tensors
        num_embeddings, dim = ctx.weight_shape
        grad_weight = torch.zeros(ctx.weight_shape, dtype=grad_out.dtype, device=grad_out.device)
        grad_weight.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, dim))
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            grad_weight[ctx.padding_idx] = 0
        rows = ctx.rows
        factor = lambda: uses.EmbeddingFactor(ids, grad_out, rows, num_embeddings, ctx.padding_idx)  # noqa: E731
        if ctx.weight_buffer is not None and not uses.hand_over(ctx.weight_buffer, factor):
            weight_pe_sqnorms = embedding_pe_sqnorm(
                ids_per_example(rows, ids), rows.per_example(grad_out), num_embeddings, ctx.padding_idx
            )
            add_pe_sqnorm(ctx.weight_buffer, weight_pe_sqnorms)
        return None, grad_weight, None


_PLAIN_EMBEDDING_DEFAULTS = dict(max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)


def _check_plain_embedding(kwargs):
    unsupported = [
        k
        for k, v in kwargs.items()
        if k in _PLAIN_EMBEDDING_DEFAULTS
        and v != _PLAIN_EMBEDDING_DEFAULTS[k]
        or k not in _PLAIN_EMBEDDING_DEFAULTS
        and k not in ("padding_idx", "device", "dtype", "_weight", "_freeze")
    ]
    if unsupported:
        raise NotSupported(
            f"per-example norm Embedding does not support {sorted(unsupported)}; "
            f"use embeddingclass='nn' for such an embedding"
        )


class _EmbeddingBase(PerExampleNormLayer, nn.Embedding):
    pe_kind = "Embedding"
    pe_shared_rows = False  # True: its parent feeds it a table shared by the examples (in_parent)

    def __init__(self, num_embeddings, embedding_dim, **kwargs):
        _check_plain_embedding(kwargs)
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.register_pe_buffers("weight")

    def pe_rows_and_buffers(self, ids, *param_names):
        if self.pe_shared_rows:  # its parent feeds it a table shared by the examples (T5's buckets)
            return Rows("shared", 0), tuple(None for _ in param_names)
        return super().pe_rows_and_buffers(ids.unsqueeze(-1), *param_names, lookup=True)  # rows: the ids themselves

    def pe_lookup(self, ids):
        """(ids untagged, Rows, weight buffer, the table when the lookup is one the examples share (else None))."""
        rows, (weight_buffer,) = self.pe_rows_and_buffers(ids, "weight")
        ids = untagged(ids)
        return ids, rows, weight_buffer, self.pe_shared_lookup(ids, rows)

    def pe_shared_lookup(self, ids, rows):
        """A table shared by the examples (core/shared.py) when the ids are one for all examples, else None."""
        if rows is None or rows.kind != "shared":
            return None
        weight, padding_idx, buffer = self.weight, self.padding_idx, self.pe_buffer("weight")
        per_example = lambda ids, rows: embedding(ids, weight, padding_idx, buffer, rows)  # noqa: E731
        return shared.lookup(ids, weight, padding_idx, buffer, per_example)


class ShimEmbedding(_EmbeddingBase):
    """nn.Embedding whose backward also records per-example norms of the weight gradient."""

    def forward(self, ids):
        ids, rows, weight_buffer, table = self.pe_lookup(ids)
        if table is not None:
            return table
        out = F.embedding(ids, self.weight, self.padding_idx)
        out = note_embedding(weight_buffer, ids, rows, out)  # first: torch.compile breaks the graph at the hook
        if weight_buffer is not None:
            on_output_grad(out, record_embedding_norms(ids, rows, self.num_embeddings, self.padding_idx, weight_buffer))
        return out


class PerExampleEmbedding(_EmbeddingBase):
    """nn.Embedding whose backward scatters the weight gradient and records per-example norms."""

    def forward(self, ids):
        ids, rows, weight_buffer, table = self.pe_lookup(ids)
        if table is not None:
            return table
        out = embedding(ids, self.weight, self.padding_idx, weight_buffer, rows)
        return note_embedding(weight_buffer, ids, rows, out)


# -----------------------------------------------------------------------------
# the registration


def convertible(module):
    plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return None if plain else "nn.Embedding with max_norm, scale_grad_by_freq or sparse"


# attribute names under which transformers' models keep an Embedding fed a table shared by the whole batch
SHARED_TABLES = {
    "relative_attention_bias": "its input is a (query, key) table of relative-position buckets that the attention "
    "shares across the batch (T5 and its kin)",
}


def in_parent(parent, name, module):
    """None: converted; an Embedding its parent feeds a table shared by the batch is marked so, and looks up a
    table shared by the examples (core/shared.py)."""
    if name in SHARED_TABLES and getattr(parent, "has_relative_attention_bias", True):
        module.pe_shared_rows = True  # (read once the module is this kind's layer)
    return None


def fits(weight, bias):
    return weight.dim() == 2 and bias is None


def probe_data(module, generator, weight, bias=None):
    ids = torch.randint(0, weight.shape[0], (3, 4), generator=generator)
    if isinstance(getattr(module, "padding_idx", None), int):
        ids[0, 0] = module.padding_idx  # a padding row gets no gradient in nn.Embedding: the probe sees that
    return {"weight": torch.randn(*weight.shape, generator=generator, dtype=torch.float64)}, ids


KIND = LayerKind(
    name="Embedding",
    config_key="embeddingclass",
    group="Embedding",
    variants={
        "nn": nn.Embedding,
        "shim": ShimEmbedding,
        "gns": PerExampleEmbedding,
        "fused": PerExampleEmbedding,
    },  # no kernel: embedding grads are a scatter-add already
    replaces=(nn.Embedding,),
    params=("weight",),
    convertible=convertible,
    in_parent=in_parent,
    options=lambda module: dict(padding_idx=module.padding_idx),
    probe=Probe(fits=fits, data=probe_data),
)
