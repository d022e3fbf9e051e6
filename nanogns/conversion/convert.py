"""
convert(model), which gives a model built elsewhere per-example norm layers.

`convert(model)` turns, in place, every module of a class a kind replaces (torch's
Linear, Embedding, LayerNorm, RMSNorm, transformers' Conv1D, ...) into that kind's
chosen variant, and any other module owning parameters into a per-example norm
layer after probe.py's probe shows it computes the same thing (one Conversion walks the model).
"""

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch.nn as nn

from nanogns.conversion import intercept, probe, replay
from nanogns.core.buffers import BUFFER_SUFFIX, PerExampleNormLayer
from nanogns.core.module_state import state_of
from nanogns.core.registry import ROLES, LayerKind, adopt
from nanogns.errors import SettingNotValid
from nanogns.kinds import KINDS
from nanogns.monitor.monitor import GNSMonitor

# -----------------------------------------------------------------------------
# converting a model that was built elsewhere


def _known_classes():
    """{class: kind} of the classes convert swaps by their exact class (only classes already imported)."""
    return {cls: kind for kind in KINDS.values() for cls in kind.replaced_classes()}


def _treat_as_entries(treat_as, known):
    """{class: (kind, options)} from convert's `treat_as` argument, checked."""
    entries = {}
    probed = [name for name, kind in KINDS.items() if kind.probe is not None]
    for cls, spec in (treat_as or {}).items():
        label = getattr(cls, "__name__", repr(cls))
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise SettingNotValid(f"treat_as keys are nn.Module classes, got {cls!r}")
        if not (isinstance(spec, str) or isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], dict)):
            raise SettingNotValid(f"treat_as[{label}] is a kind or (kind, {{option: value}}), got {spec!r}")
        kind, options = (spec, {}) if isinstance(spec, str) else spec
        if cls in known:
            raise SettingNotValid(f"{label} is converted by its class already; remove it from treat_as")
        if kind not in probed:
            raise SettingNotValid(f"treat_as[{label}]: unknown kind {kind!r}; choose from {probed}")
        allowed = set(KINDS.kind(kind).probe.options) | set(ROLES)
        if set(options) - allowed or any(not isinstance(options[role], str) for role in ROLES if role in options):
            raise SettingNotValid(
                f"treat_as[{label}]: {kind} takes options {sorted(allowed)} ({' and '.join(ROLES)} "
                f"name the parameters playing those roles), got {options}"
            )
        entries[cls] = (kind, dict(options))
    return entries


