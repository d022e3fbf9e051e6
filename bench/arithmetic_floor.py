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

For one Linear, `python bench/arithmetic_floor.py --shapes=B,T,K,L` times nn.Linear's forward and backward and,
in the same rounds, the per-example ops alone (the weight's norms by the strategy the gns Linear picks, the bias's
per-example sums): the ratio (plain + those ops) / plain is the floor of bench/linear_strategies.py's gns ratio.

Embeddings stay plain (their per-example norms are left out: the floor is lower than the gns layers' arithmetic,
never higher). Inputs are taken as (N, T, D), examples on dim 0, as the nanoGPT model gives them; float32 or
float64, no autocast.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanogns.core.matmul import (  # noqa: E402
    bias_pe_grads,
    gram_pe_sqnorm,
    linear_strategy,
    linear_weight_grad_and_pe_sqnorm,
    materialised_pe_grads,
)


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


def linear_floor(B, T, K, L, rounds):
    """(plain ms, ms the per-example ops add, strategy): medians over interleaved rounds for one Linear with a bias.
    Under the Gram trick the plain weight-gradient GEMM stays and the Grams and the bias sums are added; under
    materialise the per-example products replace that GEMM, so what they add is their time less the GEMM's."""
    torch.manual_seed(0)
    layer = nn.Linear(K, L)
    x, g = torch.randn(B, T, K, requires_grad=True), torch.randn(B, T, L)
    xd, x2, g2 = x.detach(), x.detach().reshape(-1, K), g.reshape(-1, L)
    strategy = linear_strategy(T, K, L)
    weight_norms = gram_pe_sqnorm if strategy == "gram" else materialised_pe_grads
    timed = {
        "plain": lambda: layer(x).backward(g),
        "weight gradient GEMM": lambda: g2.t() @ x2,
        "per-example ops": lambda: (weight_norms(xd, g), bias_pe_grads(g).pow(2).sum(dim=1)),
    }
    times = {name: [] for name in timed}
    for r in range(rounds + 3):  # three rounds of warm-up
        for name, run in timed.items():
            t0 = time.perf_counter()
            run()
            if r >= 3:
                times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(v) * 1000 for name, v in times.items()}
    added = ms["per-example ops"] - (ms["weight gradient GEMM"] if strategy == "materialise" else 0.0)
    return ms["plain"], added, strategy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64,32,256,256", help="B,T,K,L[;B,T,K,L...] (default: 64,32,256,256)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default: 30)")
    args = p.parse_args(argv)
    print(f"cpu, float32, {torch.get_num_threads()} threads, wall clock, median of {args.rounds} interleaved rounds")
    print("| B, T, K, L | strategy | plain ms | per-example ops beyond plain ms | floor ratio |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(";"):
        B, T, K, L = (int(v) for v in shape.split(","))
        plain, extra, strategy = linear_floor(B, T, K, L, args.rounds)
        print(f"| {B}, {T}, {K}, {L} | {strategy} | {plain:.2f} | {extra:.2f} | {(plain + extra) / plain:.3f} |")


if __name__ == "__main__":
    main()
