"""
The Conv kind: torch's nn.Conv1d and nn.Conv2d (CNNs, ViT's patch embedding, audio stems).

A convolution is a Linear applied to every patch of its input: with the patches of
example i unfolded into rows p (F.unfold: C_in * kernel elements each) and g_p the
output gradient at position p,

    dW_i = sum_p g_p patch_p^T  (C_out, C_in * kernel),   db_i = sum_p g_p,

so the Linear kind's maths (kinds/linear.py: Gram trick or materialised dW_i)
give its per-example norms, over the patches of each example. With groups, the
weight is block-diagonal over the groups; each group is such a Linear on its
channels, and the squared norms add. Non-zero padding modes pad first (F.pad),
as torch does. Dim 0 of the input holds the forward's examples, or their items
(Items: a vision tower's images, an example's tiles): an example's patches
are then all its items' patches, summed before squaring. Conv3d is not converted
(F.unfold takes 4-D inputs only; a tower's Conv3d is replayed, conversion/replay.py).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core import history, layout
from nanogns.core.buffers import (
    PerExampleNormLayer,
    accumulate_pe_sqnorm,
    autocast_inputs,
    on_output_grad,
    refuse_step,
)
from nanogns.core.registry import LayerKind
from nanogns.core.rowmaps import Items, ragged
from nanogns.kinds.linear import bias_pe_grads, linear_pe_sqnorm, linear_weight_grad_and_pe_sqnorm


def _as_2d(module):
    """(kernel, stride, dilation) as 2-tuples: a Conv1d is a Conv2d of height 1."""
    if module.weight.dim() == 3:
        return (1, *module.kernel_size), (1, *module.stride), (1, *module.dilation)
    return tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation)


def padded_input(module, x):
    """x padded as the convolution pads it (every padding mode, 'same' too: torch keeps the amounts in
    _reversed_padding_repeated_twice), so that it then runs with padding 0."""
    pads = module._reversed_padding_repeated_twice
    if not any(pads):
        return x
    return F.pad(x, pads, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)


def patches(module, x):
    """The unfolded patches of a padded input, per example and group: (groups, N, positions, C_in/groups * kernel)."""
    kernel, stride, dilation = _as_2d(module)
    x4 = x.unsqueeze(2) if x.dim() == 3 else x  # (N, C, H, W)
    cols = F.unfold(x4, kernel, dilation=dilation, stride=stride)  # (N, C * kernel, positions)
    N, _, P = cols.shape
    return cols.view(N, module.groups, -1, P).permute(1, 0, 3, 2)


def grads_per_group(module, g):
    """The output gradient (N, C_out, *positions) as (groups, N, positions, C_out/groups)."""
    N, C = g.shape[:2]
    return g.reshape(N, module.groups, C // module.groups, -1).permute(1, 0, 3, 2)


def conv(module, x, weight, bias):
    """The convolution of an already padded input."""
    fn = F.conv1d if weight.dim() == 3 else F.conv2d
    return fn(x, weight, bias, module.stride, 0, module.dilation, module.groups)


def by_example(items, t):
    """Rows (count, P, D) of the items on dim 0 as (examples, P', D): each example's items' rows together (zero rows
    padding an example with fewer)."""
    if items is None or (items.example_of_item is None and items.count == items.examples):
        return t
    if items.example_of_item is None:  # example-major: k items each
        return t.reshape(items.examples, -1, t.shape[-1])
    example_of_row = items.example_of_item.to(t.device).repeat_interleave(t.shape[1])
    return ragged(example_of_row, items.examples).per_example(t.reshape(-1, t.shape[-1]))


class ConvFunction(torch.autograd.Function):
    """conv(x padded, weight, bias, module, weight_buffer, bias_buffer, items): the convolution whose backward forms
    the weight gradient and its per-example norms together, group by group (linear_weight_grad_and_pe_sqnorm)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, weight_buffer, bias_buffer, items=None):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.buffers, ctx.has_bias, ctx.items = module, (weight_buffer, bias_buffer), bias is not None, items
        return conv(module, x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        module, (weight_buffer, bias_buffer) = ctx.module, ctx.buffers
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            input_grad = torch.nn.grad.conv1d_input if weight.dim() == 3 else torch.nn.grad.conv2d_input
            grad_x = input_grad(x.shape, weight, grad_out, module.stride, 0, module.dilation, module.groups)
        if ctx.needs_input_grad[1]:
            blocks, weight_pe_sqnorms = [], 0
            for xs, gs in zip(patches(module, x), grads_per_group(module, grad_out)):
                xs, gs = by_example(ctx.items, xs), by_example(ctx.items, gs)
                block, sq = linear_weight_grad_and_pe_sqnorm(xs, gs.to(xs.dtype))
                blocks.append(block)
                weight_pe_sqnorms = weight_pe_sqnorms + sq
            grad_weight = torch.cat(blocks).view(weight.shape).to(weight.dtype)
            accumulate_pe_sqnorm(weight_buffer, weight_pe_sqnorms)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            pe_grad_bias = bias_pe_grads(grad_out.flatten(2).transpose(1, 2))  # (items, C_out)
            grad_bias = pe_grad_bias.sum(dim=0).to(grad_out.dtype)
            pe_grad_bias = ctx.items.to_examples(pe_grad_bias) if ctx.items is not None else pe_grad_bias
            accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))
        return grad_x, grad_weight, grad_bias, None, None, None, None