class Conversion:
    """One convert() call: the user's choices, and the walk over the model's modules that swaps each for a
    per-example norm layer or notes why not (`unconverted`, {module path: reason})."""

    def __init__(self, choice, treat_as=None, exclude=()):
        self.choice = choice  # {"linearclass": variant, "embeddingclass": ..., "lnclass": ...}
        self.known = _known_classes()
        self.structural = [kind for kind in KINDS.values() if kind.matches is not None]
        self.named = _treat_as_entries(treat_as, self.known)
        self.exclude = tuple(exclude)
        self.visited = set()
        self.unconverted = {}
        self.no_layer = {}  # {id(module): why no kind's layer stands in for it}, where its forward is kept

    def run(self, model):
        """Convert every module of `model` in place; returns `unconverted`."""
        if type(model) in self.known:
            raise SettingNotValid(
                f"convert() swaps the layers inside a model; got a bare {type(model).__name__}: "
                "wrap it in a module (e.g. nn.Sequential(layer)) and convert that"
            )
        self.visit(model, "", None, model)
        if owns_untracked_parameters(model):
            self.unconverted[""] = (
                f"{type(model).__name__} owns parameters directly; call functional.py from its forward"
            )
        return self.unconverted

    def visit(self, module, path, parent, model):
        """Convert `module` by the first of PATHS that applies to it, note which (ModuleState.measured_by, what
        GNSMonitor.explain reports) and, unless the path holds the module's whole subtree, visit its children."""
        if id(module) in self.visited:  # a module registered under several paths is converted once, stays shared
            return
        self.visited.add(id(module))
        at = Visit(self, module, path, parent, model)
        for route in PATHS:
            found = route.applies(at)
            if found is None or found is False:
                continue
            reason = route.convert(at, found)
            if reason is not None:
                self.unconverted[path] = reason
            if route.name not in SILENT:
                why = route.why(found) if callable(route.why) else route.why
                if id(module) in self.no_layer:
                    why += f" (no kind's layer: {self.no_layer[id(module)]})"
                state_of(module).measured_by = (route.name, outcome(module, found), why)
            if route.descends and not state_of(module).replay_subtree:
                break
            return
        for name, child in module._modules.items():
            if child is not None:
                self.visit(child, path + ("." if path else "") + name, module, model)

    def inherited_kind(self, module):
        """The kind of a subclass of a class a kind replaces whose forward is that class's (`class MyConv(nn.Conv2d):
        pass`, timm's and EfficientNet's conv subclasses that add only constructor options): it computes what that
        class computes, so it is that kind. None for other modules."""
        for cls, kind in self.known.items():
            if isinstance(module, cls) and type(module) is not cls and _same_forward(type(module), cls):
                return kind
        return None

    def excluded(self, module, path):
        return any(
            (isinstance(e, type) and isinstance(module, e))
            or (isinstance(e, str) and (path == e or path.startswith(e + ".")))
            for e in self.exclude
        )

    def variant_of(self, kind):
        """(class of the chosen variant, or None for 'nn'; reason when the kind has no such variant)."""
        name = self.choice[kind.config_key]
        if name == "nn":
            return None, None
        if name not in kind.variants:
            return None, f"{kind.config_key}={name!r} has no {kind.name} layer; choose from {sorted(kind.variants)}"
        return kind.layer_class(name), None

    def convert_known(self, module, kind):
        """None, or why a module of a kind (by its class, or its structure) was not converted."""
        if not any(True for _ in module.parameters(recurse=kind.matches is not None)):  # (DBRX's banks: in a child)
            return None  # a norm without affine parameters: nothing to record
        cls, reason = self.variant_of(kind)
        reason = reason or kind.convertible(module)
        if cls is not None and reason is None and kind.verify is not None:
            reason = kind.verify(module, cls)
            reason = reason and f"{type(module).__name__} not converted, {reason}"
        if cls is None or reason is not None:
            return reason
        adopt(module, cls, kind.options(module))
        return None

    def convert_probed(self, module):
        """None, or why a module of a class no kind replaces was not converted: swapped for a kind's layer when
        the probe shows one computes the same (swap_probed), else kept with its own forward and its parameters'
        uses followed (intercept.py) when a probe shows that records them all (follow_uses)."""
        if getattr(module, "sparse", False) is True:  # nn.EmbeddingBag(sparse=True), an Embedding subclass
            return f"{type(module).__name__} with sparse=True: its gradient is a sparse tensor, which no per-example path forms"
        kind_name, options = self.named.get(type(module), (None, {}))
        base = next((k.name for c, k in self.known.items() if isinstance(module, c) and k.probe is not None), None)
        if base is None and any(isinstance(module, c) for c in self.known):  # a subclass of a kind no probe tries
            return self.follow_uses(module, f"it overrides the forward of {type(module).__mro__[1].__name__}")
        names = [kind_name] if kind_name else [base] if base else probe.probed_kinds()
        done, problem = self.swap_probed(module, names, options)
        if done:
            return problem  # swapped (None), or the reason the chosen kinds give
        if kind_name is not None:  # the user named a kind: only a layer of it may stand in
            return f"{type(module).__name__} not converted, {problem}"
        return self.follow_uses(module, problem)

    def swap_probed(self, module, names, options):
        """(True, None) when a layer of one of the kinds `names` replaced the module; (True, reason) when the
        user's choices leave it as it is; (False, why no kind's layer computes what it computes)."""
        problem = probe.structure_problem(module, options)
        fitting = probe.fitting_kinds(module, names, options) if problem is None else []
        if problem is None and not fitting:
            shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
            problem = f"its parameters {shapes} fit no {' or '.join(names)} layer"
        if problem is not None:
            return False, problem
        chosen = {name: self.variant_of(KINDS.kind(name)) for name in fitting}
        if all(cls is None and reason is None for cls, reason in chosen.values()):
            return True, None  # the user chose 'nn' for these kinds
        usable = [name for name in fitting if chosen[name][0] is not None]
        if not usable:
            return True, next(reason for _, reason in chosen.values() if reason is not None)
        found, problem = probe.find_replacement(module, usable, options)
        if found is None:
            return False, problem
        roles = probe.role_names(module, options)  # parameters named otherwise play their roles
        adopt(module, chosen[found.kind][0], {**found.options, **roles})
        return True, None

    def replay_subtree(self, module):
        """None: the module (which owns no parameter itself) replayed per example with its children; or why not."""
        kinds = {name: "Linear" for name, _ in module.named_parameters()}
        if all(self.choice[KINDS.kind(k).config_key] == "nn" for k in kinds.values()):
            return None
        adopt(module, replay.ReplayedForward, {})
        return None

    def follow_uses(self, module, problem):
        """Keep the module's own forward: its parameters' uses followed (intercept.py) when a probe shows that
        records them all, else its forward replayed per example in backward, children included (replay.py).
        problem: why no kind's layer stands in for it (kept for GNSMonitor.explain)."""
        self.no_layer[id(module)] = problem
        kinds = intercept.parameter_kinds(module)
        if all(self.choice[KINDS.kind(k).config_key] == "nn" for k in kinds.values()):
            return None  # the user chose 'nn' for the kinds its parameters would be recorded as
        # a block whose children hold parameters and do not have them read by its code keeps its forward with its
        # own parameters' uses followed (checked at every step) even where no probe can run it: replaying it
        # would run the block again per example
        container = any(True for c in module.children() for _ in c.parameters())
        reads = container and replay.reads_children_parameters(module)
        followed = probe.intercept_problem(module, container and not reads)
        read = replay.children_read(module) if reads else None
        if followed is None and not read:  # (a probe of its own parameters: children it reads need theirs followed)
            adopt(module, intercept.InterceptedForward, {"kinds": kinds})
            return None
        if read and probe.read_children_problem(module, read) is None:  # (Mamba's mixer: conv1d, dt_proj...)
            adopt(module, intercept.InterceptedForward, {"kinds": kinds, "children": read})
            for name in read:  # measured with this module: left as they are
                self.visited.add(id(module.get_submodule(name)))
            return None
        if probe.CHANGES_PARAMETERS in (problem or ""):  # a replay would change them again
            return (
                f"{type(module).__name__} not converted: as a layer, {problem}; with its own forward kept, "
                f"{followed}; nor replayed per example, as its forward changes its parameters"
            )
        # the generic path: its forward (children included) replayed per example in backward (replay.py)
        adopt(module, replay.ReplayedForward, {})
        return None


