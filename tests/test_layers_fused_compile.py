"""
The fused layers under torch.compile: their kernels are torch custom ops
(nanogns::norm_fwd, norm_bwd, linear_dw_db, linear_dw), so Dynamo traces the
autograd Functions around them into the graph with the ops as single nodes,
run eagerly (on the CPU, in Triton's interpreter). The compiled model equals
the eager one: outputs, input and parameter gradients, and the per-example
norm buffers.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_layers_fused_compile.py

How the test knows the ops are in the graph: a custom aot_autograd backend
keeps the forward and backward FX graphs it is handed, and the test looks for
nodes calling torch.ops.nanogns.<op> (the ops that update the buffers appear
wrapped in functionalization's auto_functionalized); the ops stay opaque there:
the kernels were not traced into, nor was the layer's torch fallback taken.
"""

import pytest
import torch
import torch.nn as nn

from nanogns.kinds.layernorm import FusedLayerNorm
from nanogns.kinds.linear import FusedLinear
from nanogns.kinds.rmsnorm import FusedRMSNorm
from nanogns.variants import fused as fused_gns

DEVICE = "cpu" if fused_gns.kernels_interpreted() else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 (kernels on CPU) or a CUDA GPU"
)


class Block(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.ln = FusedLayerNorm(D)
        self.fc = FusedLinear(D, 2 * D)
        self.proj = FusedLinear(2 * D, D, bias=False)
        self.rms = FusedRMSNorm(D)

    def forward(self, x):
        return self.rms(x + self.proj(torch.relu(self.fc(self.ln(x)))))


def capturing_backend(graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(gm, example_inputs):
            graphs.setdefault(name, []).append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def ops_in(graph_modules):
    """nanogns ops called in the graphs, directly or (those mutating the buffers) through functionalization's
    auto_functionalized wrapper, whose first argument is the op."""
    found = set()
    for gm in graph_modules:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
            if str(target).startswith("nanogns."):
                found.add(str(target))
    return found


@pytest.mark.parametrize("backend", ["capture", "inductor"])
def test_compiled_fused_layers_equal_eager_with_kernels_as_custom_ops(backend):
    torch.manual_seed(0)
    D = 32
    eager = Block(D).to(DEVICE)
    model = Block(D).to(DEVICE)
    model.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    graphs = {}
    compiled = torch.compile(
        model, backend=capturing_backend(graphs) if backend == "capture" else "inductor", fullgraph=True
    )  # fullgraph: a graph break would raise
    for step in range(2):  # buffers accumulate over two backward passes
        x = torch.randn(3, 5, D, device=DEVICE)
        g = torch.randn(3, 5, D, device=DEVICE)
        outs = []
        for m in (eager, compiled):
            xk = x.clone().requires_grad_(True)
            y = m(xk)
            y.backward(g)
            outs.append((y, xk.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    for (name, p_eager), p in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_eager.grad, rtol=1e-5, atol=1e-5, msg=name)
    for (name, b_eager), b in zip(eager.named_buffers(), model.buffers()):
        assert b_eager[1] == 6, name  # 3 examples x 2 passes
        torch.testing.assert_close(b, b_eager, rtol=1e-5, atol=1e-6, msg=name)
    if backend == "capture":
        assert ops_in(graphs["forward"]) == {"nanogns.norm_fwd.default"}
        assert ops_in(graphs["backward"]) == {
            "nanogns.norm_bwd.default",
            "nanogns.linear_dw_db.default",
            "nanogns.linear_dw.default",
        }


def test_compile_after_a_monitored_forward_traces_in_one_graph():
    """A monitored model's forward leaves its Pass as the last one (what activation checkpointing recomputes
    under); layout.current() then asks autograd for its graph task, a call Dynamo cannot trace. Under compile it
    is skipped, so a later fullgraph compile of fused layers outside a root forward still traces."""
    from nanogns.core import layout
    from nanogns.core.layout import install

    monitored = nn.Linear(16, 16)
    install(monitored)
    monitored(torch.randn(3, 5, 16))  # its forward's Pass stays the last one
    assert layout.current_pass() is None and layout.backward_pass() is not None
    torch.manual_seed(0)
    eager = Block(16).to(DEVICE)
    model = Block(16).to(DEVICE)
    model.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break would raise
    x = torch.randn(3, 5, 16, device=DEVICE)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
