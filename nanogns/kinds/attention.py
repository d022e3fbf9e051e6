"""
The MultiheadAttention kind: torch's nn.MultiheadAttention (and so nn.TransformerEncoderLayer,
nn.TransformerDecoderLayer and nn.Transformer), whose forward uses its projections
through F.multi_head_attention_forward rather than through Linear modules: the
in-projection (in_proj_weight (3E, E) and in_proj_bias, or q/k/v_proj_weight) and
out_proj's weight and bias, all Linear maps (kinds/linear.py) of rows whose
examples are on the batch dim (dim 0 with batch_first, else dim 1).

The converted module projects query, key and value with the per-example Linear on
batch-first tensors (for self-attention, one projection by the packed weight; for
cross-attention, one per slice of it, disjoint slices whose squared norms add, the
forward's examples counted once), runs the attention exactly as torch does, and
projects out with the per-example Linear. For need_weights=False (what torch's
Transformer layers call) the attention is F.scaled_dot_product_attention with the
masks merged as torch merges them; otherwise torch's own
F.multi_head_attention_forward runs on the projected q, k, v with identity
projections (the same numbers, at the cost of those identity matmuls). A probe
compares the converted module with torch's for both calls, in float64.
add_bias_kv (bias_k, bias_v, concatenated once per batch) is not converted.
"""

import copy
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import layout
from nanogns.core.buffers import PerExampleNormLayer, count_examples_in_backward, refuse_step
from nanogns.core.module_state import state_of
from nanogns.core.registry import LayerKind, adopt
from nanogns.errors import CallNotValid
from nanogns.kinds import functional

PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")


