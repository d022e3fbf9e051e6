"""
The generic exact path: a module that owns parameters and matches no kind (a weight-normed
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

import ast
import contextlib
import functools
import inspect
import os
import re
import textwrap
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from nanogns.core import layout, shared, uses
from nanogns.core.buffers import (
    PerExampleNormLayer,
    add_pe_sqnorm,
    on_output_grad,
    refuse_step,
    register_pe_sqnorm_buffers,
)
from nanogns.core.ids import ExampleIds, untagged
from nanogns.core.inputs import FOLDED_ROWS, dim_by_history, example_dim, flattened_by_history
from nanogns.core.module_state import state_of
from nanogns.core.pullback import DRAWING, DROPOUTS
from nanogns.core.registry import own_class_name
from nanogns.core.rowmaps import Items

REPLAY_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
KIND = "Replayed"  # the layer kind recorded for its parameters (analysis group "Other")


class ReplayedForward(PerExampleNormLayer):
    """The class a module whose forward is replayed per example gets (core/registry.py:adopt puts it first)."""

    pe_kind = KIND

    def pe_adopt(self, options):
        # its whole subtree is one unit when its code reads a child's parameters itself (Mamba's mixer passes
        # conv1d.weight to a kernel); else only its own parameters are replayed, its children converted as usual
        state = state_of(self)
        state.replay_subtree = bool(options.get("subtree")) or reads_children_parameters(self)
        for module in self.modules() if state.replay_subtree else [self]:
            names = [name for name, _ in module.named_parameters(recurse=False)]
            register_pe_sqnorm_buffers(module, names)
            state_of(module).kinds.update({name: KIND for name in names})
        state.replay_vmap = True  # False once vmap failed on this module's forward: one by one
        state.replay_changed = tuple(_changed_in_forward(self))

    def pe_parameters(self):
        """[(name under this module, parameter, its buffer or None when frozen)]: its subtree's, or its own."""
        found = []
        for name, param in self.named_parameters(recurse=state_of(self).replay_subtree):
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            buffer = module._buffers.get(attr + "_pe_sqnorm") if param.requires_grad else None
            found.append((name, param, buffer))
        return found

    def forward(self, *args, **kwargs):
        return self.pe_replayed("forward", super().forward, args, kwargs)

    def pe_replayed(self, method, plain, args, kwargs):
        """plain(*args, **kwargs), the module's `method` (its forward, or another method its parent calls), with
        each example's gradient of the parameters under it recorded by a replay in backward."""
        state = state_of(self)
        calls = state.replay_calls
        if layout.replaying() or calls:  # this module (or a parent) replayed per example, or a call inside a call
            return plain(*args, **kwargs)
        params = self.pe_parameters()
        buffers = [b for _, _, b in params if b is not None]
        if not buffers:
            return plain(*args, **kwargs)
        current = layout.current()
        if _given_no_examples(args, kwargs):  # ids the forward did not compute from its examples: a table's
            return self.pe_table(plain, args, kwargs, params)
        units, reason = _units(args, kwargs, current)
        if reason is not None:
            refuse_step(f"its {method} is replayed per example, but {reason}", buffers)
            return plain(*args, **kwargs)
        layout.note_uses(buffers)
        if not torch.is_grad_enabled():
            return plain(*args, **kwargs)
        before = {name: self.get_buffer(name).clone() for name in state.replay_changed}
        state.replay_calls = calls + 1
        try:
            with _RandomDraws(self.training) as draws:  # what it draws at random, served again to its replay
                out = plain(*args, **kwargs)
        finally:
            state.replay_calls = calls
        flat, spec = pytree.tree_flatten(out)
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return out
        lengths = current.lengths if current is not None else ()
        try:
            held = _Held(self, units, lengths, args, kwargs, flat, positions, draws, before, method)
        except _Ambiguous as e:
            refuse_step(f"its {method} is replayed per example, but {e}", buffers)
            return out
        except Exception as e:  # its inputs cannot be held per example (a PackedSequence): no number, and no crash
            refuse_step(
                f"its {method} is replayed per example, but its inputs could not be held one example at a time "
                f"({type(e).__name__}: {e})",
                buffers,
            )
            return out
        if len(positions) == 1 and not flat[positions[0]]._is_view():  # its gradient, read at the node making it
            on_output_grad(flat[positions[0]], lambda grad: held.replay([grad]))
            return out
        # several outputs: one may be computed from another (attention weights and the attention's output), so each
        # one's own gradient is read where it leaves the module, at a copy (an in-place op on it stays allowed)
        copies = _Boundary.apply(held, *[flat[i] for i in positions])
        for i, copy, rows in zip(positions, copies, held.out_rows):
            flat[i] = copy
            if isinstance(rows, _Rows) and rows.per > 1:  # (its history ends here: the fold said on the tensor)
                setattr(copy, FOLDED_ROWS, (units.count, rows.per))
        return pytree.tree_unflatten(flat, spec)

    def pe_table(self, plain, args, kwargs, params):
        """plain(*args, **kwargs) given no example's data (_given_no_examples): its floating-point outputs with a
        gradient are a table the examples share (core/shared.py), computed from the parameters under it, as an
        Embedding kind's lookup of such ids is; where the table meets the examples each gets its copy, or its own
        slice (a table of one row per example), and its gradient is pulled back through the forward's graph, so
        no replay is needed and no example dim is looked for among ids whose sizes say nothing."""
        state = state_of(self)
        state.replay_calls += 1
        try:
            out = plain(*args, **kwargs)
        finally:
            state.replay_calls -= 1
        sources = {id(param): (param, buffer) for _, param, buffer in params}
        given = untagged((args, kwargs))
        flat, spec = pytree.tree_flatten(out)
        single = isinstance(out, torch.Tensor)
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                found = dict(sources)  # (a table its children computed keeps their sources too)
                found.update({id(p): (p, b) for p, b in t.pe_sources} if shared.is_shared(t) else {})
                recipe = shared.Recipe(plain, given[0], given[1], None if single else i)
                flat[i] = shared.table(t.as_subclass(torch.Tensor), found.values(), recipe)
        return pytree.tree_unflatten(flat, spec)


