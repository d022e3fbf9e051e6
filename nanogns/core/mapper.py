"""
A model's RowMapper: what `install(model)` (core/layout.py) sets up for one model and the monitor reads after each
step: the hooks' handles, the refusals its layers noted (a buffer whose rows could not be mapped, counted NaN:
the monitor's error says why), the layers that mixed the examples (a BatchNorm with the batch's statistics), the
tensors several modules record (SharedTensor, core/uses.py), the last forward's Pass (core/layout.py), whose
tensors used several times are summed at the latest by `finish()`.
"""

import weakref
from dataclasses import dataclass

BUFFER_SUFFIX = "_pe_sqnorm"  # the buffers' names end in it (core/buffers.py, which imports this module)


class RowMapper:
    """What `install(model)` sets up for a model: the hooks that give each of its forwards a Layout, and the
    reasons its layers gave for the rows they could not map this step (a buffer's count is then NaN, and the
    monitor's error says why). The monitor clears the reasons with the buffers after each step.

    Reasons are kept by the address range of the buffer they concern: a bank's buffer holds its slices' views.
    `shared` lists the tensors whose uses are summed together although several modules record them (a matrix
    tied between an embedding and a head): see core/uses.py."""

    def __init__(self, layout_of=None):
        self.layout_of = layout_of
        self.handles = ()
        self.refusals = {}  # {buffer's data_ptr: reason}
        self.mixing = {}  # {layer: why} of this step's layers that mixed the examples (batchnorm.py): no number
        self.shared = []  # [SharedTensor]: tensors recorded by several modules' buffers (uses.py)
        self._model = None  # a weak reference to the model installed (its parameters' buffers: buffer_of); weak,
        # since the last forward's Pass (a module global) holds this mapper, and a distributed engine must see the
        # model freed before it destroys its process group
        self._buffers_of = {}  # {id(parameter): its buffer}
        self.last_pass = None  # the last forward with gradients (its uses are finished before the next one)
        self.forwards = 0  # root forwards since the monitor's last read (none: the layers ran outside the model's)
        self.layouts = []  # the Layouts of those forwards with gradients (what a count error says it observed)
        self.watched_norms = set()  # ids of the batch-statistics norms whose mixing forwards are noted (batchnorm.py)
        self.step_watchers = []  # weak references to the monitors told of each step's first forward (start_step)
        self.step_started = False  # a forward with gradients ran since the monitor's last read
        self.later_forwards_watched = False  # the watchers are told of this step's later forwards too (later_forward)
        self.tags_ids = True  # the root's ids are tagged (core/ids.py); False: none are, as under torch.compile
        self.made_ids_callers = None  # the modules calling an Embedding (core/scopes.py), at a forward with no ids

    def note_refusal(self, reason, buffers):
        for buffer in buffers:
            if buffer is not None:
                self.refusals[buffer.data_ptr()] = reason

    def reasons(self, buffer):
        """The reasons noted for `buffer` or any view inside it."""
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        return [reason for address, reason in self.refusals.items() if start <= address < end]

    def note_mixing(self, layer, reason):
        self.mixing[layer] = reason

    def clear(self):
        self.refusals.clear()
        self.mixing.clear()
        self.forwards = 0
        self.layouts.clear()
        self.step_started = False
        self.later_forwards_watched = False

    def watch_steps(self, watcher):
        """Call watcher.at_step_start(module, args, kwargs) at the first forward of every step (held weakly)."""
        self.step_watchers.append(weakref.ref(watcher))

    def start_step(self, module, args, kwargs):
        """Tell the watchers (GNSMonitor.at_step_start) that a root forward begins before any with gradients has run
        this step (core/layout.py's root pre-hook calls it, until one with gradients has)."""
        for ref in list(self.step_watchers):
            watcher = ref()
            if watcher is None:
                self.step_watchers.remove(ref)
            else:
                watcher.at_step_start(module, args, kwargs)

    def later_forward(self, module, args, kwargs):
        """Tell the watchers (GNSMonitor.at_later_forward) of a root forward with gradients after the step's first,
        while one of them asked for it (later_forwards_watched: the mixing check waits for a forward of more than one
        example)."""
        for ref in list(self.step_watchers):
            watcher = ref()
            if watcher is not None:
                watcher.at_later_forward(module, args, kwargs)

    @property
    def model(self):
        return self._model() if self._model is not None else None

    @model.setter
    def model(self, model):
        self._model = weakref.ref(model) if model is not None else None

    def buffer_of(self, param):
        """The `<name>_pe_sqnorm` buffer recording parameter `param` on the model's modules, or None."""
        if id(param) not in self._buffers_of and self.model is not None:
            self._buffers_of = {
                id(p): module._buffers.get(name + BUFFER_SUFFIX)
                for module in self.model.modules()
                for name, p in module.named_parameters(recurse=False)
            }
        found = self._buffers_of.get(id(param))
        return found if found is not None and param.requires_grad else None

    def finish(self):
        """Record what the last forward's uses left pending (uses.py); the monitor calls it before reading a step."""
        if self.last_pass is not None:
            self.last_pass.finish()


@dataclass(frozen=True)
class SharedTensor:
    """One tensor whose per-example gradient several modules' buffers record (a tied embedding and head).

    Attributes:
        members: ((module, buffer name), ...), the first one's buffer records the sum of every use's gradient.
        pairwise: True when each member used once is measured by the members' own norms and a cross term (tied.py).
    """

    members: tuple
    pairwise: bool = False

    def addresses(self):
        return tuple(module._buffers[name].data_ptr() for module, name in self.members)

    def target(self):
        module, name = self.members[0]
        return module._buffers[name]