@dataclass(frozen=True)
class Visit:
    """One module met by Conversion.visit: where it is, and the conversion meeting it."""

    conversion: "Conversion"
    module: nn.Module
    path: str
    parent: Optional[nn.Module]
    model: nn.Module

    @property
    def is_model(self):
        return self.module is self.model


def _excluded(at):
    return bool(at.path) and at.conversion.excluded(at.module, at.path)


def _note_excluded(at, _):
    if any(True for _ in at.module.parameters()):
        return f"{type(at.module).__name__} excluded by the caller (convert(exclude=...))"
    return None


def _called_methods(at):
    """The methods other than forward its parent calls (Gemma 3n's AltUp.predict and .correct), when it has trainable
    parameters: they run its parameters outside its forward."""
    called = replay.methods_called_by(at.parent, at.path.rpartition(".")[2], at.module) if at.path else ()
    return called if called and any(p.requires_grad for p in at.module.parameters()) else None


def _followed_calls(at):
    """The methods its parent calls (_called_methods), where the module's code computes with none of its children's
    parameters itself, in its forward or in those methods (it calls its children: each is measured on its own), and no
    weight of it is a parametrisation; else None."""
    called = _called_methods(at)
    if not called or replay.reparametrised(at.module) or replay.children_read(at.module, called) != ():
        return None
    return called


def _follow_calls(at, called):
    """Its own parameters' uses followed in its forward and in each method its parent calls (intercept.py)."""
    if not owns_untracked_parameters(at.module):
        return None
    kinds = intercept.parameter_kinds(at.module)
    if all(at.conversion.choice[KINDS.kind(k).config_key] == "nn" for k in kinds.values()):
        return None
    adopt(at.module, intercept.followed_class(called), {"kinds": kinds})
    return None


def _replay_with_calls(at, called):
    adopt(at.module, replay.replayed_class(called), {"subtree": True})
    return None


def _kind(at):
    """The kind of a module by its exact class, as a subclass keeping its class's forward, or by its structure (a
    module a convert() made a layer of a kind already is none: convert() called again leaves it as it is)."""
    conversion, module = at.conversion, at.module
    return (
        conversion.known.get(type(module))
        or conversion.inherited_kind(module)
        or next(
            (k for k in conversion.structural if not isinstance(module, PerExampleNormLayer) and k.matches(module)),
            None,
        )
    )


def _convert_kind(at, kind):
    return kind.in_parent(at.parent, at.path.rpartition(".")[2], at.module) or at.conversion.convert_known(
        at.module, kind
    )