def _given_no_examples(args, kwargs):
    """True when the forward tags its examples' ids (core/ids.py) and every tensor a module is given is integer or
    boolean and without that tag (I-BERT's token types made with torch.zeros, positions from torch.arange): it
    computes from no example's data, as an Embedding looking up such ids looks up a table (layout.looks_up_a_table),
    whatever their sizes."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(
        not (t.is_floating_point() or t.is_complex()) and layout.looks_up_a_table(t) for t in tensors
    )


@functools.lru_cache(maxsize=None)
def replayed_class(methods):
    """ReplayedForward with the module's `methods` (names of methods its parent calls besides its forward: Gemma
    3n's AltUp.predict and .correct) replayed too, each call a use of the parameters under it."""

    def wrapper(name):
        def method(self, *args, **kwargs):
            return self.pe_replayed(name, getattr(super(cls, self), name), args, kwargs)

        method.__name__ = name
        return method

    cls = type("ReplayedMethods", (ReplayedForward,), {name: wrapper(name) for name in methods})
    cls.__module__ = __name__
    return cls


def methods_called_by(parent, name, child):
    """The methods of `child` (registered as `name` under `parent`), other than forward, that the parent's forward
    calls (self.<name>.<method>(...)) and that run parameters of the child which its forward does not: they run
    those parameters outside its forward (Gemma 3n's AltUp.predict and .correct run its coefficient layers)."""
    if parent is None:
        return ()
    own = next((c for c in type(parent).__mro__ if not c.__module__.startswith("nanogns")), type(parent))
    source = _source(own)
    if not source:
        return ()
    cls = next((c for c in type(child).__mro__ if not c.__module__.startswith("nanogns")), type(child))
    trained = {n for n, p in child.named_parameters(recurse=False) if p.requires_grad}
    trained |= {n for n, c in child.named_children() if any(p.requires_grad for p in c.parameters())}
    in_forward = _referenced(cls, "forward")
    found = set()
    for method in set(re.findall(rf"self\.{re.escape(name)}\.(\w+)\(", source)) - {"forward"}:
        function = getattr(cls, method, None)
        if inspect.isfunction(function) and not function.__module__.startswith("torch"):
            if (_referenced(cls, method) & trained) - in_forward:
                found.add(method)
    return tuple(sorted(found))


@functools.lru_cache(maxsize=None)
def _referenced(cls, method):
    """The attributes self.<name> that `method` of `cls` (and the methods it calls) reads."""
    found = forward_methods(cls, start=method) or {}
    return frozenset(n for _, text in found.values() for n in re.findall(r"self\.(\w+)", text))


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
    """True when the code of the module's class computes with a parameter of one of its children itself
    (`self.conv1d.weight.view(...)`, `F.linear(x, self.proj.weight)`), rather than calling the child; True when
    the code cannot be read. What its forward runs is read (its forward and the methods it calls), not its
    constructor nor its initialisation; a frozen parameter, one only asked about (`.dtype`, `isinstance`), whether
    itself or a name it was given (`w = self.pos.weight; w.shape`), or one handed to another child (DeBERTa's relative embeddings given to its LayerNorm: a table, core/shared.py) is
    no computation of its own; nor is code in a branch this module's own settings never take (BLOOM's attention
    reads its output projection's weight only `if self.pretraining_tp > 1 and ...`: see _untaken)."""
    if parametrize.is_parametrized(module):  # its weight is a parametrisation (a child) of its parameters
        return True
    read = children_read(module)
    return read is None or bool(read)


_PLAIN = (bool, int, float, str, type(None))
_COMPARE = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
}
_UNKNOWN = object()


