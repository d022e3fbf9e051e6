"""
What the project knows about each kind of layer that records per-example gradient norms: a LayerKind, stated
once in the kind's own module (kinds/linear.py, kinds/embedding.py, ...), and the Registry that holds them, made
once from the explicit list in nanogns/kinds/__init__.py (KINDS) and read by everything else: choice.py (which
class a user's choice means), conversion/ (which torch classes convert() swaps, how to probe a module no kind
replaces by class), functional.py (the kinds a hand-written layer may declare), the monitor (each tracked
parameter's kind and group, for the record beside the log) and the analysis (the group each kind is summed in).

A kind is checked against the closed sets every other part relies on (docs/architecture.md, "Adding a layer kind"):
its flag is one of CONFIG_KEYS, its analysis group one of GROUPS, and it offers every variant of
REQUIRED_VARIANTS (a flag's value must mean a class for every kind of that flag), plus any others (sogns).

Only a third-party class that is not always installed (transformers' Conv1D) is named by a "module:Class" string,
looked up among the modules already imported (a model that holds such a class has imported it), so that importing
the layers never imports transformers.

adopt(module, variant class, options) turns a module of another class into a kind's layer in place.
"""

import collections
import copy
import functools
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from nanogns.core import shared
from nanogns.core.module_state import state_of
from nanogns.errors import SettingNotValid

CONFIG_KEYS = ("linearclass", "embeddingclass", "lnclass")  # the user choices (train.py flags) that pick variants
GROUPS = ("Linear", "Embedding", "LayerNorm")  # the analysis groups a kind sums in (runlog/record.py adds "Other")
REQUIRED_VARIANTS = ("nn", "shim", "gns", "fused")  # every kind offers these (the flags' values); "nn": torch's own


@dataclass
class Probe:
    """How conversion/probe.py tries a kind on a module it does not know by class (see its docstring).

    Attributes:
        fits: fits(weight, bias) -> True when the kind holds parameters of these shapes (bias may be None).
        data: data(module, generator, weight, bias) -> ({role: float64 tensor}, input): probe parameters and an
            input, for a module whose parameters playing the roles weight and bias (bias may be None) are given.
        candidates: candidates(module, options) -> [options dict]: the constructor options to try, in order
            (e.g. each eps), options being those the user fixed (treat_as).
        options: the option names a user may fix through convert(treat_as=...).
    """

    fits: Callable
    data: Callable
    candidates: Callable = lambda module, options: [dict(options)]
    options: tuple = ()


@dataclass
class LayerKind:
    """Everything about one kind of layer.

    Attributes:
        name: "Linear", "Embedding", "LayerNorm", ...
        config_key: the user choice that picks this kind's variant ("linearclass", "embeddingclass", "lnclass").
        group: the parameter group gns-analysis.py sums this kind in ("Linear", "Embedding", "LayerNorm").
        variants: {variant name: class} for "nn" (the plain layer) and the per-example norm layers ("shim",
            "gns", "fused", and any extra ones such as "sogns"). A variant's class records the per-example norms
            of the parameters in `params`. A third-party class may be given as "module:Class" (see above).
        replaces: the classes convert() swaps by their exact class (nn.Linear, or "module:Class" for a
            third-party class, found only when its module is imported).
        params: the parameter names (roles) a layer of this kind may hold, in order.
        convertible: convertible(module) -> None, or why a module of a replaced class cannot be swapped.
        options: options(module) -> {constructor option: value} of a module of a replaced class (eps, ...).
        in_parent: in_parent(parent, attribute name, module) -> None, or why the module is not converted as used
            by its parent (a lookup table the parent shares across the batch).
        probe: how conversion/probe.py tries this kind on other modules, or None (never probed).
        matches: for a kind whose modules come in many classes of one structure (each transformers model defines
            its own experts class): True for a module of this kind. convert() then calls verify(module, variant
            class), which returns None when the variant computes what the module computes, else why not.
    """

    name: str
    config_key: str
    group: str
    variants: dict
    replaces: tuple = ()
    params: tuple = ("weight", "bias")
    convertible: Callable = lambda module: None
    options: Callable = lambda module: {}
    probe: Optional[Probe] = None
    in_parent: Callable = lambda parent, name, module: None  # why a module is not converted where its parent uses it
    matches: Optional[Callable] = None  # matches(module) -> True for modules of this kind known by structure
    verify: Optional[Callable] = None  # verify(module, variant class) -> None, or why the swap would not be faithful

    def layer_class(self, variant):
        """The class of `variant` ('nn', 'shim', 'gns', 'fused', ...); ValueError naming the choices otherwise."""
        if variant not in self.variants:
            raise SettingNotValid(f"unknown {self.config_key} {variant!r}; choose from {sorted(self.variants)}")
        found = self.variants[variant]
        return resolve(found) if isinstance(found, str) else found

    def replaced_classes(self):
        """The classes of `replaces` whose modules are loaded (a model can only hold a loaded class)."""
        found = [loaded(c) if isinstance(c, str) else c for c in self.replaces]
        return [c for c in found if c is not None]