@dataclass(frozen=True)
class Path:
    """One way convert() measures a module, tried in the order of PATHS: the first whose `applies` gives something
    (not None or False) converts it.

    Attributes:
        name: what GNSMonitor.explain() says measured the module.
        applies: applies(Visit) -> what `convert` needs (a kind, the methods called...), or None/False.
        convert: convert(Visit, what applies gave) -> None, or why the module is left as it is.
        why: why this path is the one for such a module (a str, or why(what applies gave) -> str).
        descends: its children are visited after (else the path holds the whole subtree, or nothing under it).
    """

    name: str
    applies: Callable
    convert: Callable
    why: Any
    descends: bool = True


# convert()'s paths, most specific first: the first that applies to a module converts it
PATHS = (
    Path("excluded", _excluded, _note_excluded, "the caller excluded it (convert(exclude=...))", descends=False),
    Path(
        "converted already",
        lambda at: isinstance(at.module, replay.ReplayedForward),
        lambda at, _: None,
        "convert() was called again",
        descends=False,
    ),
    Path(
        "followed with its parent's calls",
        _followed_calls,
        _follow_calls,
        lambda called: (
            f"its parent calls its methods {list(called)}, which run its parameters outside its forward, and its code "
            "calls its children without computing with their parameters: its own parameters' uses are followed in "
            "each call (conversion/intercept.py), its children measured each on its own"
        ),
    ),
    Path(
        "replayed with its parent's calls",
        _called_methods,
        _replay_with_calls,
        lambda called: (
            f"its parent calls its methods {list(called)}, which run its parameters outside its forward: each call "
            "is replayed per example, its children included (conversion/replay.py)"
        ),
        descends=False,
    ),
    Path(
        "replayed with its parametrisation",
        lambda at: not at.is_model and replay.reparametrised(at.module),
        lambda at, _: (at.conversion.unconverted.pop(at.path, None), at.conversion.replay_subtree(at.module))[1],
        "its weight is computed from other parameters (weight norm, spectral norm, orthogonal): replayed per example "
        "with its parametrisation, so each example's gradient is the original parameters' (conversion/replay.py)",
        descends=False,
    ),
    Path(
        "a kind's layer",
        _kind,
        _convert_kind,
        lambda kind: (
            f"its class or structure is the {kind.name} kind's (nanogns/kinds/__init__.py's KINDS): that kind's "
            "layer records its norms"
        ),
        descends=False,  # a kind's layer holds its whole subtree
    ),
    Path(
        "probed",
        lambda at: not at.is_model and owns_untracked_parameters(at.module),
        lambda at, _: at.conversion.convert_probed(at.module),
        "it owns parameters and no kind converts its class: a kind's layer where a probe shows it computes the "
        "same (conversion/probe.py), else its own forward kept with its parameters' uses followed "
        "(conversion/intercept.py), else replayed per example (conversion/replay.py)",
    ),
    Path(
        "replayed with its children",
        lambda at: not at.is_model and replay.reads_children_parameters(at.module),
        lambda at, _: at.conversion.replay_subtree(at.module),
        "its code reads a child's parameter itself (SigLIP2's embeddings, LFM2's short convolution): the child's "
        "layer would not see that use, so the module is replayed per example as one unit, children included",
    ),
    Path(
        "the model's own forward",
        lambda at: at.is_model and owns_untracked_parameters(at.module),
        lambda at, _: at.conversion.follow_uses(at.module, "it is the model itself"),
        "the model owns parameters itself: its forward kept, their uses followed (conversion/intercept.py)",
    ),
)
SILENT = ("converted already",)  # paths that leave the earlier note of how the module is measured


def outcome(module, found=None):
    """What a module became: a kind's layer (the kind `found`, when its path found one), its own forward with its
    parameters' uses followed, a replay per example, or itself (left as it is)."""
    if isinstance(module, replay.ReplayedForward):
        return "replayed per example"
    if isinstance(module, intercept.InterceptedForward):
        return "its own forward, its parameters' uses followed"
    kind = found.name if isinstance(found, LayerKind) else getattr(module, "pe_kind", None)
    return f"the {kind} kind's {type(module).__name__}" if kind else f"left as it is ({type(module).__name__})"


def _same_forward(cls, base):
    """True when every method the forward of `base` runs is the same function in `cls` (none overridden)."""
    found = replay.forward_methods(base)
    if not found:
        return False
    return all(getattr(cls, name, None) is getattr(base, name, None) for name in found)


