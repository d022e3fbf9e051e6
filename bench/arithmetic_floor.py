"""
The per-example arithmetic of the all-layer `gns` step without the layers' bookkeeping: a lower bound on what any
Python cut can bring the step to (issue 47). `install(model)` makes every nn.Linear, nn.LayerNorm and nn.Embedding
of a plain model compute, in its backward, what the gns layers compute there (each Linear's weight gradient and
per-example squared norms by core/matmul.py's linear_weight_grad_and_pe_sqnorm under the same strategy rule; each
LayerNorm's per-example weight and bias gradients as LayerNormFunction's batched backward forms them; each
Embedding's as below) inside one bare autograd Function per layer: no mapping of rows to examples, no buffers, no
hooks, no monitor. The squared norms are added to one tensor (the sink `install` returns) so that nothing is left
out as unused.

bench/step_overhead.py times it as the choice "arithmetic floor" beside nn and the gns choices, in the same rounds:

    python bench/step_overhead.py --n_layer=4 --n_head=4 --n_embd=256 --block_size=128 --batch_size=8 \\
        --choices="nn,arithmetic floor,all-layer gns" --steps=40 --memory=False

For one Linear, `python bench/arithmetic_floor.py --shapes=B,T,K,L` times, in the same rounds, nn.Linear's forward
and backward, the floor's bare Function doing the gns Linear's arithmetic (the weight's norms by the strategy the
gns Linear picks, the bias's per-example sums) and the gns Linear itself: the floor of bench/linear_strategies.py's
gns ratio, and how far the gns Linear is above it.

Every nn.Embedding computes the gns Embedding's (its weight gradient by one index_add, its per-example norms by
embedding_pe_sqnorm), and an embedding whose weight a Linear shares (nanoGPT's wte and lm_head) adds the tied
weight's cross term as the gns layers do (core/tied.py: the head's P, the embedding's 2 <e_i, h_i>). Inputs are
taken as (N, T, D) and ids as (N, T), examples on dim 0, as the nanoGPT model gives them; plain embeddings only (no
padding row, max_norm or sparse gradients); float32 or float64, no autocast.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import timing  # noqa: E402  (bench/timing.py)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanogns.core.matmul import linear_strategy, linear_weight_grad_and_pe_sqnorm  # noqa: E402
from nanogns.core.rowmaps import Rows  # noqa: E402
from nanogns.core.tied import _head_cross_term  # noqa: E402  (the tied head's arithmetic, as the gns head runs it)
from nanogns.kinds.embedding import embedding_pe_sqnorm  # noqa: E402


class _Linear(torch.autograd.Function):
    """The gns Linear's backward arithmetic; for a head tied to an embedding (ids and carrier given), also P for the
    cross term, handed to the embedding as the carrier's gradient (autograd's dataflow, as core/tied.py's taps)."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink, ids=None, carrier=None):
        ctx.save_for_backward(x, weight, ids)
        ctx.sink, ctx.has_bias, ctx.tied = sink, bias is not None, carrier is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight, ids = ctx.saved_tensors
        p = _head_cross_term(ids, x, Rows("dim0", x.shape[0]), g) if ctx.tied else None
        grad_weight, pe_sqnorms = linear_weight_grad_and_pe_sqnorm(x, g)
        ctx.sink.add_(pe_sqnorms.sum())
        grad_bias = None
        if ctx.has_bias:
            pe_grad_bias = g.sum(dim=1)
            ctx.sink.add_(pe_grad_bias.pow(2).sum())
            grad_bias = pe_grad_bias.sum(dim=0)
        return g @ weight, grad_weight.to(weight.dtype), grad_bias, None, None, p


class _Embedding(torch.autograd.Function):
    """The gns Embedding's backward arithmetic: the weight gradient by one index_add, the per-example norms by
    embedding_pe_sqnorm; returns (out, carrier), the carrier's gradient being the tied head's P (or None), from
    which this backward adds the cross term 2 <e_i, h_i> (core/tied.py)."""

    @staticmethod
    def forward(ctx, ids, weight, sink):
        ctx.save_for_backward(ids)
        ctx.set_materialize_grads(False)
        ctx.sink, ctx.weight_shape = sink, weight.shape
        out = F.embedding(ids, weight)
        return out, out.new_empty(out.shape, dtype=sink.dtype)  # (a real tensor, not a view: as tied.py's)

    @staticmethod
    def backward(ctx, g, p):
        (ids,) = ctx.saved_tensors
        num_embeddings, dim = ctx.weight_shape
        grad_weight = torch.zeros(ctx.weight_shape, dtype=g.dtype, device=g.device)
        grad_weight.index_add_(0, ids.reshape(-1), g.reshape(-1, dim))
        ctx.sink.add_(embedding_pe_sqnorm(ids, g, num_embeddings).sum())
        if p is not None:
            ctx.sink.add_(2 * (g.to(p.dtype) * p).sum())
        return None, grad_weight, None


