"""
The measurements of a training step: for each tracked parameter p,
    norm = ||p.grad||                    the batch gradient's norm
    pegn = sqrt(mean_i ||g_i||^2)        from the layer's `<p>_upegsqnorm` buffer
    batch_size = B                       examples in the step (all micro-batches, all ranks)
(see buffered.py for how the buffers are filled, estimator.py for the GNS made of them).

One object does it all in a training loop, GNSMonitor:

    gns = GNSMonitor(model, log=log)     # or gns = layer_config.convert(model, log=log)
    ...backward of every micro-batch...
    gns.step(batch_size=B)               # before clipping, scaler.step and zero_grad: measure, zero, log

Which parameters are tracked: every trainable one whose layer keeps a
`<name>_upegsqnorm` buffer (find_tracked_parameters). The others are listed in
`gns.untracked` with the reason; frozen parameters (requires_grad=False) are never
measurements. Parameters are looked up on their modules at every read, so a model
sharded after the monitor was made (FSDP2) is read correctly.

A step is read in a handful of ops whatever the model's size (StepReader): every
buffer is a view of one flat tensor (BufferTable), the gradients' norms come from
one torch._foreach_norm, the ranks' sums from one all-reduce, and the numbers reach
the host in one sync. Under data parallelism (DDP, FSDP2, HSDP) each rank's backward
gives its examples' parts of the gradient, which the engine averages over the world:
example i's gradient g_i is B / world times its local part, whatever each rank's
share of the B examples (so unequal shares are exact).
"""

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Dict, List, NamedTuple, Tuple

import numpy as np
import torch
import torch.nn as nn

from nanogns.layers import layout
from nanogns.layers.buffers import BUFFER_SUFFIX, TENSOR_PARALLEL, is_dtensor, refused, refused_addresses
from nanogns.estimator import RunningGNS
from nanogns.layers.sogns import SOGNS_SUFFIX
from nanogns.layers.tied import link_tied_parameters

PARAMETERS_JSON = "gns_parameters.json"  # beside log.csv: what each tracked parameter is (describe_tracked)
APPROX_PREFIX = "train/sogns/"  # log columns of approximate (SOGNS) norms


# -----------------------------------------------------------------------------
# measurements

@dataclasses.dataclass
class Measurement:
    """One parameter's norms for one step: the batch gradient's norm (big batch,
    B examples) and the root mean squared per-example gradient norm (small
    batch of 1). `metadata["name"]` is the name in `model.named_parameters()`."""

    big_batch_norm: float
    small_batch_norm: float
    big_batch_size: int
    small_batch_size: int = 1
    metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def msg(self, prefix=""):
        """The scalar fields as a flat dict, for a logger."""
        return {prefix + k: v for k, v in dataclasses.asdict(self).items() if k != "metadata"}


def summed_sqnorms(measurements):
    """(sum of norm^2, sum of pegn^2, batch size) over measurements of one step."""
    if not measurements:
        return math.nan, math.nan, 0
    sq_norm = sum(m.big_batch_norm ** 2 for m in measurements)
    pe_sqnorm = sum(m.small_batch_norm ** 2 for m in measurements)
    return sq_norm, pe_sqnorm, measurements[0].big_batch_size


class ParameterRef:
    """Where a parameter lives: `module._parameters[attr]`, looked up on every read.

    Engines that shard a model after the monitor was made (FSDP2's fully_shard)
    put new Parameter objects (DTensors) on the same modules, so a monitor that
    held the old objects would read gradients that never come."""

    def __init__(self, module, attr):
        self.module, self.attr = module, attr

    def get(self):
        return self.module._parameters[self.attr]


class Tracked(NamedTuple):
    """One tracked tensor: its logged name, where it lives, and the buffer terms whose
    weighted sum is its [sum_i ||g_i / n||^2, n] (see find_tracked_parameters)."""

    name: str
    ref: ParameterRef
    terms: List[Tuple[Any, str, float]]


