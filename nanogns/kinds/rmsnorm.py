"""
The RMSNorm kind: torch's nn.RMSNorm with a weight, and the RMSNorm look-alikes
of transformers (LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm's (1 + weight) scale...)
that the probe recognises.

y_t = xhat_t * (offset + w) with xhat_t = x_t / sqrt(mean(x_t^2) + eps): the
affine maths every norm kind shares (kinds/affine.py) without a bias; example
i's gradient of (offset + w) is its gradient of w, so the offset changes nothing.
A weightless RMSNorm has no parameters and nothing to record.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.buffers import on_output_grad
from nanogns.core.registry import LayerKind, Probe
from nanogns.kinds.affine import affine, record_affine_norms
from nanogns.kinds.norm import OUTPUT_DTYPES, NormLayer, eps_values, norm_probe_data
from nanogns.variants import fused

RMS_OFFSETS = (0.0, 1.0)  # y = xhat * (offset + weight): 1 is Gemma's RMSNorm


def torch_rms_norm(x, weight):
    """F.rms_norm over the last dim: what the output dtype of an RMSNorm is compared with."""
    return F.rms_norm(x, x.shape[-1:], weight)


class PerExampleRMSNorm(NormLayer):
    """RMSNorm with a weight, y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), recording the weight's
    per-example norms.

    weight_offset = 1 is Gemma's RMSNorm, whose weight starts at 0 and scales by (1 + weight). eps=None is the
    machine epsilon of the dtype F.rms_norm computes in, as in F.rms_norm (with an offset that is float32 at
    least: the input is promoted, as Gemma does).
    """

    pe_kind = "RMSNorm"

    def __init__(self, ndim, eps=1e-6, weight_offset=0.0, device=None, dtype=None):
        super().__init__(ndim, bias=False, eps=eps, device=device, dtype=dtype)
        self.weight_offset = weight_offset
        if weight_offset:
            with torch.no_grad():
                self.weight.sub_(weight_offset)  # the scale (offset + weight) starts at 1

    def pe_adopt(self, options):
        super().pe_adopt({"weight_offset": 0.0, **options})

    def pe_normalize(self, x):
        return F.rms_norm(x, self.normalized_shape, None, self.eps)

    def pe_scale(self):
        """offset + weight, in float32 at least: in bf16, 1 + a small weight would round the weight away."""
        if not self.weight_offset:
            return self.weight
        return self.weight.to(torch.promote_types(self.weight.dtype, torch.float32)) + self.weight_offset

    def forward(self, x):
        rows, (weight_buffer,) = self.pe_rows_and_buffers(x, "weight")
        out_dtype = self.pe_result_dtype(x, torch_rms_norm, self.weight)
        scale = self.pe_scale()
        if self.weight_offset:
            x = x.to(torch.promote_types(x.dtype, scale.dtype))  # in float32 at least, as Gemma does
        return affine(self.pe_normalize(x), scale, None, weight_buffer, None, rows).to(out_dtype)

    def extra_repr(self):
        return super().extra_repr() + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


class ShimRMSNorm(PerExampleRMSNorm):
    """RMSNorm whose per-example norms are read from the output gradient (shim)."""

    def forward(self, x):
        out_dtype = self.pe_result_dtype(x, torch_rms_norm, self.weight)
        scale = self.pe_scale()
        if self.weight_offset:
            x = x.to(torch.promote_types(x.dtype, scale.dtype))
        xhat = self.pe_normalize(x)
        out = (xhat * scale).to(out_dtype)
        rows, (weight_buffer,) = self.pe_rows_and_buffers(x, "weight")
        if weight_buffer is not None:
            on_output_grad(out, record_affine_norms(xhat.detach(), rows, weight_buffer, None))
        return out


def rmsnorm_candidates(module, options):
    """Each eps (the module's own first) with each offset (Gemma's 1 too) and output dtype rule, or the options
    the user fixed."""
    eps_list = [options["eps"]] if "eps" in options else eps_values(module)
    offsets = [options["weight_offset"]] if "weight_offset" in options else RMS_OFFSETS
    rules = [options["output_dtype"]] if "output_dtype" in options else OUTPUT_DTYPES
    return [
        dict(eps=eps, weight_offset=offset, output_dtype=rule)
        for eps in eps_list
        for offset in offsets
        for rule in rules
    ]


def options(module):
    """nn.RMSNorm's eps (None: the input dtype's epsilon, in F.rms_norm as in nn.RMSNorm)."""
    return dict(eps=module.eps)


class FusedRMSNorm(PerExampleRMSNorm):
    """RMSNorm y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), with per-example norms of the weight
    gradient from the Triton kernels where they can run; the kernel takes the scale (offset + weight) as its weight
    and keeps the output in x's dtype."""

    def forward(self, x):
        found = fused.kernel_input(self, x, "weight")
        if found is None:
            return super().forward(x)
        xs, (weight_buffer,) = found
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # None: F.rms_norm's default
        out = fused.fused_rms_norm(xs, self.pe_scale(), eps, weight_buffer).view(x.shape)
        return out.to(self.pe_result_dtype(x, torch_rms_norm, self.weight))


KIND = LayerKind(
    name="RMSNorm",
    config_key="lnclass",
    group="LayerNorm",
    variants={
        "nn": nn.RMSNorm,
        "shim": ShimRMSNorm,
        "gns": PerExampleRMSNorm,
        "fused": FusedRMSNorm,
    },
    replaces=(nn.RMSNorm,),
    params=("weight",),
    convertible=lambda module: (
        None
        if len(module.normalized_shape) == 1
        else f"RMSNorm over {len(module.normalized_shape)} dims (per-example norm layers normalise the last dim)"
    ),
    options=options,
    probe=Probe(
        fits=lambda weight, bias: weight.dim() == 1 and bias is None,
        data=norm_probe_data,
        candidates=rmsnorm_candidates,
        options=("eps", "weight_offset", "output_dtype"),
    ),
)
