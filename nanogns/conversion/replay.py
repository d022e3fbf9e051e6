"""
The generic exact path: a module that owns parameters and matches no kind (GroupNorm, a weight-normed
convolution, a Mamba mixer reading its children's weights directly, a per-head norm, RWKV's time mixing...) keeps
its own forward, and in backward its forward is replayed one example at a time to get each example's gradient of
every parameter under it.

For a module y = f(x; theta) whose input rows x_i are example i's (dim 0 of every per-example input is the
forward's N examples; other inputs are shared by all) and whose output gradient is g:

    the batch gradient       sum_i J_theta f(x_i)^T g_i     (autograd, as without the monitor)
    example i's gradient     J_theta f(x_i)^T g_i           (torch.func.vjp of f at x_i alone, vmapped over i)

so each example's gradient is exact whenever f computes example i's output from x_i alone. That is checked at
every replay: the replayed outputs f(x_i) must equal the batch's rows y_i (within REPLAY_TOLERANCE of the output's
scale); a module whose output for one example depends on the others (batch statistics, a softmax over the batch)
or on random draws (dropout in training) fails it, and the step is refused with that reason, never a number.
Where vmap cannot run the forward (data-dependent control flow, in-place writes into unbatched tensors), the
examples are replayed one by one with autograd. Examples are taken a chunk at a time, so that at most
GATHER_CHUNK_ELEMENTS elements of per-example gradients are held at once (uses.py's budget).

What it costs, per call and step: the module's inputs are held from its forward until its backward (under
activation checkpointing too), and its forward and backward run once more, batched over the examples by vmap,
forming every example's gradient of every parameter under it (chunk x parameters elements). Large parameters
that a kind describes should get the kind (a Linear, an experts bank): the module's children are not converted,
its whole subtree is replayed.

The module's children stay as they are (plain torch layers): it is one unit, whose every parameter gets a
`<name>_pe_sqnorm` buffer on the module that owns it.
"""

import inspect
import re

import torch
from torch.utils import _pytree as pytree

from nanogns.core import layout, uses
from nanogns.core.buffers import (
    PerExampleNormLayer,
    add_pe_sqnorm,
    on_output_grad,
    refuse_step,
    register_pe_sqnorm_buffers,
)
from nanogns.core.registry import own_class_name

REPLAY_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
KIND = "Replayed"  # the layer kind recorded for its parameters (analysis group "Other")


class ReplayedForward(PerExampleNormLayer):
    """The class a module whose forward is replayed per example gets (layers.registry.adopt puts it first)."""

    pe_kind = KIND

    def pe_adopt(self, options):
        # its whole subtree is one unit when its code reads a child's parameters itself (Mamba's mixer passes
        # conv1d.weight to a kernel); else only its own parameters are replayed, its children converted as usual
        self.__dict__["_pe_subtree"] = reads_children_parameters(self)
        for module in self.modules() if self._pe_subtree else [self]:
            names = [name for name, _ in module.named_parameters(recurse=False)]
            register_pe_sqnorm_buffers(module, names)
            module.__dict__.setdefault("_pe_kinds", {}).update({name: KIND for name in names})
        self.__dict__["_pe_vmap"] = True  # False once vmap failed on this module's forward: one by one

    def pe_parameters(self):
        """[(name under this module, parameter, its buffer or None when frozen)]: its subtree's, or its own."""
        found = []
        for name, param in self.named_parameters(recurse=self.__dict__.get("_pe_subtree", True)):
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            buffer = module._buffers.get(attr + "_pe_sqnorm") if param.requires_grad else None
            found.append((name, param, buffer))
        return found

    def forward(self, *args, **kwargs):
        if layout.replaying():  # this module, or a parent, replayed per example: its plain forward
            return super().forward(*args, **kwargs)
        params = self.pe_parameters()
        buffers = [b for _, _, b in params if b is not None]
        if not buffers:
            return super().forward(*args, **kwargs)
        current = layout.current()
        examples = current.examples if current is not None else _first_dim(args, kwargs)
        lengths = current.lengths if current is not None else frozenset()
        reason = None
        if current is not None and current.packed is not None:
            reason = "its rows are packed sequences, which a replay per example cannot slice"
        elif examples is None or not _per_example_inputs(args, kwargs, examples, lengths):
            reason = f"none of its inputs has the forward's {examples} examples on dim 0"
        if reason is not None:
            refuse_step(f"its forward is replayed per example, but {reason}", buffers)
            return super().forward(*args, **kwargs)
        layout.note_uses(buffers)
        out = super().forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        flat, spec = pytree.tree_flatten(out)
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return out
        held = _Held(self, examples, lengths, args, kwargs, flat, positions)
        if len(positions) == 1 and not flat[positions[0]]._is_view():  # its gradient, read at the node making it
            on_output_grad(flat[positions[0]], lambda grad: held.replay([grad]))
            return out
        # several outputs: one may be computed from another (attention weights and the attention's output), so each
        # one's own gradient is read where it leaves the module, at a copy (an in-place op on it stays allowed)
        copies = _Boundary.apply(held, *[flat[i] for i in positions])
        for i, copy in zip(positions, copies):
            flat[i] = copy
        return pytree.tree_unflatten(flat, spec)


