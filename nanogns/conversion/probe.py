"""
Which per-example norm layer can stand in for a module that `nanogns.convert`
does not know by its class, decided by what the module computes on a probe input.

A module is probed only when a swap would lose nothing but its forward: its own
parameters are a floating-point `weight` and maybe a `bias` (or parameters named
otherwise that the user maps to those roles: convert(treat_as={Cls: (kind,
{"weight": "scale"})})), it has no submodules and its forward takes one input.
The kinds (nanogns/kinds/'s KINDS) with a Probe say which parameter shapes they hold
(a subclass of a torch class, or a class named in `convert(treat_as=...)`, is
tried as that kind only), which probe parameters and input to use, and which
options to try (each eps, Gemma's (1 + weight) offset, ...).

The probe runs the module through torch.func.functional_call on random probe
parameters (the module and its own parameters are never touched), and the
candidate layer on the same parameters, input and output gradient, and compares
the outputs, the parameter gradients and the input gradient. Each is accepted
when max |difference| / max |reference| is within PROBE_TOLERANCE, in each of:

  float64 parameters and input      decides what the module computes (1e-5: a module that
                                    computes in float32 inside, as LlamaRMSNorm does, is off
                                    by about 1e-7; an eps 20% off, a missing offset or
                                    LayerNorm for RMSNorm is off by 8e-2 or more)
  its own dtype                     rounding, and the output dtype must match
  its own dtype, a bfloat16 input   a module that casts its weight to the input's dtype
                                    (nanochat's Linear) must be matched by one that does
  its own dtype under bf16 autocast the output dtype under autocast must match

A setting in which the module's own forward fails is skipped (torch's nn.Linear
refuses a bfloat16 input with float32 weights, and so does the candidate). A
module whose forward fails in float64 is probed in its own dtype only.
"""

import copy
import inspect
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from nanogns.conversion import intercept
from nanogns.core import layout, shared
from nanogns.core.registry import adopt, adopted_twin
from nanogns.errors import NotSupported
from nanogns.kinds import KINDS

# float64 decides what the module computes; its own dtype then checks dtypes and rounding (float32: loose
# enough for TF32 matmuls on a GPU, ~1e-3)
PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 5e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
ROLES = ("weight", "bias")  # the parameter roles a probed module may have
CHANGES_PARAMETERS = "it changes its parameters in place (e.g. max_norm), which a swap would drop"


@dataclass
class Candidate:
    """A layer kind (a registry key) with the options its layer needs (eps, weight_offset, cast_weight)."""

    kind: str
    options: dict = field(default_factory=dict)

    def __str__(self):
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.options.items())})"


def probed_kinds():
    """The registered kinds that may stand in for a module the registry does not know, in registry order."""
    return [name for name, kind in KINDS.items() if kind.probe is not None]


# -----------------------------------------------------------------------------
# which modules, which candidates


def role_names(module, options=None):
    """{role: the module's parameter name} for the roles weight and bias: as the user names them, else by name,
    else the module's only parameter is its weight (a norm whose gain is called `scale`)."""
    options = options or {}
    roles = {role: options.get(role, role) for role in ROLES if options.get(role, role) in module._parameters}
    own = [name for name, p in module._parameters.items() if p is not None]
    if "weight" not in roles and "weight" not in options and len(own) == 1:
        roles = {"weight": own[0]}
    return roles


