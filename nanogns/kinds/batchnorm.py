"""
The BatchNorm kind: torch's BatchNorm1d/2d/3d and SyncBatchNorm, and the refusal of a forward that mixes examples.

In eval mode a BatchNorm normalises with its running statistics, which no example of the batch changes: for an
input (N, C, *positions), y = xhat * w + b per channel with xhat = (x - running_mean) / sqrt(running_var + eps),
and example i's gradients of the affine parameters are

    dw_i[c] = sum_p g[i, c, p] * xhat[i, c, p],     db_i[c] = sum_p g[i, c, p],

the channels-first affine maths BatchNorm shares with GroupNorm (kinds/affine.py: channels_first_affine), with
each example's positions as its rows. They are exact.

In training mode (or without running statistics) it normalises with the batch's mean and variance: every
example's output then depends on every other example of the micro-batch, so no example has a gradient of its own,
for the BatchNorm's parameters and for every layer before it (a ResNet's convolutions). `watch(model, mapper)`
(GNSMonitor calls it) notes every such forward of a batch-statistics norm, converted or not, in the model's
RowMapper, and the monitor refuses the step before reading any number, with one error naming the layer and why.
"""

import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from nanogns.core import layout
from nanogns.core.buffers import PerExampleNormLayer
from nanogns.core.registry import LayerKind, own_class_name
from nanogns.errors import SettingNotValid
from nanogns.kinds.affine import channels_first_affine

MIXES = (
    "it normalises with the statistics of the batch (training mode, or no running statistics), so every example's "
    "output depends on the other examples of the batch and no example has a gradient of its own, for it and for "
    "every layer before it; measure with it in eval mode (running statistics: model.eval() on the BatchNorms), or "
    "with a norm of each example alone (GroupNorm, LayerNorm)"
)


def uses_batch_statistics(module):
    """True when a _BatchNorm's forward normalises with the batch's statistics (torch's own rule)."""
    return module.training or (module.running_mean is None and module.running_var is None)


def watch(model, mapper):
    """Note in `mapper` (the model's RowMapper) every forward, within one of the model's own forwards, of a
    BatchNorm that uses the batch's statistics; idempotent (each norm is hooked once). The monitor refuses such a step."""
    for path, module in model.named_modules():
        if isinstance(module, _BatchNorm) and id(module) not in mapper.watched_norms:
            mapper.watched_norms.add(id(module))  # (a norm attached later is watched when the monitor follows)
            module.register_forward_pre_hook(_note(path or type(module).__name__, mapper))


def _note(path, mapper):
    def hook(module, args):
        current = layout.current_pass()
        if current is not None and current.counting and current.mapper is mapper and uses_batch_statistics(module):
            mapper.note_mixing(f"{path} ({own_class_name(module)})", MIXES)

    return hook


class PerExampleBatchNorm(PerExampleNormLayer, _BatchNorm):
    """A BatchNorm that records the per-example norms of its affine parameters in eval mode (running statistics);
    in training mode it is torch's own (and the step is refused: see the module docstring). Built on its own,
    PerExampleBatchNorm(num_features, ...) takes BatchNorm2d's arguments and any input of 2 dims or more; convert()
    mixes it into a module's own class (core/registry.py:adopt), whose input check it keeps."""

    pe_kind = "BatchNorm"

    def __init__(
        self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None, dtype=None
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.register_pe_buffers()

    def _check_input_dim(self, input):  # (torch's name) the check of the class it was made of, if any
        original = getattr(type(self), "pe_original_class", None)
        if original is not None:
            return original._check_input_dim(self, input)
        if input.dim() < 2:
            raise SettingNotValid(f"expected an input of at least 2 dims (N, C, ...), got {tuple(input.shape)}")

    def forward(self, x):
        if uses_batch_statistics(self) or not self.affine:
            return super().forward(x)
        self._check_input_dim(x)  # as torch's forward does
        xhat = F.batch_norm(x, self.running_mean, self.running_var, None, None, False, 0.0, self.eps)
        return channels_first_affine(self, xhat, self.weight.to(xhat.dtype), self.bias.to(xhat.dtype))


KIND = LayerKind(
    name="BatchNorm",
    config_key="lnclass",
    group="LayerNorm",
    variants={
        "nn": nn.BatchNorm2d,
        "shim": PerExampleBatchNorm,
        "gns": PerExampleBatchNorm,
        "fused": PerExampleBatchNorm,
    },
    replaces=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm),
)
