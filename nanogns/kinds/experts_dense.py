"""
The DenseExperts kind: expert banks that every token goes through, weighted by its routing scores (Llama 4's
Llama4TextExperts): gate_up_proj (E, D, 2I) and down_proj (E, I, D), stored (in, out), and a forward of batched
matmuls over the experts,

    x (E, R, D) = the R tokens repeated for each expert, scaled by their routing scores (0 where not routed)
    y_e = (up_e * act(gate_e)) @ down_proj[e],   [gate_e, up_e] = x_e @ gate_up_proj[e]

so each expert's rows are all R tokens of the forward (E x N x T rows in all). A bank's gradient is a stack of
the experts' gradients, disjoint slices, and example i's squared norm is

    ||dW_i||^2 = sum_e ||x_{e,i}^T g_{e,i}||^2

over example i's rows of each expert (layout.py maps the R token rows to examples: flattened (N, T), packed
sequences): the Linear kind's per-example norm (core/matmul.py) of E x N (expert, example) blocks, summed over the
experts. A probe in float64 checks the converted module computes what the module computes.
"""

import inspect
import math

import torch
import torch.nn as nn

from nanogns.core import layout
from nanogns.core.buffers import PerExampleNormLayer, accumulate_pe_sqnorm, autocast_inputs, refuse_step
from nanogns.core.matmul import linear_pe_sqnorm
from nanogns.core.module_state import state_of
from nanogns.core.registry import LayerKind, adopted_twin

BANKS = ("gate_up_proj", "down_proj")


def matches(module):
    """An experts module whose forward takes the tokens alone (repeated per expert): 3-D banks gate_up_proj
    (E, D, 2I) and down_proj (E, I, D), and an act_fn."""
    params = module._parameters
    if set(params) != set(BANKS) or not all(params[name] is not None and params[name].dim() == 3 for name in BANKS):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    try:
        takes = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return (
        hasattr(module, "act_fn")
        and not hasattr(module, "has_gate")
        and len(takes) == 1
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[2] == 2 * down.shape[1]
        and gate_up.shape[1] == down.shape[2]
    )


def bank_rows(rows, t):
    """t (E, R, K), each expert's R token rows, as (E * N, P, K): each (expert, example)'s rows (zero-padded)."""
    E, R, K = t.shape
    if rows.kind in ("dim0", "flat"):
        return t.reshape(E * rows.examples, -1, K)
    return torch.cat([rows.per_example(t[e]) for e in range(E)])


class BankMatmul(torch.autograd.Function):
    """bank_matmul(x (E, R, K), weight (E, K, L), buffer, rows) = torch.bmm(x, weight), whose backward also records
    the per-example squared norms of the weight's gradient (its experts' summed)."""

    @staticmethod
    def forward(ctx, x, weight, buffer, rows):
        ctx.save_for_backward(x, weight)
        ctx.buffer, ctx.rows = buffer, rows
        return torch.bmm(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.bmm(x.transpose(1, 2), grad.to(x.dtype))
            if ctx.buffer is not None:
                E, N = x.shape[0], ctx.rows.examples
                pe_sqnorms = linear_pe_sqnorm(bank_rows(ctx.rows, x), bank_rows(ctx.rows, grad.to(x.dtype)))
                accumulate_pe_sqnorm(ctx.buffer, pe_sqnorms.view(E, N).sum(0))
        return grad_x, grad_weight, None, None


def bank_matmul(x, weight, buffer, rows):
    x, weight = autocast_inputs(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        if buffer is None or rows is None:
            return torch.bmm(x, weight)
        return BankMatmul.apply(x, weight, buffer, rows)


class PerExampleDenseExperts(PerExampleNormLayer):
    """Llama 4's experts whose batched matmuls record per-example norms (mixed into the module's own class)."""

    pe_kind = "Linear"

    def pe_adopt(self, options):
        self.register_pe_buffers(*BANKS)
        state_of(self).kinds.update({name: "Linear" for name in BANKS})

    def forward(self, hidden_states):
        E, D = self.gate_up_proj.shape[0], hidden_states.shape[-1]
        x = hidden_states.view(E, -1, D)
        buffers = [self.pe_buffer(name) for name in BANKS]
        rows = None
        if torch.is_grad_enabled() and not layout.replaying() and any(b is not None for b in buffers):
            rows, buffers = self.pe_rows_and_buffers(x[0], *BANKS)  # each expert's rows: the forward's tokens
            if rows is not None and rows.kind == "seqfirst":
                refuse_step("its token rows are sequence-first", buffers)
                rows, buffers = None, (None, None)
        gate_up = bank_matmul(x, self.gate_up_proj, buffers[0], rows)
        gate, up = gate_up.chunk(2, dim=-1)
        out = bank_matmul(up * self.act_fn(gate), self.down_proj, buffers[1], rows)
        return out.view(-1, D)


def verify(module, variant_cls):
    """None when `variant_cls` mixed into the module computes the module's outputs and gradients on a probe (3
    examples x 4 tokens, float64), else why not."""
    gen = torch.Generator().manual_seed(0)
    params = dict(module.named_parameters(recurse=False))
    device = params["down_proj"].device
    device = torch.device("cpu") if device.type == "meta" else device
    E, D = params["gate_up_proj"].shape[:2]
    values = {
        name: (torch.randn(*p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[1])).to(device)
        for name, p in params.items()
    }
    hidden = torch.randn(E * 12, D, generator=gen, dtype=torch.float64).to(device)
    grad = torch.randn(E * 12, D, generator=gen, dtype=torch.float64).to(device)
    twin = adopted_twin(module, variant_cls, {})
    found = []
    for target in (module, twin):
        leaves = {name: nn.Parameter(v.clone()) for name, v in values.items()}
        x = hidden.clone().requires_grad_(True)
        try:
            out = torch.func.functional_call(target, leaves, (x,))
        except Exception as e:
            return f"its forward fails on a float64 probe ({type(e).__name__}: {e})"
        grads = torch.autograd.grad(out, [*leaves.values(), x], grad)
        found.append([out.detach(), *grads])
    for name, a, b in zip(["output", *params, "input gradient"], *found):
        if a.shape != b.shape or ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() > 1e-9:
            return f"the per-example experts differ from its forward in the {name} on a float64 probe"
    return None


KIND = LayerKind(
    name="DenseExperts",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Module,  # Llama 4's experts class is the model's own: nothing to name here
        "shim": PerExampleDenseExperts,
        "gns": PerExampleDenseExperts,
        "fused": PerExampleDenseExperts,
    },
    params=BANKS,
    matches=matches,
    verify=verify,
)
