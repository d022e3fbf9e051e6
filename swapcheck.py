"""
Which per-example norm layer can stand in for a module that `layer_config.convert`
does not know by its class, decided by what the module computes on a probe input.

A module is probed only when a swap would lose nothing but its forward: its own
parameters are a floating-point `weight` and maybe a `bias`, it has no
submodules, buffers or hooks, and its forward takes one input. Its parameter
shapes give the candidate kinds (convert may narrow them: a subclass of a torch
class, or a class named in `convert(treat_as=...)`, is tried as that kind only):

    weight (D,)                  RMSNorm, RMSNorm scaled by (1 + weight) (Gemma's), LayerNorm without bias
    weight (D,), bias (D,)       LayerNorm
    weight (L, K), bias (L,)     Linear   (weight stored (out, in), y = x W^T + b)
    weight (K, L), bias (L,)     Conv1D   (weight stored (in, out), y = x W + b: transformers' GPT-2)
    weight 2-D, no bias          Linear, Conv1D, Embedding

Norms are tried with each eps the module stores (`eps`, `variance_epsilon`,
..., or any float attribute in (0, 1)), then with common values; the probe decides.

The probe runs the module through torch.func.functional_call on random probe
parameters (the module and its own parameters are never touched), and the
candidate layer on the same parameters, input and output gradient, and
compares the outputs, the parameter gradients and the input gradient. Each
is accepted when max |difference| / max |reference| is within PROBE_TOLERANCE:
first in float64 (1e-5: a module that computes in float32 inside, as
transformers' LlamaRMSNorm does, is off by about 1e-7; an eps 20% off, a missing
offset or LayerNorm for RMSNorm is off by 8e-2 or more), then in the module's
own dtype, where the output dtype must match too (loose tolerances: rounding
and TF32 matmuls). A module whose forward fails in float64 is probed in its own
dtype only.

The norm probe has 12 rows (3 examples of 4 positions): zero-mean rows of scale
1 down to 1e-6, so mean(x^2) spans 1 to 1e-12 and any eps in that range
dominates some row, and rows with mean 3, -2 and 1, which LayerNorm subtracts
and RMSNorm does not.
"""

import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

PROBED_KINDS = ("RMSNorm", "LayerNorm", "Linear", "Conv1D", "Embedding")
NORM_KINDS = ("RMSNorm", "LayerNorm")
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps",
                  "norm_eps")
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12, None)  # None: the input dtype's machine epsilon, F.rms_norm's default
RMS_OFFSETS = (0.0, 1.0)  # y = xhat * (offset + weight): 1 is Gemma's RMSNorm
# float64 decides what the module computes; its own dtype then checks dtypes and rounding (float32: loose
# enough for TF32 matmuls on a GPU, ~1e-3)
PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 5e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
ROW_SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 3e-3, 3e-5, 1.0, 1.0, 0.3)
ROW_MEANS = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, -2.0, 1.0)
SHAPE_FITS = {  # (weight, bias or None) -> does the kind hold such parameters?
    "RMSNorm": lambda w, b: w.dim() == 1 and b is None,
    "LayerNorm": lambda w, b: w.dim() == 1 and (b is None or b.shape == w.shape),
    "Linear": lambda w, b: w.dim() == 2 and (b is None or b.shape == w.shape[:1]),
    "Conv1D": lambda w, b: w.dim() == 2 and (b is None or b.shape == w.shape[1:]),
    "Embedding": lambda w, b: w.dim() == 2 and b is None,
}


@dataclass
class Candidate:
    """A layer kind (a LAYER_CLASSES key) with the options its constructor needs (eps, weight_offset)."""

    kind: str
    options: dict = field(default_factory=dict)

    def __str__(self):
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.options.items())})"


# -----------------------------------------------------------------------------
# which modules, which candidates

