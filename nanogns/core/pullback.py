"""
The backward side of tables shared by the examples (core/shared.py): each example's gradient of a table, received in
its copy (ExampleCopies) or its slice (SlicedTable), pulled back through the table's computation to the parameters
it was computed from, batched over the examples (torch.autograd.grad with is_grads_batched), and recorded.

Where the forward's graph of the table cannot run backward a second time (a table computed inside a region under
activation checkpointing, whose saved tensors are freed after the one backward allowed), the table is computed
again from its Recipe (how it was computed: the op, its parameters, constants and the other tables' or followed
tensors' recipes) and the pull-back runs through that. An op drawing at random (a dropout of the table, the mask a
custom dropout draws) draws again from the random state it drew from, so the table computed again is the one the
forward computed, as torch's checkpoint restores the random state for its recompute.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import get_device_states, set_device_states

from nanogns.core import trees, uses
from nanogns.core.buffers import add_pe_sqnorm

# ops drawing at random (conversion/replay.py serves their draws to a module's replay); DROPOUTS draw inside
DRAWING = {
    torch.rand,
    torch.rand_like,
    torch.randn,
    torch.randn_like,
    torch.randint,
    torch.randint_like,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.randperm,
    torch.Tensor.bernoulli,
    torch.Tensor.bernoulli_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.random_,
    torch.Tensor.multinomial,
}
DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}


class Recipe:
    """How a table (or a tensor followed from a parameter) was computed: func(*args, **kwargs), output `index` of
    its flattened outputs; its arguments the parameters themselves, constants, and other tables' or followed
    tensors' Recipes. A table's per-example gradients are pulled back through the graph the forward built; where
    that graph cannot be run backward a second time (selective activation checkpointing), through the table
    computed again from its recipe (`recomputed`)."""

    __slots__ = ("func", "args", "kwargs", "index", "random_state")

    def __init__(self, func, args, kwargs=None, index=None, random_state=None):
        self.func, self.args, self.kwargs, self.index = func, args, kwargs or {}, index
        self.random_state = random_state  # (random_state_at: func draws at random), drawn from again


def random_state_at(tensors):
    """The random state an op on `tensors` draws from: the CPU generator's, and that of each accelerator they are
    on (as torch.utils.checkpoint keeps it for its recompute)."""
    on_devices = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")]
    device_type = on_devices[0].device.type if on_devices else None
    devices, states = get_device_states(*on_devices) if on_devices else ([], [])
    return torch.get_rng_state(), device_type, devices, states


@contextlib.contextmanager
def _drawing_from(random_state):
    """Draw from random_state in the block (None: as now), the random state outside it left as it was."""
    if random_state is None:
        yield
        return
    cpu, device_type, devices, states = random_state
    with torch.random.fork_rng(devices=devices, device_type=device_type or "cuda"):
        torch.set_rng_state(cpu)
        if devices:
            set_device_states(devices, states, device_type=device_type)
        yield


def recomputed(value):
    """value (a Recipe, or anything else, returned as it is) computed again, plain, with a graph to the parameters."""
    if not isinstance(value, Recipe):
        return value.as_subclass(torch.Tensor) if getattr(type(value), "pe_shared", False) else value
    args, kwargs = trees.map_leaves(recomputed, (value.args, value.kwargs))
    with torch._C.DisableTorchFunctionSubclass(), _drawing_from(value.random_state):
        out = value.func(*args, **kwargs)
    return out if value.index is None else trees.leaves(out)[value.index]


class ExampleCopies(torch.autograd.Function):
    """copies(table (plain), shape (count, ...), items, (sources, recipe)) -> the table's copies, one per item; backward
    records each example's gradient of the sources (its items' copies' gradients summed, pulled back through the
    table's computation, batched over the examples) and returns the table's gradient, the copies' sum."""

    @staticmethod
    def forward(ctx, plain, shape, items, sources):
        ctx.save_for_backward(plain)
        (ctx.sources, ctx.recipe), ctx.table_shape, ctx.items = sources, plain.shape, items
        return plain.reshape(1, *shape[1:]).expand(shape).clone()  # a copy: an output may not be a view of an input

    @staticmethod
    def backward(ctx, grad):
        (plain,) = ctx.saved_tensors
        per_item = grad.reshape(grad.shape[0], *ctx.table_shape)
        record(plain, ctx.sources, ctx.items.to_examples(per_item), ctx.recipe)
        return per_item.sum(0), None, None, None


class SlicedTable(torch.autograd.Function):
    """sliced(table (plain), items, (sources, recipe)) -> the table (a copy), whose dim 0 holds one slice per item; backward
    records each example's gradient of the sources: its items' slices of the table's gradient (the rest zero),
    pulled back through the table's computation."""

    @staticmethod
    def forward(ctx, plain, items, sources):
        ctx.save_for_backward(plain)
        (ctx.sources, ctx.recipe), ctx.items = sources, items
        return plain.clone()

    @staticmethod
    def backward(ctx, grad):
        (plain,) = ctx.saved_tensors
        count = grad.shape[0]
        per_item = grad.new_zeros(count, *grad.shape)
        index = torch.arange(count, device=grad.device)
        per_item[index, index] = grad
        record(plain, ctx.sources, ctx.items.to_examples(per_item), ctx.recipe)
        return grad, None, None


def record(plain, sources, per_example, recipe=None):
    """Record each example's gradient of the sources, per_example (N, *table shape) pulled back through the
    table's computation."""
    recorded = [(p, b) for p, b in sources if b is not None and p.requires_grad]
    if not recorded:
        return
    N = per_example.shape[0]
    grads = _pulled_back(plain, [p for p, _ in recorded], per_example, recipe)
    for (param, buffer), g in zip(recorded, grads):
        g = torch.zeros(N, *param.shape, dtype=per_example.dtype, device=per_example.device) if g is None else g
        if not uses.hand_over(buffer, lambda g=g: uses.DenseFactor(g)):
            dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
            add_pe_sqnorm(buffer, g.reshape(N, -1).pow(2).sum(1, dtype=dtype))  # (a 0-d tensor's too)


def _pulled_back(table_tensor, params, per_example, recipe=None):
    """Each example's gradients of `params` (N, *shape each) for its gradient of the table, through the table's
    computation: batched over the examples, or one by one where a backward formula cannot be batched."""
    try:
        return torch.autograd.grad(
            table_tensor, params, per_example, is_grads_batched=True, retain_graph=True, allow_unused=True
        )
    except RuntimeError:
        if recipe is not None:  # (a graph that cannot run backward twice: selective activation checkpointing)
            with torch.enable_grad():
                table_tensor = recomputed(recipe)
            try:
                return torch.autograd.grad(table_tensor, params, per_example, is_grads_batched=True, allow_unused=True)
            except RuntimeError:
                pass
        found = [
            torch.autograd.grad(table_tensor, params, g, retain_graph=True, allow_unused=True) for g in per_example
        ]
        return [None if found[0][j] is None else torch.stack([f[j] for f in found]) for j in range(len(params))]
