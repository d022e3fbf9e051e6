"""
The DbrxExperts kind: DBRX's expert banks (96% of DBRX-132B's elements). Its `mlp` child holds every expert's
matrices stacked along dim 0: w1, v1 and w2, each (E * F, D), expert e's the rows e*F .. (e+1)*F; DbrxExperts'
forward slices them for the experts its tokens are routed to, and expert e computes, for its tokens x,

    y = (act(x w1_e^T) * (x v1_e^T)) w2_e * routing weight,

i.e. two Linears of weights w1_e, v1_e (F, D) and one of weight w2_e^T (D, F). As for transformers' other experts
banks (experts.py), the slices are disjoint, so example i's squared norm of a bank is the sum over experts of the
Linear kind's per-example norm over the rows of i's tokens routed to e; the bank counts its examples once, in
backward. Parameters this large get a kind rather than the generic replay (replay.py), which would form every
example's gradient of every expert.
"""

import collections
import copy
import math

import torch
import torch.nn as nn

from nanogns.core import layout
from nanogns.core.buffers import (
    PerExampleNormLayer,
    count_examples_in_backward,
    refuse_step,
    register_pe_sqnorm_buffers,
)
from nanogns.core.module_state import state_of
from nanogns.core.registry import LayerKind, adopt
from nanogns.core.rowmaps import ragged
from nanogns.kinds import functional

BANKS = ("w1", "v1", "w2")
TOKENS, TOP_K = 12, 2  # the probe: 12 tokens, each routed to 2 experts


def matches(module):
    """DBRX's experts: an `mlp` child holding w1, v1, w2 of one shape (E * F, D), and the sizes to slice them."""
    mlp = module._modules.get("mlp")
    params = getattr(mlp, "_parameters", {})
    return (
        all(hasattr(module, a) for a in ("num_experts", "ffn_hidden_size", "hidden_size"))
        and all(name in params and params[name].dim() == 2 for name in BANKS)
        and len({params[name].shape for name in BANKS}) == 1
    )


class PerExampleDbrxExperts(PerExampleNormLayer):
    """DbrxExperts whose loop over the experts hit runs each expert's projections through the per-example Linear on
    the rows of the tokens routed to it. Mixed into the module's own class (core/registry.py:adopt)."""

    pe_kind = "Linear"

    def pe_adopt(self, options):
        register_pe_sqnorm_buffers(self.mlp, BANKS)
        state_of(self.mlp).kinds.update({name: "Linear" for name in BANKS})

    def pe_buffer(self, role):
        param = self.mlp._parameters.get(role)
        return self.mlp._buffers.get(role + "_pe_sqnorm") if param is not None and param.requires_grad else None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        buffers = [self.pe_buffer(name) for name in BANKS]
        rows = layout.rows_for(hidden_states.shape) if not layout.replaying() else None  # (a replay: plain)
        if isinstance(rows, str):
            refuse_step(rows, buffers)
            rows = None
        example_of_token = rows.example_ids(hidden_states.shape[0], hidden_states.device) if rows else None
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.unique(top_k_index[top_k_index < self.num_experts]).tolist()
        shape = (-1, self.ffn_hidden_size, self.hidden_size)
        w1, v1, w2 = (getattr(self.mlp, name).view(shape) for name in BANKS)
        for expert in hit:
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            expert_rows = None if rows is None else ragged(example_of_token[token_idx], rows.examples, counted=False)

            def linear(x, weight, name):
                if rows is None:
                    return torch.nn.functional.linear(x, weight)
                return functional.linear(x, weight, None, self.pe_buffer(name), rows=expert_rows)

            x = hidden_states[token_idx]
            h = self.mlp.activation_fn(linear(x, w1[expert], "w1")) * linear(x, v1[expert], "v1")
            y = linear(h, w2[expert].t(), "w2") * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        if rows is not None and torch.is_grad_enabled():  # each example counted once per bank, in backward
            count_examples_in_backward(out, rows.examples, buffers)
        return out.view(batch_size, -1, self.hidden_size)


def verify(module, variant_cls):
    """None when `variant_cls` mixed into the module computes the module's outputs and gradients on a probe (12
    tokens routed to 2 experts each, float64), else why not."""
    gen = torch.Generator().manual_seed(0)
    device = module.mlp.w1.device
    device = torch.device("cpu") if device.type == "meta" else device
    values = {
        f"mlp.{name}": torch.randn(*module.mlp._parameters[name].shape, generator=gen, dtype=torch.float64)
        / math.sqrt(module.hidden_size)
        for name in BANKS
    }
    values = {name: v.to(device) for name, v in values.items()}
    hidden = torch.randn(1, TOKENS, module.hidden_size, generator=gen, dtype=torch.float64).to(device)
    top_k = min(TOP_K, module.num_experts)  # (a bank of one expert routes each token to it)
    index = torch.stack([torch.randperm(module.num_experts, generator=gen)[:top_k] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, top_k, generator=gen, dtype=torch.float64).to(device)
    grad = torch.randn(1, TOKENS, module.hidden_size, generator=gen, dtype=torch.float64).to(device)
    twin = copy.copy(module)
    mlp = copy.copy(module.mlp)
    mlp.__dict__.update(_parameters=dict(module.mlp._parameters), _buffers=dict(module.mlp._buffers))
    twin.__dict__.update(
        _modules={**module._modules, "mlp": mlp}, _forward_hooks={}, _forward_pre_hooks=collections.OrderedDict()
    )
    adopt(twin, variant_cls, {})

    def run(forward):
        leaves = {name: nn.Parameter(v.clone()) for name, v in values.items()}
        x = hidden.clone().requires_grad_(True)
        out = torch.func.functional_call(forward, leaves, (x, index.to(device), weights))
        return [out.detach(), *torch.autograd.grad(out, [*leaves.values(), x], grad)]

    try:
        want = run(module)
    except Exception as e:
        return f"its forward fails on a float64 probe ({type(e).__name__}: {e})"
    got = run(twin)
    for name, a, b in zip(["output", *values, "input gradient"], want, got):
        if a.shape != b.shape or ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() > 1e-9:
            return f"the per-example experts differ from its forward in the {name} on a float64 probe"
    return None


KIND = LayerKind(
    name="DbrxExperts",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Module,  # DBRX's own class
        "shim": PerExampleDbrxExperts,
        "gns": PerExampleDbrxExperts,
        "fused": PerExampleDbrxExperts,
    },
    params=BANKS,
    matches=matches,
    verify=verify,
)
