"""
The monitor follows the model: parameters added, removed, resized, frozen or unfrozen after the monitor was made are
noticed, and the monitor's list of what it measures is made again (GNSMonitor.follow).

A model changes after convert() in ordinary training: a task head attached, `resize_token_embeddings` after special
tokens are added (a new embedding or head module, or the same one with a larger weight), gradual unfreezing, a block
frozen. Each is noticed at the first forward of the next step (the root's pre-hook calls the monitor: core/layout.py's start,
RowMapper.start_step), before the new layers run, so that a monitor made by convert() converts them with the same
choices and measures them in that very step; and again when the step is read. Nothing changes silently: one warning
names what changed and what became of it, and `monitor.untracked` gives every parameter that is not measured its
reason.

Cost: ModelShape.same() compares, in C (map over the modules' dicts), the module tree, and each module's parameters
(which tensor, requires_grad, shape) with what they were: no walk of the modules in Python and no torch op, about
twenty Python calls whatever the model's size (tests/test_bench_call_overhead.py holds the step's calls). Only when
something differs is the model walked (`changes`), which an engine replacing parameter objects by others of the same
names and shapes (FSDP2's fully_shard) triggers once, changing nothing.
"""

import functools
import itertools
import operator
from typing import Dict, List, NamedTuple, Tuple

import torch.nn as nn

_PARAMETERS_OF = operator.attrgetter("_parameters")
_CHILDREN_OF = operator.attrgetter("_modules")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SHAPE = operator.attrgetter("shape")
_NOT_NONE = functools.partial(operator.is_not, None)


class ModelShape:
    """What the model's parameters were when last looked at: the module tree, each parameter tensor, whether it
    requires a gradient, its shape; `same()` says whether they still are, in a handful of C calls."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.take()

    def _now(self):
        children = list(itertools.chain.from_iterable(map(dict.values, map(_CHILDREN_OF, self._modules))))
        params = list(
            filter(_NOT_NONE, itertools.chain.from_iterable(map(dict.values, map(_PARAMETERS_OF, self._modules))))
        )
        return children, params

    def take(self) -> None:
        """Remember the model as it is now."""
        self._modules = list(self.model.modules())
        self.module_ids = set(map(id, self._modules))
        self._children, self._params = self._now()
        self._flags = list(map(_REQUIRES_GRAD, self._params))
        self._shapes = list(map(_SHAPE, self._params))
        self.parameters = {name: (tuple(p.shape), p.requires_grad) for name, p in self.model.named_parameters()}

    def same(self) -> bool:
        """True when no module was attached, replaced or removed, and no parameter added, replaced, resized, frozen
        or unfrozen since take()."""
        children, params = self._now()
        return (
            len(children) == len(self._children)
            and all(map(operator.is_, children, self._children))
            and len(params) == len(self._params)
            and all(map(operator.is_, params, self._params))
            and list(map(_REQUIRES_GRAD, params)) == self._flags
            and list(map(_SHAPE, params)) == self._shapes
        )

    def added_modules(self) -> List[Tuple[str, nn.Module, nn.Module]]:
        """[(path, module, parent)] of the top modules of every subtree attached since take() (none owned before)."""
        found = []
        for path, module in self.model.named_modules():
            for name, child in module._modules.items():
                if child is not None and id(child) not in self.module_ids and id(module) in self.module_ids:
                    found.append((path + ("." if path else "") + name, child, module))
        return found


class Changes(NamedTuple):
    """What differs between two looks at a model's parameters, by name."""

    added: List[str]
    removed: List[str]
    resized: Dict[str, Tuple[tuple, tuple]]
    unfrozen: List[str]
    frozen: List[str]

    def __bool__(self):
        return any(map(bool, self))


def changes(before: Dict[str, Tuple[tuple, bool]], after: Dict[str, Tuple[tuple, bool]]) -> Changes:
    """The parameters added, removed, resized, unfrozen and frozen between two {name: (shape, requires_grad)}."""
    kept = [name for name in after if name in before]
    return Changes(
        added=[name for name in after if name not in before],
        removed=[name for name in before if name not in after],
        resized={name: (before[name][0], after[name][0]) for name in kept if before[name][0] != after[name][0]},
        unfrozen=[name for name in kept if after[name][1] and not before[name][1]],
        frozen=[name for name in kept if before[name][1] and not after[name][1]],
    )


def describe_changes(found: Changes, tracked: set, untracked: Dict[str, str], step: int) -> str:
    """One line: what changed since step `step` and, for each parameter, whether it is measured now."""

    def outcome(name):
        logged = next((t for t in tracked if name in t.split("+")), None)
        if logged is not None and name not in untracked:
            return f"{name} (measured{'' if logged == name else ' as ' + logged})"
        return f"{name} (not measured: {untracked.get(name, 'its layer records no per-example norms')})"

    parts = []
    if found.added:
        parts.append("added " + ", ".join(map(outcome, found.added)))
    if found.unfrozen:
        parts.append("unfrozen " + ", ".join(map(outcome, found.unfrozen)))
    if found.resized:
        parts.append(
            "resized " + ", ".join(f"{outcome(name)} {list(a)} -> {list(b)}" for name, (a, b) in found.resized.items())
        )
    if found.frozen:
        parts.append("frozen " + ", ".join(found.frozen) + " (not measured: frozen, no gradient)")
    if found.removed:
        parts.append("removed " + ", ".join(found.removed))
    return f"GNS: the model's parameters changed after step {step}: " + "; ".join(parts)
