"""
The affine maths every norm kind shares (LayerNorm, RMSNorm, BatchNorm, GroupNorm), as pure functions of the
normalised input and the output gradient, beside the plumbing that records them.

For y_t = xhat_t * w + b over the rows t of example i (a row: one position's features, or, channels first, one
position's channels), xhat_t the normalised row and g_t = dL/dy_t:

    dw_i = sum_t g_t * xhat_t,     db_i = sum_t g_t                      (affine_pe_grads)

The per-example squared norms are ||dw_i||^2 and ||db_i||^2; the batch gradients are their sums over examples.
A norm whose channels are on dim 1 (BatchNorm, GroupNorm: (N, C, *positions)) is the same affine over its channels,
each example's positions its rows (channels_first_affine). What differs between the kinds is only how xhat is made:
over the last dim with the row's mean and variance (LayerNorm), its root mean square (RMSNorm), a channel's running
statistics (BatchNorm in eval mode), or a group of the example's channels and positions (GroupNorm).

The plumbing: `affine` runs xhat * w + b through AffineFunction, whose backward forms the per-example gradients once
and records their squared norms (`record_pe_grads`, or hands them to core/uses.py when the forward used the tensor
several times); `record_affine_norms` is the shim's hook on the output gradient.
"""

import torch

from nanogns.core import uses
from nanogns.core.buffers import add_pe_sqnorm, norm_dtype

# -----------------------------------------------------------------------------
# the maths


def affine_pe_grads(xhat, g, has_bias=True):
    """Per-example affine gradients (N, D): dw_i = sum_t g_t * xhat_t, db_i = sum_t g_t, for xhat and g per
    example (N, T, D); float32 (float64 for float64)."""
    dtype = norm_dtype(g)
    g = g.to(dtype)
    weight_grads = (g * xhat.to(dtype)).sum(dim=1)
    bias_grads = g.sum(dim=1) if has_bias else None
    return weight_grads, bias_grads


# -----------------------------------------------------------------------------
# the plumbing


def record_pe_grads(buffer, pe_grads):
    """Add the squared norms of per-example gradients (N, D) to the buffer, or hand them over when the forward used
    the tensor more than once (core/uses.py sums its uses)."""
    if not uses.hand_over(buffer, lambda: uses.DenseFactor(pe_grads)):
        add_pe_sqnorm(buffer, pe_grads.pow(2).sum(dim=1))


def record_affine_norms(xhat, rows, weight_buffer, bias_buffer):
    """A hook for the output gradient that adds the weight's and bias's per-example squared norms to the buffers."""

    def record(g):
        weight_grads, bias_grads = affine_pe_grads(rows.per_example(xhat), rows.per_example(g), bias_buffer is not None)
        record_pe_grads(weight_buffer, weight_grads)
        if bias_buffer is not None:
            record_pe_grads(bias_buffer, bias_grads)

    return record


def affine(xhat, weight, bias, weight_buffer, bias_buffer, rows):
    """xhat * weight (+ bias) recording per-example norms (AffineFunction); torch's ops where there is nothing to
    record."""
    if weight_buffer is None and bias_buffer is None:
        return torch.addcmul(bias, xhat, weight) if bias is not None else xhat * weight
    return AffineFunction.apply(xhat, weight, bias, ((weight_buffer, bias_buffer), rows))


def channels_first_affine(layer, xhat, weight, bias):
    """xhat (N, C, *positions) * weight + bias per channel, recording the per-example norms of the layer's weight and
    bias (BatchNorm, GroupNorm): the affine maths over the channels moved last, each example's positions its rows."""
    channels_last = xhat.movedim(1, -1)  # (N, *positions, C)
    rows, buffers = layer.pe_rows_and_buffers(channels_last, "weight", "bias")
    return affine(channels_last, weight, bias, *buffers, rows).movedim(-1, 1)


class AffineFunction(torch.autograd.Function):
    """AffineFunction.apply(xhat, weight, bias, ((weight_buffer, bias_buffer), rows)) = xhat * weight (+ bias): the
    affine half of a norm layer whose normalisation autograd handles; backward records the per-example norms."""

    @staticmethod
    def forward(ctx, xhat, weight, bias, recording):
        ctx.save_for_backward(xhat, weight)
        ctx.buffers, ctx.rows = recording
        ctx.has_bias = bias is not None
        return torch.addcmul(bias, xhat, weight) if bias is not None else xhat * weight

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight = ctx.saved_tensors
        weight_buffer, bias_buffer = ctx.buffers
        grad_xhat = grad_out * weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # else frozen: no gradients, no norms
            rows = ctx.rows
            if rows is None:  # no norms this step (rows not mapped): the plain gradients
                xs, gs = xhat.reshape(1, -1, xhat.shape[-1]), grad_out.reshape(1, -1, grad_out.shape[-1])
            else:
                xs, gs = rows.per_example(xhat), rows.per_example(grad_out)
            pe_grad_weight, pe_grad_bias = affine_pe_grads(xs, gs, ctx.has_bias)  # (N, D) each
            if ctx.needs_input_grad[1]:
                record_pe_grads(weight_buffer, pe_grad_weight)
                grad_weight = pe_grad_weight.sum(dim=0).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                record_pe_grads(bias_buffer, pe_grad_bias)
                grad_bias = pe_grad_bias.sum(dim=0).to(weight.dtype)
        return grad_xhat, grad_weight, grad_bias, None
