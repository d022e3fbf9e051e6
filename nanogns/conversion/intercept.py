"""
Per-example norms for a module that keeps its own forward: every use of its
parameters inside that forward is routed through functional.py.

convert() uses this for modules it cannot swap for a layer of a kind, because
their forward does more than a layer's (a router returning logits and top-k
choices, Gemma's embedding scaled by a buffer, OPT's position embedding computed
from the attention mask, a Linear that casts its weight...), but whose
parameters enter the computation only through F.linear and F.embedding, or
broadcast over the examples.
The module keeps its class (it gains a wrapper forward), code, buffers and
hooks; while its forward runs with gradients, a TorchFunctionMode watches every
torch call that takes one of its parameters:

  F.linear(x, W, b), F.embedding(ids, W)   computed by functional.linear/embedding: the same
                                           values, and the per-example norms recorded
  W.expand(N, ...), x + W, x * W, ...      W broadcast over the N examples of the forward (dim 0 of
                                           x): replaced by one copy per example, whose gradients are
                                           the examples' own (a ViT's class token and position
                                           embeddings, a scale written out by hand)
  torch.einsum("bind,snd->bnis", x, W)     the examples' data x holding them under a subscript (b) that the output
                                           keeps and W lacks: W given that subscript, one copy per example
                                           (Funnel's seg_embed; core/einsum.py)
  W @ x                                    x^T through F.linear (Mamba's dt_proj.weight @ time_step^T)
  F.conv1d(x, W, b, ..., groups=g)         each example's copy of W and b (of a table of them, W.squeeze(1)),
                                           as one convolution of N*g groups over the examples' channels
  W.to(dtype), W.float(), W.t(), W.T, ...  norm-preserving views and casts: followed, so that
                                           F.linear(x, W.to(x.dtype)) is a use of W
  W.shape, W.dtype, W.detach(), ...        no gradient flows: ignored
  anything else                            a use the norms would miss: the step is refused
                                           with an error naming the call (never a number)

A module whose code reads its children's parameters itself (Mamba's mixer: conv1d.weight.squeeze(1) into a
depthwise convolution, dt_proj.weight @ x) has those children's parameters followed too, the children left as
they are (their own forwards run inside this one, their uses followed the same way), once a probe shows the
followed forward computes what the module computes (probe.py:read_children_problem); the children it only calls
are converted by kind. Otherwise such a module is replayed per example (replay.py), which runs it again.

A parameter used twice in one forward counts its examples twice, and the
monitor then stops tracking it (the norm of a sum of uses needs cross terms),
as for a layer shared across depth; a parameter whose gradient came from
somewhere else than these calls is an error at the step.
"""

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from nanogns.core import history, layout, shared, uses
from nanogns.core.buffers import (
    BUFFER_SUFFIX,
    PerExampleNormLayer,
    add_pe_sqnorm,
    norm_dtype,
    refuse_step,
    register_pe_sqnorm_buffers,
)
from nanogns.core.einsum import einsum_with_copies, per_example_conv1d
from nanogns.core.module_state import state_of
from nanogns.core.rowmaps import Items
from nanogns.kinds import functional

# calls that return the same numbers (or their transpose) as a tensor: a use of the result is a use of the parameter
_FOLLOWED = {
    torch.Tensor.to,
    torch.Tensor.type,
    torch.Tensor.type_as,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.double,
    torch.Tensor.t,
    torch.Tensor.contiguous,
    torch.Tensor.clone,
}
_FOLLOWED_PROPERTIES = {"T", "mT"}
# elementwise calls in which a parameter may be broadcast over the examples (a ViT's position embeddings added to
# every example's tokens, a scale multiplying every row)
_BROADCAST = {
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
    torch.Tensor.__iadd__,
    torch.Tensor.__isub__,
    torch.Tensor.__imul__,
    torch.Tensor.add,
    torch.Tensor.sub,
    torch.Tensor.mul,
    torch.Tensor.div,
    torch.Tensor.add_,
    torch.Tensor.sub_,
    torch.Tensor.mul_,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
# a parameter shifted by a number (Gemma's 1 + weight written out): each example's gradient keeps its norm
_SHIFTS = {
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.add,
    torch.Tensor.sub,
    torch.add,
    torch.sub,
}
# calls through which no gradient flows
_IGNORED = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr,
    torch.Tensor.detach,
    torch.Tensor.__len__,
    torch.Tensor.__hash__,
    torch.Tensor.dim_order,
}


