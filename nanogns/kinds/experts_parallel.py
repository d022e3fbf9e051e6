"""
The ParallelExperts kind: an expert bank called with its rows already grouped by expert, `bank(inputs, expert_size)`
(JetMoE's JetMoeParallelExperts, the ScatterMoE-style banks): one Parameter (E, out, in) holding every expert's
matrix (or (E, in, out)), `inputs` (S, in) the rows routed to expert 0, then those routed to expert 1, ... (`expert_size`
of each), and each row s of expert e computing

    y_s = W_e x_s.

The bank's parent regrouped the rows (the tokens sorted by expert and gathered, `layer_input[batch_index]`), so no dim
of them holds the examples, and their number is no count of the layout's: which example each row serves is read from
how the rows were made, the gather in their autograd history (core/history.py:rows_by_gather): row s is the source's
row index[s], whose example the layout maps (flattened (N, T) tokens, packed sequences). A bank fed from another's
output (JetMoE's output_linear takes act(h1) * h2 of input_linear's rows) finds the same gather behind that bank's
function. Rows whose history shows no gather are refused, whatever their number.

The bank's gradient is a stack of its experts' (disjoint slices), so example i's squared norm is, as for the other
expert banks (kinds/experts.py),

    ||dW_i||^2 = sum_e ||sum over i's rows s of expert e of g_s x_s^T||^2,

each (expert, example) segment's norm by the Gram trick (kinds/grouped.py). The parent need not order an expert's
rows by example (JetMoE's sort is not stable): the segments are formed on the rows' (expert, example) order, the rows
staying where they are. The bank counts its forward's examples once, in backward.

convert() finds such a bank by its structure (one 3-D parameter, no children, a forward of two arguments) and a
float64 probe of the module on random rows and expert sizes (an expert given none among them) showing it computes
the grouped products, in which layout of the bank; then a probe shows the converted module computes what the module
computes (outputs and every gradient).
"""

import inspect
import itertools
import math

import torch
import torch.nn as nn

from nanogns.core import history, layout
from nanogns.core.buffers import PerExampleNormLayer, autocast_inputs, count_examples_in_backward, refuse_step
from nanogns.core.module_state import state_of
from nanogns.core.registry import LayerKind, adopted_twin
from nanogns.core.rowmaps import Rows
from nanogns.kinds import grouped

PROBE_SIZES = (5, 0, 4, 3)  # the probe's rows of each expert, cycled over the bank's (an expert given none)


def _bank(module):
    """(name, parameter) of the module's one parameter, when it is 3-D; else None."""
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    return params[0] if len(params) == 1 and params[0][1].dim() == 3 else None


def _takes_two(module):
    """True when the module's forward takes exactly two arguments (the rows and the experts' sizes)."""
    try:
        takes = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(takes) == 2 and all(p.kind in plain for p in takes)


def _probe_sizes(experts):
    return [PROBE_SIZES[e % len(PROBE_SIZES)] for e in range(experts)]


def grouped_products(x, weight, sizes, transposed=False):
    """The maths a bank computes: each expert's rows of x (S, in), `sizes` of each in expert order, times its
    matrix: x_e W_e^T for a bank (E, out, in), x_e W_e for one stored (E, in, out) (transposed)."""
    parts = x.split(sizes, dim=0)
    return torch.cat([part @ (weight[e] if transposed else weight[e].t()) for e, part in enumerate(parts)])


def bank_layout(module):
    """'out, in' or 'in, out': how the module's forward reads its bank, as a float64 probe of its forward on random
    rows and expert sizes shows (its output equals grouped_products of that layout); None when neither (not a bank of
    this kind)."""
    found = _bank(module)
    if found is None or not _takes_two(module):
        return None
    name, param = found
    E, a, b = param.shape
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(E, a, b, generator=gen, dtype=torch.float64)
    sizes = _probe_sizes(E)
    for transposed, features in ((False, b), (True, a)):
        x = torch.randn(sum(sizes), features, generator=gen, dtype=torch.float64)
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, {name: value}, (x, sizes))
        except Exception:
            continue
        want = grouped_products(x, value, sizes, transposed)
        if isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-9, atol=0):
            return "in, out" if transposed else "out, in"
    return None


def matches(module):
    """A bank of rows grouped by expert: one 3-D parameter, no children, forward(rows, expert sizes), whose
    forward computes each expert's products (bank_layout's probe)."""
    return _bank(module) is not None and not module._modules and bank_layout(module) is not None


def options(module):
    return {"transposed": bank_layout(module) == "in, out"}