class _Boundary(torch.autograd.Function):
    """Copies of a replayed module's outputs, whose backward hands their gradients (from outside the module only)
    to the replay."""

    @staticmethod
    def forward(ctx, held, *outputs):
        ctx.held = held
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.held.replay(grads)
        return (None, *grads)


_QUERIES = "dtype|device|shape|size|ndim|dim|requires_grad|is_cuda|numel"  # a child's parameter only asked about


def reads_children_parameters(module):
    """True when the code of the module's class reads a parameter of one of its children itself
    (`self.conv1d.weight`), rather than calling the child; True when the code cannot be read."""
    own = next(c for c in type(module).__mro__ if not c.__module__.startswith("nanogns"))  # before adopt
    try:
        source = inspect.getsource(own)
    except (OSError, TypeError):
        return True
    for child_name, child in module.named_children():
        for path, _ in child.named_parameters():
            if re.search(rf"self\.{re.escape(child_name)}\.{re.escape(path)}\b(?!\.({_QUERIES}))", source):
                return True
        if re.search(rf"self\.{re.escape(child_name)}\.parameters\(", source):
            return True
    return False


def _first_dim(args, kwargs):
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return tensors[0].shape[0] if tensors else None


def _rows(t, examples, lengths):
    """How a tensor's dim 0 holds the forward's examples: 1 (dim 0 is the example), T (flattened (N*T, ...) rows,
    example i's are rows i*T .. (i+1)*T), or None (shared by every example)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    if t.shape[0] == examples:
        return 1
    if examples and t.shape[0] % examples == 0 and (t.shape[0] // examples in lengths or layout.in_windows()):
        return t.shape[0] // examples  # (inside a layer splitting its examples into windows: k windows each)
    return None


def _per_example_inputs(args, kwargs, examples, lengths):
    return any(
        _rows(t, examples, lengths) is not None and t.is_floating_point() for t in pytree.tree_leaves((args, kwargs))
    )


def _by_example(t, rows):
    """t viewed with the examples on dim 0: (N, ...) as it is, flattened rows (N*T, ...) as (N, T, ...)."""
    return t if rows in (None, 1) else t.view(-1, rows, *t.shape[1:])


def _one_example(t, rows):
    """One example's slice of _by_example (no example dim) as the module takes it: (1, ...) or its T rows."""
    return t.unsqueeze(0) if rows == 1 else t


