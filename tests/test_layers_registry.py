"""
The layer registry (nanogns/core/registry.py) and the contextual config (nanogns/kinds/choice.py).

    python -m pytest tests/test_layers_registry.py -q
"""

import copy

import pytest
import torch
import torch.nn as nn
from oracle import loss_sqnorms_from_batched_forward

import nanogns as lc
from nanogns import kinds as layer_kinds
from nanogns.core import buffers as buffered
from nanogns.core import layout
from nanogns.core.registry import adopt
from nanogns.core.rowmaps import Layout
from nanogns.kinds.conv import PerExampleConv
from nanogns.kinds.layernorm import SeparatedLayerNorm
from nanogns.kinds.linear import PerExampleLinear
from nanogns.kinds.rmsnorm import PerExampleRMSNorm


def mixtral_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts = MixtralExperts(MixtralConfig(hidden_size=5, intermediate_size=6, num_local_experts=3))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    return experts


def dbrx_experts():
    from transformers.models.dbrx.configuration_dbrx import DbrxFFNConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    experts = DbrxExperts(DbrxFFNConfig(hidden_size=5, ffn_hidden_size=6, moe_num_experts=3))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    return experts


def llama4_experts():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    experts = Llama4TextExperts(Llama4TextConfig(hidden_size=5, intermediate_size=6, num_local_experts=3))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    return experts


def jetmoe_bank():
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts

    bank = JetMoeParallelExperts(num_experts=3, input_size=5, output_size=4)
    nn.init.normal_(bank.weight, std=0.3)
    return bank


def grouped_rows():
    """16 rows grouped by expert as JetMoE's router groups them: 4 examples' 2 tokens each (the (8, 5) token rows a
    forward flattens), each token routed to 2 of 3 experts, gathered by the slots sorted by expert (an expert's rows
    in no order of their examples: the last token's first); and the size of each expert's group (a list, as JetMoE
    hands it)."""
    tokens = torch.randn(8, 5, requires_grad=True)
    return tokens[GROUPED_SLOTS // 2], torch.bincount(ROUTES.flatten(), minlength=3).tolist()


ROUTES = torch.stack([torch.randperm(3, generator=torch.Generator().manual_seed(t))[:2] for t in range(8)])
GROUPED_SLOTS = (ROUTES.flatten() * 16 - torch.arange(16)).argsort()  # (token, k) slots by expert, then last first
EXAMPLE_OF_GROUPED_ROW = GROUPED_SLOTS // 2 // 2  # (each example: 2 tokens)


def routed():
    x = torch.randn(8, 5)
    index = torch.stack([torch.randperm(3)[:2] for _ in range(8)])
    return x, index, torch.rand(8, 2)


# each kind: (its plain module, its forward's inputs: 4 examples)
BUILD = {
    "Linear": (lambda: nn.Linear(5, 3), lambda: (torch.randn(4, 2, 5),)),
    "Embedding": (lambda: nn.Embedding(11, 3), lambda: (torch.randint(0, 11, (4, 2)),)),
    "LayerNorm": (lambda: nn.LayerNorm(5), lambda: (torch.randn(4, 2, 5),)),
    "RMSNorm": (lambda: nn.RMSNorm(5), lambda: (torch.randn(4, 2, 5),)),
    "Conv1D": (
        lambda: __import__("transformers.pytorch_utils").pytorch_utils.Conv1D(3, 5),  # (nf, nx): 5 in, 3 out
        lambda: (torch.randn(4, 2, 5),),
    ),
    "Conv": (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: (torch.randn(4, 3, 5, 5),)),
    "BatchNorm": (lambda: nn.BatchNorm2d(3).eval(), lambda: (torch.randn(4, 3, 5, 5),)),  # running statistics
    "GroupNorm": (lambda: nn.GroupNorm(2, 6), lambda: (torch.randn(4, 6, 3, 5),)),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(6, 2, batch_first=True), lambda: (torch.randn(4, 3, 6),) * 3),
    "Experts": (mixtral_experts, routed),  # 8 token rows: 4 examples of 2 (layout below)
    "DbrxExperts": (dbrx_experts, lambda: (routed()[0].view(4, 2, 5), *routed()[1:])),
    "DenseExperts": (llama4_experts, lambda: (torch.randn(3 * 8, 5),)),  # each of 3 experts: 8 token rows
    "ParallelExperts": (jetmoe_bank, grouped_rows),  # 16 rows grouped by expert, gathered from 4 examples' 8 tokens
}
ENTRIES = [(kind.name, name) for kind in layer_kinds.KINDS.values() for name in kind.variants if name != "nn"]


def layout_of(examples, lengths):
    """The layout a model's forward would set (4 examples; the experts' 8 rows are 4 examples of 2 tokens)."""
    return layout.running(Layout(examples, frozenset(lengths)))


