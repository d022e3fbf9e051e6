"""
The per-example arithmetic of the all-layer `gns` step without the layers' bookkeeping: a lower bound on what any
Python cut can bring the step to (issue 47). `install(model)` makes every nn.Linear and nn.LayerNorm of a plain
model compute, in its backward, what the gns layers compute there (each Linear's weight gradient and per-example
squared norms by core/matmul.py's linear_weight_grad_and_pe_sqnorm under the same strategy rule; each LayerNorm's
per-example weight and bias gradients as LayerNormFunction's batched backward forms them) inside one bare autograd
Function per layer: no mapping of rows to examples, no buffers, no hooks, no monitor. The squared norms are added
to one tensor (`floor_sink(model)`) so that nothing is left out as unused.

bench/step_overhead.py times it as the choice "arithmetic floor" beside nn and the gns choices, in the same rounds:

    python bench/step_overhead.py --n_layer=4 --n_head=4 --n_embd=256 --block_size=128 --batch_size=8 \\
        --choices="nn,arithmetic floor,all-layer gns" --steps=40 --memory=False

Embeddings stay plain (their per-example norms are left out: the floor is lower than the gns layers' arithmetic,
never higher). Inputs are taken as (N, T, D), examples on dim 0, as the nanoGPT model gives them; float32 or
float64, no autocast.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogns.core.matmul import linear_weight_grad_and_pe_sqnorm


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.has_bias = sink, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_weight, pe_sqnorms = linear_weight_grad_and_pe_sqnorm(x, g)
        ctx.sink.add_(pe_sqnorms.sum())
        grad_bias = None
        if ctx.has_bias:
            pe_grad_bias = g.sum(dim=1)
            ctx.sink.add_(pe_grad_bias.pow(2).sum())
            grad_bias = pe_grad_bias.sum(dim=0)
        return g @ weight, grad_weight.to(weight.dtype), grad_bias, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, sink):
        out, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.sink = sink
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        g = g.contiguous()
        grad_x, _, _ = torch.ops.aten.native_layer_norm_backward(
            g, x, weight.shape, mean, rstd, weight, bias, [True, False, False]
        )
        pe_grad_weight = torch.sub(x, mean).mul_(rstd).mul_(g).sum(dim=1)  # (N, D)
        ctx.sink.add_(pe_grad_weight.pow(2).sum())
        grad_bias = None
        if bias is not None:
            pe_grad_bias = g.sum(dim=1)
            ctx.sink.add_(pe_grad_bias.pow(2).sum())
            grad_bias = pe_grad_bias.sum(dim=0)
        return grad_x, pe_grad_weight.sum(dim=0), grad_bias, None, None


def install(model):
    """Make every nn.Linear and nn.LayerNorm of `model` compute the gns layers' per-example arithmetic (module
    docstring); returns the sink its squared norms add to (zeroed by the caller after each step)."""
    param = next(model.parameters())  # the norms' dtype: float32, float64 for a float64 model (as the buffers sum)
    sink = torch.zeros((), dtype=torch.float64 if param.dtype == torch.float64 else torch.float32, device=param.device)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = lambda x, m=module: _Linear.apply(x, m.weight, m.bias, sink)
        elif type(module) is nn.LayerNorm:
            module.forward = lambda x, m=module: _LayerNorm.apply(x, m.weight, m.bias, m.eps, sink)
    return sink