def _owner(model, name):
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def layer_kind(module, attr):
    """What kind of layer records `attr`'s per-example norms: 'Linear', 'Embedding', 'LayerNorm',
    'RMSNorm' (a class's `pe_kind`, or what functional.register_buffers was told), else 'unknown'."""
    declared = getattr(module, "_pe_kinds", {}).get(attr)
    return declared or getattr(module, "pe_kind", None) or "unknown"


def block_index(model, module_path):
    """The index of the first container (nn.ModuleList / nn.Sequential) entry on the path to a
    module: transformer.h.3.attn.c_attn -> 3, model.layers.2.mlp -> 2; None outside any."""
    module = model
    for component in module_path.split(".") if module_path else []:
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and component.isdigit():
            return int(component)
        module = module._modules[component]
    return None


def _is_alias_of(recorded, names):
    """True when one name records the tensor's norms and every other name is on a module that contains that
    layer (an attribute of a parent pointing at its child's parameter)."""
    if len(recorded) != 1:
        return False
    layer_path = recorded[0].rpartition(".")[0]
    return all(n == recorded[0] or layer_path.startswith(n.rpartition(".")[0] + ".") or n.rpartition(".")[0] == ""
               for n in names)


def find_tracked_parameters(model, suffix=BUFFER_SUFFIX):
    """Split `model`'s parameters by whether their per-example norms can be read.

    Args:
        suffix: the buffer suffix to look for (BUFFER_SUFFIX for exact norms;
            another suffix reads another method's buffers, e.g. sogns.SOGNS_SUFFIX).
    Returns:
        tracked: [Tracked(name, ref, terms)] in `named_parameters()` order, where
            terms = [(module, buffer name, coefficient)] whose buffers' weighted sum is the parameter's
            [sum_i ||g_i / B||^2, count]: one buffer for an ordinary parameter (of shape (2,), or
            (..., 2) for a bank of disjoint slices, see functional.register_buffers); three for a
            tensor tied between an Embedding and a Linear (each use's buffer and twice the cross
            term, see tied.py), logged under its names joined by "+".
        skipped: {name: reason} for every other parameter; frozen ones (requires_grad=False)
            are never measurements.
    """
    buffers = {name for name, _ in model.named_buffers()}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied = link_tied_parameters(model) if suffix == BUFFER_SUFFIX else {}
    tracked, skipped = [], {}
    for name, param in model.named_parameters():
        names = aliases[id(param)]
        module, attr = _owner(model, name)
        if not param.requires_grad:
            skipped[name] = "frozen (requires_grad=False): it gets no gradient, so there is nothing to measure"
            continue
        if id(param) in tied:
            link = tied[id(param)]
            tracked.append(Tracked("+".join(link.names), ParameterRef(module, attr), link.terms))
            continue
        # one module registered under several paths (a shared module) has one owner and one exact buffer, as
        # long as it runs once per example (step() stops tracking it, with a warning, if it counts more)
        owners = {id(_owner(model, n)[0]) for n in names}
        parametrized_layer = name.split(".parametrizations.")[0] if ".parametrizations." in name else None
        recorded = [n for n in names if n + suffix in buffers]
        if len(owners) > 1 and _is_alias_of(recorded, names):
            # a parent's attribute naming its child layer's parameter (BERT's cls.predictions.bias is
            # cls.predictions.decoder.bias): one use, recorded by the child, logged once
            layer, layer_attr = _owner(model, recorded[0])
            tracked.append(Tracked(name, ParameterRef(module, attr), [(layer, layer_attr + suffix, 1.0)]))
            continue
        if len(owners) > 1 and any(n + suffix in buffers for n in names):
            layers_using = [type(_owner(model, n)[0]).__name__ for n in names]
            skipped[name] = (f"tied to {', '.join(n for n in names if n != name)}: one tensor used by {len(owners)} "
                             f"layers ({', '.join(layers_using)}); the norm of its per-example gradient needs the "
                             "cross terms between every pair of uses, which are computed for one Embedding and one "
                             "Linear that both record per-example norms, and for no other sharing")
        elif parametrized_layer is not None and parametrized_layer + "." + name.split(".")[-2] + suffix in buffers:
            skipped[name] = ("parametrized (torch.nn.utils.parametrize, e.g. spectral_norm): the layer records the "
                             "per-example norms of the weight it computes, not of this trainable tensor")
        elif name + suffix not in buffers:
            skipped[name] = "its layer records no per-example norms (a plain torch layer)"
        else:
            tracked.append(Tracked(name, ParameterRef(module, attr), [(module, attr + suffix, 1.0)]))
    return tracked, skipped