@pytest.mark.parametrize("kind, name", ENTRIES, ids=[f"{k}-{n}" for k, n in ENTRIES])
def test_every_registered_variant_is_exact_and_a_drop_in_for_its_kind(kind, name):
    """Each variant, made of its kind's plain module as convert() makes it, keeps the module's parameter names and
    shapes and gives its output (a registry entry pointing at the wrong class fails here), and records every
    trainable parameter's per-example squared norms for the 4 examples of the input: equal to the brute-force
    loop over examples (float64, each example's gradient from the plain module's batched forward). Approximate
    variants (SOGNS) record every parameter. Adding a kind or a variant to the registry adds its case here."""
    make, make_input = BUILD[kind]
    torch.manual_seed(0)
    reference = make().double()
    # the fused variants in float32, so that their kernels run (Triton's interpreter on the CPU); the rest in float64
    dtype, rel = (
        (torch.float32, 1e-4)
        if name == "fused" and layer_kinds.get(kind).variants["fused"] is not layer_kinds.get(kind).variants["gns"]
        else (torch.float64, 1e-6)
    )
    module = copy.deepcopy(reference).to(dtype)
    variant = layer_kinds.get(kind)
    adopt(module, variant.layer_class(name), variant.options(module))
    assert [(n, p.shape) for n, p in module.named_parameters()] == [
        (n, p.shape) for n, p in reference.named_parameters()
    ]
    floating = lambda x: isinstance(x, torch.Tensor) and x.is_floating_point()  # noqa: E731
    inputs = tuple(x.double() if floating(x) else x for x in make_input())
    want = reference(*inputs)
    with layout_of(4, (2,) if kind.endswith("Experts") else ()):
        got = module(*(x.to(dtype) if floating(x) else x for x in inputs))
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    torch.testing.assert_close(got.double(), want, rtol=rel, atol=rel)
    got.pow(2).sum().backward()
    recorded = {
        n[: -len(buffered.BUFFER_SUFFIX)]: b for n, b in module.named_buffers() if n.endswith(buffered.BUFFER_SUFFIX)
    }
    if "sogns" in name:
        assert {n.split("_sogns")[0] for n in recorded} == {n for n, _ in module.named_parameters()}
        return
    assert set(recorded) == {n for n, _ in module.named_parameters()}
    # example i's loss is the part of the summed loss its rows make (token rows of the experts: 2 per example; the
    # dense experts' rows are each expert's 8 token rows, example after example; the rows grouped by expert, each
    # its token's example)
    by_example = want.view(3, 4, -1).transpose(0, 1) if kind == "DenseExperts" else want
    losses = by_example.reshape(4, -1).pow(2).sum(dim=1)
    if kind == "ParallelExperts":
        losses = want.new_zeros(4).index_add(0, EXAMPLE_OF_GROUPED_ROW, want.pow(2).sum(dim=1))
    pe_sq, _ = loss_sqnorms_from_batched_forward(reference, losses)
    for n, buffer in recorded.items():
        assert buffer[1].item() == 4, n
        assert buffer[0].item() == pytest.approx(4 * pe_sq[n], rel=rel), n  # [sum_i ||g_i||^2, count]


def test_unknown_name_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown lnclass 'fast'; choose from \['fused', 'gns', 'nn', 'shim'\]"):
        lc.layer_classes(lnclass="fast")
    with pytest.raises(ValueError, match="unknown layer kind"):
        lc.get_layer_class("Conv3d", "nn")


def test_context_manager_sets_and_restores():
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", lnclass="shim")) as config:
        assert config.Linear is PerExampleLinear
        assert lc.config.LayerNorm is SeparatedLayerNorm
        assert lc.config.Embedding is nn.Embedding
    assert lc.config.Linear is nn.Linear and lc.config.LayerNorm is nn.LayerNorm
    with pytest.raises(RuntimeError):
        with lc.set_contextual_config(Linear=PerExampleLinear):
            raise RuntimeError("boom")
    assert lc.config.Linear is nn.Linear  # restored after an exception too
    with pytest.raises(ValueError, match="unknown layer kind"):
        with lc.set_contextual_config(Conv3d=nn.Conv3d):
            pass
    # every kind a model builds by class has its place in the config, read from the registry (not a field list)
    with lc.set_contextual_config(Conv=PerExampleConv, RMSNorm=PerExampleRMSNorm):
        assert lc.config.Conv is PerExampleConv and lc.config.RMSNorm is PerExampleRMSNorm
    assert lc.config.Conv is layer_kinds.get("Conv").layer_class("nn")


def test_tracking_flag():
    assert not lc.tracks_per_example_norms()
    assert lc.tracks_per_example_norms(lnclass="fused")
