"""
Measurements of gradient norms and per-example gradient norms, and the gradient
noise scale (GNS) estimator built from them.

One optimizer step gives, for each tracked parameter p,
    norm = ||p.grad||                    the batch gradient's norm
    pegn = sqrt(mean_i ||g_i||^2)        from the layer's `<p>_upegsqnorm` buffer
    batch_size = B                       examples in the step (all micro-batches, all ranks)
(see buffered.py for how the buffers are filled). `unbiased_stats` turns the
squared norms, summed over the parameters of interest, into unbiased estimates
of |G|^2 and tr(Sigma); GNS = EMA(tr(Sigma)) / EMA(|G|^2). gns-analysis.py and
the running estimate in train.py's status line both use these functions.

Usage in a training loop (GNSMonitor, at the end of this file, does these steps in one call):

    accumulate = AccumulateMeasurements(prefix="train/gns/")
    tracker = MeasurementTracker.from_model(model, callback=accumulate)
    ...backward of every micro-batch...
    tracker.step(batch_size=B)        # before clipping, scaler.step and zero_grad
    zero_sqgradnorm_buffers(model)
    log(accumulate.get_msg())         # {"train/gns/<name>/norm": ..., "/pegn": ..., "/batch_size": ...}

Which parameters are tracked: every trainable one whose layer keeps a
`<name>_upegsqnorm` buffer. Frozen parameters (requires_grad=False) are never
measurements; they are listed in `tracker.skipped` with the other untracked
ones and the reason. Parameters are looked up on their modules at every read,
so a model sharded after the tracker was made (FSDP2) is read correctly.
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

import layers
import layout
from buffered import BUFFER_SUFFIX, norm_dtype, refused, refused_addresses, zero_sqgradnorm_buffers
from tied import link_tied_parameters

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed
    DTensor = Shard = None

PARAMETERS_JSON = "gns_parameters.json"  # beside log.csv: what each tracked parameter is (describe_tracked)
APPROX_PREFIX = "train/sogns/"  # log columns of approximate (SOGNS) norms


def two_batch_stats(sq_norm_small, sq_norm_big, small_batch_size, big_batch_size):
    """Unbiased |G|^2 and tr(Sigma) from the squared norms of a small-batch and a big-batch gradient.

    McCandlish et al. 2018 (arXiv 1812.06162) eq. A.2, with b examples in each small
    batch (|g_b|^2 their mean squared norm) and B in the big one:
        |G|^2     = (B * |g_B|^2 - b * |g_b|^2) / (B - b)
        tr(Sigma) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)
    Works on floats, numpy arrays and pandas Series alike (a Series stays a Series).
    Returns (gtg, trsigma), both NaN where B > b > 0 does not hold.
    """
    b = np.asarray(small_batch_size, dtype=np.float64)
    B = np.asarray(big_batch_size, dtype=np.float64)
    valid = (B > b) & (b > 0)
    b_safe, B_safe = np.where(valid, b, 1.0), np.where(valid, B, 2.0)
    gtg = np.where(valid, (B_safe * sq_norm_big - b_safe * sq_norm_small) / (B_safe - b_safe), np.nan)
    trsigma = np.where(valid, (sq_norm_small - sq_norm_big) / (1.0 / b_safe - 1.0 / B_safe), np.nan)
    if np.ndim(gtg) == 0:
        return float(gtg), float(trsigma)
    for series in (sq_norm_big, sq_norm_small):
        if hasattr(series, "index"):
            return type(series)(gtg, index=series.index), type(series)(trsigma, index=series.index)
    return gtg, trsigma


def unbiased_stats(sq_norm, pe_sqnorm, batch_size):
    """Unbiased |G|^2 and tr(Sigma) from one step's squared norms: `two_batch_stats` with small batches
    of one example, i.e. the Bessel-corrected sample statistics of the per-example gradients:
        |G|^2     = (B * |g_B|^2 - mean_i |g_i|^2) / (B - 1)
        tr(Sigma) = (mean_i |g_i|^2 - |g_B|^2) / (1 - 1/B)

    Args:
        sq_norm: squared norm of the batch-mean gradient |g_B|^2.
        pe_sqnorm: mean over examples of the squared per-example gradient norm.
        batch_size: B. Works on floats, numpy arrays and pandas Series alike.
    Returns:
        (gtg, trsigma). Both are NaN where B <= 1: one example gives no
        estimate of the noise, so the GNS is undefined there.
    """
    return two_batch_stats(pe_sqnorm, sq_norm, 1, batch_size)


def gns_from_emas(gtg_ema, trsigma_ema):
    """GNS = EMA(tr(Sigma)) / EMA(|G|^2); NaN where the |G|^2 EMA is not positive.

    (The paper's script clips the denominator at 1e-6 instead, which turns a
    noise-dominated estimate into a huge but plausible-looking number.)
    """
    gtg_ema = np.asarray(gtg_ema, dtype=np.float64)
    gns = np.where(gtg_ema > 0, np.asarray(trsigma_ema, dtype=np.float64) / np.where(gtg_ema > 0, gtg_ema, 1.0), np.nan)
    return float(gns) if gns.ndim == 0 else gns


class EMA:
    """Exponential moving average that skips non-finite values (as pandas'
    `ewm(alpha=1 - decay, adjust=False, ignore_na=True)` does for NaN), so one bad step does not
    poison it. `value` is NaN until the first finite update."""

    def __init__(self, decay):
        self.decay = decay
        self.value = math.nan

    def update(self, x):
        if not math.isfinite(x):
            return self.value
        self.value = x if math.isnan(self.value) else self.decay * self.value + (1 - self.decay) * x
        return self.value


class RunningGNS:
    """Running GNS over steps: EMAs of |G|^2 and tr(Sigma) kept separately.

    Feed it the summed squared norms of each step; `gns` is the current estimate
    (NaN until a step with B > 1 and a positive |G|^2 EMA)."""

    def __init__(self, decay=0.95):
        self.gtg = EMA(decay)
        self.trsigma = EMA(decay)

    def update(self, sq_norm, pe_sqnorm, batch_size):
        gtg, trsigma = unbiased_stats(sq_norm, pe_sqnorm, batch_size)
        if math.isfinite(gtg) and math.isfinite(trsigma):
            self.gtg.update(gtg)
            self.trsigma.update(trsigma)
        return self.gns

    @property
    def gns(self):
        return gns_from_emas(self.gtg.value, self.trsigma.value)

    def state_dict(self):
        return {"decay": self.gtg.decay, "gtg": self.gtg.value, "trsigma": self.trsigma.value}

    def load_state_dict(self, state):
        self.gtg.value, self.trsigma.value = state["gtg"], state["trsigma"]


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

    Engines that shard a model after the tracker was made (FSDP2's fully_shard)
    put new Parameter objects (DTensors) on the same modules, so a tracker that
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
        module, attr = entry.ref.module, entry.ref.attr
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


def _is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


class MeasurementTracker:
    """Reads every per-example norm buffer of a model once per optimizer step.

    Args:
        model: the model whose parameters are tracked (looked up again at every
            read, so sharding the model afterwards with FSDP2 is fine).
        tracked: [Tracked(name, ref, terms)], see `find_tracked_parameters`.
        callback: a callable, or a list of callables, given each Measurement.
        scaler: the GradScaler of fp16 training, or None; its scale is divided out,
            and a step it will skip (an inf/nan gradient) is not a measurement.
        skipped: {name: reason} of the parameters not tracked.
    Call `step(batch_size=B)` after the last micro-batch's backward and before
    gradient clipping / `scaler.unscale_` / `scaler.step` / `zero_grad`, then
    `zero_sqgradnorm_buffers(model)` (GNSMonitor does all of it in one call).

    Counters: `scaler_skipped_steps` (steps not measured because the scaler
    skips them) and `nonfinite_steps` (measured steps with an inf/nan norm;
    those are passed on as inf/nan, never replaced by a number).
    """

    def __init__(self, model, tracked, callback=None, scaler=None, skipped=None):
        self.model = model
        self.tracked = tracked
        if callback is None:
            callback = []
        self.callbacks = list(callback) if isinstance(callback, (list, tuple)) else [callback]
        self.scaler = scaler
        self.skipped = dict(skipped or {})
        self.unconverted = {}  # filled by layer_config.convert
        self.step_count = 0
        self.scaler_skipped_steps = 0
        self.nonfinite_steps = 0
        self.dropped = set()  # parameters found used several times per example (see step)

    @classmethod
    def from_model(cls, model, callback=None, scaler=None, suffix=BUFFER_SUFFIX, warn=True):
        """A tracker of every trainable parameter of `model` whose layer records per-example norms.

        Links tied Embedding/Linear tensors (tied.link_tied_parameters) so that
        they are logged exactly; warns (unless warn=False) about tied tensors it cannot log exactly.
        """
        layout.install(model)  # each forward's examples, read by every layer (layout.py)
        tracked, skipped = find_tracked_parameters(model, suffix)
        for name, reason in skipped.items():
            if warn and reason.startswith("tied"):
                warnings.warn(f"GNS: not tracking {name}: {reason}")
        return cls(model, tracked, callback=callback, scaler=scaler, skipped=skipped)

    def describe(self):
        """{logged name: layer kind, class, block, names, elements} (see describe_tracked)."""
        return describe_tracked(self.model, self.tracked)

    def _scaler_on(self):
        return self.scaler is not None and self.scaler.is_enabled()

    def read(self):
        """Per tracked parameter: (||grad||^2, sum_i ||g_i||^2, examples counted), in one host sync.

        Returns:
            (values (n, 3) float64 on the CPU, all_grads_finite: bool, names of tracked
            parameters without a gradient). The flag covers the untracked parameters
            too, and is only computed (else True) when a GradScaler is on.

        The buffer holds [sum_i ||g_i / n||^2, n] for the n examples this process
        saw, so sum_i ||g_i||^2 = buffer[0] * n^2 (a bank's buffer has one such row
        per disjoint slice; the rows add up). Under torch.distributed the sums and
        counts of all ranks are added, and so are the squared norms of gradients
        sharded by FSDP2 (one small all-reduce); a DDP gradient is already whole.
        """
        rows, no_grad = [], []
        for name, ref, terms in self.tracked:
            grad = ref.get().grad
            # buffers looked up on every read: module.to(device) replaces them
            buffers = [(module._buffers[buffer_name], coefficient) for module, buffer_name, coefficient in terms]
            device = buffers[0][0].device
            whole_sq = sharded_sq = torch.zeros((), dtype=torch.float64, device=device)
            if grad is None:
                no_grad.append(name)
            elif _is_dtensor(grad) and all(isinstance(p, Shard) for p in grad.placements) \
                    and grad.device_mesh.ndim == 1 and grad.device_mesh.size() == _world_size():
                local = grad.to_local()  # this rank's shard: the squares of the shards add up
                sharded_sq = torch.linalg.vector_norm(local, dtype=norm_dtype(local)).double().to(device) ** 2
            elif _is_dtensor(grad):  # other layouts (HSDP's 2-D mesh, ...): gather the whole gradient (slower, exact)
                whole = grad.full_tensor()
                whole_sq = torch.linalg.vector_norm(whole, dtype=norm_dtype(whole)).double().to(device) ** 2
            else:
                whole_sq = torch.linalg.vector_norm(grad, dtype=norm_dtype(grad)).double().to(device) ** 2
            table = sum(coefficient * buffer.double() for buffer, coefficient in buffers).reshape(-1, 2)
            counts = buffers[0][0].double().reshape(-1, 2)[:, 1]  # every term counts the same examples
            rows.append(torch.stack([whole_sq, sharded_sq, (table[:, 0] * counts ** 2).sum(), counts.max()]))
        values = torch.stack(rows) if rows else torch.zeros(0, 4, dtype=torch.float64)
        # GradScaler skips the step when any gradient is inf/nan: the untracked ones are checked in the same
        # all-reduce and sync (a sharded gradient's inf may sit on another rank's shard)
        other_sq = self._untracked_sq_norm(values.device) if self._scaler_on() else None
        if other_sq is not None:
            values = torch.cat([values, torch.stack([torch.zeros((), dtype=torch.float64, device=values.device),
                                                     other_sq, torch.zeros_like(other_sq), torch.zeros_like(other_sq)])[None]])
        if len(values) and _world_size() > 1:
            summed = values[:, 1:].clone()
            torch.distributed.all_reduce(summed)
            values = torch.cat([values[:, :1], summed], dim=1)
        values = torch.stack([values[:, 0] + values[:, 1], values[:, 2], values[:, 3]], dim=1).cpu()
        if other_sq is None:
            return values, True, no_grad
        return values[:-1], bool(torch.isfinite(values[:, 0]).all()), no_grad

    def _untracked_sq_norm(self, device):
        """Sum of the squared norms of the gradients of the untracked parameters (their local shards under FSDP2)."""
        tracked_ids = {id(ref.get()) for _, ref, _ in self.tracked}
        grads = [p.grad for p in self.model.parameters() if id(p) not in tracked_ids and p.grad is not None]
        grads = [g.to_local() if _is_dtensor(g) else g for g in grads]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in grads]).double().sum().to(device)

    def _count_error(self, name, count, batch_size):
        """The ValueError for a buffer that counted `count` examples in a step of `batch_size`."""
        if math.isnan(count):
            terms = next(t for t in self.tracked if t.name == name).terms
            reasons = {refused[a] for module, buffer_name, _ in terms
                       for a in refused_addresses(module._buffers[buffer_name])}
            why = "; ".join(sorted(reasons)) or "on another rank, a layer's input rows could not be mapped"
            return ValueError(f"GNS: {name}: this step is not measured: its layer's input rows could not be mapped to "
                              f"the forward's examples ({why}). See layout.py for the rows that can be mapped; "
                              f"for a layout of your own, pass layout.install(model, layout_of=...)")
        return ValueError(f"GNS: {name}'s buffer counted {count:.0f} examples but step(batch_size={batch_size}); "
                          f"pass the number of examples of the whole step (micro-batch size x accumulation steps x "
                          f"ranks, or the number of packed sequences)")

    def step(self, batch_size, step=None):
        """Emit one Measurement per tracked parameter that took part in this step; returns them.

        Returns [] for a step the GradScaler will skip (counted in scaler_skipped_steps).
        Raises ValueError when a buffer's count of examples is not batch_size, or when
        a parameter whose layer recorded examples has no gradient."""
        values, grads_finite, no_grad = self.read()
        if not grads_finite:
            self.scaler_skipped_steps += 1
            self.step_count += 1
            return []
        scale = self.scaler.get_scale() if self._scaler_on() else 1.0
        # a count of k x B means k uses per example only beside parameters that counted B; when none did,
        # batch_size itself is wrong (e.g. the micro-batch size, or one rank's share), which is an error
        some_counted_batch_size = any(count == batch_size for count in values[:, 2].tolist())
        measurements = []
        for (name, _, _), (grad_sq, pe_sqnorm_sum, count) in zip(self.tracked, values.tolist()):
            if math.isnan(count):
                raise self._count_error(name, count, batch_size)
            if count == 0:
                if grad_sq > 0 and name not in no_grad and name not in self.dropped:
                    raise ValueError(
                        f"GNS: {name} has a gradient (norm {math.sqrt(grad_sq):.3g}) but its layer recorded no "
                        f"example in this step: the parameter was used by code other than its layer's forward (e.g. "
                        f"a parent module reading its weight), so its per-example norms are unknown. Call "
                        f"functional.py's per-example functions where it is used, or leave it unconverted")
                continue  # the layer was not used in this step
            if name in no_grad:
                raise ValueError(
                    f"GNS: {name}: its layer recorded {count:.0f} examples in this step but the parameter has no "
                    f"gradient (.grad is None), so there is no batch gradient to compare them with. Call step() "
                    f"after the last backward and before optimizer.zero_grad(); if the parameter was frozen after "
                    f"the tracker was made, make the tracker again (frozen parameters are not tracked)")
            if count != batch_size and count % batch_size == 0 and some_counted_batch_size and name not in self.dropped:
                warnings.warn(f"GNS: {name} recorded {count / batch_size:.0f} uses per example (a module or bank slice "
                              "used more than once per forward, e.g. shared across depth); the norm of the summed "
                              "gradient needs the cross terms between uses, so it is no longer tracked")
                self.dropped.add(name)
            if name in self.dropped:
                continue
            if count != batch_size:
                raise self._count_error(name, count, batch_size)
            # GradScaler multiplies every gradient by scale, so squared norms by scale^2.
            # nan stays nan; a sum pushed below 0 by rounding (tied cross term) is nan too, never a made-up number
            measurement = Measurement(
                big_batch_norm=math.sqrt(grad_sq) / scale if grad_sq >= 0 else math.nan,
                small_batch_norm=math.sqrt(pe_sqnorm_sum / count) / scale if pe_sqnorm_sum >= 0 else math.nan,
                big_batch_size=batch_size,
                small_batch_size=1,
                metadata={"name": name, "step": self.step_count if step is None else step},
            )
            for callback in self.callbacks:
                callback(measurement)
            measurements.append(measurement)
        if any(not (math.isfinite(m.big_batch_norm) and math.isfinite(m.small_batch_norm)) for m in measurements):
            self.nonfinite_steps += 1
        self.step_count += 1
        return measurements

    def state_dict(self):
        """The counters, for a checkpoint (the tracker holds no other state between steps)."""
        return {"step_count": self.step_count, "scaler_skipped_steps": self.scaler_skipped_steps,
                "nonfinite_steps": self.nonfinite_steps, "dropped": sorted(self.dropped)}

    def load_state_dict(self, state):
        self.step_count = state["step_count"]
        self.scaler_skipped_steps = state["scaler_skipped_steps"]
        self.nonfinite_steps = state["nonfinite_steps"]
        self.dropped = set(state["dropped"])


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class AccumulateMeasurements:
    """Callback collecting a step's measurements as CSV columns
    `<prefix><name>/norm`, `/pegn`, `/batch_size`; `get_msg()` hands them over and clears."""

    def __init__(self, prefix="train/gns/"):
        self.prefix = prefix
        self.msg = {}

    def __call__(self, measurement):
        key = self.prefix + measurement.metadata["name"]
        self.msg[key + "/norm"] = measurement.big_batch_norm
        self.msg[key + "/pegn"] = measurement.small_batch_norm
        self.msg[key + "/batch_size"] = measurement.big_batch_size

    def get_msg(self):
        msg, self.msg = self.msg, {}
        return msg


# -----------------------------------------------------------------------------
# everything a training loop adds, in one object

class GNSMonitor:
    """What a training loop adds for the GNS: make it once, call `step` once per optimizer step.

        gns = GNSMonitor(model, log=log)     # after convert(model) or building with per-example norm layers
        for ...:
            ...forward/backward of every micro-batch...
            gns.step(batch_size=B)           # after the last backward, before clipping and optimizer.step()
            optimizer.step(); optimizer.zero_grad()

    `step` reads every per-example norm buffer and gradient norm (one host sync),
    zeroes the buffers, updates the running GNS and hands the row
    {`<prefix><param>/norm`, `/pegn`, `/batch_size`, ..., "gns"} to `log` (a
    tracker.LogWrapper, or any callable taking a dict, e.g. wandb's run.log); it
    returns the row too. Approximate SOGNS norms, where a layer records them,
    go under "train/sogns/". When `log` writes files (a LogWrapper with an
    out_dir, or out_dir=...), what each tracked parameter is (layer kind,
    block, names) is written there as PARAMETERS_JSON for gns-analysis.py.

    Args:
        model: the model (unwrapped: not the DDP wrapper; FSDP2-sharded is fine).
        log: a LogWrapper, a callable, or None.
        scaler: the fp16 GradScaler, or None.
        ema_decay: decay of the running GNS's EMAs (gns-analysis.py's --alpha).
        out_dir: where to write the record when `log` has no out_dir.
    Under torch.distributed every rank must call `step` (it all-reduces once).
    `state_dict()` / `load_state_dict()` carry the running GNS across a resume.
    """

    def __init__(self, model, log=None, scaler=None, ema_decay=0.95, prefix="train/gns/", out_dir=None):
        from sogns import SOGNS_SUFFIX  # imported here: sogns imports buffered, as this module does

        self.model = model
        self.log = log
        self._exact = AccumulateMeasurements(prefix=prefix)
        self.tracker = MeasurementTracker.from_model(model, callback=self._exact, scaler=scaler)
        self._approx = AccumulateMeasurements(prefix=APPROX_PREFIX)
        # SOGNS approximates Linear layers only; a tied pair is logged exactly above, so say nothing of it here
        self.approx_tracker = MeasurementTracker.from_model(model, callback=self._approx, scaler=scaler,
                                                            suffix=SOGNS_SUFFIX, warn=False)
        if not self.tracker.tracked and not self.approx_tracker.tracked:
            raise ValueError(f"GNSMonitor: no parameter of {type(model).__name__} has a per-example norm layer; convert "
                             "it first (layer_config.convert(model)) or build it with per-example norm layer classes")
        self.running = RunningGNS(decay=ema_decay)
        self.measurements = []  # the last step's exact Measurements (e.g. for a GNS over some of the parameters)
        out_dir = out_dir if out_dir is not None else getattr(log, "out_dir", None)
        self.record_path = write_parameter_record(out_dir, self.tracker.describe()) if out_dir else None

    @property
    def gns(self):
        """The running GNS (NaN until a step with B > 1 and a positive |G|^2 EMA)."""
        return self.running.gns

    def step(self, batch_size):
        """Measure this step (B = batch_size examples over all micro-batches and ranks), zero the buffers, log."""
        exact = self.measurements = self.tracker.step(batch_size)
        approx = self.approx_tracker.step(batch_size) if self.approx_tracker.tracked else []
        zero_sqgradnorm_buffers(self.model)
        # the running GNS is the exact one when there is one
        row = {**self._exact.get_msg(), **self._approx.get_msg(),
               "gns": self.running.update(*summed_sqnorms(exact or approx))}
        if self.log is not None:
            (self.log.log if hasattr(self.log, "log") else self.log)(row)
        return row

    def state_dict(self):
        return {"running": self.running.state_dict(), "tracker": self.tracker.state_dict(),
                "approx_tracker": self.approx_tracker.state_dict()}

    def load_state_dict(self, state):
        self.running.load_state_dict(state["running"])
        self.tracker.load_state_dict(state["tracker"])
        self.approx_tracker.load_state_dict(state["approx_tracker"])
