"""
nanogns.verify(model, batch, per_example_loss): the brute-force oracle as one call a user runs on their own setup.

The layers check what they can see (rows they cannot map, a BatchNorm in training mode, the first step's mixing
check); what only the user's model, data and loss can show, this call shows:

    result = nanogns.verify(model, batch, lambda model, batch: my_losses(model(batch["x"]), batch["y"]))  # (B,)
    result.verdict      # "exact", "refused" or "differs"; result.parameters: one ParameterCheck per parameter

`per_example_loss(model, batch)` returns each example's loss, a (B,) tensor, whose mean is the step's loss. One
forward of the batch gives those losses; the monitor measures the backward of their mean (the model converted or
not: a model not converted is copied and the copy converted, with `convert_options`), and each example's own
gradient g_i comes from a backward of its loss alone through that same forward (tests/oracle.py's rule). Every
parameter's measured `pegn` = sqrt(mean_i ||g_i||^2) and `norm` = ||mean_i g_i|| are compared with those, in float64
where the model runs in it, and a table says for each: exact, refused (and why: the monitor's reason), not measured
(and why), or differs. Where a number differs, what was observed names the likely cause:

    a loss coupling the examples   example i's loss depends on another example's outputs of the model (a contrastive
                                   loss with in-batch negatives, a batch-level regulariser): its gradient is not the
                                   part of the step's gradient that reaches example i's rows, which is what the layers
                                   see. Make the group the example (install(model, layout_of=...), docs/integrations.md)
    a forward mixing them          example j's outputs depend on another example's inputs (monitor/mixing.py's check,
                                   naming where); the monitor refuses such steps at its first step in a training mode
    neither                        a parameter used outside its layer's forward, or a gradient changed by a hook

Nothing of the user's model changes: its weights and their dtype, its gradients, its buffers (running statistics,
the per-example norm buffers and what a monitor noted of the step), its training mode and the random number
generators (dropout) are as they were when the call returns, or raises.

Cost: one forward and B + 1 backward passes of the batch (B + 3 when a number differs, to name the cause), in
float64 where the model allows: about B + 2 training steps, once; memory for the forward's graph kept over those
backwards, a float64 copy of the parameters and the per-example gradients' running sum, and a copy of the whole
model when it is not converted. Under torch.distributed each rank checks its own batch (no collective).
"""

import copy
import dataclasses
import math
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, TextIO

import torch
import torch.nn as nn

from nanogns.conversion.convert import convert
from nanogns.core import layout, trees
from nanogns.core.buffers import BUFFER_SUFFIX, zero_pe_sqnorm_buffers
from nanogns.core.module_state import state_of
from nanogns.errors import NotSupported, SettingNotValid
from nanogns.monitor.mixing import examples_mixed, reached_example, rows_of
from nanogns.monitor.monitor import GNSMonitor
from nanogns.monitor.reader import world_size

# how close a measured squared norm must be to the oracle's to be exact, by the dtype the check ran in: the buffers
# add float32 sums (float64 models), and a float32 or 16-bit model's per-example norms carry its rounding
RELATIVE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 2e-3}
LOW_PRECISION_TOLERANCE = 5e-2
# a squared norm this small beside the largest one of the model is zero (a bias the loss is invariant to)
ABSOLUTE_TOLERANCE = 1e-9


@dataclasses.dataclass
class ParameterCheck:
    """One parameter's verdict: its true `rms_pe_norm` = sqrt(mean_i ||g_i||^2) (the log's `pegn`) and `norm` =
    ||mean_i g_i|| (the oracle's), what the monitor measured (None where it measured nothing), and why where it is
    not exact."""

    name: str
    verdict: str  # "exact", "differs", "refused", "not measured"
    true_rms_pe_norm: float
    true_norm: float
    rms_pe_norm: Optional[float] = None
    norm: Optional[float] = None
    why: str = ""