class _Tie:
    """What the tied embedding's last forward leaves for the head: its ids and the carrier of P."""

    ids = carrier = None


def _embedding_forward(module, ids, sink, tie):
    out, carrier = _Embedding.apply(ids, module.weight, sink)
    if tie is not None:
        tie.ids, tie.carrier = ids, carrier
    return out


def _linear_forward(module, x, sink, tie):
    if tie is None or tie.carrier is None:
        return _Linear.apply(x, module.weight, module.bias, sink)
    return _Linear.apply(x, module.weight, module.bias, sink, tie.ids, tie.carrier)


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
    """Make every nn.Linear, nn.LayerNorm and nn.Embedding of `model` compute the gns layers' per-example arithmetic
    (module docstring); returns the sink its squared norms add to (zeroed by the caller after each step)."""
    param = next(model.parameters())  # the norms' dtype: float32, float64 for a float64 model (as the buffers sum)
    sink = torch.zeros((), dtype=torch.float64 if param.dtype == torch.float64 else torch.float32, device=param.device)
    modules = list(model.modules())
    # an embedding and a head sharing one weight (nanoGPT's wte and lm_head): the head's P reaches the embedding
    heads = {id(m.weight) for m in modules if type(m) is nn.Linear}
    ties = {id(m.weight): _Tie() for m in modules if type(m) is nn.Embedding and id(m.weight) in heads}
    for module in modules:
        tie = ties.get(id(getattr(module, "weight", None)))
        if type(module) is nn.Linear:
            module.forward = lambda x, m=module, tie=tie: _linear_forward(m, x, sink, tie)
        elif type(module) is nn.Embedding:
            module.forward = lambda ids, m=module, tie=tie: _embedding_forward(m, ids, sink, tie)
        elif type(module) is nn.LayerNorm:
            module.forward = lambda x, m=module: _LayerNorm.apply(x, m.weight, m.bias, m.eps, sink)
    return sink


def linear_floor(B, T, K, L, rounds, clock=time.perf_counter):
    """{"plain" | "floor" | "gns": (median ms, median ratio to plain, (quartiles))} for one Linear with a bias on a
    (B, T, K) input that requires a gradient, forward and backward: nn.Linear, the floor's bare Function (_Linear:
    the gns Linear's arithmetic under its strategy rule, nothing else) and the gns Linear itself, taking turns in
    each round so that the machine's drift hits them alike; plus "strategy" (what the rule picks). The whole layer is
    timed, not its extra ops alone: those, timed apart, find x and g in the cache and read lower than they cost in a
    backward (bench/RESULTS.md, issue 47). `clock`: time.perf_counter (wall) or time.process_time (the process's
    CPU time)."""
    from nanogns.kinds.linear import PerExampleLinear

    torch.manual_seed(0)
    plain = nn.Linear(K, L)
    gns = PerExampleLinear(K, L)
    gns.load_state_dict(plain.state_dict())
    x, g = torch.randn(B, T, K, requires_grad=True), torch.randn(B, T, L)
    sink = torch.zeros(())
    timed = {
        "plain": lambda: plain(x).backward(g),
        "floor": lambda: _Linear.apply(x, plain.weight, plain.bias, sink).backward(g),
        "gns": lambda: gns(x).backward(g),
    }
    times = {name: [] for name in timed}
    names = list(timed)
    for r in range(rounds + 3):  # three rounds of warm-up
        for name in names[r % 3 :] + names[: r % 3]:  # the first to run rotates
            t0 = clock()
            timed[name]()
            if r >= 3:
                times[name].append(clock() - t0)
        x.grad = None
    result = {"strategy": linear_strategy(T, K, L)}
    for name, values in times.items():
        q1, median, q3 = timing.quartiles([v / p for v, p in zip(values, times["plain"])])
        result[name] = (statistics.median(values) * 1000, median, (q1, q3))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64,32,256,256", help="B,T,K,L[;B,T,K,L...] (default: 64,32,256,256)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default: 30)")
    timing.add_options(p)
    args = p.parse_args(argv)
    clock = timing.apply(args)
    print(
        f"cpu, float32, {torch.get_num_threads()} threads, {'wall clock' if args.clock == 'wall' else 'CPU time'}, "
        f"median of {args.rounds} interleaved rounds;"
    )
    print("forward + backward of one Linear with a bias, ratio to nn.Linear's in the same round [quartiles]")
    print("| B, T, K, L | strategy | plain ms | arithmetic floor | gns |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(";"):
        B, T, K, L = (int(v) for v in shape.split(","))
        r = linear_floor(B, T, K, L, args.rounds, clock)
        floor, gns = (f"{r[n][1]:.3f} [{r[n][2][0]:.3f}, {r[n][2][1]:.3f}]" for n in ("floor", "gns"))
        print(f"| {B}, {T}, {K}, {L} | {r['strategy']} | {r['plain'][0]:.2f} | {floor} | {gns} |")


if __name__ == "__main__":
    main()