def describe_tracked(model, tracked):
    """{logged name: what it is}: layer kind, layer class, block, every name of the tensor, elements.

    Written beside the log (PARAMETERS_JSON) so that gns-analysis.py groups by these
    facts rather than by parameter names."""
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    record = {}
    for entry in tracked:
        param = entry.ref.get()
        first = aliases[id(param)][0]
        if len(entry.terms) > 1:  # a tied Embedding/Linear pair (tied.py)
            kind, layer = "Embedding+Linear", "+".join(type(m).__name__ for m, _, _ in entry.terms[:2])
        else:  # the layer that records it (for an alias, the child layer rather than the parent naming it)
            recorder, buffer_name, _ = entry.terms[0]
            kind, layer = layer_kind(recorder, buffer_name[:-len(BUFFER_SUFFIX)]), type(recorder).__name__
        buffer = entry.terms[0][0]._buffers[entry.terms[0][1]]
        record[entry.name] = {
            "kind": kind, "layer": layer.removeprefix("FSDP"),
            "block": block_index(model, first.rpartition(".")[0]),
            "names": aliases[id(param)], "numel": param.numel(),
            "bank_slices": int(buffer.numel() // 2) if buffer.dim() > 1 else None,
        }
    return record


def write_parameter_record(out_dir, record):
    """out_dir/PARAMETERS_JSON, written atomically (a resumed run rewrites the same facts)."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": 1, "parameters": record}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def read_parameter_record(out_dir):
    """{logged name: facts} from out_dir/PARAMETERS_JSON, or None for a log without one (e.g. the paper's code)."""
    path = os.path.join(out_dir, PARAMETERS_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["parameters"]


# -----------------------------------------------------------------------------
# reading a step: a handful of ops whatever the number of parameters

def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def grad_piece(grad):
    """(this rank's part of a gradient, how many ranks hold that same part): a plain gradient is whole on every
    rank (DDP averaged it); a DTensor's local shard is its part, repeated over the mesh dims it is Replicate on
    (HSDP's replicas). Partial placements (sums not yet reduced) are refused."""
    if not is_dtensor(grad):
        return grad, None
    return grad._local_tensor, _copies(grad.device_mesh, grad.placements)  # the attribute: no op per parameter


_copies_by_layout = {}  # (id(mesh), placements) -> copies: reading a mesh's shape builds a tensor each time


def _copies(mesh, placements):
    key = (id(mesh), tuple(placements))
    if key not in _copies_by_layout:
        if any(p.is_partial() for p in placements):
            raise ValueError("GNS: a gradient with a Partial placement (not yet reduced across ranks) cannot be read; "
                             "read the step after the gradients are reduced")
        if mesh.size() != _world_size():
            raise ValueError(f"GNS: a DTensor gradient on a mesh of {mesh.size()} ranks in a world of "
                             f"{_world_size()}: the monitor adds the ranks' shards over the whole world")
        copies = 1
        for placement, size in zip(placements, mesh.mesh.shape):
            copies *= size if placement.is_replicate() else 1
        _copies_by_layout[key] = copies
    return _copies_by_layout[key]


class BufferTable:
    """Every per-example norm buffer of a model (names ending in BUFFER_SUFFIX) re-homed as a view of one flat
    float32 tensor per device, so that a step's reading and zeroing are one op each, not one per buffer.

    A buffer replaced since (model.to(device) moves buffers) is noticed at the next read, and the table rebuilt.
    """

    def __init__(self, model):
        self.model = model
        self.views = []  # [(module, buffer name, view)]
        self.flats = {}  # device -> flat tensor (one extra zero element at the end: a padding slot)
        self.build()

    def current(self):
        """True when every buffer is still the table's view and no buffer was added."""
        found = [(m, n) for m in self.model.modules() for n, b in m._buffers.items()
                 if b is not None and n.endswith(BUFFER_SUFFIX)]
        return len(found) == len(self.views) and all(m._buffers.get(n) is v for m, n, v in self.views)

    def build(self):
        entries = [(m, n, b) for m in _unique_modules(self.model) for n, b in m._buffers.items()
                   if b is not None and n.endswith(BUFFER_SUFFIX)]
        if any(is_dtensor(b) for _, _, b in entries):  # parallelize_module distributes the buffers too
            raise ValueError("GNS: the model's layers are sharded by tensor parallelism (their buffers are DTensors): "
                             + TENSOR_PARALLEL)
        sizes = {}
        for _, _, b in entries:
            sizes[b.device] = sizes.get(b.device, 0) + b.numel()
        self.flats = {device: torch.zeros(size + 1, dtype=torch.float32, device=device) for device, size in sizes.items()}
        offsets = {device: 0 for device in sizes}
        self.views, self.slot = [], {}
        with torch.no_grad():
            for module, name, buffer in entries:
                device, n = buffer.device, buffer.numel()
                view = self.flats[device][offsets[device]:offsets[device] + n].view(buffer.shape)
                view.copy_(buffer)
                module._buffers[name] = view
                self.views.append((module, name, view))
                self.slot[(id(module), name)] = (device, offsets[device])
                offsets[device] += n

    def zero(self):
        """Zero every buffer (one op per device) and forget the step's refusals."""
        for flat in self.flats.values():
            flat.zero_()
        refused.clear()


def buffer_table(model):
    """The model's one BufferTable, shared by every monitor of it (two tables would keep replacing each other's
    buffers and rebuild at every read)."""
    table = model.__dict__.get("_pe_buffer_table")
    if table is None:
        table = model.__dict__["_pe_buffer_table"] = BufferTable(model)
    return table


def _unique_modules(model):
    seen = set()
    for module in model.modules():
        if id(module) not in seen:
            seen.add(id(module))
            yield module


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
        self._plans = {}  # the index tensors squared_norms needs, by the gradients' pattern (dtypes, shards, absences)

    def indices(self):
        """Per device: (term slot of each [sum] (k,), its entry (k,), its coefficient (k,), count slots (n, slices))."""
        if self._indices is not None and self._built_for is self.table.views:
            return self._indices
        n = len(self.tracked)
        per_device = {}
        for i, entry in enumerate(self.tracked):
            for term, (module, name, coefficient) in enumerate(entry.terms):
                device, offset = self.table.slot[(id(module), name)]
                numel = module._buffers[name].numel()
                sums = per_device.setdefault(device, ([], [], [], [[] for _ in range(n)]))
                for row in range(numel // 2):  # a bank's buffer: one [sum, count] per slice
                    sums[0].append(offset + 2 * row)
                    sums[1].append(i)
                    sums[2].append(coefficient)
                    if term == 0:
                        sums[3][i].append(offset + 2 * row + 1)
        self._indices = {}
        for device, (slots, entries, coefficients, counts) in per_device.items():
            pad = self.table.flats[device].numel() - 1  # the zero padding slot
            width = max(1, max(len(c) for c in counts))
            count_slots = [c + [pad] * (width - len(c)) for c in counts]
            self._indices[device] = tuple(torch.tensor(v, device=device) for v in (slots, entries)) + (
                torch.tensor(coefficients, dtype=torch.float32, device=device),
                torch.tensor(count_slots, device=device))
        self._built_for = self.table.views
        return self._indices

    def read(self, scaler_on=False):
        """(values (n, 3) float64 numpy array: ||grad||^2, sum of the buffers' sums over all ranks, examples counted;
        all gradients finite (computed only when scaler_on, else True); names of tracked tensors without a gradient).
        The sums are those of the local backward's per-example contributions, added over the ranks."""
        if not self.table.current():
            self.table.build()
        indices = self.indices()
        n = len(self.tracked)
        grads, no_grad = [], []
        for entry in self.tracked:
            grad = entry.ref.get().grad
            if grad is None:
                no_grad.append(entry.name)
            grads.append(grad)
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
        if _world_size() > 1:
            torch.distributed.all_reduce(reduced)
        values = torch.cat([whole_sq, reduced.double()]).cpu().numpy()  # the one host sync
        grad_sq = values[:n] + (values[3 * n:4 * n] if shard_sq is not None else 0.0)
        table = np.stack([grad_sq, values[n:2 * n], values[2 * n:3 * n]], axis=1)
        rest = values[(4 if shard_sq is not None else 3) * n:]
        finite = bool(np.isfinite(grad_sq).all() and np.isfinite(rest).all()) if scaler_on else True
        return table, finite, no_grad

    def squared_norms(self, grads, device, plan_key="tracked"):
        """(squared norms of the whole gradients (n,) float64, of this rank's shards divided by their copies (n,)
        float64, or None when no gradient is sharded); zero where a gradient is absent. One _foreach_norm per
        dtype family (float64 gradients keep float64 norms; any other dtype: float32), index tensors cached."""
        pieces = [grad_piece(g) if g is not None else (None, None) for g in grads]
        pattern = tuple((t is not None and t.dtype == torch.float64, t is None, copies) for t, copies in pieces)
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


# -----------------------------------------------------------------------------
# everything a training loop adds, in one object

class GNSMonitor:
    """What a training loop adds for the GNS: make it once, call `step` once per optimizer step.

        gns = GNSMonitor(model, log=log)     # after convert(model), or a model built with per-example norm layers
        for ...:
            ...forward/backward of every micro-batch...
            gns.step(batch_size=B)           # after the last backward, before clipping and optimizer.step()
            optimizer.step(); optimizer.zero_grad()

    `step` reads every per-example norm buffer and gradient norm (a handful of ops, one host sync), zeroes the
    buffers, updates the running GNS and hands the row {`<prefix><param>/norm`, `/pegn`, `/batch_size`, ...,
    "gns"} to `log` (a tracker.LogWrapper, or any callable taking a dict, e.g. wandb's run.log); it returns the
    row. `measure` reads without zeroing, logging or updating (the Measurements). Approximate SOGNS norms, where
    a layer records them, go under "train/sogns/". When `log` writes files (a LogWrapper with an out_dir, or
    out_dir=...), what each tracked parameter is (layer kind, block, names) is written there as PARAMETERS_JSON
    for gns-analysis.py.

    What it knows, each said once (as warnings, and here): `unconverted` {module path: why} from
    layer_config.convert; `untracked` {parameter: why} for every trainable parameter it does not measure (and
    those it stops measuring during the run, with the step); `tracked`, the Tracked entries it logs.

    Args:
        model: the model (unwrapped: not the DDP wrapper; FSDP2-sharded is fine).
        log: a LogWrapper, a callable, or None.
        scaler: the fp16 GradScaler, or None: its scale is divided out, and a step it will skip (an inf/nan
            gradient) is not a measurement.
        ema_decay: decay of the running GNS's EMAs (gns-analysis.py's --alpha).
        out_dir: where to write the record when `log` has no out_dir.
        expect_tracked: raise when no parameter records per-example norms (convert() passes False: it says why).
    Under torch.distributed every rank must call `step` (it all-reduces once).
    `state_dict()` / `load_state_dict()` carry the running GNS and the counters across a resume.
    """

    def __init__(self, model, log=None, scaler=None, ema_decay=0.95, prefix="train/gns/", out_dir=None,
                 expect_tracked=True):
        from nanogns.layers.sogns import SOGNS_SUFFIX  # imported here: sogns imports the layers, which this module's callers need

        layout.install(model)  # each forward's examples, read by every layer (layout.py)
        self.model, self.log, self.scaler, self.prefix = model, log, scaler, prefix
        self.tracked, self.untracked = find_tracked_parameters(model)
        self.approx_tracked, _ = find_tracked_parameters(model, SOGNS_SUFFIX)
        self.unconverted = dict(model.__dict__.get("_pe_unconverted", {}))
        if expect_tracked and not self.tracked and not self.approx_tracked:
            raise ValueError(f"GNSMonitor: no parameter of {type(model).__name__} has a per-example norm layer; convert "
                             "it first (layer_config.convert(model)) or build it with per-example norm layer classes")
        self._warn_once({name: reason for name, reason in self.untracked.items() if reason.startswith("tied")})
        self.table = buffer_table(model)
        tracked_ids = {id(entry.ref.get()) for entry in self.tracked}
        others = lambda: [p.grad for p in model.parameters() if id(p) not in tracked_ids and p.grad is not None]  # noqa: E731
        self.reader = StepReader(self.table, self.tracked + self.approx_tracked, others)
        self.running = RunningGNS(decay=ema_decay)
        self.measurements = []  # the last step's exact Measurements (e.g. for a GNS over some of the parameters)
        self.approx_measurements = []  # and its SOGNS ones
        self.step_count = self.scaler_skipped_steps = self.nonfinite_steps = 0
        self.record_path = None
        self.write_record(out_dir if out_dir is not None else getattr(log, "out_dir", None))

    def write_record(self, out_dir):
        """Write out_dir/PARAMETERS_JSON, what each tracked parameter is (nothing when out_dir is None)."""
        if out_dir:
            self.record_path = write_parameter_record(out_dir, self.describe())

    def _warn_once(self, reasons):
        """Warn about each parameter once per model, however many monitors are made of it."""
        said = self.model.__dict__.setdefault("_pe_warned", set())
        for name, reason in reasons.items():
            if name not in said:
                said.add(name)
                warnings.warn(f"GNS: not tracking {name}: {reason}")

    @property
    def gns(self):
        """The running GNS (NaN until a step with B > 1 and a positive |G|^2 EMA)."""
        return self.running.gns

    @property
    def dropped(self):
        """The parameters no longer measured since a step found them used more than once per forward."""
        return {name for name, reason in self.untracked.items() if reason.startswith("used")}

    def describe(self):
        """{logged name: layer kind, class, block, names, elements} (see describe_tracked)."""
        return describe_tracked(self.model, self.tracked)

    def _scaler_on(self):
        return self.scaler is not None and self.scaler.is_enabled()

    def measure(self, batch_size=None, gradients_unscaled=False):
        """The exact Measurements of this step (B = batch_size examples over all micro-batches and ranks), without
        zeroing the buffers or logging ([] for a step the GradScaler will skip); the SOGNS ones, where layers record
        them, go to `approx_measurements`.

        Args:
            batch_size: B; None takes the examples the layers counted (the count most tracked tensors report, as a
                layer used twice per forward counts 2 B), for trainers that do not say (integrations.py).
            gradients_unscaled: the GradScaler has unscaled the gradients already (Lightning does before its
                hook); the per-example norms, made in backward, still carry the scale.
        Raises ValueError when a buffer's count of examples is not batch_size (or a forward's rows could not be
        mapped to its examples), when a parameter whose layer recorded examples has no gradient, and when one
        with a gradient had no example recorded."""
        values, finite, no_grad = self.reader.read(self._scaler_on())
        self.step_count += 1
        self.measurements, self.approx_measurements = [], []
        if not finite:
            self.scaler_skipped_steps += 1
            return []
        if batch_size is None:  # the count most tracked tensors report (a layer shared across depth counts k B)
            counted = [c for c in values[:, 2].tolist() if c > 0 and not math.isnan(c)]
            batch_size = int(min(set(counted), key=lambda c: (-counted.count(c), c))) if counted else 0
        scale = self.scaler.get_scale() if self._scaler_on() else 1.0
        scales = (1.0 if gradients_unscaled else scale, scale)  # (of the batch gradient, of the per-example parts)
        n_exact = len(self.tracked)
        exact = self._measurements(self.tracked, values[:n_exact].tolist(), no_grad, batch_size, scales)
        approx = self._measurements(self.approx_tracked, values[n_exact:].tolist(), no_grad, batch_size, scales, False)
        if any(not (math.isfinite(m.big_batch_norm) and math.isfinite(m.small_batch_norm)) for m in exact):
            self.nonfinite_steps += 1
        self.measurements, self.approx_measurements = exact, approx
        return exact

    def _measurements(self, tracked, rows, no_grad, batch_size, scales, exact=True):
        """Measurements from the read rows (||grad||^2, summed buffer sums, counts) of the tracked entries."""
        world = _world_size()  # DDP and FSDP2 average the ranks' gradients: each example's part is divided by it
        # a count of k x B means k uses per example only beside parameters that counted B; when none did,
        # batch_size itself is wrong (e.g. the micro-batch size, or one rank's share), which is an error
        some_counted_batch_size = any(count == batch_size for _, _, count in rows)
        found = []
        for entry, (grad_sq, sums, count) in zip(tracked, rows):
            name = entry.name
            if math.isnan(count):
                raise self._count_error(entry, count, batch_size)
            if count == 0:
                if exact and grad_sq > 0 and name not in no_grad:
                    raise ValueError(
                        f"GNS: {name} has a gradient (norm {math.sqrt(grad_sq):.3g}) but its layer recorded no "
                        f"example in this step: the parameter was used by code other than its layer's forward (e.g. "
                        f"a parent module reading its weight), so its per-example norms are unknown. Call "
                        f"functional.py's per-example functions where it is used, or leave it out of convert()")
                continue  # the layer was not used in this step
            if name in no_grad:
                raise ValueError(
                    f"GNS: {name}: its layer recorded {count:.0f} examples in this step but the parameter has no "
                    f"gradient (.grad is None), so there is no batch gradient to compare them with. Call step() "
                    f"after the last backward and before optimizer.zero_grad(); if the parameter was frozen after "
                    f"the monitor was made, make the monitor again (frozen parameters are not tracked)")
            if exact and name in self.untracked:
                continue  # stopped being measured at an earlier step
            if count != batch_size and count % batch_size == 0 and some_counted_batch_size and exact:
                reason = (f"used {count / batch_size:.0f} times per example (a module or bank slice used more than "
                          "once per forward, e.g. shared across depth): the norm of the summed gradient needs the "
                          f"cross terms between uses; not measured since step {self.step_count - 1}")
                self._warn_once({name: reason})
                self.untracked[name] = reason
                continue
            if count != batch_size:
                raise self._count_error(entry, count, batch_size)
            # each example's part of the averaged gradient is (local contribution) / world and equals g_i / B, so
            # mean_i ||g_i||^2 = (B / world)^2 * (sum of the contributions' squared norms) / B. GradScaler multiplies
            # every gradient by scale. nan stays nan; a sum pushed below 0 by rounding (tied cross term) is nan too
            pe_sqnorm = sums * batch_size / world ** 2
            found.append(Measurement(
                big_batch_norm=math.sqrt(grad_sq) / scales[0] if grad_sq >= 0 else math.nan,
                small_batch_norm=math.sqrt(pe_sqnorm) / scales[1] if pe_sqnorm >= 0 else math.nan,
                big_batch_size=batch_size, small_batch_size=1,
                metadata={"name": name, "step": self.step_count - 1}))
        return found

    def _count_error(self, entry, count, batch_size):
        """The ValueError for a buffer that counted `count` examples in a step of `batch_size` (NaN: refused)."""
        if math.isnan(count):
            reasons = {refused[a] for module, buffer_name, _ in entry.terms
                       for a in refused_addresses(module._buffers[buffer_name])}
            why = "; ".join(sorted(reasons)) or "on another rank, a layer's input rows could not be mapped"
            return ValueError(f"GNS: {entry.name}: this step is not measured: its layer's input rows could not be "
                              f"mapped to the forward's examples ({why}). See layout.py for the rows that can be "
                              f"mapped; for a layout of your own, pass layout.install(model, layout_of=...); to "
                              f"leave the layer untracked, convert(model, exclude=[its path])")
        return ValueError(f"GNS: {entry.name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}); "
                          f"pass the number of examples of the whole step (micro-batch size x accumulation steps x "
                          f"ranks, or the number of packed sequences)")

    def step(self, batch_size=None, gradients_unscaled=False):
        """Measure this step (B = batch_size examples over all micro-batches and ranks; see `measure`), zero the
        buffers, update the running GNS and log the row; returns the row."""
        try:
            exact = self.measure(batch_size, gradients_unscaled)
        finally:
            self.table.zero()  # whatever happened, the next step starts from zero
        approx = self.approx_measurements
        row = {}
        for prefix, found in ((self.prefix, exact), (APPROX_PREFIX, approx)):
            for m in found:
                key = prefix + m.metadata["name"]
                row.update({key + "/norm": m.big_batch_norm, key + "/pegn": m.small_batch_norm,
                            key + "/batch_size": m.big_batch_size})
        row["gns"] = self.running.update(*summed_sqnorms(exact or approx))  # the exact GNS when there is one
        if self.log is not None:
            (self.log.log if hasattr(self.log, "log") else self.log)(row)
        return row

    def replay(self, frame):
        """Rebuild the running GNS from logged rows (a load_csv DataFrame of this model's earlier steps, oldest
        first) as step() built it, each row's exact norms or else its approximate ones: for a resumed run whose
        checkpoint does not hold state_dict() (a trainer's). Returns the running GNS."""
        columns = {prefix: [c[:-len("/norm")] for c in frame.columns if c.startswith(prefix) and c.endswith("/norm")]
                   for prefix in (self.prefix, APPROX_PREFIX)}
        for _, row in frame.iterrows():
            for prefix in (self.prefix, APPROX_PREFIX):
                measured = [name for name in columns[prefix] if not math.isnan(row[name + "/norm"])]
                if measured:
                    self.running.update(sum(row[name + "/norm"] ** 2 for name in measured),
                                        sum(row[name + "/pegn"] ** 2 for name in measured),
                                        row[measured[0] + "/batch_size"])
                    break
        return self.gns

    def state_dict(self):
        return {"running": self.running.state_dict(), "step_count": self.step_count,
                "scaler_skipped_steps": self.scaler_skipped_steps, "nonfinite_steps": self.nonfinite_steps,
                "dropped": {name: self.untracked[name] for name in sorted(self.dropped)}}

    def load_state_dict(self, state):
        self.running.load_state_dict(state["running"])
        self.step_count = state["step_count"]
        self.scaler_skipped_steps = state["scaler_skipped_steps"]
        self.nonfinite_steps = state["nonfinite_steps"]
        self.untracked.update(state["dropped"])
