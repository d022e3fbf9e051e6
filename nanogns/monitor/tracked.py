"""
Which parameters of a model are tracked, and what each is: a trainable parameter whose layer keeps a
`<name>_pe_sqnorm` buffer (core/buffers.py) is tracked, under its name or, for a tensor tied between an
Embedding and a Linear, under its names joined by "+" (core/tied.py); every other parameter is listed with the
reason. A step's numbers for one tracked parameter are a Measurement.
"""

import dataclasses
import math
from typing import Any, Dict, List, NamedTuple, Tuple

import numpy as np
import torch.nn as nn

from nanogns.core.buffers import BUFFER_SUFFIX
from nanogns.core.mapper import SharedTensor
from nanogns.core.module_state import state_of
from nanogns.core.tied import link_tied_parameters
from nanogns.kinds import KINDS

# -----------------------------------------------------------------------------
# measurements


@dataclasses.dataclass
class Measurement:
    """One parameter's norms for one step: `norm` = ||grad|| of the batch gradient (B = batch_size examples) and
    `rms_pe_norm` = sqrt(mean_i ||g_i||^2), the root mean square of the per-example gradient norms (the log's
    `norm` and `pegn` columns). `metadata["name"]` is the name in `model.named_parameters()`."""

    norm: float
    rms_pe_norm: float
    batch_size: int
    metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def msg(self, prefix=""):
        """The scalar fields as a flat dict, for a logger."""
        return {prefix + k: v for k, v in dataclasses.asdict(self).items() if k != "metadata"}


def summed_squares(measurements):
    """(sum of norm^2, sum of rms_pe_norm^2, batch size) over measurements of one step."""
    if not measurements:
        return math.nan, math.nan, 0
    sq_norm, pe_sqnorm = np.square([(m.norm, m.rms_pe_norm) for m in measurements]).sum(axis=0).tolist()
    return sq_norm, pe_sqnorm, measurements[0].batch_size


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
    declared = state_of(module).kinds.get(attr)
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
    return all(
        n == recorded[0] or layer_path.startswith(n.rpartition(".")[0] + ".") or n.rpartition(".")[0] == ""
        for n in names
    )


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
        recorders = {id(_owner(model, n)[0]): _owner(model, n) for n in recorded}
        if len(owners) > 1 and len(recorders) == len(owners) and suffix == BUFFER_SUFFIX:
            # every module using the tensor records it: their uses are summed together (core/uses.py)
            terms = [(layer, layer_attr + suffix, 1.0) for layer, layer_attr in recorders.values()]
            tracked.append(Tracked("+".join(names), ParameterRef(module, attr), terms))
            continue
        if len(owners) > 1 and any(n + suffix in buffers for n in names):
            layers_using = [type(_owner(model, n)[0]).__name__ for n in names]
            skipped[name] = (
                f"tied to {', '.join(n for n in names if n != name)}: one tensor used by {len(owners)} "
                f"layers ({', '.join(layers_using)}), some of which record no per-example norms (plain torch "
                "layers): the norm of its per-example gradient is the sum over every use's"
            )
        elif parametrized_layer is not None and parametrized_layer + "." + name.split(".")[-2] + suffix in buffers:
            skipped[name] = (
                "parametrized (torch.nn.utils.parametrize, e.g. spectral_norm): the layer records the "
                "per-example norms of the weight it computes, not of this trainable tensor"
            )
        elif name + suffix not in buffers:
            skipped[name] = "its layer records no per-example norms (a plain torch layer)"
        else:
            tracked.append(Tracked(name, ParameterRef(module, attr), [(module, attr + suffix, 1.0)]))
    return tracked, skipped


def shared_tensors(tracked):
    """The SharedTensor of every tracked tensor that several modules' buffers record, whose uses are summed
    together in backward (core/uses.py); a tied Embedding/Linear pair (its cross term weighted 2) keeps tied.py's
    cross term when each is used once."""
    return [
        SharedTensor(tuple((m, n) for m, n, _ in entry.terms), pairwise=any(c != 1.0 for _, _, c in entry.terms))
        for entry in tracked
        if len(entry.terms) > 1
    ]


def describe_tracked(model, tracked):
    """{logged name: what it is}: layer kind, its analysis group, layer class, block, every name, elements.

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
            kind, layer = layer_kind(recorder, buffer_name[: -len(BUFFER_SUFFIX)]), type(recorder).__name__
        buffer = entry.terms[0][0]._buffers[entry.terms[0][1]]
        record[entry.name] = {
            "kind": kind,
            "group": KINDS.group_of(kind),
            "layer": layer.removeprefix("FSDP"),
            "block": block_index(model, first.rpartition(".")[0]),
            "names": aliases[id(param)],
            "numel": param.numel(),
            "bank_slices": int(buffer.numel() // 2) if buffer.dim() > 1 else None,
        }
    return record