def structure_problem(module, options=None):
    """None when swapping `module` would lose nothing but its forward, else what a swap would lose."""
    params = dict(module.named_parameters(recurse=False))
    roles = role_names(module, options)
    if "weight" not in roles or set(params) - set(roles.values()):
        hint = (
            ""
            if len(params) > 2 or not params
            else (
                "; if one of them is its weight, name it: convert(treat_as={"
                + type(module).__name__
                + ': (kind, {"weight": "<name>"})})'
            )
        )
        return f"its parameters {sorted(params)} are not a weight and maybe a bias{hint}"
    if not all(p.is_floating_point() for p in params.values()):
        return "its parameters are not floating point"
    if any(child is not None for child in module._modules.values()):
        return "it has submodules, which a swap would drop"
    if isinstance(module, (nn.Embedding, nn.LayerNorm, nn.RMSNorm)) and _reads_its_input_dtype(module):
        return (  # Ovis2's visual embedding table multiplies soft tokens; diffusers' FP32LayerNorm computes in float32
            f"{type(module).__name__}'s forward reads its input's dtype (it computes otherwise for floating-point "
            "inputs, or in a dtype of its own), which no layer of its kind does"
        )
    if not _takes_only_its_input(module):  # MambaRMSNormGated's forward(hidden_states, gate=None): a one-input
        try:  # layer would drop the gate (or crash on the model's own call)
            return f"its forward{inspect.signature(module.forward)} takes more than its input"
        except (TypeError, ValueError):
            return "its forward's signature cannot be read"
    return None


def _reads_its_input_dtype(module):
    """True when the module's own forward (not torch's) asks its input's dtype or whether it is floating point."""
    forward = type(module).forward
    if forward.__module__.startswith("torch."):
        return False
    try:
        parameters = list(inspect.signature(forward).parameters)
        source = inspect.getsource(forward)
    except (OSError, TypeError, ValueError):
        return False
    if len(parameters) < 2:
        return False
    name = parameters[1]
    return f"{name}.dtype" in source or f"{name}.is_floating_point" in source


def _takes_only_its_input(module):
    """True when module.forward takes exactly one argument, its input: a layer of a kind takes nothing else, so
    a module whose forward takes more (even with a default, even through *args or **kwargs) is never swapped."""
    try:
        inputs = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(inputs) == 1 and inputs[0].kind in positional


def _takes_one_input(module):
    """True when module.forward needs exactly one positional input (so a probe can call it); others may have
    defaults."""
    try:
        inputs = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in inputs
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return bool(inputs) and inputs[0].kind in positional and len(required) == 1 and required[0] is inputs[0]


def fitting_kinds(module, kinds=None, options=None):
    """The kinds among `kinds` (default: every probed kind) whose layers hold parameters of `module`'s shapes."""
    roles = role_names(module, options)
    if "weight" not in roles:
        return []
    weight, bias = module._parameters[roles["weight"]], module._parameters.get(roles.get("bias", "bias"))
    if "bias" not in roles:
        bias = None
    return [kind for kind in (kinds or probed_kinds()) if KINDS.kind(kind).probe.fits(weight, bias)]


def candidates(module, kinds, options=None):
    """Candidate layers in the order tried: each kind's option sets (the module's own eps first)."""
    options = {k: v for k, v in (options or {}).items() if k not in ROLES}
    return [Candidate(kind, found) for kind in kinds for found in KINDS.kind(kind).probe.candidates(module, options)]


# -----------------------------------------------------------------------------
# the probe


