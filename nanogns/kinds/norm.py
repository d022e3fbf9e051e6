"""
What the norm kinds over the last dim share (LayerNorm, RMSNorm): NormLayer, their base class (the parameters, eps,
the output's dtype rule), and the probe that finds them among modules no kind replaces by class.

Probing a module the registry does not know (conversion/probe.py): norm-shaped parameters are tried with each eps
the module stores (`eps`, `variance_epsilon`, ..., or any float attribute in (0, 1)), then common values. The probe
input has 12 rows (3 examples of 4 positions): zero-mean rows of scale 1 down to 1e-6, so mean(x^2) spans 1 to
1e-12 and any eps in that range dominates some row, and rows with mean 3, -2 and 1, which LayerNorm subtracts and
RMSNorm does not.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.buffers import PerExampleNormLayer, autocast_result_dtype

EPS_ATTRIBUTES = (
    "eps",
    "variance_epsilon",
    "epsilon",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rms_norm_eps",
    "norm_eps",
)
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12, None)  # None: the input dtype's machine epsilon, F.rms_norm's default
ROW_SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 3e-3, 3e-5, 1.0, 1.0, 0.3)
ROW_MEANS = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, -2.0, 1.0)


class NormLayer(PerExampleNormLayer, nn.Module):
    """A norm over the last dim, NormLayer(ndim, bias=True, eps=1e-5), with parameters `weight` (ones) and `bias` (zeros
    or None); its subclasses say how a row is normalised (`pe_normalize`) and record the affine part's norms."""

    pe_kind = "LayerNorm"
    # the output's dtype: None as torch's own layer (autocast included); "promote" the promotion of the input's and
    # the weight's dtypes, as norms written out by hand return (Llama's, T5's); "input" the input's (Gemma's)
    output_dtype = None

    def __init__(self, ndim, bias=True, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        assert len(self.normalized_shape) == 1, "per-example norm LayerNorm normalises the last dim only"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype)) if bias else None
        self.register_pe_buffers()

    def pe_adopt(self, options):
        self.normalized_shape = tuple(self.weight.shape)
        super().pe_adopt(options)

    def pe_normalize(self, x):
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)

    def pe_result_dtype(self, x, torch_op, *params):
        """The dtype of the output for input x (output_dtype's rule; torch_op(x, *params) is torch's layer)."""
        if self.output_dtype == "promote":
            return torch.promote_types(x.dtype, self.weight.dtype)
        if self.output_dtype == "input":
            return x.dtype
        return autocast_result_dtype(torch_op, x, *params)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"


# -----------------------------------------------------------------------------
# the probe


def eps_values(module):
    """eps values to try: those the module stores, then the common ones."""
    stored = [getattr(module, name) for name in EPS_ATTRIBUTES if hasattr(module, name)]
    stored += [v for v in vars(module).values() if isinstance(v, float) and 0 < v < 1]
    values = []
    for v in stored + list(COMMON_EPS):
        if (v is None or isinstance(v, (int, float)) and not isinstance(v, bool)) and v not in values:
            values.append(v)
    return values


def norm_probe_data(module, generator, weight, bias):
    """Probe parameters (weight, and bias when the module has one) and the 12-row input of the docstring."""
    D = weight.shape[0]
    x = torch.randn(len(ROW_SCALES), D, generator=generator, dtype=torch.float64)
    x = (
        x * torch.tensor(ROW_SCALES, dtype=torch.float64)[:, None]
        + torch.tensor(ROW_MEANS, dtype=torch.float64)[:, None]
    )
    params = {"weight": 1 + 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)}
    if bias is not None:
        params["bias"] = 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)
    return params, x.view(3, 4, D)


OUTPUT_DTYPES = (None, "promote", "input")  # the output dtype rules a probed norm may follow (output_dtype)
