"""
The Experts kind: the expert banks of transformers' mixture-of-experts models
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...), one Parameter per projection holding
every expert's matrix: gate_up_proj (E, 2I, D) (or up_proj), down_proj (E, D, I),
and their biases where the model has them.

Each token is routed to k experts; expert e computes, for the tokens routed to it,

    y = down_e(act(gate_e x) * up_e x) * routing weight,

and the token's output is the sum over its experts. The bank's gradient is a
stack of the experts' gradients, disjoint slices, so example i's squared norm is

    ||dW_i||^2 = sum_e ||dW_{e,i}||^2,   dW_{e,i} = sum over i's tokens routed to e of g x^T,

each term the Linear kind's per-example norm (kinds/linear.py) over the rows of
expert e, mapped to their examples: the experts' input is the (tokens, D)
hidden states, whose rows layout.py maps to examples (flattened (B, T), or
packed sequences), and expert e's rows are the tokens routed to it. An example
none of whose tokens reach expert e adds nothing for it; a token routed to no
expert (transformers' sentinel index E) adds nothing anywhere. The forward counts
its examples once per bank (not once per expert).

transformers builds these classes with `use_experts_implementation`, which
selects an implementation by config (eager loop, batched or grouped matmuls);
the converted module computes the grouped implementation's maths whatever the
setting, one grouped GEMM per projection with each (expert, example) segment's
norms by the Gram trick (kinds/grouped.py), after a probe in float64 shows it
computes what the module computes (outputs and every gradient).
"""

import math

import torch
import torch.nn as nn

from nanogns.core import layout
from nanogns.core.buffers import PerExampleNormLayer, count_examples_in_backward, refuse_step
from nanogns.core.module_state import state_of
from nanogns.core.registry import LayerKind, adopted_twin
from nanogns.kinds import grouped

PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
TOKENS, TOP_K = 12, 2  # the probe: 3 examples of 4 tokens, each routed to 2 experts


def matches(module):
    """A transformers experts module: `use_experts_implementation` attributes and 3-D projection banks."""
    params = module._parameters
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "is_transposed")
        and "down_proj" in params
        and ("gate_up_proj" in params or "up_proj" in params)
        and all(params[name].dim() == 3 for name in PROJECTIONS if name in params)
    )


class PerExampleExperts(PerExampleNormLayer):
    """An experts module whose forward is the grouped one (kinds/grouped.py: rows sorted by expert and example, one
    grouped GEMM per projection, each segment's norms by the Gram trick). It is mixed into the module's own class
    (core/registry.py:adopt), whose attributes (act_fn, _apply_gate, has_gate, ...) it reads."""

    pe_kind = "Linear"

    def pe_adopt(self, options):
        names = [name for name, _ in self.named_parameters(recurse=False)]
        self.register_pe_buffers(*names)
        state_of(self).kinds.update({name: "Linear" for name in names})

    def forward(self, hidden_states, top_k_index, top_k_weights):
        names = [name for name, _ in self.named_parameters(recurse=False)]
        buffers = [self.pe_buffer(name) for name in names]
        rows = layout.rows_for(hidden_states.shape) if not layout.replaying() else None  # (a replay: plain)
        if isinstance(rows, str):
            refuse_step(rows, buffers)
            rows = None
        example_of_token = rows.example_ids(hidden_states.shape[0], hidden_states.device) if rows else None
        out = grouped.routed_experts(
            self, hidden_states, top_k_index, top_k_weights, example_of_token, rows.examples if rows else 0
        )
        if rows is not None and torch.is_grad_enabled():  # each example counted once per bank, in backward (a
            count_examples_in_backward(out, rows.examples, buffers)  # recompute's graph gets none: no use)
        return out


def convertible(module):
    if getattr(module, "has_post_expert_norm", False):
        return "an experts module with a norm after each expert (its rows are an expert's tokens, no layer's input)"
    if getattr(module, "_is_expert_parallel", False):
        return "experts sharded across ranks (expert parallelism) are not converted"
    return None


def verify(module, variant_cls):
    """None when `variant_cls` mixed into the module computes the module's outputs and gradients on a probe (random
    hidden states of 3 examples x 4 tokens routed to 2 experts each, float64), else why not."""
    reason = convertible(module)
    if reason is not None:
        return reason
    found = None
    for dtype, tolerance in PROBE_DTYPES:  # float64 decides; grouped matmuls refuse it, then float32 does
        found = _probe(module, variant_cls, dtype, tolerance)
        if found is None or not found.startswith("its forward fails"):
            return found
    return found


PROBE_DTYPES = ((torch.float64, 1e-9), (torch.float32, 1e-4))  # (dtype, max relative difference)


def _probe(module, variant_cls, dtype, tolerance):
    """verify's probe in one dtype."""

    gen = torch.Generator().manual_seed(0)
    params = dict(module.named_parameters(recurse=False))
    device = next(iter(params.values())).device
    device = torch.device("cpu") if device.type == "meta" else device
    num_experts = params["down_proj"].shape[0]
    D = (
        module.hidden_dim
        if hasattr(module, "hidden_dim")
        else params["down_proj"].shape[1 if not module.is_transposed else 2]
    )
    values = {
        name: (torch.randn(*p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1])).to(device, dtype)
        for name, p in params.items()
    }
    hidden = torch.randn(TOKENS, D, generator=gen, dtype=torch.float64).to(device, dtype)
    top_k = min(TOP_K, num_experts)  # (a bank of one expert routes each token to it)
    top_k_index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(TOKENS)]).to(device)
    top_k_weights = torch.rand(TOKENS, top_k, generator=gen, dtype=torch.float64).to(device, dtype)
    grad = torch.randn(TOKENS, D, generator=gen, dtype=torch.float64).to(device, dtype)

    def run(forward, param_values):
        leaves = {name: torch.nn.Parameter(v.clone()) for name, v in param_values.items()}
        x = hidden.clone().requires_grad_(True)
        out = forward(leaves, x)
        grads = torch.autograd.grad(out, [*leaves.values(), x], grad, allow_unused=True)
        return [out.detach()] + [torch.zeros_like(v) if g is None else g for v, g in zip([*leaves.values(), x], grads)]

    where = f"{str(dtype).replace('torch.', '')} probe"
    try:
        want = run(lambda p, x: torch.func.functional_call(module, p, (x, top_k_index, top_k_weights)), values)
    except Exception as e:
        return f"its forward fails on a {where} ({type(e).__name__}: {e})"
    twin = adopted_twin(module, variant_cls, {})
    try:
        got = run(lambda p, x: torch.func.functional_call(twin, p, (x, top_k_index, top_k_weights)), values)
    except Exception as e:
        return f"the per-example experts fail on a {where} ({type(e).__name__}: {e})"
    names = ["output"] + [f"{name} gradient" for name in params] + ["input gradient"]
    for name, a, b in zip(names, want, got):
        scale = a.abs().max().clamp_min(1e-30)
        if a.shape != b.shape or a.dtype != b.dtype or ((a - b).abs().max() / scale).item() > tolerance:
            return f"the per-example experts differ from its forward in the {name} on a {where}"
    return None


KIND = LayerKind(
    name="Experts",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Module,  # transformers' experts classes are the model's own: nothing to name here
        "shim": PerExampleExperts,
        "gns": PerExampleExperts,
        "fused": PerExampleExperts,
    },
    params=PROJECTIONS + tuple(name + "_bias" for name in PROJECTIONS),
    convertible=convertible,
    matches=matches,
    verify=verify,
)