def _forward_backward(forward, params, x, grad_out=None, autocast_dtype=None):
    """(output, output gradient, [parameter gradients..., input gradient]) of forward(params, x). An output that
    is a tuple (a router's logits and choices) counts by its floating-point tensors, concatenated."""
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    device_type = x.device.type
    with (
        torch.enable_grad(),
        torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None),
    ):
        out = forward(params, x)
    outs = (
        [out]
        if isinstance(out, torch.Tensor)
        else [
            t
            for t in (out if isinstance(out, (tuple, list)) else [])
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
    )
    if not outs:
        raise NotSupported(f"its forward returns a {type(out).__name__}, not tensors")
    if grad_out is None:
        gen = torch.Generator().manual_seed(1)
        grad_out = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
    differentiable = [(o, g) for o, g in zip(outs, grad_out) if o.requires_grad]
    leaves = list(params.values()) + ([x] if x.requires_grad else [])
    grads = (
        torch.autograd.grad([o for o, _ in differentiable], leaves, [g for _, g in differentiable], allow_unused=True)
        if differentiable
        else [None] * len(leaves)
    )
    grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    flat = (
        torch.cat([o.detach().reshape(-1).to(torch.float64 if o.dtype == torch.float64 else o.dtype) for o in outs])
        if len(outs) > 1
        else outs[0].detach()
    )
    return flat, grad_out, grads


def _difference(reference, result, names, check_dtype):
    """(largest max |difference| / max |reference| over the tensors, which tensor)."""
    worst = (0.0, names[0])
    for name, want, got in zip(names, reference, result):
        if want.shape != got.shape:
            return math.inf, f"{name} (shape {tuple(got.shape)}, expected {tuple(want.shape)})"
        if check_dtype and want.dtype != got.dtype:
            return math.inf, f"{name} (dtype {got.dtype}, expected {want.dtype})"
        scale = want.double().abs().max().clamp_min(1e-300) if want.numel() else torch.tensor(1.0)
        diff = ((got.double() - want.double()).abs().max() / scale).item() if want.numel() else 0.0
        diff = math.inf if math.isnan(diff) else diff
        worst = max(worst, (diff, name))
    return worst


@dataclass(frozen=True)
class Setting:
    """One way of running the probe: parameter dtype, input dtype (None: the parameters'), autocast dtype."""

    param_dtype: torch.dtype
    input_dtype: torch.dtype = None
    autocast: torch.dtype = None

    def __str__(self):
        described = str(self.param_dtype).replace("torch.", "")
        if self.input_dtype is not None:
            described += f" parameters, {str(self.input_dtype).replace('torch.', '')} input"
        if self.autocast is not None:
            described += f" under {str(self.autocast).replace('torch.', '')} autocast"
        return described

    @property
    def tolerance(self):
        lowest = self.autocast or self.input_dtype or self.param_dtype
        return max(PROBE_TOLERANCE[self.param_dtype], PROBE_TOLERANCE.get(lowest, 5e-2))


class _Probe:
    """Runs `module` once per probe input and setting (cached) and compares candidates against it."""

    def __init__(self, module, options=None):
        self.module = module
        self.roles = role_names(module, options)
        self.weight = module._parameters[self.roles["weight"]]
        self.device = torch.device("cpu") if self.weight.device.type == "meta" else self.weight.device
        self._reference = {}

    def settings(self, kind):
        own = self.weight.dtype
        found = [Setting(torch.float64)]
        if own != torch.float64 and own in PROBE_TOLERANCE:
            found.append(Setting(own))
            found.append(Setting(own, input_dtype=torch.bfloat16 if own != torch.bfloat16 else torch.float32))
            if self.device.type in ("cpu", "cuda"):
                found.append(Setting(own, autocast=torch.bfloat16))
        return found

    def reference(self, kind, setting):
        """(parameter values by role, input, output, output grad, grads) of the module itself, or the exception
        its forward raised."""
        key = (kind, setting)
        if key not in self._reference:
            gen = torch.Generator().manual_seed(0)
            bias = self.module._parameters[self.roles["bias"]] if "bias" in self.roles else None
            values, x = KINDS.kind(kind).probe.data(self.module, gen, self.weight, bias)
            values = {role: v.to(self.device, setting.param_dtype) for role, v in values.items()}
            if not x.is_floating_point():
                if setting.input_dtype is not None:  # token ids have no dtype to vary
                    self._reference[key] = None
                    return None
                x = x.to(self.device)
            else:
                x = x.to(self.device, setting.input_dtype or setting.param_dtype)
            params = {self.roles[role]: nn.Parameter(v.clone()) for role, v in values.items()}
            try:
                out, grad_out, grads = _forward_backward(
                    lambda p, inp: torch.func.functional_call(self.module, p, (inp,)),
                    params,
                    x,
                    autocast_dtype=setting.autocast,
                )
                if not all(torch.equal(p, values[role]) for role, p in zip(values, params.values())):
                    raise RuntimeError(CHANGES_PARAMETERS)
                self._reference[key] = (values, x, out, grad_out, grads)
            except Exception as e:  # any failure of the user's forward means: not this setting
                self._reference[key] = e
        return self._reference[key]

    def candidate_layer(self, candidate, values):
        """A fresh layer of the candidate's gns variant holding probe parameters `values` (by role), with the
        module's plain attributes (padding_idx, ...) and the candidate's options."""
        layer = nn.Module()
        for name, value in vars(self.module).items():
            if isinstance(value, (bool, int, float, str, tuple, type(None))) and not name.startswith("_"):
                setattr(layer, name, value)
        for role, value in values.items():
            setattr(layer, role, nn.Parameter(value.clone()))
        # the torch-only variant: it runs in every dtype and device
        return adopt(layer, KINDS.kind(candidate.kind).layer_class("gns"), dict(candidate.options))

    def difference(self, candidate):
        """(max relative difference, in what, setting) of `candidate` against the module: the first setting out
        of tolerance, else the last one run; inf where the candidate fails or the module runs in none."""
        result = None
        for setting in self.settings(candidate.kind):
            reference = self.reference(candidate.kind, setting)
            if reference is None:  # the setting does not apply to this kind's input
                continue
            if isinstance(reference, Exception):
                if setting.param_dtype == torch.float64 or result is None:
                    result = result or (
                        math.inf,
                        f"module's forward ({type(reference).__name__}: {reference})",
                        setting,
                    )
                continue  # this setting is one the module itself refuses: nothing to match
            values, x, want_out, grad_out, want_grads = reference
            layer = self.candidate_layer(candidate, values)
            params = {role: getattr(layer, role) for role in values}
            try:
                got_out, _, got_grads = _forward_backward(
                    lambda p, inp: layer(inp), params, x, grad_out, autocast_dtype=setting.autocast
                )
            except Exception as e:
                return math.inf, f"candidate's forward ({type(e).__name__}: {e})", setting
            names = ["output"] + [f"{self.roles[role]} gradient" for role in values] + ["input gradient"]
            diff, where = _difference(
                [want_out, *want_grads], [got_out, *got_grads], names, check_dtype=setting.param_dtype != torch.float64
            )
            result = (diff, where, setting)
            if diff > setting.tolerance:
                break
        return result


def find_replacement(module, kinds, options=None):
    """The first candidate of `kinds` that computes what `module` computes on the probe.

    Args:
        module: a module that passes `structure_problem`.
        kinds: the kinds to try (registered kinds with a Probe).
        options: fixed options (eps, weight_offset; the roles weight and bias mapped to parameter names).
    Returns:
        (Candidate, None) for the swap, or (None, why no candidate was accepted).
    """
    probe = _Probe(module, options)
    tried = []
    for candidate in candidates(module, kinds, options):
        with warnings.catch_warnings():  # the probe's mixed dtypes make torch warn; the user's model is not at stake
            warnings.simplefilter("ignore")
            diff, where, setting = probe.difference(candidate)
        if diff <= setting.tolerance:
            return candidate, None
        tried.append((diff, str(candidate), where, setting))
    if not tried:
        return None, f"no {' or '.join(kinds)} layer takes the options {options}"
    diff, closest, where, setting = min(tried, key=lambda t: t[0])
    if math.isinf(diff):
        return None, f"no candidate ran on a probe input: {closest} failed in the {where} ({setting})"
    reason = (
        f"computes none of {', '.join(kinds)} on a probe input; closest {closest} differs in the {where} by "
        f"{diff:.1e} (max relative; {setting} probe, tolerance {setting.tolerance:.0e})"
    )
    norm_kinds = [k for k in kinds if KINDS.kind(k).group == "LayerNorm"]
    if norm_kinds:
        reason += (
            f"; if only its eps is unusual, give it: convert(treat_as={{{type(module).__name__}: "
            f"(\"{norm_kinds[0]}\", {{\"eps\": ...}})}})"
        )
    return None, reason


# -----------------------------------------------------------------------------
# a module that keeps its own forward (intercept.py)


def _intercept_probe_data(module, generator):
    """(probe parameters {name: float64 tensor}, input) for a module whose own forward is kept: token ids for an
    nn.Embedding subclass, else rows of the last dim of its first parameter (a Linear's in_features, a scale's
    size); None when it has no parameter to shape an input from."""
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, nn.Embedding):
        return KINDS.kind("Embedding").probe.data(module, generator, module.weight, None)
    shaped = [p for p in params.values() if p.dim() >= 1]
    if not shaped:
        return None
    D = shaped[0].shape[-1]
    values = {
        name: torch.randn(*p.shape, generator=generator, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5
        for name, p in params.items()
    }
    return values, torch.randn(3, 4, D, generator=generator, dtype=torch.float64)


def intercept_problem(module, container=False):
    """None when `module`'s own forward, run with its parameter uses intercepted (intercept.py), computes what
    it computes and records every trainable parameter's examples on a probe input; else what goes wrong. A
    forward that takes several inputs (or fails on the probe's) cannot be probed: for a subclass of torch's Linear
    or Embedding, a forward of no input, parameters shaped (1, ...), or a `container` (a block whose children hold
    parameters its code does not read) that is None (its uses are still checked at every step), for any other
    module a reason."""

    params = dict(module.named_parameters(recurse=False))
    if not params or not all(p.is_floating_point() for p in params.values()):
        return "its parameters are not floating point"
    # a subclass of torch's Linear or Embedding, or parameters shaped to broadcast over the batch (a ViT's class
    # token): when no probe can run its forward, its uses are checked at every step instead
    checked_at_each_step = (
        isinstance(module, (nn.Linear, nn.Embedding))
        or all(p.dim() >= 2 and p.shape[0] == 1 for p in params.values())
        or _inputs(module) == []  # a forward of no input computes tables the examples share (Swin's bias)
        or _sized_by_an_int(module)  # forward(batch_size: int): parameters expanded to the batch (Perceiver's latents)
        or container  # a block whose children hold its big layers (Wav2Vec2Model, CLIP's embeddings)
    )
    if not _takes_one_input(module):
        return (
            None
            if checked_at_each_step
            else f"its forward{_signature(module)} takes several inputs, so no probe can check it"
        )
    device = next(iter(params.values())).device
    device = torch.device("cpu") if device.type == "meta" else device
    data = _intercept_probe_data(module, torch.Generator().manual_seed(0))
    if data is None:
        return "it has no parameter to shape a probe input from"
    values, x = data
    values = {name: v.to(device) for name, v in values.items()}
    x = x.to(device)
    try:
        want_out, grad_out, want_grads = _forward_backward(
            lambda p, inp: torch.func.functional_call(module, p, (inp,)),
            {name: nn.Parameter(v.clone()) for name, v in values.items()},
            x,
        )
    except Exception as e:
        return None if checked_at_each_step else f"its forward fails on a probe input ({type(e).__name__}: {e})"
    twin = adopted_twin(
        module,
        intercept.InterceptedForward,
        {"kinds": {}},
        {name: nn.Parameter(v.clone()) for name, v in values.items()},
    )
    tables = []  # outputs that are tables the examples share (shared.py): their uses count where they meet them

    def forward(p, inp):
        out = twin(inp)
        tables.append(any(shared.is_shared(t) for t in pytree.tree_leaves(out)))  # (a bias handed back with it)
        return out

    try:
        with layout.collecting() as row_map:
            got_out, _, got_grads = _forward_backward(forward, dict(twin._parameters), x, grad_out)
    except Exception as e:
        return f"its forward fails with its parameter uses followed ({type(e).__name__}: {e})"
    trainable = [name for name, p in params.items() if p.requires_grad]  # (a router's frozen score correction)
    reasons = {name: row_map.reasons(twin.pe_buffer(name)) for name in trainable}
    found = next((r[0] for r in reasons.values() if r), None)
    if found is not None:
        return found
    names = ["output"] + [f"{name} gradient" for name in params] + ["input gradient"]
    diff, where = _difference([want_out, *want_grads], [got_out, *got_grads], names, check_dtype=True)
    if diff > PROBE_TOLERANCE[torch.float64]:
        return f"its forward with its parameter uses followed differs in the {where} by {diff:.1e}"
    unused = [name for name in trainable if twin.pe_buffer(name)[1].item() == 0]
    if unused and not any(tables):
        return f"its forward does not use its {', '.join(unused)} through F.linear or F.embedding"
    return None


def _inputs(module):
    """The parameters of module.forward (None when its signature cannot be read)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _sized_by_an_int(module):
    """True when module.forward's first input is annotated as an int (a batch size it expands its parameters to):
    no probe can feed it data, and its uses of its parameters are checked at every step."""
    inputs = _inputs(module)
    if not inputs:
        return False
    annotation = inputs[0].annotation
    return annotation is int or (isinstance(annotation, str) and annotation.strip() == "int")


def _signature(module):
    try:
        return str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        return "(...)"


def read_children_problem(module, read):
    """See _read_children_problem; any failure of the probe itself (a module that cannot be copied) is its reason."""
    try:
        return _read_children_problem(module, read)
    except Exception as e:
        return f"no probe of its forward with its children's parameter uses followed ran ({type(e).__name__}: {e})"


def _read_children_problem(module, read):
    """None when `module`'s own forward, with its own parameters' and its children `read`'s parameters' uses followed
    (intercept.py: its code reads those children's parameters itself, Mamba's mixer its conv1d's and dt_proj's),
    computes what it computes and records each of those parameters' examples, on a probe input of three examples
    of four rows as wide as its first Linear child takes (float64, inside a forward of that layout); else what goes
    wrong (the module is then replayed per example)."""
    params = list(module.parameters())
    if not all(p.is_floating_point() for p in params):
        return "its parameters are not floating point"
    width = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)
    if width is None or not _takes_one_input(module):
        return "no probe input can be made for it (a Linear child's width, one input)"
    generator = torch.Generator().manual_seed(0)
    device = params[0].device
    if device.type == "meta":  # (real sizes built on the meta device: probed on the CPU, with random values)
        device = torch.device("cpu")
        plain = copy.deepcopy(module).to_empty(device=device).double()
    else:
        plain = copy.deepcopy(module).double()
    twin = copy.deepcopy(plain)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), twin.parameters()):
            scale = max(1, p.shape[-1]) ** 0.5 if p.dim() else 1.0  # (a 0-d parameter: a scale)
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(device) / scale)
            q.copy_(p)
    x = torch.randn(3, 4, width, generator=generator, dtype=torch.float64).to(device)
    adopt(twin, intercept.InterceptedForward, {"kinds": {}, "children": read})
    try:
        want_out, grad_out, want_grads = _forward_backward(lambda p, inp: plain(inp), dict(plain.named_parameters()), x)
        with layout.running(layout.Layout(3, (4,))) as running:
            got_out, _, got_grads = _forward_backward(
                lambda p, inp: twin(inp), dict(twin.named_parameters()), x, grad_out
            )
    except Exception as e:
        return f"its forward fails with its children's parameter uses followed ({type(e).__name__}: {e})"
    grads = dict(zip([name for name, _ in twin.named_parameters()], want_grads))
    owners = [("", twin)] + [(name + ".", twin.get_submodule(name)) for name in read]
    for prefix, owner in owners:
        for name, param in owner.named_parameters(recurse=False):
            buffer = owner._buffers.get(name + "_pe_sqnorm")
            found = running.mapper.reasons(buffer) if buffer is not None else ()
            if found:
                return found[0]
            used = bool(grads[prefix + name].abs().sum() > 0)  # (a bias its code never reads has no gradient)
            if param.requires_grad and used and (buffer is None or buffer[1].item() != 3):
                return f"its {prefix + name} recorded no example on the probe"
    names = ["output"] + [f"{name} gradient" for name, _ in plain.named_parameters()] + ["input gradient"]
    diff, where = _difference([want_out, *want_grads], [got_out, *got_grads], names, check_dtype=True)
    if diff > PROBE_TOLERANCE[torch.float64]:
        return f"its forward with its children's parameter uses followed differs in the {where} by {diff:.1e}"
    return None
