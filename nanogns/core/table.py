"""
One flat tensor behind every per-example norm buffer of a model: the BufferTable.

`BufferTable.build` re-homes every `<param>_pe_sqnorm` buffer of the model as a view of one float32 tensor per
device (`flats`), so that a step's reading (monitor/reader.py's StepReader.read: one gather of the sums and counts)
and zeroing (`zero`) are one op each whatever the number of buffers, instead of one or two per buffer. The hand-off
is the view itself: a layer's backward adds to its buffer in place (core/buffers.py's add_pe_sqnorm), and the add
lands in `flats`, where the monitor reads it. Both ends name it: add_pe_sqnorm's docstring points here, and
StepReader.read rebuilds the table (`current()` false) before it reads. bench/read_ops.py measures what it saves
(`--per-buffer` reads and zeroes the same buffers one by one).

The table is the model's (`buffer_table(model)`), kept in the model's ModuleState (core/module_state.py), not a
submodule or a buffer, so state_dict and copies stay clean.
"""

import itertools
import operator

import torch

from nanogns.core.mapper import BUFFER_SUFFIX
from nanogns.core.module_state import state_of
from nanogns.errors import NotSupported

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

# why tensor-parallel layers are refused, wherever that is found (a sharded parameter in a forward, sharded buffers)
TENSOR_PARALLEL = (
    "each rank would record the norms of its shard of the examples' gradients, which the monitor "
    "does not combine; measure with data parallelism only (DDP, FSDP2, HSDP)"
)


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


_BUFFERS_OF = operator.attrgetter("_buffers")
_CHILDREN_OF = operator.attrgetter("_modules")


class BufferTable:
    """Every per-example norm buffer of a model (names ending in BUFFER_SUFFIX) re-homed as a view of one flat
    float32 tensor per device, so that a step's reading and zeroing are one op each, not one per buffer.

    A buffer replaced since (model.to(device) moves buffers), a buffer added to a module of the model, and a
    submodule attached or replaced are noticed by `current()` (the monitor's read and zero_pe_sqnorm_buffers ask
    it), and the table is rebuilt. The check compares the modules' children, their numbers of buffers and the
    table's buffers with what they were when it was built, by identity, in C: no walk of the modules in Python.
    """

    def __init__(self, model):
        self.model = model
        self.views = []  # [(module, buffer name, view)]
        self.flats = {}  # device -> flat tensor (one extra zero element at the end: a padding slot)
        self.slot = {}  # (id(module), buffer name) -> (device, offset in its flat)
        self._owners, self._names, self._views = [], [], []  # the views' columns, for current()
        self._modules, self._children, self._buffer_counts = [], [], []  # the module tree as built, for current()
        self.build()

    def current(self):
        """True when every buffer is still the table's view, and no submodule or buffer was added or replaced."""
        children = list(itertools.chain.from_iterable(map(dict.values, map(_CHILDREN_OF, self._modules))))
        return (
            len(children) == len(self._children)
            and all(map(operator.is_, children, self._children))
            and list(map(len, map(_BUFFERS_OF, self._modules))) == self._buffer_counts
            and all(map(operator.is_, map(dict.get, map(_BUFFERS_OF, self._owners), self._names), self._views))
        )

    def build(self):
        self._modules = list(self.model.modules())
        self._children = list(itertools.chain.from_iterable(map(dict.values, map(_CHILDREN_OF, self._modules))))
        self._buffer_counts = list(map(len, map(_BUFFERS_OF, self._modules)))
        entries = [
            (m, n, b)
            for m in self._modules
            for n, b in m._buffers.items()
            if b is not None and n.endswith(BUFFER_SUFFIX)
        ]
        if any(is_dtensor(b) for _, _, b in entries):  # parallelize_module distributes the buffers too
            raise NotSupported(
                "GNS: the model's layers are sharded by tensor parallelism (their buffers are DTensors): "
                + TENSOR_PARALLEL
            )
        sizes = {}
        for _, _, b in entries:
            sizes[b.device] = sizes.get(b.device, 0) + b.numel()
        self.flats = {
            device: torch.zeros(size + 1, dtype=torch.float32, device=device) for device, size in sizes.items()
        }
        offsets = {device: 0 for device in sizes}
        self.views, self.slot = [], {}
        with torch.no_grad():
            for module, name, buffer in entries:
                device, n = buffer.device, buffer.numel()
                view = self.flats[device][offsets[device] : offsets[device] + n].view(buffer.shape)
                view.copy_(buffer)
                module._buffers[name] = view
                self.views.append((module, name, view))
                self.slot[(id(module), name)] = (device, offsets[device])
                offsets[device] += n
        self._owners = [module for module, _, _ in self.views]
        self._names = [name for _, name, _ in self.views]
        self._views = [view for _, _, view in self.views]

    def zero(self):
        """Zero every buffer (one op per device)."""
        for flat in self.flats.values():
            flat.zero_()


def buffer_table(model):
    """The model's one BufferTable, shared by every monitor of it (two tables would keep replacing each other's
    buffers and rebuild at every read)."""
    state = state_of(model)
    if state.buffer_table is None:
        state.buffer_table = BufferTable(model)
    return state.buffer_table