def _untaken(tree, module):
    """`tree` without the branches of its `if` statements (and `x if c else y` expressions) whose condition is
    decided by `module`'s own plain settings (self.<attr> or self.<attr>.<attr> holding a bool, number, str or None,
    compared with constants): False drops the body, True the else part. Undecided conditions keep both."""

    class Pruner(ast.NodeTransformer):
        def visit_If(self, node):
            self.generic_visit(node)
            value = _static_value(node.test, module)
            if value is _UNKNOWN:
                return node
            kept = node.body if value else node.orelse
            return kept or ast.Pass()

        def visit_IfExp(self, node):
            self.generic_visit(node)
            value = _static_value(node.test, module)
            if value is _UNKNOWN:
                return node
            return node.body if value else node.orelse

    return Pruner().visit(tree)


def _static_value(node, module):
    """The value of expression `node` from `module`'s plain settings and constants, or _UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == "self") or len(chain) > 2 or "training" in chain:
            return _UNKNOWN  # (self.training changes after convert: model.train(), model.eval())
        value = module
        for attr in reversed(chain):
            value = getattr(value, attr, _UNKNOWN) if attr not in ("_parameters", "_modules", "_buffers") else _UNKNOWN
            if value is _UNKNOWN:
                return _UNKNOWN
        return value if isinstance(value, _PLAIN) else _UNKNOWN
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        value = _static_value(node.operand, module)
        return _UNKNOWN if value is _UNKNOWN else not value
    if isinstance(node, ast.BoolOp):
        values = [_static_value(v, module) for v in node.values]
        if isinstance(node.op, ast.And):
            if any(v is not _UNKNOWN and not v for v in values):
                return False
            return True if all(v is not _UNKNOWN for v in values) else _UNKNOWN
        if any(v is not _UNKNOWN and v for v in values):
            return True
        return False if all(v is not _UNKNOWN for v in values) else _UNKNOWN
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        left, right = _static_value(node.left, module), _static_value(node.comparators[0], module)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        try:
            return _COMPARE[type(node.ops[0])](left, right)
        except TypeError:
            return _UNKNOWN
    return _UNKNOWN


_ASKING = {"isinstance", "getattr", "hasattr", "type", "id", "len", "callable"}


def children_read(module, methods=()):
    """The names of the children whose parameters the module's code computes with itself (the rules of
    reads_children_parameters, child by child), in its forward and in `methods` (those its parent calls); None when
    the code cannot be read."""
    children = {name: child for name, child in module.named_children() if any(True for _ in child.parameters())}
    if not children:
        return ()
    cls = next(c for c in type(module).__mro__ if not c.__module__.startswith("nanogns"))
    found = {}
    for start in ("forward", *methods):
        reached = forward_methods(cls, True, start)
        if reached is None:
            return None
        found.update(reached)
    read = set()
    for _, text in found.values():
        try:
            tree = _untaken(ast.parse(textwrap.dedent(text)), module)
        except SyntaxError:
            return None
        read |= {name for name, child in children.items() if _computes_with_children(tree, {name: child})}
    return tuple(sorted(read))


def _computes_with_children(tree, children):
    """True when the parsed method reads self.<child>.<parameter> (or a ParameterDict child's entries, or the
    child's .parameters()) in a computation (see reads_children_parameters)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
            continue
        child = children.get(node.attr)
        if child is None:
            continue
        up = parents.get(node)
        while isinstance(up, ast.Attribute) and isinstance(child._modules.get(up.attr), torch.nn.Module):
            # a grandchild's parameter read through the child (Gemma 4's pad row: self.language_model.embed_tokens
            # .weight[pad]) is the child's to measure no more than its own
            child, node, up = child._modules[up.attr], up, parents.get(up)
        if isinstance(child, (torch.nn.ParameterDict, torch.nn.ParameterList)):  # PEFT's adapters: self.ia3_l[name]
            if isinstance(up, ast.Subscript) or (isinstance(up, ast.Attribute) and up.attr in ("values", "items")):
                return True
            continue
        if isinstance(up, ast.Attribute) and up.attr == "parameters" and isinstance(parents.get(up), ast.Call):
            return True
        param = child._parameters.get(up.attr) if isinstance(up, ast.Attribute) else None
        if param is None or not param.requires_grad:  # (a frozen table read for its values: no gradient to follow)
            continue
        use = parents.get(up)  # what is done with self.<child>.<parameter>
        if isinstance(use, ast.Assign) and [type(t) for t in use.targets] == [ast.Name]:
            # given a name (GLM-4V's pos_embed_weight = self.position_embedding.weight): what is done with the name
            if any(_computes_with(n, parents) for n in _loads_of(tree, use.targets[0].id)):
                return True
            continue
        if _computes_with(up, parents):
            return True
    return False


def _loads_of(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]


def _computes_with(value, parents):
    """True when the expression `value` (a child's parameter, or a name it was given) is computed with where it
    stands: operated on, indexed, a method of it called, or handed to a call (other than a question, isinstance,
    or a call of one of the module's children)."""
    use = parents.get(value)
    if isinstance(use, ast.keyword):  # handed to a call by keyword (WavLM: q_proj_weight=self.q_proj.weight)
        if use.value is not value:
            return False
        use, value = parents.get(use), None  # (the call's func is never this argument)
    if isinstance(use, ast.Attribute):
        return use.attr not in _QUERIES.split("|")
    if isinstance(use, ast.Subscript):
        return True
    if isinstance(use, ast.Call) and value is not use.func:
        func = use.func
        asking = isinstance(func, ast.Name) and func.id in _ASKING
        to_child = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
        return not asking and not to_child
    return isinstance(use, (ast.BinOp, ast.UnaryOp))


def forward_methods(cls, skip_torch=False, start="forward"):
    """{name: (function, source)} of the methods of `cls` that its forward (or method `start`) runs: it, and the
    methods it calls as self.<method>(...), followed through them (those of nn.Module itself left out; of any
    torch.nn class too with skip_torch); None when the source of one cannot be read."""
    found, todo = {}, [start]
    while todo:
        name = todo.pop()
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if name in found or owner is None or owner is torch.nn.Module or owner is object:
            continue
        if skip_torch and owner.__module__.startswith("torch.nn"):
            continue
        function = getattr(vars(owner)[name], "__func__", vars(owner)[name])
        if not inspect.isfunction(function):
            continue
        try:
            text = inspect.getsource(function)
        except (OSError, TypeError):
            return None
        found[name] = (function, text)
        todo.extend(re.findall(r"self\.(\w+)\(", text))
    return found


@functools.lru_cache(maxsize=None)
def _source(cls):
    """The source of what the forward of `cls` runs (forward_methods, torch's own left out), or None."""
    found = forward_methods(cls, skip_torch=True)
    return None if found is None else "\n".join(text for _, text in found.values())


def reparametrised(module):
    """True when a weight of `module` is computed from other parameters at each forward: torch.nn.utils.parametrize
    (weight norm, spectral norm, orthogonal, ParametrizedConv1d as in EnCodec) or the old-style weight_norm and
    spectral_norm hooks. Its replay computes the weight again from the original parameters, per example."""
    if parametrize.is_parametrized(module):
        return True
    return any(isinstance(hook, (WeightNorm, SpectralNorm)) for hook in module._forward_pre_hooks.values())


def _changed_in_forward(module):
    """The buffers a parametrisation updates in place in a training forward (spectral norm's power iteration: its
    u and v), by name under `module`: the replay starts from their values before the forward."""
    names = []
    for path, sub in module.named_modules():
        prefix = path + "." if path else ""
        if isinstance(sub, parametrize.ParametrizationList):
            names += [prefix + name for name, _ in sub.named_buffers()]
    return names


@contextlib.contextmanager
def _iterated_already(module):
    """The old spectral_norm hooks run their power iteration before the forward (updating u and v): the replay uses
    the u and v they left, without iterating again (their eval mode)."""
    hooked = [
        sub
        for sub in module.modules()
        if sub.training and any(isinstance(h, SpectralNorm) for h in sub._forward_pre_hooks.values())
    ]
    for sub in hooked:
        sub.training = False
    try:
        yield
    finally:
        for sub in hooked:
            sub.training = True


def _units(args, kwargs, current):
    """(Items, None): what a replay takes one at a time, the items of its per-example inputs (the examples, or
    their choices, channels, a tower's images on dim 0: each example's gradient is its items' sum); or (None, why
    not)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if current is None:  # outside an installed model: dim 0 of its first input is the example
        return (Items(tensors[0].shape[0], tensors[0].shape[0]), None) if tensors else (None, "no input")
    if current.packed is not None:
        return None, "its rows are packed sequences, which a replay per example cannot slice"
    floats = [t for t in tensors if t.is_floating_point()]
    ids = [t for t in tensors if isinstance(t, ExampleIds)]  # (the choices' ids: I-BERT's embedding; ids tagged as
    for t in floats + ids:  # the examples' only, so that a buffer of positions whose size happens to fit is none)
        items = layout.items_of(t.shape[0])
        if items is not None and (items.count != items.examples or items.example_of_item is not None):
            return items, None  # (a tower's images map to their examples whatever their number: 2 images of 1
            # example in a micro-batch of 2 examples are not those examples)
    N = current.examples
    for t in floats or tensors:  # (a module looking up ids takes integer inputs: PEFT's trainable tokens)
        found = example_dim(t, N)
        if isinstance(found, str):
            return None, found
        if found is not None or (N and t.shape[0] % N == 0 and t.shape[0] // N in current.lengths):
            return Items(N, N), None  # (N, ...) on some dim, or (N*T, ...) flattened rows
        if flattened_by_history(t, N):  # (N*k, ...) rows a reshape of (N, ...) made
            return Items(N, N), None
    return None, f"none of its inputs has the forward's {N} examples (or their items) on a dim"


@dataclass(frozen=True)
class _Rows:
    """How a tensor holds the replay's units: on `dim` (per=1), or as flattened rows on dim 0, `per` each."""

    dim: int
    per: int = 1


def _rows(t, units, lengths):
    """_Rows of a tensor with respect to the replay's units, or None (shared by every unit); _Ambiguous when two of
    its dims could hold the examples and its history does not say which (example_dim)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    count = units.count
    if count == units.examples and units.example_of_item is None:  # the examples themselves: on whichever dim holds
        # them (Gemma 3n stacks (K, N, ...))
        found = example_dim(t, count)
        if isinstance(found, str):  # (N*H, T, T) with N == T: rows a view of (N, ...) made say so themselves
            folded = flattened_by_history(t, count)
            if folded is None:
                raise _Ambiguous(found)
            return _Rows(0, folded)
        per = _flattened(t, count, lengths)
        if found and per and dim_by_history(t) == 0:  # (N*T, k) rows whose k == N (a router's top-k weights)
            return _Rows(0, per)
        if found is not None:
            return _Rows(found)
    elif t.shape[0] == count:
        return _Rows(0)
    per = _flattened(t, count, lengths)
    return None if per is None else _Rows(0, per)


def _flattened(t, count, lengths):
    """T where t's dim 0 holds `count` units' T rows each, flattened (N*T, ...) (inside a layer splitting its
    examples into windows: k windows each), else None."""
    if count and t.shape[0] % count == 0 and (t.shape[0] // count in lengths or layout.in_windows()):
        return t.shape[0] // count
    return flattened_by_history(t, count)  # (N*k, ...) rows a reshape of (N, ...) made, whatever k


@dataclass(frozen=True)
class _Undecided:
    """An output's dims `dims` have the examples' size and its history does not say which holds them (`why`): the
    first example's replay decides (_Held.decide_outputs)."""

    dims: tuple
    why: str


def _output_rows(t, units, lengths, args, kwargs, in_rows):
    """_Rows of an output of the replayed module, or None (it does not hold the units), or _Undecided where two of
    its dims have the examples' size: its history alone is a guess past an op it does not know (the projections of
    WavLM's attention after its own transpose to (T, N, D)), so the first example's replay decides, unless a view
    of (N, ...) made the rows."""
    dims = tuple(d for d, n in enumerate(t.shape) if n == units.count) if isinstance(t, torch.Tensor) else ()
    if len(dims) > 1 and units.count == units.examples > 1 and units.example_of_item is None:
        folded = flattened_by_history(t, units.count)
        if folded is not None:
            return _Rows(0, folded)
        return _Undecided(
            dims,
            f"two of its output's dims (shape {tuple(t.shape)}) have the forward's {units.count} examples, and its "
            "output for one example alone does not say which holds them",
        )
    return _rows(t, units, lengths) or _like_inputs(t, args, kwargs, in_rows)


def _like_inputs(out, args, kwargs, in_rows):
    """The flattened rows (N*k, ...) of an input whose dim 0 `out` has (a norm of (N*T*H, d) rows returns as many),
    else None: `check` then holds each example's replayed output to the batch's rows it is given."""
    for t, rows in zip(pytree.tree_leaves((args, kwargs)), pytree.tree_leaves(in_rows, is_leaf=_is_rows)):
        if isinstance(rows, _Rows) and rows.per > 1 and isinstance(out, torch.Tensor) and out.dim() > 0:
            if isinstance(t, torch.Tensor) and t.shape[0] == out.shape[0]:
                return _Rows(0, rows.per)
    return None


def _is_rows(x):
    return x is None or isinstance(x, _Rows)


class _Ambiguous(Exception):
    pass


def _by_example(t, rows):
    """t with its units on dim 0: (N, ...) as it is (its example dim moved first), flattened rows (N*T, ...) as
    (N, T, ...)."""
    if rows is None:
        return t
    if rows.per == 1:
        return t.movedim(rows.dim, 0) if rows.dim else t
    return t.view(-1, rows.per, *t.shape[1:])


def _one_example(t, rows):
    """One unit's slice of _by_example (no unit dim) as the module takes it: its example dim back, of size 1, or
    its T rows."""
    return t.unsqueeze(rows.dim) if rows.per == 1 else t


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
    tensor's rows (_rows) with respect to its units (the items on dim 0 its replay takes one at a time), the
    parameters under it, the autocast state it ran in and the random numbers it drew."""

    def __init__(self, module, units, lengths, args, kwargs, flat, positions, draws, before, method="forward"):
        self.module, self.units, self.params, self.before = module, units, module.pe_parameters(), before
        self.method = method
        self.in_rows = pytree.tree_map(lambda t: _rows(t, units, lengths), (args, kwargs))  # (their history too)
        inputs = pytree.tree_map(_held_input, (args, kwargs))
        self.inputs = pytree.tree_map(_by_example, inputs, self.in_rows)
        self.positions = positions
        self.out_rows = [_output_rows(flat[i], units, lengths, args, kwargs, self.in_rows) for i in positions]
        self.out = [
            _by_example(flat[i].detach(), r) if isinstance(r, _Rows) else flat[i].detach()
            for i, r in zip(positions, self.out_rows)
        ]
        self.draws = draws.drawn
        device = next((t.device.type for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), "cpu")
        enabled = torch.is_autocast_enabled(device)
        self.autocast = (device, torch.get_autocast_dtype(device), enabled)

    def replay(self, grads):
        """The backward hook: every output's gradient is known; record each example's parameter gradients (the sum
        of its units'). Whatever fails here refuses the step naming the failure: never a number, nor a crash in the
        model's backward."""
        trained = [(name, buffer) for name, _, buffer in self.params if buffer is not None]
        buffers = [buffer for _, buffer in trained]
        try:
            found = self.per_example_grads(grads, [name for name, _ in trained])
        except _Refused as e:
            refuse_step_in_backward(str(e), buffers)
            return
        except _Bookkeeping as e:
            refuse_step_in_backward(_bookkeeping_failure(self.module, self.method, e.stage, e.__cause__), buffers)
            return
        except Exception as e:
            refuse_step_in_backward(_failure(self.module, self.method, e), buffers)
            return
        try:
            for (name, buffer), per_example in zip(trained, found):
                if not uses.hand_over(buffer, lambda g=per_example: uses.DenseFactor(g)):
                    dtype = torch.float64 if per_example.dtype == torch.float64 else torch.float32
                    flat = per_example.reshape(per_example.shape[0], -1)  # (a 0-d parameter's too: CLIP's logit_scale)
                    add_pe_sqnorm(buffer, flat.pow(2).sum(1, dtype=dtype))
        except Exception as e:
            refuse_step_in_backward(_bookkeeping_failure(self.module, self.method, "recording", e), buffers)

    def per_example_grads(self, grads, names):
        """[(examples, *shape) each example's gradient of each parameter of `names`], from the outputs' gradients."""
        N = self.units.count
        self.decide_outputs()
        if any(r is None for r in self.out_rows):
            raise _Refused(
                f"its forward is replayed per example, but an output with a gradient does not hold the forward's {N} "
                "examples (or their items) on dim 0"
            )
        grads = [
            _by_example(g, r) if g is not None else torch.zeros_like(o)
            for g, r, o in zip(grads, self.out_rows, self.out)
        ]
        values = {name: p.detach().clone() for name, p, _ in self.params}  # (a forward may write into them)
        chunk = max(1, min(N, uses.GATHER_CHUNK_ELEMENTS // max(1, sum(values[n].numel() for n in names))))
        pieces = {name: [] for name in names}
        device, dtype, enabled = self.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):  # as its forward ran
            for start in range(0, N, chunk):
                part = slice(start, min(N, start + chunk))
                outs, found = self.replayed_grads(values, names, part, [g[part] for g in grads])
                self.check(outs, part)
                for name in names:
                    pieces[name].append(found[name])
        try:
            return [self.units.to_examples(torch.cat(pieces[name])) for name in names]  # each example's units summed
        except Exception as e:
            raise _Bookkeeping("summing each example's units") from e

    def decide_outputs(self):
        """Outputs with two dims of the examples' size whose history does not say which holds them (_Undecided):
        the module run on the first example alone says, its output having size 1 on that dim only."""
        undecided = [k for k, r in enumerate(self.out_rows) if isinstance(r, _Undecided)]
        if not undecided:
            return
        values = {name: p.detach() for name, p, _ in self.params}
        inputs = pytree.tree_map(lambda t, r: t[0] if r else t, self.inputs, self.in_rows)
        device, dtype, enabled = self.autocast
        with torch.no_grad(), layout.replay(), torch.autocast(device, dtype=dtype, enabled=enabled):
            with _ServedDraws(self.draws, 0, self.units.count):
                flat = self.outputs_of_one(values, inputs)
        for k in undecided:
            dims = [d for d in self.out_rows[k].dims if flat[self.positions[k]].shape[d] == 1]
            if len(dims) != 1:
                raise _Refused(f"its forward is replayed per example, but {self.out_rows[k].why}")
            self.out_rows[k] = _Rows(dims[0])
            self.out[k] = _by_example(self.out[k], self.out_rows[k])

    def check(self, outs, part):
        """The replayed outputs must be the batch's rows: else the module mixes examples (the step is refused)."""
        for replayed, batch in zip(outs, self.out):
            batch = batch[part]
            scale = batch.abs().max().double().clamp_min(1e-300)
            diff = ((replayed.double() - batch.double()).abs().max() / scale).item()
            if not diff <= REPLAY_TOLERANCE.get(batch.dtype, 3e-2):
                raise _Refused(
                    f"{own_class_name(self.module)}'s output for one example alone differs from that example's rows "
                    f"in the batch by {diff:.1e} (relative), replayed in the forward's autocast state and with its "
                    "random numbers: it mixes the examples of a batch (batch statistics, a softmax over the batch), "
                    "so no example's own gradient can be told apart"
                )

    def call(self, values, inputs_i):
        """The module's outputs with gradients for one example's inputs (each as _one_example gives it)."""
        flat = self.outputs_of_one(values, inputs_i)
        return [flat[i].squeeze(r.dim) if r.per == 1 else flat[i] for i, r in zip(self.positions, self.out_rows)]

    def outputs_of_one(self, values, inputs_i):
        """The leaves of the module's output for one example's inputs, computed with parameters `values`."""
        args_i, kwargs_i = pytree.tree_map(lambda t, r: _one_example(t, r) if r else t, inputs_i, self.in_rows)
        values = {**values, **{name: b.clone() for name, b in self.before.items()}}  # (buffers it updates in place)
        if self.method == "forward":
            with _iterated_already(self.module):
                out = torch.func.functional_call(self.module, values, tuple(args_i), kwargs_i)
        else:  # another method, with the same parameters swapped in as functional_call swaps them
            with torch.nn.utils.stateless._reparametrize_module(self.module, values):
                out = getattr(self.module, self.method)(*args_i, **kwargs_i)
        return pytree.tree_leaves(out)

    def replayed_grads(self, values, names, part, grads):
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
            if state_of(module).replay_vmap and not self.draws:  # (draws are served one example at a time)
                try:
                    return torch.func.vmap(one, in_dims=(in_dims, 0))(inputs, grads)
                except Exception:  # vmap cannot run this forward: replay the examples one by one
                    state_of(module).replay_vmap = False
            return self.one_by_one(inputs, grads, values, names, part.start)

    def one_by_one(self, inputs, grads, values, names, first):
        outs, found = [[] for _ in self.positions], {name: [] for name in names}
        for i in range(grads[0].shape[0]):
            inputs_i = pytree.tree_map(lambda t, r: t[i] if r else t, inputs, self.in_rows)
            leaves = {name: v.clone().requires_grad_(name in names) for name, v in values.items()}
            with torch.enable_grad(), _ServedDraws(self.draws, first + i, self.units.count):
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


class _Bookkeeping(Exception):
    """A failure of the replay's own bookkeeping (after the per-example pass), at `stage`."""

    def __init__(self, stage):
        super().__init__(stage)
        self.stage = stage


def _bookkeeping_failure(module, method, stage, error):
    """The reason for a replay whose per-example pass ran but whose bookkeeping then failed: this project's code."""
    return (
        f"nanogns failed while {stage} of the per-example gradients of {own_class_name(module)}'s {method}, replayed "
        f"per example ({type(error).__name__}: {error}): an error of this project's code, not of the model's (please "
        "report it)"
    )


def _failure(module, method, error):
    """The reason for a replay that raised `error`: the module's own `method` (its forward, or another method its
    parent calls) failing on one example's inputs, or this project's code failing (named as such, with where: a bug
    to report, not the examples' doing)."""
    frames = traceback.extract_tb(error.__traceback__)
    libraries = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__))  # torch and Python raise for
    innermost = next((f for f in reversed(frames) if not f.filename.startswith(libraries)), None)  # their caller
    name = own_class_name(module)
    if innermost is not None and f"{os.sep}nanogns{os.sep}" in innermost.filename:
        where = f"{os.path.basename(innermost.filename)}:{innermost.lineno} ({innermost.name})"
        return (
            f"nanogns failed while replaying {name}'s {method} per example, in {where} ({type(error).__name__}: "
            f"{error}): an error of this project's code, not of the model's (please report it)"
        )
    return f"{name}'s {method}, replayed on one example's inputs, fails ({type(error).__name__}: {error})"


# random functions (DRAWING) and the dropouts drawing inside torch (DROPOUTS; both core/pullback.py's): what a
# replayed module draws is drawn once, in its forward, and the same numbers are served to its replay, each example
# its rows of them
_PLAIN_DROPOUTS = (F.dropout, torch.dropout)  # (as imported: _dropout_inside swaps F.dropout for a while)
# torch functions written in Python that call F.dropout inside (WavLM's attention calls multi_head_attention_forward):
# a mode is off while it handles a function, so these run with F.dropout itself drawing through the mode
_DRAWING_INSIDE = {F.multi_head_attention_forward}
_DRAWS_IN_A_KERNEL = {F.scaled_dot_product_attention}  # (its dropout: _attention)


_ATTENTION = F.scaled_dot_product_attention  # (as imported: _dropout_inside swaps it for a while)


@contextlib.contextmanager
def _dropout_inside(mask_of):
    """F.dropout and F.scaled_dot_product_attention drawing their keep-masks from mask_of, while a function of
    _DRAWING_INSIDE runs."""
    plain, attention = F.dropout, F.scaled_dot_product_attention
    F.dropout = lambda *args, **kwargs: _dropout(plain, args, kwargs, mask_of)
    F.scaled_dot_product_attention = lambda *args, **kwargs: _attention(args, kwargs, mask_of)
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = plain, attention


def _with_masks(func, args, kwargs, mask_of):
    """func computed with its dropout's keep-masks from mask_of (a dropout, a torch function dropping out inside,
    attention dropping out in its kernel), or NotImplemented for a function that drops nothing out."""
    if func in DROPOUTS:
        return _dropout(func, args, kwargs, mask_of)
    if func in _DRAWING_INSIDE:
        with _dropout_inside(mask_of):
            return func(*args, **kwargs)
    if func in _DRAWS_IN_A_KERNEL:
        return _attention(args, kwargs, mask_of)
    return NotImplemented


_ATTENTION_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(args, kwargs, mask_of):
    """F.scaled_dot_product_attention with its dropout's keep-mask from mask_of (the weights' shape): the kernel
    drops out inside itself, where no mode sees it, so with dropout on it is computed as torch's math backend
    computes it (softmax of the scaled scores, masked, dropped out by bernoulli(1 - p) / (1 - p), times the values)."""
    bound = dict(zip(_ATTENTION_ARGUMENTS, args), **kwargs)
    p = float(bound.get("dropout_p", 0.0))
    if p == 0.0:
        return _ATTENTION(*args, **kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if bound.get("enable_gqa"):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = bound.get("scale") or q.size(-1) ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    if bound.get("is_causal"):
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    mask = bound.get("attn_mask")
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(-1)
    keep = mask_of(weights, p)
    return (weights * (keep.to(weights.dtype) / (1 - p) if p < 1 else weights * 0)) @ v


class _RandomDraws(TorchFunctionMode):
    """During a replayed module's forward: keeps the tensors it draws at random (`drawn`, in order); a dropout
    draws its keep-mask here (bernoulli), so that its replay can be given the same mask. Off (`watching` False: a
    module in eval mode, which draws nothing) it costs nothing."""

    def __init__(self, watching=True):
        super().__init__()
        self.drawn, self.watching = [], watching

    def __enter__(self):
        return super().__enter__() if self.watching else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.watching else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masked = _with_masks(func, args, kwargs, self.draw)
        if masked is not NotImplemented:
            return masked
        out = func(*args, **kwargs)
        if func in DRAWING and isinstance(out, torch.Tensor):
            self.drawn.append(out.detach().clone())
        return out

    def draw(self, like, p):
        mask = torch.empty_like(like).bernoulli_(1 - p)
        self.drawn.append(mask)
        return mask


class _ServedDraws(TorchFunctionMode):
    """During the replay of unit `unit` of `count`: each random function gives that unit's rows of what the
    forward drew, in the same order."""

    def __init__(self, drawn, unit, count):
        super().__init__()
        self.drawn, self.unit, self.count, self.next = drawn, unit, count, 0

    def __enter__(self):
        return super().__enter__() if self.drawn else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.drawn else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masked = _with_masks(func, args, kwargs, lambda like, p: self.serve(tuple(like.shape)))
        if masked is not NotImplemented:
            return masked
        if func not in DRAWING:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)  # (its shape, dtype, device; and an in-place fill's target)
        if not isinstance(out, torch.Tensor):
            return out
        served = self.serve(tuple(out.shape)).to(out.dtype)
        if func.__name__.endswith("_"):  # an in-place fill: the tensor it filled
            with torch.no_grad():
                return out.copy_(served)
        return served

    def serve(self, shape):
        if self.next >= len(self.drawn):
            raise _Refused("its forward, replayed on one example, draws more random numbers than it drew in the batch")
        drawn = self.drawn[self.next]
        self.next += 1
        whole = tuple(drawn.shape)
        if whole == shape and (not shape or shape[0] != self.count or self.count == 1):
            return drawn  # drawn once for every example (no example dim)
        if shape and whole[1:] == shape[1:] and whole[0] == self.count * shape[0]:
            return drawn[self.unit * shape[0] : (self.unit + 1) * shape[0]]  # its rows, example after example
        if whole == (self.count, *shape):
            return drawn[self.unit]
        raise _Refused(
            f"its forward draws random numbers of shape {whole} for the batch and {shape} for one example, whose "
            "rows of them cannot be told"
        )


def _dropout(func, args, kwargs, mask_of):
    """func(input, p, training, inplace) computed with a keep-mask mask_of(input, p) (bernoulli(1 - p)), scaled by
    1 / (1 - p) as torch's dropout; the alpha dropouts and a dropout off (p = 0, not training) run as they are."""
    names = ("input", "p", "training", "inplace") if func is not torch.dropout else ("input", "p", "train")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, p = bound["input"], float(bound.get("p", 0.5))
    training = bound.get("training", bound.get("train", True))
    if func in (F.alpha_dropout, F.feature_alpha_dropout) or not training or p == 0.0:
        return func(*args, **kwargs)
    if func not in _PLAIN_DROPOUTS:  # channel dropouts: one draw per channel of an example
        keep = mask_of(x.new_empty(*x.shape[:2], *(1,) * (x.dim() - 2)), p)
    else:
        keep = mask_of(x, p)
    scale = keep.to(x.dtype) / (1 - p) if p < 1 else keep.to(x.dtype) * 0
    return x.mul_(scale) if bound.get("inplace", False) else x * scale


class _Refused(Exception):
    """A replay whose numbers would not be the example's own: the step is refused with this reason."""


def refuse_step_in_backward(reason, buffers):
    """Refuse the step from a backward hook (where gradients are off): counts NaN, the reason kept."""
    with torch.no_grad():
        for buffer in buffers:
            buffer[..., 1] = float("nan")
    layout.note_refusal(reason, buffers)
