"""
The GroupNorm kind: torch's nn.GroupNorm with its affine parameters (diffusers' UNets, Wav2Vec2's feature encoder,
speech and vision stems).

GroupNorm normalises each example on its own (each group of its channels, over the group's channels and all its
positions), so each example's output is its own. For an input (N, C, *positions), xhat the normalised input and
g = dL/dy, y = xhat * w + b per channel gives example i

    dw_i[c] = sum_p g[i, c, p] * xhat[i, c, p],     db_i[c] = sum_p g[i, c, p],

the channels-first affine maths BatchNorm's kind shares (kinds/affine.py: channels_first_affine). Exact, whatever
the groups, the positions or the micro-batches. A GroupNorm without affine parameters has nothing to record
(convert() leaves it as it is).

The output keeps torch's dtype: the input's (with float32 parameters too: torch's mixed kernel), or float32 where
autocast runs group_norm in float32 (CUDA); xhat and the affine are computed in the promotion of the input's and the
parameters' dtypes, then cast.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.buffers import PerExampleNormLayer, autocast_result_dtype
from nanogns.core.registry import LayerKind
from nanogns.kinds.affine import channels_first_affine


def torch_group_norm(x, weight, bias):
    """F.group_norm of an (n, C) input in one group: what the output dtype of a GroupNorm is compared with (the dtype
    does not depend on the groups)."""
    return F.group_norm(x, 1, weight, bias)


class PerExampleGroupNorm(PerExampleNormLayer, nn.GroupNorm):
    """nn.GroupNorm whose backward records the per-example norms of its affine weight and bias."""

    pe_kind = "GroupNorm"

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.register_pe_buffers()

    def forward(self, x):
        if not self.affine:
            return super().forward(x)
        out_dtype = autocast_result_dtype(torch_group_norm, x.movedim(1, -1), self.weight, self.bias)
        dtype = torch.promote_types(torch.promote_types(x.dtype, self.weight.dtype), out_dtype)
        autocast = torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
            xhat = F.group_norm(x.to(dtype), self.num_groups, None, None, self.eps)
            out = channels_first_affine(self, xhat, self.weight.to(dtype), self.bias.to(dtype))
        return out.to(out_dtype)


KIND = LayerKind(
    name="GroupNorm",
    config_key="lnclass",
    group="LayerNorm",
    variants={
        "nn": nn.GroupNorm,
        "shim": PerExampleGroupNorm,
        "gns": PerExampleGroupNorm,
        "fused": PerExampleGroupNorm,  # no kernel
    },
    replaces=(nn.GroupNorm,),
)