def _held_input(value):
    """An input as the replay passes it: a tensor detached; a cache (transformers' key/value or state caches,
    which a forward appends to) as None, as a training forward's empty cache (the output check catches the rest)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if "Cache" in type(value).__name__:
        return None
    return value


class _Held:
    """What one forward of a replayed module leaves for its backward: its inputs and outputs, detached, each
    tensor's rows (_rows), the parameters under it."""

    def __init__(self, module, examples, lengths, args, kwargs, flat, positions):
        self.module, self.examples, self.params = module, examples, module.pe_parameters()
        inputs = pytree.tree_map(_held_input, (args, kwargs))
        self.in_rows = pytree.tree_map(lambda t: _rows(t, examples, lengths), inputs)
        self.inputs = pytree.tree_map(_by_example, inputs, self.in_rows)
        self.positions = positions
        self.out_rows = [_rows(flat[i], examples, lengths) for i in positions]
        self.out = [
            _by_example(flat[i].detach(), r) if r else flat[i].detach() for i, r in zip(positions, self.out_rows)
        ]

    def replay(self, grads):
        """The backward hook: every output's gradient is known; record each example's parameter gradients."""
        trained = [(name, buffer) for name, _, buffer in self.params if buffer is not None]
        buffers = [buffer for _, buffer in trained]
        N = self.examples
        if any(r is None for r in self.out_rows):
            refuse_step_in_backward(
                f"its forward is replayed per example, but an output with a gradient does not hold the forward's {N} "
                "examples on dim 0",
                buffers,
            )
            return
        grads = [
            _by_example(g, r) if g is not None else torch.zeros_like(o)
            for g, r, o in zip(grads, self.out_rows, self.out)
        ]
        values = {name: p.detach() for name, p, _ in self.params}
        names = [name for name, _ in trained]
        chunk = max(1, min(N, uses.GATHER_CHUNK_ELEMENTS // max(1, sum(values[n].numel() for n in names))))
        pieces = {name: [] for name in names}
        try:
            for start in range(0, N, chunk):
                part = slice(start, min(N, start + chunk))
                outs, found = self.per_example(values, names, part, [g[part] for g in grads])
                self.check(outs, part)
                for name in names:
                    pieces[name].append(found[name])
        except _Mixing as e:
            refuse_step_in_backward(str(e), buffers)
            return
        except Exception as e:  # never a number, nor a crash in the model's backward
            refuse_step_in_backward(f"its forward replayed per example fails ({type(e).__name__}: {e})", buffers)
            return
        for name, buffer in trained:
            per_example = torch.cat(pieces[name])  # (N, *shape)
            if not uses.hand_over(buffer, lambda g=per_example: uses.DenseFactor(g)):
                dtype = torch.float64 if per_example.dtype == torch.float64 else torch.float32
                add_pe_sqnorm(buffer, per_example.flatten(1).pow(2).sum(1, dtype=dtype))

    def check(self, outs, part):
        """The replayed outputs must be the batch's rows: else the module mixes examples (the step is refused)."""
        for replayed, batch in zip(outs, self.out):
            batch = batch[part]
            scale = batch.abs().max().double().clamp_min(1e-300)
            diff = ((replayed.double() - batch.double()).abs().max() / scale).item()
            if not diff <= REPLAY_TOLERANCE.get(batch.dtype, 3e-2):
                raise _Mixing(
                    f"{own_class_name(self.module)}'s output for one example alone differs from that example's rows "
                    f"in the batch by {diff:.1e} (relative): it mixes the examples of a batch (batch statistics) "
                    "or draws at random (dropout), so no example's own gradient can be told apart"
                )

    def call(self, values, inputs_i):
        """The module's outputs with gradients for one example's inputs (each as _one_example gives it)."""
        args_i, kwargs_i = pytree.tree_map(lambda t, r: _one_example(t, r) if r else t, inputs_i, self.in_rows)
        flat = pytree.tree_leaves(torch.func.functional_call(self.module, values, tuple(args_i), kwargs_i))
        return [flat[i].squeeze(0) if r == 1 else flat[i] for i, r in zip(self.positions, self.out_rows)]

    def per_example(self, values, names, part, grads):
        """(replayed outputs (n, ...), {name: (n, *shape) per-example gradients}) of examples `part`."""
        in_dims = pytree.tree_map(lambda r: 0 if r else None, self.in_rows)
        inputs = pytree.tree_map(lambda t, r: t[part] if r else t, self.inputs, self.in_rows)
        frozen = {name: v for name, v in values.items() if name not in names}

        def one(inputs_i, grads_i):
            outs, vjp = torch.func.vjp(
                lambda trained: self.call({**frozen, **trained}, inputs_i), {n: values[n] for n in names}
            )
            (found,) = vjp([g.to(o.dtype) for o, g in zip(outs, grads_i)])
            return outs, found

        module = self.module
        with layout.replay():  # layers under it compute plainly, recording nothing
            if module.__dict__.get("_pe_vmap", True):
                try:
                    return torch.func.vmap(one, in_dims=(in_dims, 0))(inputs, grads)
                except Exception:  # vmap cannot run this forward: replay the examples one by one
                    module.__dict__["_pe_vmap"] = False
            return self.one_by_one(inputs, grads, values, names)

    def one_by_one(self, inputs, grads, values, names):
        outs, found = [[] for _ in self.positions], {name: [] for name in names}
        for i in range(grads[0].shape[0]):
            inputs_i = pytree.tree_map(lambda t, r: t[i] if r else t, inputs, self.in_rows)
            leaves = {name: v.clone().requires_grad_(name in names) for name, v in values.items()}
            with torch.enable_grad():
                chosen = self.call(leaves, inputs_i)
                differentiable = [(o, g[i]) for o, g in zip(chosen, grads) if o.requires_grad]
                got = torch.autograd.grad(
                    [o for o, _ in differentiable],
                    [leaves[name] for name in names],
                    [g.to(o.dtype) for o, g in differentiable],
                    allow_unused=True,
                )
            for j, o in enumerate(chosen):
                outs[j].append(o.detach())
            for name, g in zip(names, got):
                found[name].append(torch.zeros_like(values[name]) if g is None else g)
        return [torch.stack(o) for o in outs], {name: torch.stack(g) for name, g in found.items()}


class _Mixing(Exception):
    pass


def refuse_step_in_backward(reason, buffers):
    """Refuse the step from a backward hook (where gradients are off): counts NaN, the reason kept."""
    with torch.no_grad():
        for buffer in buffers:
            buffer[..., 1] = float("nan")
    layout.note_refusal(reason, buffers)
