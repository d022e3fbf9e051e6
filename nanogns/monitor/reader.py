"""
A step's numbers in a handful of ops whatever the model's size: every per-example norm buffer is a view of one
flat tensor (core/buffers.py's BufferTable, which zeroes them in one op too), the gradients' norms come from one
torch._foreach_norm, the ranks' sums from one all-reduce, and the numbers reach the host in one sync (StepReader).
Under data parallelism (DDP, FSDP2, HSDP) a gradient may be a DTensor: each rank reads its shard (grad_piece).
"""

import itertools
import operator

import numpy as np
import torch

from nanogns.core.table import BufferTable, buffer_table, is_dtensor  # noqa: F401  (the monitor's names for them)
from nanogns.errors import StepNotMeasured

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

_PARAMETERS_OF = operator.attrgetter("_parameters")
_GRAD_OF = operator.attrgetter("grad")

# -----------------------------------------------------------------------------
# reading a step: a handful of ops whatever the number of parameters


def world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_dtensor(tensors):
    """True when one of `tensors` (None allowed) is a DTensor: a pass in C over them, then one check per type."""
    return DTensor is not None and any(issubclass(t, DTensor) for t in set(map(type, tensors)))


def grad_piece(grad, copies_by_layout):
    """(this rank's part of a gradient, how many ranks hold that same part): a plain gradient is whole on every
    rank (DDP averaged it); a DTensor's local shard is its part, repeated over the mesh dims it is Replicate on
    (HSDP's replicas). Partial placements (sums not yet reduced) are refused."""
    if not is_dtensor(grad):
        return grad, None
    return grad._local_tensor, _copies(grad.device_mesh, grad.placements, copies_by_layout)  # no op per parameter


def _copies(mesh, placements, copies_by_layout):
    """How many ranks hold the same shard under `placements` on `mesh`, kept in `copies_by_layout` ({(id(mesh),
    placements): copies}, the StepReader's: reading a mesh's shape builds a tensor each time)."""
    key = (id(mesh), tuple(placements))
    if key not in copies_by_layout:
        if any(p.is_partial() for p in placements):
            raise StepNotMeasured(
                "GNS: a gradient with a Partial placement (not yet reduced across ranks) cannot be read; "
                "read the step after the gradients are reduced"
            )
        if mesh.size() != world_size():
            raise StepNotMeasured(
                f"GNS: a DTensor gradient on a mesh of {mesh.size()} ranks in a world of "
                f"{world_size()}: the monitor adds the ranks' shards over the whole world"
            )
        copies = 1
        for placement, size in zip(placements, mesh.mesh.shape):
            copies *= size if placement.is_replicate() else 1
        copies_by_layout[key] = copies
    return copies_by_layout[key]