class PerExampleMultiheadAttention(PerExampleNormLayer):
    """nn.MultiheadAttention whose projections record per-example norms (mixed into the module's own class)."""

    pe_kind = "Linear"

    def pe_adopt(self, options):
        names = [name for name, _ in self.named_parameters(recurse=False)]
        self.register_pe_buffers(*names)
        state_of(self).kinds.update({name: "Linear" for name in names})
        for name in ("weight", "bias"):  # out_proj's buffers live on out_proj, where the monitor looks
            param = getattr(self.out_proj, name, None)
            if param is not None:
                self.out_proj.register_buffer(
                    name + "_pe_sqnorm", torch.zeros(2, device=param.device), persistent=False
                )
                state_of(self.out_proj).kinds[name] = "Linear"

    def pe_buffer_of(self, module, name):
        param = getattr(module, name, None)
        return module._buffers.get(name + "_pe_sqnorm") if param is not None and param.requires_grad else None

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        batched = query.dim() == 3
        if not batched or not torch.is_grad_enabled() or layout.replaying():  # no examples, no gradients, a replay
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        if not self.batch_first:  # (L, B, E) -> (B, L, E): the examples on dim 0, as every layer reads them
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        rows, count_buffers = self.pe_count(query, key)
        q, k, v = self.pe_in_projection(query, key, value, rows)
        if need_weights or self.add_zero_attn:
            out, weights = self.pe_torch_attention(
                q, k, v, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        else:
            out, weights = self.pe_sdpa(q, k, v, key_padding_mask, attn_mask, is_causal), None
        out = functional.linear(
            out,
            self.out_proj.weight,
            self.out_proj.bias,
            self.pe_buffer_of(self.out_proj, "weight"),
            self.pe_buffer_of(self.out_proj, "bias"),
            rows=rows[0],
        )
        if rows[0] is not None:
            count_examples_in_backward(out, rows[0].examples, count_buffers)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def pe_count(self, query, key):
        """((Rows of the query, of the key/value) with counted=False, the parameters' buffers): the examples are
        counted once per parameter when the output's gradient arrives (count_examples_in_backward; the projections
        add their norms' sums); Nones for rows that cannot be mapped (step refused)."""
        buffers = [self.pe_buffer_of(self, name) for name, _ in self.named_parameters(recurse=False)]
        buffers += [self.pe_buffer_of(self.out_proj, name) for name in ("weight", "bias")]
        found = [layout.rows_for(t.shape, batch_first=True) for t in (query, key)]  # (transposed to batch first)
        reasons = [r for r in found if isinstance(r, str)] + [
            f"its {what}, batch first, has rows {tuple(t.shape[:-1])}: one row for the forward's {r.examples} examples "
            "(dim 0 of the model's input), which no example's own gradient can be told apart in"
            for r, t, what in zip(found, (query, key), ("query", "key"))
            if not isinstance(r, str) and r.kind == "shared"
        ]
        if reasons:
            refuse_step(reasons[0], buffers)
            return (None, None), buffers
        return tuple(dataclasses.replace(r, counted=False) for r in found), buffers

    def pe_in_projection(self, query, key, value, rows):
        """q, k, v (B, L or S, E) by the per-example Linear: one packed projection for self-attention, else one per
        weight or slice of the packed weight (disjoint slices of one parameter: their squared norms add)."""
        E = self.embed_dim
        bias, bias_buffer = self.in_proj_bias, self.pe_buffer_of(self, "in_proj_bias")
        if self._qkv_same_embed_dim and query is key and key is value:
            proj = functional.linear(
                query, self.in_proj_weight, bias, self.pe_buffer_of(self, "in_proj_weight"), bias_buffer, rows=rows[0]
            )
            return proj.chunk(3, dim=-1)
        outputs = []
        for i, (x, name) in enumerate(zip((query, key, value), ("q_proj_weight", "k_proj_weight", "v_proj_weight"))):
            part = slice(i * E, (i + 1) * E)
            if self._qkv_same_embed_dim:
                weight, buffer = self.in_proj_weight[part], self.pe_buffer_of(self, "in_proj_weight")
            else:
                weight, buffer = getattr(self, name), self.pe_buffer_of(self, name)
            b = bias[part] if bias is not None else None
            outputs.append(functional.linear(x, weight, b, buffer, bias_buffer, rows=rows[min(i, 1)]))
        return outputs

    def pe_sdpa(self, q, k, v, key_padding_mask, attn_mask, is_causal):
        """torch's need_weights=False attention (F.multi_head_attention_forward's steps): the masks made float and
        merged, then F.scaled_dot_product_attention over (B, heads, L, head_dim)."""
        B, L, E = q.shape
        S, H = k.shape[1], self.num_heads
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=q.dtype,
        )
        if is_causal and attn_mask is None:
            raise CallNotValid("Need attn_mask if specifying the is_causal hint (as torch's MultiheadAttention)")
        if is_causal and key_padding_mask is None:
            attn_mask = None  # the hint alone tells SDPA
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=q.dtype,
                check_other=False,
            )
            if key_padding_mask is not None:
                is_causal = False
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)  # (1, L, S)
        if key_padding_mask is not None:
            padding = key_padding_mask.view(B, 1, 1, S).expand(-1, H, -1, -1).reshape(B * H, 1, S)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(B, H, -1, S)
        head = E // H
        q, k, v = (t.reshape(B, t.shape[1], H, head).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, self.dropout if self.training else 0.0, is_causal)
        return out.transpose(1, 2).reshape(B, L, E)

    def pe_torch_attention(self, q, k, v, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
        """torch's own attention on projected q, k, v (sequence first), with identity projections."""
        E = self.embed_dim
        eye = torch.eye(E, dtype=q.dtype, device=q.device)
        out, weights = F.multi_head_attention_forward(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            E,
            self.num_heads,
            None,
            None,
            None,
            None,
            self.add_zero_attn,
            self.dropout,
            eye,
            None,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        return out.transpose(0, 1), weights


def convertible(module):
    if module.bias_k is not None or module.bias_v is not None:
        return "nn.MultiheadAttention with add_bias_kv (bias_k, bias_v are concatenated once for the whole batch)"
    return None


def verify(module, variant_cls):
    """None when the converted module gives torch's outputs and gradients on float64 probes: self-attention with
    need_weights (the default), as torch's Transformer layers call it (key padding and causal masks,
    need_weights=False), and cross-attention; else what differs."""
    reason = convertible(module)
    if reason is not None:
        return reason
    gen = torch.Generator().manual_seed(0)
    E, B, L, S = module.embed_dim, 3, 5, 4
    twin = copy.deepcopy(module).double()
    twin.train(False)  # dropout off, for the comparison only
    params = {
        name: nn.Parameter(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1]))
        for name, p in twin.named_parameters()
    }
    x = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
    memory = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    first = (lambda t: t) if module.batch_first else (lambda t: t.transpose(0, 1))
    calls = {
        "self-attention": lambda m, x: m(first(x), first(x), first(x)),
        "masked self-attention": lambda m, x: m(
            first(x), first(x), first(x), key_padding_mask=padding, attn_mask=causal, need_weights=False, is_causal=True
        ),
        "cross-attention": lambda m, x: m(first(x), first(memory), first(memory), need_weights=False),
    }
    converted = copy.deepcopy(twin)
    adopt(converted, variant_cls, {})
    for what, call in calls.items():
        results = []
        for m in (twin, converted):
            inputs = x.clone().requires_grad_(True)
            with torch.nn.utils.stateless._reparametrize_module(m, params):
                out = call(m, inputs)[0]
                grads = torch.autograd.grad(out, [*params.values(), inputs], torch.ones_like(out), allow_unused=True)
            results.append([out.detach()] + [g if g is not None else torch.zeros(1) for g in grads])
        for a, b in zip(*results):
            if a.shape != b.shape or (a - b).abs().max() > 1e-9 * max(a.abs().max().item(), 1e-30):
                return f"the per-example attention differs from torch's in {what} on a float64 probe"
    return None


KIND = LayerKind(
    name="MultiheadAttention",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.MultiheadAttention,
        "shim": PerExampleMultiheadAttention,
        "gns": PerExampleMultiheadAttention,
        "fused": PerExampleMultiheadAttention,
    },
    replaces=(nn.MultiheadAttention,),
    params=PROJECTIONS,
    convertible=convertible,
    verify=verify,
)
