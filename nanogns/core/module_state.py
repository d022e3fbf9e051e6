"""
What the package keeps on a user's module besides its `<param>_pe_sqnorm` buffers: one ModuleState, read and
written through `state_of(module)` only.

It lives in the module's `__dict__` under STATE_ATTRIBUTE: not a submodule, parameter or buffer, so state_dict,
named_modules and the engines' wrapping never see it. A copy of a module (copy.copy for a probe's twin, deepcopy
for an EMA twin) gets its own state on first access, a copy of the original's, so that marking one never marks
the other.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

STATE_ATTRIBUTE = "_pe_state"


@dataclass(eq=False)
class ModuleState:
    """Everything the package notes on one module (each field's writer in brackets).

    Attributes:
        kinds: {parameter name: layer kind} for parameters whose norms the module's own code records, where its
            class's `pe_kind` does not say (functional.register_buffers, the experts, attention, the replayed and
            intercepted modules); read by the monitor's record (monitor/tracked.py).
        row_mapper: the RowMapper of a model `install` was called on (core/layout.py).
        buffer_table: the model's BufferTable (core/table.py).
        tables_hooked: its forward pre-hook marking a parameter passed as input as a table is registered
            (core/registry.py's adopt, core/shared.py).
        tied: the TiedParameter of an Embedding whose weight a Linear shares (core/tied.py).
        replay_subtree: its whole subtree is replayed as one unit (conversion/replay.py); convert() then leaves
            its children as they are.
        replay_vmap: False once vmap failed on its forward: its examples are replayed one by one (replay.py).
        replay_changed: the buffers its forward changes, restored before each replay (replay.py).
        replay_calls: its replayed methods running now: a call inside a call runs plainly (replay.py).
        measured_by: (path, why): which of convert()'s paths measures it and why (conversion/convert.py), what
            GNSMonitor.explain() reports.
        read_children: names of the children whose parameters its own code reads, their uses followed by its
            kept forward with its own (conversion/intercept.py); convert() leaves them as they are.
    """

    owner: int = 0  # id() of the module this state belongs to (a copy's is another)
    kinds: dict = field(default_factory=dict)
    row_mapper: Any = None
    buffer_table: Any = None
    tables_hooked: bool = False
    tied: Any = None
    replay_subtree: bool = False
    replay_vmap: bool = True
    replay_changed: tuple = ()
    replay_calls: int = 0
    measured_by: Optional[tuple] = None
    read_children: tuple = ()


def state_of(module) -> ModuleState:
    """The ModuleState of `module` (made on first access; a copied module's is a copy of the original's)."""
    found = module.__dict__.get(STATE_ATTRIBUTE)
    if found is None or found.owner != id(module):
        found = ModuleState(owner=id(module)) if found is None else _copied(found, module)
        module.__dict__[STATE_ATTRIBUTE] = found
    return found


def _copied(state, module):
    """A copy's own state: the original's values (as the copy of its __dict__ holds them), its own kinds."""
    return dataclasses.replace(state, owner=id(module), kinds=dict(state.kinds))