@dataclasses.dataclass
class Verification:
    """What nanogns.verify found: `verdict` ("exact", "refused" or "differs"), one ParameterCheck per trainable
    parameter, the causes observed (`causes`), the monitor's refusal of the step if it refuses it (`refusal`)."""

    verdict: str
    parameters: List[ParameterCheck]
    causes: List[str]
    refusal: Optional[str]
    examples: int
    dtype: torch.dtype
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    def by_name(self) -> Dict[str, ParameterCheck]:
        return {check.name: check for check in self.parameters}

    def table(self) -> str:
        """The verdict table, as verify prints it."""

        def number(value):
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6g}"

        width = max([len("parameter")] + [len(c.name) for c in self.parameters])
        lines = [
            f"nanogns.verify: {self.verdict} ({self.examples} examples, {str(self.dtype).removeprefix('torch.')}; "
            f"each example's gradient from the same forward, against what the monitor measures)",
            f"{'parameter':<{width}}  {'verdict':<12}  {'pegn (true)':>12}  {'pegn (measured)':>15}  "
            f"{'norm (true)':>12}  {'norm (measured)':>15}",
        ]
        for c in self.parameters:
            lines.append(
                f"{c.name:<{width}}  {c.verdict:<12}  {number(c.true_rms_pe_norm):>12}  {number(c.rms_pe_norm):>15}  "
                f"{number(c.true_norm):>12}  {number(c.norm):>15}" + (f"  {c.why}" if c.why else "")
            )
        lines += [f"likely cause: {cause}" for cause in self.causes]
        if self.refusal:
            lines.append(f"the monitor refuses this step: {self.refusal}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# -----------------------------------------------------------------------------
# the user's model, put back as it was


class _Kept:
    """Everything of a converted model that the check changes, put back by restore(): each parameter's tensor and
    gradient, each buffer (the tensor, and its values), each module's training flag, the RowMapper's record of the
    step and the last forward's Pass."""

    def __init__(self, model):
        self.parameters = [(p, p.data, p.grad) for p in _unique_parameters(model)]
        self.buffers = [
            (m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None
        ]
        self.training = [(m, m.training) for m in model.modules()]
        self.mappers = []
        for m in model.modules():
            mapper = state_of(m).row_mapper
            if mapper is not None and all(mapper is not kept for kept, _ in self.mappers):
                self.mappers.append((mapper, _mapper_state(mapper)))
        self.last = layout.PASSES.last

    def restore(self):
        with torch.no_grad():
            for p, data, grad in self.parameters:
                p.data, p.grad = data, grad
            for m, name, b, value in self.buffers:
                m._buffers[name] = b
                b.copy_(value)
        for m, training in self.training:
            m.training = training
        for mapper, kept in self.mappers:
            for name, value in kept.items():
                setattr(mapper, name, type(value)(value) if isinstance(value, (dict, list)) else value)
        layout.PASSES.last = self.last

    def quiet(self):
        """Tell no monitor of the user's that the check's forwards start a step (RowMapper.start_step): one would
        follow the cast model and keep the check's inputs for its own mixing check."""
        for mapper, _ in self.mappers:
            mapper.step_started = True


_MAPPER_STATE = ("refusals", "mixing", "forwards", "layouts", "last_pass", "step_started", "step_watchers", "shared")


def _mapper_state(mapper):
    return {
        name: (type(v)(v) if isinstance(v, (dict, list)) else v)
        for name in _MAPPER_STATE
        for v in [getattr(mapper, name)]
    }


def _unique_parameters(model):
    seen, found = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            found.append(p)
    return found


def _cast(model, dtype):
    """Cast the model's floating-point parameters and buffers (not the per-example norm buffers) to dtype, in place
    on the module objects (restored by _Kept)."""
    with torch.no_grad():
        for p in _unique_parameters(model):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and not name.endswith(BUFFER_SUFFIX):
                    m._buffers[name] = b.to(dtype)


def _cast_batch(batch, dtype):
    return trees.map_leaves(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
    )


def _converted(model):
    return any(name.endswith(BUFFER_SUFFIX) for name, _ in model.named_buffers())


# -----------------------------------------------------------------------------
# the check


def verify(
    model: nn.Module,
    batch: Any,
    per_example_loss: Callable[[nn.Module, Any], torch.Tensor],
    dtype: Optional[torch.dtype] = torch.float64,
    convert_options: Optional[Dict[str, Any]] = None,
    show: bool = True,
    file: Optional[TextIO] = None,
) -> Verification:
    """Check the monitor's numbers for `model` on `batch` against each example's own gradient (see the module
    docstring): prints the verdict table (unless show=False) and returns it as a Verification.

    Args:
        model: the model, converted (nanogns.convert) or not (then a copy is converted with convert_options).
        batch: what per_example_loss takes (its floating-point tensors are cast to dtype with the model).
        per_example_loss: per_example_loss(model, batch) -> (B,) tensor, example i's loss; their mean is the step's.
        dtype: the dtype the check runs in (float64: the oracle's; None: the model's own). Where the model's forward
            fails in it, the check runs in the model's own dtype and says so.
        convert_options: keyword arguments of nanogns.convert for a model not converted.
    Raises SettingNotValid (a ValueError) when per_example_loss does not return a (B,) tensor that has a gradient."""
    converted = _converted(model)
    if converted and convert_options:
        raise SettingNotValid(
            f"verify: the model is converted already; convert options {convert_options} cannot apply (verify the "
            "model before converting it, or without them)"
        )
    own = next((p.dtype for p in _unique_parameters(model) if p.is_floating_point()), torch.float32)
    dtypes = [dtype, own] if dtype is not None and dtype != own else [own]
    kept = _Kept(model)
    devices = sorted({p.device.index or 0 for p in _unique_parameters(model) if p.device.type == "cuda"})
    notes = []
    try:
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for k, run_dtype in enumerate(dtypes):
                try:
                    kept.quiet()
                    result = _check(model, batch, per_example_loss, run_dtype, own, convert_options, converted)
                    break
                except _ForwardFailed as e:
                    if k + 1 == len(dtypes):
                        raise NotSupported(
                            f"verify: the model's forward failed in {_name(run_dtype)}: {e.__cause__!r}"
                        ) from e.__cause__
                    kept.restore()  # the model as it was, for the try in its own dtype
                    notes.append(f"the forward failed in {_name(run_dtype)} ({e.__cause__!r}); checked in {_name(own)}")
        result.notes = notes + sorted({str(w.message) for w in said if str(w.message).startswith(("GNS", "convert"))})
    finally:
        kept.restore()
    if show:
        print(result.table(), file=file or sys.stdout)
    return result


class _ForwardFailed(Exception):
    """The user's forward raised in the dtype the check cast the model to (its __cause__ is the forward's error)."""


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _check(model, batch, per_example_loss, run_dtype, own, convert_options, converted):
    """The Verification of one try, in run_dtype."""
    work = model if converted else copy.deepcopy(model)  # (a copy is converted: the user's model stays plain)
    cast = run_dtype != own
    if cast:
        _cast(work, run_dtype)
        batch = _cast_batch(batch, run_dtype)
    monitor = (
        GNSMonitor(work, expect_tracked=False, check_mixing=False)
        if converted
        else convert(work, check_mixing=False, **(convert_options or {}))
    )
    for p in _unique_parameters(work):
        p.grad = None
    zero_pe_sqnorm_buffers(work)
    calls = []  # [module, args, kwargs, output, its Pass] of each forward of an installed root
    roots = [m for m in work.modules() if state_of(m).row_mapper is not None]

    def called(module, args, kwargs):
        calls.append([module, args, kwargs, None, None])

    def returned(module, args, output):
        found = next((c for c in reversed(calls) if c[0] is module and c[3] is None), None)
        if found is not None:
            found[3], found[4] = output, state_of(module).row_mapper.last_pass

    handles = [m.register_forward_pre_hook(called, with_kwargs=True, prepend=True) for m in roots]
    handles += [m.register_forward_hook(returned) for m in roots]
    try:
        try:
            losses = per_example_loss(work, batch)
        except Exception as e:
            if cast:
                raise _ForwardFailed() from e
            raise
    finally:
        for handle in handles:
            handle.remove()
    if not (isinstance(losses, torch.Tensor) and losses.dim() == 1 and losses.is_floating_point()):
        got = f"a tensor of shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise SettingNotValid(
            f"verify: per_example_loss(model, batch) returned {got}; it returns each example's loss, a (B,) tensor "
            "whose mean is the step's loss (reduction='none', then a mean over each example's tokens)"
        )
    if not losses.requires_grad:
        raise SettingNotValid(
            "verify: per_example_loss(model, batch) returned losses with no gradient (computed under "
            "torch.no_grad(), or from no trainable parameter)"
        )
    B = losses.shape[0]
    losses.mean().backward(retain_graph=True)
    monitor.row_map.finish()  # (what tensors used several times left pending)
    values, _, _ = monitor.reader.read(across_ranks=False)
    refusal = None
    if world_size() == 1:  # (the monitor's own read all-reduces across ranks)
        try:
            monitor.measure(batch_size=B)
        except ValueError as e:
            refusal = str(e)
    truth = _oracle(work, losses)
    checks = _parameter_checks(work, monitor, values, truth, B, run_dtype)
    causes = []
    if any(c.verdict == "differs" for c in checks):
        causes = _causes(calls, losses, monitor)
    verdict = (
        "differs"
        if any(c.verdict == "differs" for c in checks)
        else "refused"
        if refusal or any(c.verdict == "refused" for c in checks)
        else "exact"
    )
    return Verification(verdict, checks, causes, refusal, B, run_dtype)


def _oracle(model, losses):
    """{id(parameter): (mean_i ||g_i||^2, ||mean_i g_i||^2)}, g_i the gradient of losses[i] alone (float64)."""
    params = [p for p in _unique_parameters(model) if p.requires_grad]
    B = losses.shape[0]
    sq = [0.0] * len(params)
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(B):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        for k, g in enumerate(grads):
            if g is not None:
                g = g.detach().double()
                sq[k] += g.pow(2).sum().item()
                total[k] += g
    return {id(p): (sq[k] / B, (total[k] / B).pow(2).sum().item()) for k, p in enumerate(params)}


def _parameter_checks(model, monitor, values, truth, B, dtype):
    """One ParameterCheck per trainable parameter (a tied tensor once, under its logged name)."""
    relative = RELATIVE_TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
    scale = max([t for pair in truth.values() for t in pair] + [0.0])
    absolute = ABSOLUTE_TOLERANCE * scale
    entries = {id(entry.ref.get()): (i, entry) for i, entry in enumerate(monitor.tracked)}
    checks, seen = [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        true_pe_sq, true_norm_sq = truth[id(p)]
        check = ParameterCheck(name, "not measured", math.sqrt(true_pe_sq), math.sqrt(true_norm_sq))
        checks.append(check)
        if id(p) not in entries:
            check.why = monitor.untracked.get(name, "no layer records its per-example norms")
            continue
        i, entry = entries[id(p)]
        check.name = entry.name
        grad_sq, sums, count = values[i]
        if entry.name in monitor.untracked:
            check.why = monitor.untracked[entry.name]
        elif math.isnan(count):
            reasons = {r for m, b, _ in entry.terms for r in monitor.row_map.reasons(m._buffers[b])}
            check.verdict, check.why = "refused", "; ".join(sorted(reasons)) or "its rows could not be mapped"
        elif count == 0:
            if true_pe_sq > absolute:
                check.verdict = "refused"
                check.why = "its layer recorded no example although it has a gradient (a use outside its forward)"
            else:
                check.why = "unused by this forward"
        elif count != B:
            check.verdict = "refused"
            check.why = f"its layer counted {count:.0f} examples in a step of {B}"
        else:
            pe_sq = sums * B
            check.rms_pe_norm, check.norm = math.sqrt(max(pe_sq, 0.0)), math.sqrt(grad_sq)
            close = all(
                abs(got - want) <= relative * want + absolute
                for got, want in ((pe_sq, true_pe_sq), (grad_sq, true_norm_sq))
            )
            check.verdict = "exact" if close else "differs"
    return checks


def _causes(calls, losses, monitor):
    """What the observations say of why numbers differ (see the module docstring)."""
    causes = []
    call = next((c for c in calls if c[4] is not None and c[4].layout is not None), None)
    if call is None:
        return ["no forward of the model itself ran (its submodules called directly): the cause was not looked for"]
    module, args, kwargs, output, found = call
    B = losses.shape[0]
    targets = [
        (t if t.dim() > 1 else t[:, None], rows)
        for t in trees.leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.dim() >= 1
        for rows in [rows_of(found, t)]
        if rows is not None
    ]
    if targets and found.layout.examples == B:
        for i in sorted({0, B - 1}):
            grads = torch.autograd.grad(losses[i], [t for t, _ in targets], retain_graph=True, allow_unused=True)
            reached = next(
                (k for (_, rows), g in zip(targets, grads) for k in [reached_example(g, rows, i)] if k is not None),
                None,
            )
            if reached is not None:
                causes.append(
                    f"the loss couples the examples: example {i}'s loss depends on the model's outputs for example "
                    f"{reached}, so its own gradient is not the part of the step's gradient that reaches its rows, "
                    "which is what the layers measure (a contrastive loss with in-batch negatives, a batch-level "
                    "term); make the group of examples the loss couples the example (docs/integrations.md, "
                    "install(model, layout_of=...)), or measure a loss that is a mean of per-example losses"
                )
                break
    elif found.layout.examples != B:
        causes.append(
            f"per_example_loss returned {B} losses for a forward of {found.layout.examples} examples: the losses must "
            "be the model's examples'"
        )
    mixed = examples_mixed(module, args, kwargs, monitor.row_map, monitor.table)
    if isinstance(mixed, tuple):
        where, why = mixed
        causes.append(f"a forward mixing the examples: {where} mixes the examples of the batch: {why}")
    if not causes:
        causes.append(
            "none observed: no example's loss depends on another's outputs, and no example's outputs on another's "
            "inputs; a parameter used outside its layer's forward, or a gradient changed by a hook, gives this"
        )
    return causes