class PerExampleParallelExperts(PerExampleNormLayer):
    """A bank of rows grouped by expert whose products are kinds/grouped.py's grouped linear, with each example's
    squared norm of the bank recorded (its rows' examples from the gather that regrouped them). Mixed into the
    module's own class (core/registry.py:adopt)."""

    pe_kind = "Linear"

    def pe_adopt(self, options):
        name, _ = _bank(self)
        self.pe_bank, self.pe_transposed = name, bool(options.get("transposed", False))
        self.register_pe_buffers(name)
        state_of(self).kinds.update({name: "Linear"})

    def forward(self, inputs, expert_size):
        weight = self._parameters[self.pe_bank]
        sizes = expert_size.tolist() if isinstance(expert_size, torch.Tensor) else [int(n) for n in expert_size]
        if inputs.dim() != 2 or len(sizes) != weight.shape[0] or sum(sizes) != inputs.shape[0]:
            return super().forward(inputs, expert_size)  # (the module's own answer to such arguments)
        buffer = self.pe_buffer(self.pe_bank)
        rows = None
        if buffer is not None and torch.is_grad_enabled() and not layout.replaying():  # (a replay: plain)
            rows = rows_of_grouped(inputs)
            if isinstance(rows, str):
                refuse_step(rows, [buffer])
                rows = None
        x, weight = autocast_inputs(inputs, weight)  # (as F.linear under autocast)
        with torch.autocast(x.device.type, enabled=False):
            out = grouped_linear(x, weight.transpose(1, 2) if self.pe_transposed else weight, sizes, rows, buffer)
        if rows is not None:  # each example counted once per bank, in backward
            count_examples_in_backward(out, rows.examples, [buffer])
        return out


def rows_of_grouped(inputs):
    """Rows of a bank's input rows grouped by expert: those of the gather that regrouped them (rows_by_gather); each
    row its own example outside an installed model (a bare bank, as core/layout.py's rows_for); else why not."""
    if layout.current() is None:
        return Rows("dim0", inputs.shape[0])
    found = history.rows_by_gather(inputs)
    if found is not None:
        return found
    seen = (
        "they have no autograd history (made from inputs that need no gradient), so no gather"
        if inputs.grad_fn is None
        else "their autograd history shows no gather"
    )
    return (
        f"its input's {inputs.shape[0]} rows are grouped by expert, and {seen} of the examples' rows by an index "
        "(rows[index], rows.index_select(0, index)) that made them can be seen: which example each row serves cannot "
        "be told"
    )


def grouped_linear(x, weight, sizes, rows, buffer):
    """Each expert's rows of x (S, in), `sizes` of each, through its matrix of weight (E, out, in), by
    grouped.GroupedLinearFunction; with `rows` (ragged, each row's example), the bank's per-example squared norms
    recorded in `buffer` in backward (uncounted)."""
    device, experts = x.device, weight.shape[0]
    ends = list(itertools.accumulate(sizes))
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=device), torch.tensor(sizes, device=device))
    segments = None
    if rows is not None:
        with torch.no_grad():
            example_of_row = rows.example_ids(x.shape[0], device)
            keys, order = torch.sort(expert_of_row * rows.examples + example_of_row, stable=True)
            segments = grouped.Segments(keys, order)
    buffer = buffer if segments is not None else None
    return grouped.GroupedLinearFunction.apply(x, weight, None, offsets, ends, expert_of_row, segments, buffer, None)


def verify(module, variant_cls):
    """None when `variant_cls` mixed into the module computes the module's output and gradients on a float64 probe
    (random rows and expert sizes, an expert given none), else why not."""
    name, param = _bank(module)
    E = param.shape[0]
    transposed = bank_layout(module) == "in, out"
    gen = torch.Generator().manual_seed(1)
    value = torch.randn(*param.shape, generator=gen, dtype=torch.float64) / math.sqrt(param.shape[2])
    sizes = _probe_sizes(E)
    features = param.shape[1 if transposed else 2]
    x0 = torch.randn(sum(sizes), features, generator=gen, dtype=torch.float64)
    twin = adopted_twin(module, variant_cls, {"transposed": transposed})
    found = []
    for target in (module, twin):
        leaf = nn.Parameter(value.clone())
        x = x0.clone().requires_grad_(True)
        try:
            out = torch.func.functional_call(target, {name: leaf}, (x, sizes))
        except Exception as e:
            return f"its forward fails on a float64 probe ({type(e).__name__}: {e})"
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        found.append([out.detach(), *torch.autograd.grad(out, [leaf, x], grad)])
    for what, a, b in zip(("output", f"{name} gradient", "input gradient"), *found):
        if a.shape != b.shape or ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() > 1e-9:
            return f"the per-example bank differs from its forward in the {what} on a float64 probe"
    return None


KIND = LayerKind(
    name="ParallelExperts",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Module,  # such banks are the model's own classes: nothing to name here
        "shim": PerExampleParallelExperts,
        "gns": PerExampleParallelExperts,
        "fused": PerExampleParallelExperts,
    },
    params=("weight",),
    options=options,
    matches=matches,
    verify=verify,
)
