"""
torch.compile on a GPT built with the per-example norm layers: the compiled
model's loss, parameter gradients and `<param>_pe_sqnorm` buffers equal the
eager model's, over two optimizer steps of two accumulated micro-batches.

    python -m pytest -q tests/test_layers_compile.py

Dynamo traces the autograd Functions of layers/, buffer updates in backward
included, and the tied wte/lm_head cross term (tied.py: two autograd taps that
hand P from the head's backward to the embedding's as a gradient). A GPT with
the gns or fused layers and its monitor compiles into one graph, with no graph
break; a converted transformers GPT-2 breaks no more often than the plain one.
The shim layers break the graph at each layer (their backward hooks sit on
autograd nodes). The fused layers' kernels are custom ops that the compiled
graph runs eagerly, on CPU in Triton's interpreter
(tests/test_layers_fused_compile.py checks they are in the graph).
"""

import copy

import pytest
import torch

import nanogns as lc
from nanogns.core import buffers as buffered
from nanogns.core import tied
from nanogns.core.rowmaps import Rows

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
            buffered.zero_pe_sqnorm_buffers(m)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


@pytest.mark.filterwarnings("ignore:.*Triton kernel not used:RuntimeWarning")
@pytest.mark.parametrize(
    "kind, strategy", [("gns", None), ("gns", "materialise"), ("fused", None)], ids=["gns", "gns-materialise", "fused"]
)
def test_monitored_gpt_compiles_into_one_graph(kind, strategy, force_strategy):
    """The baby GPT with per-example layers, its layout hooks and tied matrix linked by the monitor: no graph break
    (Dynamo's explain), and a fullgraph compile (a break would raise) gives the eager model's buffers. The gns
    Linear's materialised strategy too (the one long sequences take: it broke the graph once per Linear)."""
    force_strategy(linear=strategy)
    torch.manual_seed(0)
    eager = build(kind)
    model = copy.deepcopy(eager)
    monitors = [lc.GNSMonitor(m) for m in (eager, model)]
    x, y = torch.randint(0, CONFIG["vocab_size"], (2, BATCH, CONFIG["block_size"]))
    explained = torch._dynamo.explain(model)(x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for m in (eager, compiled):
        m(x, y)[1].backward()
    expected, got = pe_buffers(eager), pe_buffers(model)
    assert any("tiecross" in n for n in got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert [m.step(batch_size=BATCH)["gns"] for m in monitors]  # both read


def gpt2_steps(convert, compile=True, lengths=(16, 12, 16, 9)):
    """Graph breaks and graphs of a compiled tiny transformers GPT-2 (float64) over steps of varying, right-padded
    lengths, and the monitor's rows (converted) or None."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=97)).double()
    monitor = lc.convert(model) if convert else None
    compiled = torch.compile(model, backend="aot_eager") if compile else model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rows = []
    for T in lengths:
        ids = torch.randint(0, 97, (BATCH, T), generator=torch.Generator().manual_seed(T))
        mask = torch.ones(BATCH, T, dtype=torch.long)
        mask[1, T - 3 :] = 0
        positions = torch.arange(T).expand(
            BATCH, T
        )  # GPT-2's default (1, T) positions are refused (docs/integrations.md)
        compiled(input_ids=ids, attention_mask=mask, labels=ids, position_ids=positions).loss.backward()
        if monitor is not None:
            rows.append(monitor.step(batch_size=BATCH))
        model.zero_grad(set_to_none=True)
    counters = torch._dynamo.utils.counters
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], rows


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_converted_gpt2_breaks_no_more_than_plain():
    """convert() adds no graph break to a compiled transformers model (before: 33 breaks in 26 graphs against the
    plain model's 3 in 8), and the compiled converted model still measures."""
    plain_breaks, plain_graphs, _ = gpt2_steps(convert=False)
    breaks, graphs, rows = gpt2_steps(convert=True)
    # one more graph at most: the layout hook's frame (core/layout.py), recompiled once with dynamic lengths as
    # every frame is at the second length, gives an empty graph; a third length (9) recompiles nothing
    assert breaks <= plain_breaks and graphs <= plain_graphs + 1, (breaks, graphs, plain_breaks, plain_graphs)
    _, _, eager_rows = gpt2_steps(convert=True, compile=False)
    for row, eager_row in zip(rows, eager_rows):  # every logged number, float64
        assert row.keys() == eager_row.keys()
        for key, value in eager_row.items():
            assert row[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_compiled_layernorm_backward_does_not_grow_with_the_examples(monkeypatch):
    """Issue 39: rows of at least PER_EXAMPLE_KERNEL_ELEMENTS per example take torch's LayerNorm backward once per
    example eagerly (out= slices of one input gradient); compiled, that loop became one functional call and one
    scatter of the whole input gradient per example (the baby GPT's compiled step 1.76x the plain one). Compiled,
    the backward graph holds one LayerNorm backward whatever N, and gives the eager buffers and gradients."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from nanogns.kinds import layernorm

    monkeypatch.setattr(layernorm, "PER_EXAMPLE_KERNEL_THREADS", 2**20)  # whatever torch's threads
    D = 256
    T = layernorm.PER_EXAMPLE_KERNEL_ELEMENTS // D  # the eager layer takes the per-example kernels here
    backward_graphs = []

    def keep_backward(graph, example_inputs):
        backward_graphs.append(graph)
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=lambda graph, example_inputs: make_boxed_func(graph), bw_compiler=keep_backward)
    for N in (2, 5):
        torch.manual_seed(N)
        eager = layernorm.PerExampleLayerNorm(D)
        model = copy.deepcopy(eager)
        x = torch.randn(N, T, D, dtype=torch.float64)
        g = torch.randn(N, T, D, dtype=torch.float64)
        eager.double(), model.double()
        assert layernorm._per_example_kernels(layout_rows(N), x, eager.weight)
        grads = []
        for m in (eager, torch.compile(model, backend=backend, fullgraph=True)):
            xs = x.clone().requires_grad_()  # the input gradient asked for too: the eager layer's per-example path
            m(xs).backward(g)
            grads.append(xs.grad)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
        for name, b in pe_buffers(eager).items():
            torch.testing.assert_close(pe_buffers(model)[name], b, rtol=1e-10, atol=0, msg=name)
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)
    calls = [
        sum(1 for node in graph.graph.nodes if "native_layer_norm_backward" in str(node.target))
        for graph in backward_graphs
    ]
    assert calls == [1, 1], calls


def layout_rows(N):

    return Rows("dim0", N)