def owns_untracked_parameters(module):
    """Parameters of its own and no per-example norm buffer (layers built with functional.py have one). A
    parameter that is also its child's (BERT's cls.predictions.bias is decoder.bias) is the child's."""
    in_children = {id(p) for child in module.children() for p in child.parameters()}
    own = [p for p in module.parameters(recurse=False) if id(p) not in in_children]
    return bool(own) and not any(n.endswith(BUFFER_SUFFIX) for n in module._buffers)


def attached_converter(choice, treat_as=None, exclude=()):
    """The converter of a monitor made by convert(): layers attached to the model later (a task head, a resized
    embedding's new module) are converted with the same choices when the monitor notices them (GNSMonitor.follow),
    before their first forward; returns {path: why} of those left as they are."""

    def convert_attached(model, attached):
        conversion = Conversion(choice, treat_as, exclude)
        for path, module, parent in attached:  # each (path, module, parent) is the top of a subtree attached since
            conversion.visit(module, path, parent, model)
        return conversion.unconverted

    return convert_attached


def check_choice(choice):
    """Raise ValueError, naming the choices, for a variant name no kind of its key offers."""
    for key, name in choice.items():
        kinds = [kind for kind in KINDS.values() if kind.config_key == key]
        if not any(name in kind.variants for kind in kinds):
            kinds[0].layer_class(name)  # raises, naming the choices


def convert(
    model: nn.Module,
    linearclass: str = "gns",
    embeddingclass: str = "gns",
    lnclass: str = "gns",
    treat_as: Optional[Dict[type, Union[str, Tuple[str, dict]]]] = None,
    exclude: Sequence[Union[str, type]] = (),
    **monitor: Any,
) -> GNSMonitor:
    """Give the layers of an existing model per-example norms, in place.

    Every module whose class is exactly one a layer kind replaces (torch's nn.Linear, nn.Embedding,
    nn.LayerNorm, nn.RMSNorm with a weight, transformers' Conv1D, ...) becomes that kind's variant chosen by
    `linearclass`, `embeddingclass` or `lnclass` ('nn' leaves the kind alone). Any other module owning
    parameters, such as transformers' LlamaRMSNorm, GemmaRMSNorm (scale 1 + weight), T5LayerNorm, nanoGPT's
    LayerNorm or a subclass of a torch class with its own forward, is converted when a probe shows that a
    per-example norm layer computes the same output and gradients (probe.py: the kind is found by what the
    module computes, not by its name; a subclass of a torch class is tried as that class's kind only).

    A converted module stays the same object, with the same Parameters, buffers, hooks, attributes and
    `state_dict` keys, and an instance of its class (its class gains the variant's forward); weights,
    devices, dtypes, tied weights and an optimizer built earlier carry over, and a module used in several
    places stays shared. Modules that cannot be converted are left untouched and listed with the reason in
    the returned monitor's `unconverted` and in one warning, and their parameters in its `untracked`. Such
    modules can call nanogns.kinds.functional from their forward.

    Args:
        treat_as: {module class: kind} for classes to probe as one kind only (a kind with a probe: docs/
            integrations.md's table of kinds), or {class: (kind, options)} to fix options the probe would
            otherwise search: eps (RMSNorm, LayerNorm), weight_offset (RMSNorm: 1.0 for a (1 + weight) scale),
            and "weight"/"bias": the names of the parameters playing those roles ({MyNorm: ("RMSNorm",
            {"weight": "scale"})}; a module whose only parameter is not named weight is probed with it as its
            weight anyway). Matched by exact class; the probe still decides.
        exclude: module paths ("model.layers.3", matching that module and everything under it) or module classes
            to leave as they are; listed as excluded, their parameters not tracked.
        monitor: keyword arguments of the GNSMonitor made of the model (log, scaler, ema_decay, out_dir, ...).
    Returns:
        GNSMonitor of the converted model, ready to `.step()`; its `unconverted` is this conversion's report.
    """
    choice = dict(linearclass=linearclass, embeddingclass=embeddingclass, lnclass=lnclass)
    check_choice(choice)  # an unknown name is an error before anything changes
    unconverted = Conversion(choice, treat_as, exclude).run(model)
    if unconverted:
        listing = "; ".join(f"{path or '(the model itself)'}: {reason}" for path, reason in unconverted.items())
        warnings.warn(f"convert(): {len(unconverted)} module(s) not converted, their parameters not tracked: {listing}")
    converter = attached_converter(choice, treat_as, exclude)  # for layers attached later (GNSMonitor.follow)
    return GNSMonitor(model, **{"expect_tracked": False, "unconverted": unconverted, "converter": converter, **monitor})