def loaded(path):
    """The class named by "module:Class" when its module is imported already, else None."""
    module_name, attribute = path.split(":")
    return getattr(sys.modules.get(module_name), attribute, None)


def resolve(path):
    """The class named by "module:Class", importing its module (a third-party package the user chose)."""
    module_name, attribute = path.split(":")
    return getattr(importlib.import_module(module_name), attribute)


class Registry(Mapping):
    """The layer kinds, by name, in the order given (the order convert()'s probe tries them in): a read-only mapping
    {name: LayerKind}, each kind checked against the closed sets when the registry is made."""

    def __init__(self, *kinds: LayerKind):
        self._kinds = {}
        for kind in kinds:
            problem = _problem(kind, self._kinds)
            if problem is not None:
                raise SettingNotValid(f"layer kind {kind.name!r}: {problem}")
            self._kinds[kind.name] = kind

    def __getitem__(self, name: str) -> LayerKind:
        return self._kinds[name]

    def __iter__(self):
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def kind(self, name: str) -> LayerKind:
        """The LayerKind `name`; SettingNotValid (a ValueError) naming the kinds otherwise."""
        if name not in self._kinds:
            raise SettingNotValid(f"unknown layer kind {name!r}; choose from {sorted(self._kinds)}")
        return self._kinds[name]

    def group_of(self, kind_name: str) -> str:
        """The analysis group of a recorded layer kind: the kind's group; a tied Embedding+Linear pair sums with the
        embeddings; anything else (a kind of another version, 'unknown', a replayed module) is 'Other'."""
        if kind_name in self._kinds:
            return self._kinds[kind_name].group
        return "Embedding" if kind_name == "Embedding+Linear" else "Other"


def _problem(kind, known):
    """Why `kind` cannot join a registry already holding `known`, or None."""
    if kind.name in known:
        return "listed twice"
    if kind.config_key not in CONFIG_KEYS:
        return f"config_key {kind.config_key!r} is not one of {CONFIG_KEYS}"
    if kind.group not in GROUPS:
        return f"group {kind.group!r} is not one of {GROUPS}"
    missing = [v for v in REQUIRED_VARIANTS if v not in kind.variants]
    if missing:
        return f"it offers no {missing} variant (every kind offers {REQUIRED_VARIANTS})"
    return None


# -----------------------------------------------------------------------------
# turning a module into a layer of a kind, in place

ROLES = ("weight", "bias")  # parameter roles a user may map to other names (convert's treat_as)


def _role_property(name):
    return property(lambda self: getattr(self, name))


@functools.cache  # one class per (variant, original class, roles): modules of one class share it
def adopted_class(variant_cls, original_cls, roles=()):
    """The class a module of `original_cls` becomes: the variant itself when it subclasses the original, else a
    class deriving from both (the variant's forward first), so isinstance checks on the original class (weight
    decay groups, wrap policies, transformers' init) still hold; its `pe_original_class` is the original.
    roles: ((role, parameter name), ...) for parameters named otherwise than the variant reads them (a norm's
    `scale` as its weight)."""
    if issubclass(variant_cls, original_cls) and not roles:
        return variant_cls
    namespace = {"__module__": variant_cls.__module__, "pe_roles": dict(roles), "pe_original_class": original_cls}
    namespace.update({role: _role_property(name) for role, name in roles})
    bases = (variant_cls,) if issubclass(variant_cls, original_cls) else (variant_cls, original_cls)
    return type(f"{variant_cls.__name__}({original_cls.__name__})", bases, namespace)


def own_class_name(module):
    """The name of the class a module had before it was adopted ("BatchNorm2d", not "PerExampleBatchNorm(...)")."""
    return getattr(type(module), "pe_original_class", type(module)).__name__


def adopted_twin(module, variant_cls, options, parameters=None):
    """A shallow copy of `module` (its attributes, buffers and children; `parameters` for its own, else the same
    ones) with none of its hooks, adopted as `variant_cls`: a probe runs it beside the module to compare them, and
    nothing the original registers fires."""
    twin = copy.copy(module)
    twin.__dict__.update(
        _parameters=dict(module._parameters) if parameters is None else parameters,
        _buffers=dict(module._buffers),
        _forward_hooks={},
        _forward_pre_hooks=collections.OrderedDict(),  # (adopt registers a hook)
        _backward_hooks={},
        _backward_pre_hooks={},
    )
    return adopt(twin, variant_cls, options)


def adopt(module, variant_cls, options):
    """Turn `module` into a layer of `variant_cls` in place: the same object, Parameters, buffers, hooks and
    attributes, plus the options the variant's forward reads (eps, ...) and its per-example norm buffers.
    Options "weight"/"bias" name the parameters that play those roles, when they are named otherwise."""
    roles = tuple((role, options.pop(role)) for role in ROLES if options.get(role, role) != role)
    options.pop("weight", None), options.pop("bias", None)
    module.__class__ = adopted_class(variant_cls, type(module), roles)
    module.pe_adopt(options)
    state = state_of(module)
    if not state.tables_hooked:  # a parameter as its input: a table (shared.py)
        state.tables_hooked = True
        module.register_forward_pre_hook(shared.parameters_as_tables)
    return module