def _property_name(func):
    """'T' for the getter of Tensor.T, ...; None for any other function."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) if getattr(func, "__name__", None) == "__get__" else None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _ParameterUses(TorchFunctionMode):
    """During one forward of `module`: routes the uses of its own parameters through functional.py."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.params = dict(module.named_parameters(recurse=False))
        self.buffers = {name: module.pe_buffer(name) for name in self.params}
        for child_name in state_of(module).read_children:  # children whose parameters its code reads itself
            child = module.get_submodule(child_name)
            for name, p in child.named_parameters(recurse=False):
                self.params[f"{child_name}.{name}"] = p
                self.buffers[f"{child_name}.{name}"] = child._buffers.get(name + BUFFER_SUFFIX)
        self.tracked = {id(p): name for name, p in self.params.items() if p.requires_grad}
        self.derived = []  # tensors followed from a parameter: kept alive so that their ids stay theirs
        self.signs = {}  # id(derived tensor) -> -1 where its gradient is minus the parameter's (c - W)
        self.recipes = {}  # id(derived tensor) -> how to compute it again (shared.Recipe)

    def name_of(self, t):
        return self.tracked.get(id(t)) if isinstance(t, torch.Tensor) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        names = [self.name_of(t) for t in _tensors((args, kwargs))]
        if not any(names) or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        prop = _property_name(func)
        if func in _IGNORED or (prop is not None and prop not in _FOLLOWED_PROPERTIES):
            return func(*args, **kwargs)
        if func in _FOLLOWED or prop in _FOLLOWED_PROPERTIES:
            out = func(*args, **kwargs)
            name = self.name_of(args[0])
            if name is not None and sum(n is not None for n in names) == 1 and isinstance(out, torch.Tensor):
                return self.follow(out, args[0], recipe=self.recipe(func, args, kwargs))
        elif func is F.linear:
            return self.linear(*args, **kwargs)
        elif func is F.embedding:
            return self.embedding(*args, **kwargs)
        elif func is torch.Tensor.__getitem__ and names[0] is not None and sum(n is not None for n in names) == 1:
            found = self.index(*args)
            if found is not None:
                return found
        elif func is torch.Tensor.__setitem__ and len(args) == 3 and names[2] is not None and not any(names[:2]):
            if self.write(*args):  # x[mask] = W: W written into rows of the examples (Wav2Vec2's masked frames)
                return None
        elif func is torch.Tensor.expand and names[0] is not None and sum(n is not None for n in names) == 1:
            expanded = self.broadcast(args[0], _sizes(args[1:]))
            if expanded is not None:
                return expanded.expand(*args[1:], **kwargs)
        elif func is torch.Tensor.repeat and names[0] is not None and sum(n is not None for n in names) == 1:
            sizes = _sizes(args[1:])  # W.repeat(N, k, ...) of W (1, ...): each example its copy (ViTMAE's mask token)
            expanded = self.broadcast(args[0], sizes) if len(sizes) == args[0].dim() else None
            if expanded is not None and not kwargs:
                return expanded.repeat(1, *sizes[1:])
        elif func in _MATMUL and len(args) == 2 and names == [None, names[1]] and names[1] is not None and not kwargs:
            if args[1].dim() == 2 and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:  # x @ W: F.linear
                return functional.linear(args[0], args[1].t(), None, self.buffer(args[1]))  # (Gemma 3's projector)
        elif func in _MATMUL and len(args) == 2 and names[0] is not None and names[1] is None and not kwargs:
            if args[0].dim() == 2 and isinstance(args[1], torch.Tensor) and args[1].dim() >= 3:  # W @ x: F.linear
                x = args[1].transpose(-1, -2)  # (Mamba's dt_proj.weight @ time_step^T)
                return functional.linear(x, args[0], None, self.buffer(args[0])).transpose(-1, -2)
        elif func is F.conv1d:
            found = self.conv1d(*args, **kwargs)
            if found is not None:
                return found
        elif func is torch.functional.einsum or func is torch.einsum:
            given = einsum_with_copies(args, kwargs, self.copied, self.items_of_data, self.copies)
            if given is not None:  # einsum("bind,snd->bnis", x, W): each example's own copy of W
                return torch.einsum(*given)
        elif func in _SHIFTS and len(args) == 2 and names[0] is not None and _is_number(args[1]) and not kwargs:
            # W + c, W - c, c + W, c - W: the same gradient as W's, up to its sign
            sign = -1 if func is torch.Tensor.__rsub__ else 1
            return self.follow(func(*args), args[0], sign, self.recipe(func, args, {}))
        elif func in _BROADCAST and len(args) == 2 and sum(n is not None for n in names) == 1 and not kwargs:
            i = 0 if names[0] is not None else 1
            other = args[1 - i]
            target = other if isinstance(other, torch.Tensor) else None
            expanded = self.broadcast(args[i], None if target is None else target.shape, target)
            if expanded is not None:
                return func(*((expanded, other) if i == 0 else (other, expanded)))
        if self.parameters_alone(args, kwargs):  # computed from parameters (and constants) alone: a table
            return self.table(func(*args, **kwargs), names, (func, args, kwargs))
        return self.refuse(func, names, func(*args, **kwargs))

    def returned(self, t):
        """An output of the forward: a parameter (or a tensor followed from one) handed back to the caller, which
        uses it outside this forward (GPT-NeoX-Japanese's attention returns its dense_bias for its layer to add), is a
        table the examples share (shared.py): where it meets them, each example gets its copy."""
        name = self.name_of(t)
        if name is None or not t.requires_grad:
            return t
        if t is self.params[name]:
            return shared.table(t.view_as(t), [(t, self.buffers[name])], shared.Recipe(torch.Tensor.view_as, (t, t)))
        recipe = self.recipes.get(id(t))
        return shared.table(t, [(self.params[name], self.buffers[name])], recipe)

    def parameters_alone(self, args, kwargs):
        """True when no tensor argument carries the examples' data: all are this module's parameters (or followed
        from them), tables (shared.py) or constants, through which no gradient flows (as items_of_data and
        shared.py hold: a constant whose dim 0 happens to have the items' size, Funnel's relative positions of 4
        rows in a step of 2 examples of 2 choices, is no example's). The result is a table: where it meets the
        examples, torch's broadcasting gives each its copy or its own slice (shared.py), whatever its sizes."""
        current = layout.current()
        if current is None:
            return False
        for t in _tensors((args, kwargs)):
            if self.name_of(t) is not None or shared.is_shared(t):
                continue
            if t.requires_grad:
                return False
        return True

    def recipe(self, func, args, kwargs, index=None):
        """shared.Recipe of func(*args, **kwargs): the tensors followed from parameters and the tables among its
        arguments by their own recipes."""
        given = pytree.tree_map(
            lambda t: self.recipes.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
        )
        given = pytree.tree_map(shared.recipe_of, given)
        return shared.Recipe(func, given[0], given[1], index)

    def table(self, out, names, call=None):
        """out, computed from these parameters alone (by call: (func, args, kwargs)), as a table the examples share
        (shared.py): where it meets them, each example gets its copy, and its gradient is pulled back to the
        parameters."""
        sources = {id(self.params[n]): (self.params[n], self.buffers[n]) for n in names if n is not None}
        single = isinstance(out, torch.Tensor)
        positions = iter(range(len(pytree.tree_leaves(out))))

        def wrap(t):
            index = None if single else next(positions)
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return t
            found = dict(sources)
            if shared.is_shared(t):
                found.update({id(p): (p, b) for p, b in t.pe_sources})
            return shared.table(t, found.values(), None if call is None else self.recipe(*call, index))

        return pytree.tree_map(wrap, out)

    def follow(self, out, source, sign=1, recipe=None):
        """Track `out`, computed from the parameter (or derived tensor) `source` with a Jacobian of +-1 (a cast, a
        transpose, a shift by a number; by `recipe`): a use of `out` is a use of the parameter."""
        self.tracked[id(out)] = self.tracked[id(source)]
        self.signs[id(out)] = self.signs.get(id(source), 1) * sign
        if recipe is not None:
            self.recipes[id(out)] = recipe
        self.derived.append(out)
        return out

    def broadcast(self, param, target_shape, target=None):
        """The parameter as one copy per item of the forward's examples (the examples themselves, or their choices,
        a tower's images...), (count, ...), when an op broadcasts it over a target whose dim 0 holds those items (the
        op then gives each item's gradient to its own copy; an example's is its items' sum); else None."""
        if target_shape is None or len(target_shape) < param.dim() or not len(target_shape):
            return None
        items = _items_of(target_shape[0])
        if items is None and target is not None and not shared.is_shared(target):  # (N*k, ...) rows a reshape made
            items = history.items_folded_on_dim0(target)
        leading = (1,) * (len(target_shape) - param.dim()) + tuple(param.shape)
        sign = self.signs.get(id(param), 1)
        if items is None and len(leading) > 1 and leading[:2] == (1, 1):  # (T, N, ...) where the ids were moved
            held = history.items_held(target_shape)
            if held is not None and held[1] == 1:  # (XLNet's q_head + r_w_bias): each example's copy on dim 1
                copies = BroadcastOverExamples.apply(param.view(leading[1:]), held[0], self.buffer(param), sign)
                return copies.unsqueeze(0)
        if items is None or leading[0] != 1:
            return None
        return BroadcastOverExamples.apply(param.view(leading), items, self.buffer(param), sign)

    def conv1d(self, *args, **kwargs):
        """F.conv1d of the examples' data with a weight and bias that are this module's parameters or tables computed
        from them (Mamba's depthwise causal convolution of conv1d.weight.squeeze(1)): core/einsum.py's per_example_conv1d,
        each example its own copy of each. None when that does not hold."""

        def copies(t, items):
            if self.name_of(t) is not None:
                return self.copies(t, items)
            return shared.copies_for(t, items) if shared.is_shared(t) else None

        if self.name_of(args[0] if args else kwargs.get("input")) is not None:  # (a parameter as the data)
            return None
        return per_example_conv1d(*args, **kwargs, copies=copies)

    def copied(self, t):
        return self.name_of(t) is not None

    def items_of_data(self, t):
        """(Items, the dim holding them) when t is the examples' data (not a parameter, nor a table), else None."""
        if shared.is_shared(t) or isinstance(t, torch.nn.Parameter) or t.dim() == 0 or not t.requires_grad:
            return None  # (a constant, sinusoidal positions, whose dim 0 happens to have the items' size, is none)
        return history.items_of_data(t)

    def copies(self, param, items):
        """(items.count, *param.shape): one copy of the parameter per item, each receiving its item's gradient."""
        sign = self.signs.get(id(param), 1)
        return BroadcastOverExamples.apply(param.reshape(1, *param.shape), items, self.buffer(param), sign)

    def index(self, weight, index):
        """W[ids] for a tensor of ids: an embedding lookup (functional.embedding: per example, or a table shared by
        the examples); W[a:b] (no tensor in the index): rows of the parameter that every example shares, a table
        (shared.py, Whisper's positions); else None."""
        if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
            if self.constant(index):  # ids stored in the module (Swin's relative-position index): a shared table
                param = self.params[self.name_of(weight)]
                recipe = self.recipe(torch.Tensor.__getitem__, (weight, index), {})
                return shared.table(weight[index], [(param, self.buffer(weight))], recipe)
            if weight.dim() == 2:
                return functional.embedding(index, weight, self.buffer(weight))
            return None
        if any(isinstance(t, torch.Tensor) for t in _tensors(index)):
            return None
        param = self.params[self.name_of(weight)]
        recipe = self.recipe(torch.Tensor.__getitem__, (weight, index), {})
        return shared.table(weight[index], [(param, self.buffer(weight))], recipe)

    def write(self, target, index, value):
        """target[mask] = value for a boolean mask over target's leading dims, whose dim 0 holds the forward's
        examples (or their items): each selected row gets its item's own copy of the parameter (one copy per item,
        gathered by the rows' items), so that each example's gradient reaches its copies. False when that does not
        hold."""
        items = _items_of(target.shape[0])
        if not (
            items is not None
            and isinstance(index, torch.Tensor)
            and index.dtype == torch.bool
            and index.dim() >= 1
            and tuple(index.shape) == tuple(target.shape[: index.dim()])
            and tuple(value.shape) == tuple(target.shape[index.dim() :])
        ):
            return False
        sign = self.signs.get(id(value), 1)
        copies = BroadcastOverExamples.apply(value.reshape(1, *value.shape), items, self.buffer(value), sign)
        target[index] = copies[index.nonzero()[:, 0]]  # (inside this mode's handler the mode is off)
        return True

    def constant(self, t):
        """True when t's storage is one of the module's buffers (ids it holds, not the forward's data)."""
        storage = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == storage for b in self.module.buffers(recurse=False))

    def buffer(self, t):
        name = self.name_of(t)
        return self.buffers.get(name) if name is not None else None

    def linear(self, input, weight, bias=None):
        if self.name_of(input) is not None or (
            weight is not None and self.name_of(weight) is None and bias is not None and self.name_of(bias) is None
        ):
            return self.refuse(F.linear, [self.name_of(input)], F.linear(input, weight, bias))
        return functional.linear(input, weight, bias, self.buffer(weight), self.buffer(bias))

    def embedding(
        self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False
    ):
        if max_norm is not None or scale_grad_by_freq or sparse or self.name_of(weight) is None:
            return self.refuse(
                F.embedding,
                [self.name_of(weight)],
                F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse),
            )
        return functional.embedding(input, weight, self.buffer(weight), padding_idx)

    def refuse(self, func, names, out):
        """A use the per-example norms would miss: the step is refused for these parameters, with the call named."""
        call = torch.overrides.resolve_name(func) or getattr(func, "__qualname__", repr(func))
        for name in {n for n in names if n is not None}:
            reason = (
                f"its forward uses its {name} in {call}, which per-example norms do not follow (only "
                f"F.linear, F.embedding and broadcasts over the examples)"
            )
            refuse_step(reason, [self.buffers.get(name)])
        return out


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sizes(args):
    """expand's sizes, given as expand(*sizes) or expand(sizes)."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)


def _items_of(dim0):
    """The Items a dim 0 of `dim0` rows holds in the running forward (outside one: that many examples)."""
    if layout.current() is None:
        return Items(dim0, dim0)
    return layout.items_of(dim0)


class BroadcastOverExamples(torch.autograd.Function):
    """broadcast(param (1, ...), items, buffer, sign) -> (count, ...) copies: backward receives each item's gradient
    of the parameter in its own copy (times sign: -1 for c - W), sums each example's items', records their squared
    norms (or hands them to uses.py, flattened, when the forward used the parameter more than once) and returns
    their sum."""

    @staticmethod
    def forward(ctx, param, items, buffer, sign=1):
        ctx.buffer, ctx.shape, ctx.sign, ctx.items = buffer, param.shape, sign, items
        layout.note_uses([buffer])
        return param.expand(items.count, *param.shape[1:]).clone()  # a copy: an output may not be a view of an input

    @staticmethod
    def backward(ctx, grad):
        per_example = ctx.items.to_examples(grad)
        factor = lambda: uses.DenseFactor(per_example.reshape(len(per_example), -1) * ctx.sign)  # noqa: E731
        if ctx.buffer is not None and not uses.hand_over(ctx.buffer, factor):
            add_pe_sqnorm(
                ctx.buffer, per_example.reshape(len(per_example), -1).pow(2).sum(dim=1, dtype=norm_dtype(grad))
            )
        return grad.sum(dim=0, keepdim=True).view(ctx.shape), None, None, None


class InterceptedForward(PerExampleNormLayer):
    """The class a module gets when its own forward is kept (core/registry.py:adopt puts it first in the MRO)."""

    def forward(self, *args, **kwargs):
        return self.pe_followed(super().forward, args, kwargs)

    def pe_followed(self, plain, args, kwargs):
        """plain(*args, **kwargs), its forward or another of its methods, with its parameters' uses followed."""
        if not torch.is_grad_enabled() or layout.replaying():
            return plain(*args, **kwargs)
        with _ParameterUses(self) as followed:
            out = plain(*args, **kwargs)
        return pytree.tree_map(followed.returned, out)

    def pe_adopt(self, options):
        kinds = options.pop("kinds", {})
        self.register_pe_buffers(*[name for name, _ in self.named_parameters(recurse=False)])
        state_of(self).kinds.update(kinds)
        state_of(self).read_children = tuple(options.pop("children", ()))
        for child_name in state_of(self).read_children:  # their parameters' norms recorded by this module's forward
            child = self.get_submodule(child_name)
            names = [name for name, _ in child.named_parameters(recurse=False)]
            register_pe_sqnorm_buffers(child, names)
            state_of(child).kinds.update(parameter_kinds(child))


@functools.lru_cache(maxsize=None)
def followed_class(methods):
    """InterceptedForward with the module's `methods` (names of methods its parent calls besides its forward: JetMoE's
    mixture of attention heads, map and reduce) run with its parameters' uses followed too."""

    def wrapper(name):
        def method(self, *args, **kwargs):
            return self.pe_followed(getattr(super(cls, self), name), args, kwargs)

        method.__name__ = name
        return method

    cls = type("InterceptedMethods", (InterceptedForward,), {name: wrapper(name) for name in methods})
    cls.__module__ = __name__
    return cls


def parameter_kinds(module):
    """{parameter name: the layer kind recorded for it}: an nn.Embedding subclass's weight is an Embedding's,
    any other 2-D weight a Linear's, a 1-D parameter a Linear bias's."""
    is_embedding = isinstance(module, torch.nn.Embedding)
    return {
        name: "Embedding" if is_embedding and name == "weight" else "Linear"
        for name, _ in module.named_parameters(recurse=False)
    }
