"""
The BatchNorm kind: torch's BatchNorm1d/2d/3d and SyncBatchNorm, and the refusal of a forward that mixes examples.

In eval mode a BatchNorm normalises with its running statistics, which no example of the batch changes: for an
input (N, C, *positions), y = xhat * w + b per channel with xhat = (x - running_mean) / sqrt(running_var + eps),
and example i's gradients of the affine parameters are

    dw_i[c] = sum_p g[i, c, p] * xhat[i, c, p],     db_i[c] = sum_p g[i, c, p],

the LayerNorm kind's affine maths (kinds/layernorm.py) over the channels, with each example's positions as its
rows. They are exact.

In training mode (or without running statistics) it normalises with the batch's mean and variance: every
example's output then depends on every other example of the micro-batch, so no example has a gradient of its own,
for the BatchNorm's parameters and for every layer before it (a ResNet's convolutions). `watch(model, mapper)`
(GNSMonitor calls it) notes every such forward of a batch-statistics norm, converted or not, in the model's
RowMapper, and the monitor refuses the step before reading any number, with one error naming the layer and why.
"""

import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import layout
from nanogns.core.buffers import PerExampleNormLayer
from nanogns.core.registry import LayerKind, own_class_name, register
from nanogns.kinds.layernorm import affine

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
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and id(module) not in mapper.watched_norms:
            mapper.watched_norms.add(id(module))  # (a norm attached later is watched when the monitor follows)
            module.register_forward_pre_hook(_note(path or type(module).__name__, mapper))


def _note(path, mapper):
    def hook(module, args):
        current = layout.current_pass()
        if current is not None and current.counting and current.mapper is mapper and uses_batch_statistics(module):
            mapper.note_mixing(f"{path} ({own_class_name(module)})", MIXES)

    return hook


class PerExampleBatchNorm(PerExampleNormLayer):
    """A BatchNorm that records the per-example norms of its affine parameters in eval mode (running statistics);
    in training mode it is torch's own (and the step is refused: see the module docstring). Mixed into the
    module's own class (core/registry.py:adopt)."""

    pe_kind = "BatchNorm"

    def forward(self, x):
        if uses_batch_statistics(self) or not self.affine:
            return super().forward(x)
        xhat = F.batch_norm(x, self.running_mean, self.running_var, None, None, False, 0.0, self.eps)
        channels_last = xhat.movedim(1, -1)  # (N, *positions, C): each example's positions are its rows
        rows, buffers = self.pe_rows_and_buffers(channels_last, "weight", "bias")
        weight, bias = self.weight.to(xhat.dtype), self.bias.to(xhat.dtype)
        return affine(channels_last, weight, bias, *buffers, rows).movedim(-1, 1)


KIND = register(
    LayerKind(
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
)