def structure_problem(module):
    """None when swapping `module` would lose nothing but its forward, else what a swap would lose."""
    params = dict(module.named_parameters(recurse=False))
    if "weight" not in params or set(params) - {"weight", "bias"}:
        return f"its parameters {sorted(params)} are not a weight and maybe a bias"
    if not all(p.is_floating_point() for p in params.values()):
        return "its parameters are not floating point"
    if any(child is not None for child in module._modules.values()):
        return "it has submodules, which a swap would drop"
    buffers = sorted(name for name, b in module._buffers.items() if b is not None)
    if buffers:
        return f"it has buffers {buffers}, which a swap would drop"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return "it has hooks, which a swap would drop"
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    inputs = list(signature.parameters.values())
    if len(inputs) != 1 or inputs[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return f"its forward{signature} takes more than one input"
    return None


def fitting_kinds(module, kinds=PROBED_KINDS):
    """The kinds among `kinds` whose layers hold parameters of `module`'s shapes."""
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    if weight is None:
        return []
    return [kind for kind in kinds if SHAPE_FITS[kind](weight, bias)]


def eps_values(module):
    """eps values to try: those the module stores, then the common ones."""
    stored = [getattr(module, name) for name in EPS_ATTRIBUTES if hasattr(module, name)]
    stored += [v for v in vars(module).values() if isinstance(v, float) and 0 < v < 1]
    values = []
    for v in stored + list(COMMON_EPS):
        if (v is None or isinstance(v, (int, float)) and not isinstance(v, bool)) and v not in values:
            values.append(v)
    return values


def candidates(module, kinds, options=None):
    """Candidate layers in the order tried: each eps (the module's own first) with every norm kind, then the rest."""
    options = options or {}
    found = []
    for eps in [options["eps"]] if "eps" in options else eps_values(module):
        if "RMSNorm" in kinds:
            offsets = [options["weight_offset"]] if "weight_offset" in options else RMS_OFFSETS
            found += [Candidate("RMSNorm", dict(eps=eps, weight_offset=offset)) for offset in offsets]
        if "LayerNorm" in kinds and eps is not None:
            found.append(Candidate("LayerNorm", dict(eps=eps)))
    return found + [Candidate(kind) for kind in kinds if kind not in NORM_KINDS]


# -----------------------------------------------------------------------------
# the probe

def _probe_data(kind, module, device, dtype):
    """(parameters {name: Parameter}, input) for probing `kind`, the same numbers on every call."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = module._parameters["weight"], module._parameters.get("bias")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if kind in NORM_KINDS:
        D = weight.shape[0]
        x = randn(len(ROW_SCALES), D) * torch.tensor(ROW_SCALES, dtype=torch.float64)[:, None]
        x = (x + torch.tensor(ROW_MEANS, dtype=torch.float64)[:, None]).view(3, 4, D)
        params = {"weight": 1 + 0.5 * randn(D)}
    elif kind == "Embedding":
        x = torch.randint(0, weight.shape[0], (3, 4), generator=gen)
        if isinstance(getattr(module, "padding_idx", None), int):
            x[0, 0] = module.padding_idx  # a padding row gets no gradient in nn.Embedding: the probe sees that
        params = {"weight": randn(*weight.shape)}
    else:  # Linear: weight (L, K); Conv1D: weight (K, L)
        K = weight.shape[1] if kind == "Linear" else weight.shape[0]
        x = randn(3, 4, K)
        params = {"weight": randn(*weight.shape) / math.sqrt(K)}
    if bias is not None:
        params["bias"] = 0.5 * randn(*bias.shape)
    params = {name: nn.Parameter(p.to(device, dtype)) for name, p in params.items()}
    return params, (x.to(device, dtype) if x.is_floating_point() else x.to(device))


def _forward_backward(forward, params, x, grad_out=None):
    """(output, output gradient, [parameter gradients..., input gradient]) of forward(params, x)."""
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
        out = forward(params, x)
        if grad_out is None:
            gen = torch.Generator().manual_seed(1)
            grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
        leaves = list(params.values()) + ([x] if x.requires_grad else [])
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    return out.detach(), grad_out, grads


def _difference(reference, result, names, check_dtype):
    """(largest max |difference| / max |reference| over the tensors, which tensor)."""
    worst = (0.0, names[0])
    for name, want, got in zip(names, reference, result):
        if want.shape != got.shape:
            return math.inf, f"{name} (shape {tuple(got.shape)}, expected {tuple(want.shape)})"
        if check_dtype and want.dtype != got.dtype:
            return math.inf, f"{name} (dtype {got.dtype}, expected {want.dtype})"
        scale = want.double().abs().max().clamp_min(1e-300)
        diff = ((got.double() - want.double()).abs().max() / scale).item()
        diff = math.inf if math.isnan(diff) else diff
        worst = max(worst, (diff, name))
    return worst


class _Probe:
    """Runs `module` once per probe input and dtype (cached) and compares candidates against it."""

    def __init__(self, module):
        self.module = module
        self.weight = module._parameters["weight"]
        self.device = torch.device("cpu") if self.weight.device.type == "meta" else self.weight.device
        self._reference = {}

    def dtypes(self):
        own = self.weight.dtype
        return [torch.float64] + ([own] if own != torch.float64 and own in PROBE_TOLERANCE else [])

    def reference(self, kind, dtype):
        """(parameter values, input, output, output grad, grads) of the module itself, or the exception its
        forward raised."""
        key = ("Embedding" if kind == "Embedding" else "norm" if kind in NORM_KINDS else kind, dtype)
        if key not in self._reference:
            params, x = _probe_data(kind, self.module, self.device, dtype)
            values = {name: p.detach().clone() for name, p in params.items()}
            try:
                out, grad_out, grads = _forward_backward(
                    lambda p, inp: torch.func.functional_call(self.module, p, (inp,)), params, x)
                if not all(torch.equal(p, values[name]) for name, p in params.items()):
                    raise RuntimeError("it changes its parameters in place (e.g. max_norm), which a swap would drop")
                self._reference[key] = (values, x, out, grad_out, grads)
            except Exception as e:  # any failure of the user's forward means: not this probe
                self._reference[key] = e
        return self._reference[key]

    def difference(self, candidate):
        """(max relative difference, in what, probe dtype) of `candidate` against the module: the first probe
        dtype out of tolerance, else the last one run; inf where the candidate fails or the module runs in none."""
        import layer_config  # imported here: layer_config imports this module

        layer_cls = layer_config.get_layer_class(candidate.kind, "gns")  # torch-only: runs in every dtype
        result = None
        for dtype in self.dtypes():
            reference = self.reference(candidate.kind, dtype)
            if isinstance(reference, Exception):  # a forward that fails in float64 is probed in its own dtype only
                result = result or (math.inf, f"module's forward ({type(reference).__name__}: {reference})", dtype)
                continue
            values, x, want_out, grad_out, want_grads = reference
            params = {name: nn.Parameter(v.clone()) for name, v in values.items()}  # fresh: the same start values
            layer = layer_config.new_layer(layer_cls, candidate.kind, params, candidate.options)
            try:
                got_out, _, got_grads = _forward_backward(lambda p, inp: layer(inp), params, x, grad_out)
            except Exception as e:
                return math.inf, f"candidate's forward ({type(e).__name__}: {e})", dtype
            names = ["output"] + [f"{name} gradient" for name in params] + ["input gradient"]
            diff, where = _difference([want_out, *want_grads], [got_out, *got_grads], names,
                                      check_dtype=dtype == self.weight.dtype)
            result = (diff, where, dtype)
            if diff > PROBE_TOLERANCE[dtype]:
                break
        return result


def find_replacement(module, kinds, options=None):
    """The first candidate of `kinds` that computes what `module` computes on the probe.

    Args:
        module: a module that passes `structure_problem` (its own weight, maybe a bias).
        kinds: the kinds to try (a subset of PROBED_KINDS).
        options: fixed options (eps, weight_offset) instead of the values tried.
    Returns:
        (Candidate, None) for the swap, or (None, why no candidate was accepted).
    """
    probe = _Probe(module)
    tried = []
    for candidate in candidates(module, kinds, options):
        diff, where, dtype = probe.difference(candidate)
        if diff <= PROBE_TOLERANCE[dtype]:
            return candidate, None
        tried.append((diff, str(candidate), where, dtype))
    if not tried:
        return None, f"no {' or '.join(kinds)} layer takes the options {options}"
    diff, closest, where, dtype = min(tried, key=lambda t: t[0])
    if math.isinf(diff):
        return None, f"no candidate ran on a probe input: {closest} failed in the {where}"
    which = f"{str(dtype).replace('torch.', '')} probe, tolerance {PROBE_TOLERANCE[dtype]:.0e}"
    reason = (f"computes none of {', '.join(kinds)} on a probe input; closest {closest} differs in the {where} by "
              f"{diff:.1e} (max relative; {which})")
    if any(kind in NORM_KINDS for kind in kinds):
        reason += (f"; if only its eps is unusual, give it: convert(treat_as={{{type(module).__name__}: "
                   f"(\"{[k for k in kinds if k in NORM_KINDS][0]}\", {{\"eps\": ...}})}})")
    return None, reason