class StepReader:
    """The numbers of one step for a list of tracked tensors, in a number of ops that does not grow with them:
    their gradients' squared norms (torch._foreach_norm), their buffers' sums and counts (one gather each from the
    BufferTable), one all-reduce of what the ranks add up, one host sync.

    Args:
        table: the model's BufferTable.
        tracked: [Tracked(name, ref, terms)].
        untracked_params: callable -> the parameters whose gradients only the GradScaler's finiteness check reads.
    """

    def __init__(self, table, tracked, untracked_params):
        self.table, self.tracked, self.untracked_params = table, tracked, untracked_params
        self._indices = self._built_for = None
        self._modules = [entry.ref.module for entry in tracked]  # where each parameter lives (gradients())
        self._attrs = [entry.ref.attr for entry in tracked]
        self._plans = {}  # the index tensors squared_norms needs, by the gradients' pattern (dtypes, shards, absences)
        self._copies_by_layout = {}  # {(id(mesh), placements): ranks holding each shard} of the sharded gradients

    def indices(self):
        """Per device: (term slot of each [sum] (k,), its entry (k,), its coefficient (k,), count slots (n, slices))."""
        if self._indices is not None and self._built_for is self.table.views:
            return self._indices
        n = len(self.tracked)
        per_device = {}
        for i, entry in enumerate(self.tracked):
            for module, name, coefficient in entry.terms:
                device, offset = self.table.slot[(id(module), name)]
                numel = module._buffers[name].numel()
                sums = per_device.setdefault(device, ([], [], [], [[] for _ in range(n)]))
                for row in range(numel // 2):  # a bank's buffer: one [sum, count] per slice
                    sums[0].append(offset + 2 * row)
                    sums[1].append(i)
                    sums[2].append(coefficient)
                    sums[3][i].append(offset + 2 * row + 1)  # the examples: the most any term counted
        self._indices = {}
        for device, (slots, entries, coefficients, counts) in per_device.items():
            pad = self.table.flats[device].numel() - 1  # the zero padding slot
            width = max(1, max(len(c) for c in counts))
            count_slots = [c + [pad] * (width - len(c)) for c in counts]
            self._indices[device] = tuple(torch.tensor(v, device=device) for v in (slots, entries)) + (
                torch.tensor(coefficients, dtype=torch.float32, device=device),
                torch.tensor(count_slots, device=device),
            )
        self._built_for = self.table.views
        return self._indices

    def read(self, scaler_on=False, across_ranks=True):
        """(values (n, 3) float64 numpy array: ||grad||^2, sum of the buffers' sums over all ranks, examples counted;
        all gradients finite (computed only when scaler_on, else True); names of tracked tensors without a gradient).
        The sums are those of the local backward's per-example contributions, added over the ranks (this rank's
        alone when not across_ranks: nanogns.verify's check of one rank's batch)."""
        if not self.table.current():
            self.table.build()
        indices = self.indices()
        n = len(self.tracked)
        grads = self.gradients()
        no_grad = [entry.name for entry, grad in zip(self.tracked, grads) if grad is None]
        device = next(iter(self.table.flats), torch.device("cpu"))
        whole_sq, shard_sq = self.squared_norms(grads, device)
        sums = torch.zeros(n, dtype=torch.float32, device=device)
        counts = None
        for flat_device, (slots, entries, coefficients, count_slots) in indices.items():
            flat = self.table.flats[flat_device]
            sums.index_add_(0, entries.to(device), (flat[slots] * coefficients).to(device))
            found = flat[count_slots].amax(dim=1).to(device)
            counts = found if counts is None else torch.maximum(counts, found)
        parts = [sums, counts if counts is not None else torch.zeros_like(sums)]
        parts += [shard_sq.float()] if shard_sq is not None else []
        if scaler_on:  # GradScaler skips a step where any gradient is inf/nan: the untracked ones too
            others = list(self.untracked_params())
            if others:
                others_whole, others_shard = self.squared_norms(others, device, plan_key="untracked")
                parts.append(others_whole.sum().reshape(1).float())
                parts += [others_shard.sum().reshape(1).float()] if others_shard is not None else []
        reduced = torch.cat(parts)
        if across_ranks and world_size() > 1:
            torch.distributed.all_reduce(reduced)
        values = torch.cat([whole_sq, reduced.double()]).cpu().numpy()  # the one host sync
        grad_sq = values[:n] + (values[3 * n : 4 * n] if shard_sq is not None else 0.0)
        table = np.stack([grad_sq, values[n : 2 * n], values[2 * n : 3 * n]], axis=1)
        rest = values[(4 if shard_sq is not None else 3) * n :]
        finite = bool(np.isfinite(grad_sq).all() and np.isfinite(rest).all()) if scaler_on else True
        return table, finite, no_grad

    def gradients(self):
        """The tracked tensors' gradients (None where absent), each parameter looked up on its module now (an engine
        may have replaced it since: FSDP2's fully_shard); in C, not a Python call per parameter."""
        parameters = map(dict.__getitem__, map(_PARAMETERS_OF, self._modules), self._attrs)
        return list(map(_GRAD_OF, parameters))

    def squared_norms(self, grads, device, plan_key="tracked"):
        """(squared norms of the whole gradients (n,) float64, of this rank's shards divided by their copies (n,)
        float64, or None when no gradient is sharded); zero where a gradient is absent. One _foreach_norm per
        dtype family (float64 gradients keep float64 norms; any other dtype: float32), index tensors cached."""
        sharded_engine = any_dtensor(grads)
        if sharded_engine:
            pieces = [grad_piece(g, self._copies_by_layout) if g is not None else (None, None) for g in grads]
        else:  # plain tensors: each whole on this rank
            pieces = list(zip(grads, itertools.repeat(None)))
        dtypes = tuple(map(getattr, grads, itertools.repeat("dtype"), itertools.repeat(None)))  # None: no gradient
        pattern = (dtypes, tuple(copies for _, copies in pieces) if sharded_engine else None)
        plans = self._plans.setdefault(plan_key, {})
        if pattern not in plans:
            groups = []
            for wide in (False, True):
                chosen = [i for i, (t, _) in enumerate(pieces) if t is not None and (t.dtype == torch.float64) == wide]
                if chosen:
                    copies = torch.tensor([pieces[i][1] or 1 for i in chosen], dtype=torch.float64, device=device)
                    sharded = torch.tensor([pieces[i][1] is not None for i in chosen], device=device)
                    groups.append((wide, chosen, torch.tensor(chosen, device=device), copies, sharded))
            everything = len(groups) == 1 and len(groups[0][1]) == len(grads)
            plans[pattern] = (groups, everything, any(c is not None for _, c in pieces))
        groups, everything, any_sharded = plans[pattern]
        whole = None if everything else torch.zeros(len(grads), dtype=torch.float64, device=device)
        shard = torch.zeros(len(grads), dtype=torch.float64, device=device) if any_sharded else None
        for wide, chosen, index, copies, sharded in groups:
            tensors = [pieces[i][0] for i in chosen]
            sq = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64 if wide else torch.float32))
            sq = sq.to(device, torch.float64).pow(2)
            if any_sharded:
                shard.index_copy_(0, index, torch.where(sharded, sq / copies, torch.zeros_like(sq)))
                sq = torch.where(sharded, torch.zeros_like(sq), sq)
            if everything:
                whole = sq  # every gradient present, one dtype family: already in order
            else:
                whole.index_copy_(0, index, sq)
        if whole is None:
            whole = torch.zeros(len(grads), dtype=torch.float64, device=device)
        return whole, shard
