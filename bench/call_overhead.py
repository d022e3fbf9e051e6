"""
What each converted layer adds per call, counted (not timed, so the count is the same on a loaded machine):
the ops it dispatches and the Python calls it makes in one forward and in one backward, beside the plain
torch layer's, and the same for a whole training step of the baby GPT.

    python bench/call_overhead.py                   # the small Linear of bench/linear_strategies.py and the step
    python bench/call_overhead.py --shape=64,32,256,256 --n_layer=6

Ops: aten ops seen by a TorchDispatchMode (views and allocations included: each costs a dispatch on the
CPU; bench/launch_counts.py counts only the ops that launch GPU work). Python calls: cProfile's count of
function calls (Python functions and builtins) over the call, the layer's own forward and the autograd
engine's calls into the backward included. A step (forward + backward of one micro-batch, the monitor's
read and zeroing where a layer records norms, AdamW) is counted the same way on a tiny baby GPT: the
counts do not depend on the width.
"""

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import nanogns as lc  # noqa: E402
from nanogns import monitor as gnstracking  # noqa: E402
from nanogns.kinds import embedding as embedding_kind  # noqa: E402
from nanogns.kinds import layernorm as layernorm_kind  # noqa: E402
from nanogns.kinds import linear as linear_kind  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def python_calls(fn):
    """Function calls cProfile sees while fn runs (its own call excluded)."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls - 1  # less profile.disable


def ops(fn):
    counter = OpCounter()
    with counter:
        fn()
    return sum(counter.ops.values())


def layer_counts(module, make_input, grad_shape):
    """(forward ops, backward ops, forward Python calls, backward Python calls) of one call, after one warm-up."""
    x = make_input()
    g = torch.randn(grad_shape)
    module(x).backward(g)  # one-time work (cached dtypes, strategy rules) is not per call
    outs = []
    forward_ops = ops(lambda: outs.append(module(x)))
    forward_calls = python_calls(lambda: outs.append(module(x)))
    backward_ops = ops(lambda: outs[0].backward(g))
    backward_calls = python_calls(lambda: outs[1].backward(g))
    return forward_ops, backward_ops, forward_calls, backward_calls


def layers(B, T, K, L, V):
    """(kind, {variant: module}, make_input, grad shape) per layer kind at one shape."""
    torch.manual_seed(0)
    linear = {
        "nn": torch.nn.Linear(K, L),
        "gns": linear_kind.PerExampleLinear(K, L),
        "shim": linear_kind.ShimLinear(K, L),
    }
    norm = {
        "nn": torch.nn.LayerNorm(K),
        "gns": layernorm_kind.PerExampleLayerNorm(K),
        "shim": layernorm_kind.SeparatedLayerNorm(K),
    }
    embedding = {
        "nn": torch.nn.Embedding(V, K),
        "gns": embedding_kind.PerExampleEmbedding(V, K),
        "shim": embedding_kind.ShimEmbedding(V, K),
    }
    return [
        (f"Linear {K}->{L}", linear, lambda: torch.randn(B, T, K, requires_grad=True), (B, T, L)),
        (f"LayerNorm {K}", norm, lambda: torch.randn(B, T, K, requires_grad=True), (B, T, K)),
        (f"Embedding {V}x{K}", embedding, lambda: torch.randint(0, V, (B, T)), (B, T, K)),
    ]


CHOICES = {
    "nn": ("nn", "nn", "nn"),
    "LayerNorm-only gns": ("nn", "nn", "gns"),
    "all-layer gns": ("gns", "gns", "gns"),
}


def step_counts(choice, n_layer, batch=4, block=16):
    """(ops, Python calls) of one training step of a tiny baby GPT (after two warm-up steps)."""
    from model import GPT, GPTConfig

    linear, embedding, ln = CHOICES[choice]
    torch.manual_seed(0)
    # (model.py prints its size: kept out of the tables)
    with (
        lc.set_contextual_config(**lc.layer_classes(linearclass=linear, embeddingclass=embedding, lnclass=ln)),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=block, vocab_size=65, dropout=0.0))
    monitor = gnstracking.GNSMonitor(model) if choice != "nn" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 65, (2, batch, block))

    def step():
        _, loss = model(x, y)
        loss.backward()
        if monitor is not None:
            monitor.step(batch_size=batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    return ops(step), python_calls(step)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="64,32,256,256", help="B,T,K,L of the layers (default: 64,32,256,256)")
    p.add_argument("--vocab", type=int, default=65, help="the Embedding's rows (default: 65)")
    p.add_argument("--n_layer", type=int, default=6, help="blocks of the baby GPT whose step is counted (default: 6)")
    args = p.parse_args(argv)
    B, T, K, L = (int(v) for v in args.shape.split(","))
    print(f"one call, B={B} T={T}: ops dispatched / Python calls, forward and backward (counts, not times)")
    print("| layer | variant | forward ops | backward ops | forward calls | backward calls |")
    print("|---|---|---|---|---|---|")
    for kind, variants, make_input, grad_shape in layers(B, T, K, L, args.vocab):
        for name, module in variants.items():
            f_ops, b_ops, f_calls, b_calls = layer_counts(module, make_input, grad_shape)
            print(f"| {kind} | {name} | {f_ops} | {b_ops} | {f_calls} | {b_calls} |")
    print(f"\none training step of the baby GPT ({args.n_layer} blocks; forward, backward, the GNS read, AdamW)")
    print("| layers | ops | Python calls |")
    print("|---|---|---|")
    for choice in CHOICES:
        step_ops, step_calls = step_counts(choice, args.n_layer)
        print(f"| {choice} | {step_ops} | {step_calls} |", flush=True)


if __name__ == "__main__":
    main()