def record_conv_norms(module, x, weight_buffer, bias_buffer, items=None):
    """A hook for the output gradient that adds the per-example squared norms to the buffers (shim)."""

    def record(g):
        if weight_buffer is not None:
            pairs = zip(patches(module, x), grads_per_group(module, g))
            sq = sum(linear_pe_sqnorm(by_example(items, xs), by_example(items, gs)) for xs, gs in pairs)
            accumulate_pe_sqnorm(weight_buffer, sq)
        if bias_buffer is not None:
            pe_grad_bias = bias_pe_grads(g.flatten(2).transpose(1, 2))
            pe_grad_bias = items.to_examples(pe_grad_bias) if items is not None else pe_grad_bias
            accumulate_pe_sqnorm(bias_buffer, pe_grad_bias.pow(2).sum(dim=1))

    return record


class _ConvBase(PerExampleNormLayer):
    """Mixed into a converted nn.Conv1d / nn.Conv2d (core/registry.py:adopt), whose attributes it reads."""

    pe_kind = "Conv"

    def pe_input(self, x):
        """(x padded, cast for autocast; weight; bias; buffers; the Items on dim 0), buffers None when dim 0 does not
        hold the examples (or their items)."""
        rows, buffers = self.pe_rows_and_buffers(x.movedim(1, -1), "weight", "bias")  # examples on dim 0
        given, (x, weight, bias) = x, autocast_inputs(padded_input(self, x), self.weight, self.bias)
        items = None
        if rows is not None:
            items = layout.items_of(x.shape[0]) if layout.current() is not None else Items(x.shape[0], x.shape[0])
            if items is None:  # (N*F, C, H, W): frames folded into the batch by a reshape of (N, ...) data
                items = history.items_folded_on_dim0(given)
            if items is None:
                refuse_step(
                    f"a convolution's input must have the forward's examples (or their items) on dim 0, got shape "
                    f"{tuple(x.shape)}",
                    buffers,
                )
                buffers = (None, None)
        return x, weight, bias, buffers, items


class PerExampleConv(_ConvBase):
    """The convolution whose backward computes the weight gradient and its per-example norms together."""

    def forward(self, x):
        x, weight, bias, buffers, items = self.pe_input(x)
        with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
            if all(b is None for b in buffers):  # nothing to record: torch's own convolution
                return conv(self, x, weight, bias)
            return ConvFunction.apply(x, weight, bias, self, *buffers, items)


class ShimConv(_ConvBase):
    """torch's convolution, the per-example norms read from the output gradient (shim)."""

    def forward(self, x):
        x, weight, bias, (weight_buffer, bias_buffer), items = self.pe_input(x)
        with torch.autocast(x.device.type, enabled=False):
            out = conv(self, x, weight, bias)
        if weight_buffer is not None or bias_buffer is not None:
            on_output_grad(out, record_conv_norms(self, x.detach(), weight_buffer, bias_buffer, items))
        return out


KIND = LayerKind(
    name="Conv",
    config_key="linearclass",
    group="Linear",
    variants={
        "nn": nn.Conv2d,
        "shim": ShimConv,
        "gns": PerExampleConv,
        "fused": PerExampleConv,
    },  # no kernel
    replaces=(nn.Conv1d, nn.Conv2d),
)
