"""
torch.compile on a GPT built with the per-example norm layers: the compiled
model's loss, parameter gradients and `<param>_upegsqnorm` buffers equal the
eager model's, over two optimizer steps of two accumulated micro-batches.

    python -m pytest -q tests/test_layers_compile.py

Dynamo traces the autograd Functions of the gns layers, buffer updates in backward
included; the Embedding's torch.unique (a data-dependent shape) graph-breaks and
that Function runs eagerly, as does the tied wte/lm_head cross term's
backward (tied.py hands a tensor from one node to the other). The fused layers'
kernels are custom ops that the compiled graph runs eagerly, on CPU in Triton's
interpreter (tests/test_layers_fused_compile.py checks they are in the graph).
"""

import copy

import pytest
import torch

import nanogns as lc
from nanogns.layers import buffers as buffered
from nanogns.layers import tied

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=67, dropout=0.0, bias=True)
BATCH, STEPS, MICRO_STEPS = 4, 2, 2


def build(kind):
    with lc.set_contextual_config(**lc.layer_classes(linearclass=kind, embeddingclass=kind, lnclass=kind)):
        from model import GPT, GPTConfig

        return GPT(GPTConfig(**CONFIG))


def pe_buffers(model):
    return {name: b.clone() for name, b in model.named_buffers() if name.endswith(buffered.BUFFER_SUFFIX)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:.*Triton kernel not used:RuntimeWarning")
@pytest.mark.parametrize("kind", ["shim", "gns", "fused"])
def test_compiled_matches_eager(kind):
    torch.manual_seed(0)
    eager = build(kind)
    model = copy.deepcopy(eager)
    for m in (eager, model):  # the tied wte/lm_head cross term too (its backward mutates Python state: runs eagerly)
        tied.link_tied_parameters(m)
    compiled = torch.compile(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    # float32; inductor fuses and reorders the reductions, so allow a few ulps of drift
    tol = dict(rtol=1e-4, atol=1e-6)
    for step in range(STEPS):
        for micro in range(MICRO_STEPS):
            x, y = torch.randint(0, CONFIG["vocab_size"], (2, BATCH, CONFIG["block_size"]))
            losses = []
            for m in (eager, compiled):
                _, loss = m(x, y)
                (loss / MICRO_STEPS).backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], **tol)
        expected, got = pe_buffers(eager), pe_buffers(model)
        assert got.keys() == expected.keys() and any("tiecross" in n for n in got)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **tol, msg=f"step {step}: buffer {name}")
            assert got[name][1] == BATCH * MICRO_STEPS, f"{name}: micro-batches should accumulate, got {got[name]}"
            assert got[name][0] != 0, f"{name}: nothing recorded"  # the tied cross term may be negative
        for (name, p_eager), p in zip(eager.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, p_eager.grad, **tol, msg=f"step {step}: grad of {name}")
        for m, opt in zip((eager, model), optimizers):
            opt.step()
            opt.zero_grad(set_to_none=True)
            buffered.zero_sqgradnorm_buffers(m)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
