"""
transformers' models through nanogns.convert, against a brute-force loop
over examples: GPT-2 (Conv1D layers, tied head) and Llama (LlamaRMSNorm) have
every parameter tracked exactly; transformers' own norm classes (GemmaRMSNorm's
(1 + weight) scale, T5LayerNorm, LlamaRMSNorm) are swapped after the probe;
Conv1D in every flavour; and the examples/hf_*.py scripts.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_conversion_transformers.py

Models are built from tiny configs with random weights (nothing is downloaded).
transformers is imported once, here (it takes seconds).
"""

import copy
import functools
import importlib.util
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward, per_example_sqnorms_by_loop
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm
from transformers.pytorch_utils import Conv1D

import fused_gns
import nanogns as lc
from nanogns.analysis import cli as analysis_cli
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.runlog.reader import load_csv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, T = 23, 7
SIZES = dict(n_layer=2, n_head=2, n_embd=16, block_size=T)  # the examples' models, smaller


sys.path.insert(0, os.path.join(REPO, "examples"))  # the examples' own helpers (common.py), as a script has them


@functools.cache
def load(path, name):
    """A script of the repository (examples/hf_gpt2.py, gns-analysis.py) imported as a module, once."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example(name):
    return load(f"examples/{name}.py", f"examples_{name}")


def parameter_names(model):
    """Every name of every parameter (a tied tensor under each of its names)."""
    return {name for name, _ in model.named_parameters(remove_duplicate=False)}


def tracked_names(monitor):
    return {part for name, _, _ in monitor.tracked for part in name.split("+")}


# -----------------------------------------------------------------------------
# whole models: every parameter tracked, exactly


def loss_fn(name, model, x, y):
    """The mean over examples of each example's mean token loss (all sequences have T tokens)."""
    return F.cross_entropy(example(name).logits(model, x).flatten(0, 1), y.flatten())


def brute_force(name, model, x, y):
    """{parameter name: (|mean_i g_i|^2, mean_i |g_i|^2)} by the oracle (each example's gradient, its mean token loss,
    from the batched forward), in float64."""
    logits = example(name).logits(model, x)
    losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
    per_example, batch = loss_sqnorms_from_batched_forward(model, losses)
    zero_pe_sqnorm_buffers(model)
    return {n: (batch[n], per_example[n]) for n in batch}


def accumulated_measurements(name, model, monitor, x, y, split=2):
    """{name: Measurement} of one step over two micro-batches, each loss weighted by its share of the batch."""
    B = x.size(0)
    for part in (slice(0, split), slice(split, B)):
        (loss_fn(name, model, x[part], y[part]) * x[part].size(0) / B).backward()
    measurements = {m.metadata["name"]: m for m in monitor.measure(batch_size=B)}
    model.zero_grad(set_to_none=True)
    zero_pe_sqnorm_buffers(model)
    return measurements


def converted(name, dtype, classes=("gns", "gns", "gns")):
    torch.manual_seed(0)
    model = example(name).build(VOCAB, **SIZES).to(dtype)
    return model, lc.convert(model, *classes)


@pytest.mark.parametrize("classes", [("gns", "gns", "gns"), ("shim", "shim", "shim")], ids="-".join)
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_every_parameter_tracked_and_exact(name, classes):
    """float64, dropout 0, 2 uneven micro-batches: pegn and norm of every parameter within 1e-6 of brute force."""
    model, monitor = converted(name, torch.float64, classes)
    assert monitor.unconverted == {} and monitor.untracked == {}
    assert tracked_names(monitor) == parameter_names(model)
    tracked_elements = sum(model.get_parameter(n.split("+")[0]).numel() for n, _, _ in monitor.tracked)
    assert tracked_elements == sum(p.numel() for p in model.parameters())  # 100% of the elements
    if name == "hf_gpt2":
        assert "transformer.wte.weight+lm_head.weight" in {n for n, _, _ in monitor.tracked}
        c_attn = model.transformer.h[0].attn.c_attn  # converted in place: still a Conv1D, with the variant's forward
        assert isinstance(c_attn, lc.get_layer_class("Conv1D", classes[0])) and isinstance(c_attn, Conv1D)
    else:
        norm = model.model.norm
        assert isinstance(norm, lc.get_layer_class("RMSNorm", classes[2])) and isinstance(norm, LlamaRMSNorm)
        assert norm.eps == 1e-6
    x, y = torch.randint(0, VOCAB, (2, 5, T), generator=torch.Generator().manual_seed(1))
    measurements = accumulated_measurements(name, model, monitor, x, y)
    want = brute_force(name, model, x, y)
    assert {n.split("+")[0] for n in measurements} == set(want)
    for param, m in measurements.items():
        sq_norm, pe_sqnorm = want[param.split("+")[0]]
        assert m.batch_size == 5
        assert m.norm**2 == pytest.approx(sq_norm, rel=1e-6), param
        assert m.rms_pe_norm**2 == pytest.approx(pe_sqnorm, rel=1e-6), param


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_bf16_autocast_close_to_float32(name):
    model, monitor = converted(name, torch.float32)
    x, y = torch.randint(0, VOCAB, (2, 6, T), generator=torch.Generator().manual_seed(2))
    want = accumulated_measurements(name, model, monitor, x, y, split=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = accumulated_measurements(name, model, monitor, x, y, split=3)
    assert set(got) == set(want) and len(got) == len(monitor.tracked)
    for param, m in got.items():
        assert m.norm == pytest.approx(want[param].norm, rel=3e-2), param
        assert m.rms_pe_norm == pytest.approx(want[param].rms_pe_norm, rel=3e-2), param


def test_llama_with_a_pad_token_and_tied_head_tracked_and_exact():
    """pad_token_id makes transformers build nn.Embedding(..., padding_idx): converted, and padding tokens in the
    input add nothing to the embedding's side of the tied matrix (float64, 2 uneven micro-batches)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=T,
        pad_token_id=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).double()
    assert model.model.embed_tokens.padding_idx == 2 and model.lm_head.weight is model.model.embed_tokens.weight
    monitor = lc.convert(model)
    assert monitor.unconverted == {} and monitor.untracked == {} and tracked_names(monitor) == parameter_names(model)
    x, y = torch.randint(0, VOCAB, (2, 5, T), generator=torch.Generator().manual_seed(4))
    x[:, -3:] = 2  # right padding in every example
    measurements = accumulated_measurements("hf_llama", model, monitor, x, y)
    want = brute_force("hf_llama", model, x, y)
    assert "model.embed_tokens.weight+lm_head.weight" in measurements and len(measurements) == len(want)
    for param, m in measurements.items():
        sq_norm, pe_sqnorm = want[param.split("+")[0]]
        assert m.norm**2 == pytest.approx(sq_norm, rel=1e-6), param
        assert m.rms_pe_norm**2 == pytest.approx(pe_sqnorm, rel=1e-6), param


def test_converted_models_give_the_same_loss():
    """The converted GPT-2 and Llama compute what transformers' own modules compute (float64)."""
    x, y = torch.randint(0, VOCAB, (2, 3, T), generator=torch.Generator().manual_seed(3))
    for name in ("hf_gpt2", "hf_llama"):
        torch.manual_seed(0)
        model = example(name).build(VOCAB, **SIZES).double()
        before = loss_fn(name, model, x, y).item()
        lc.convert(model)
        assert loss_fn(name, model, x, y).item() == pytest.approx(before, rel=1e-6), name  # LlamaRMSNorm runs in fp32


# -----------------------------------------------------------------------------
# transformers' norm classes, swapped after the probe

NORMS = {  # class: (the replacement's options, the scale the weight is drawn around)
    GemmaRMSNorm: (dict(weight_offset=1.0, eps=1e-6), 0.0),
    T5LayerNorm: (dict(weight_offset=0.0, eps=1e-6), 1.0),
    LlamaRMSNorm: (dict(weight_offset=0.0, eps=1e-5), 1.0),
}


@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (4, 3, 7), (1, 3, 7)], ids=str)
@pytest.mark.parametrize("lnclass", ["shim", "gns", "fused"])
@pytest.mark.parametrize("norm_cls", list(NORMS), ids=lambda c: c.__name__)
@pytest.mark.filterwarnings("ignore:.*Triton kernel not used:RuntimeWarning")
def test_transformers_norms_swapped_and_exact(norm_cls, lnclass, shape):
    """Same output and gradients as the original module; per-example norms equal the loop over examples."""
    dtype = torch.float32 if lnclass == "fused" else torch.float64  # fused: the kernel (Triton's interpreter on CPU)
    options, center = NORMS[norm_cls]
    torch.manual_seed(0)
    norm = norm_cls(7, eps=options["eps"]).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(center + 0.3 * torch.randn(7))
    original = copy.deepcopy(norm)
    model = nn.Sequential(norm)
    monitor = lc.convert(model, lnclass=lnclass)
    assert isinstance(model[0], lc.get_layer_class("RMSNorm", lnclass)) and model[0].weight is norm.weight
    assert (model[0].eps, model[0].weight_offset) == (options["eps"], options["weight_offset"])
    assert not monitor.unconverted and list(model.state_dict()) == ["0.weight"]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    if lnclass == "fused":
        assert fused_gns.kernel_unavailable_reason(x) is None  # the kernel, not the fallback, is tested
    out = model(x)
    out.backward(g)
    reference = original(x.detach().requires_grad_())
    reference.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # transformers' classes compute in float32 inside
    torch.testing.assert_close(out, reference, rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad, original.weight.grad, rtol=tol, atol=tol)
    total, count = model[0].weight_pe_sqnorm.tolist()
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x.detach(), g)["0.weight"]
    assert count == shape[0] and total == pytest.approx(loop.sum().item(), rel=1e-5)


def test_gemma_norm_in_bf16_keeps_a_small_weight():
    """(1 + w) is formed in float32 as Gemma does: a bf16 1 + 0.01 would round to 1."""
    torch.manual_seed(0)
    norm = GemmaRMSNorm(16).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(0.01)
    x = torch.randn(3, 5, 16).to(torch.bfloat16)
    reference = norm(x)
    model = nn.Sequential(norm)
    lc.convert(model)
    torch.testing.assert_close(model(x), reference, rtol=1e-2, atol=1e-2)
    assert (model(x).float() / F.rms_norm(x.float(), (16,))).mean().item() == pytest.approx(1.01, abs=2e-3)


# -----------------------------------------------------------------------------
# transformers' Conv1D (weight stored (in, out))


@pytest.mark.parametrize("shape", [(4, 7), (1, 7), (3, 5, 7), (1, 5, 7)], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("linearclass", ["shim", "gns", "fused"])
def test_conv1d_layers_match_brute_force(linearclass, bias, shape):
    dtype = torch.float32 if linearclass == "fused" else torch.float64
    torch.manual_seed(0)
    layer = lc.get_layer_class("Conv1D", linearclass)(9, 7, bias=bias).to(dtype)  # nf=9 out, nx=7 in
    assert layer.weight.shape == (7, 9)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    x = torch.randn(shape, dtype=dtype)
    g = torch.randn(*shape[:-1], 9, dtype=dtype)
    if linearclass == "fused":
        assert fused_gns.kernel_unavailable_reason(x) is None
    out = layer(x)
    out.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out, x @ layer.weight + (layer.bias if bias else 0), rtol=tol, atol=tol)
    torch.testing.assert_close(layer.weight.grad, x.reshape(-1, 7).T @ g.reshape(-1, 9), rtol=tol, atol=tol)
    recorded = {n: layer.get_buffer(n + "_pe_sqnorm").tolist() for n, _ in layer.named_parameters()}
    zero_pe_sqnorm_buffers(layer)
    loop = per_example_sqnorms_by_loop(layer, x, g)
    assert set(recorded) == ({"weight", "bias"} if bias else {"weight"})
    for name, (total, count) in recorded.items():
        assert count == shape[0] and total == pytest.approx(loop[name].sum().item(), rel=1e-5), name


@pytest.mark.parametrize("linearclass", ["shim", "gns", "fused"])
def test_convert_swaps_conv1d_keeping_its_parameters(linearclass):
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(9, 7), nn.GELU(), Conv1D(5, 9))
    params, keys = list(model.parameters()), list(model.state_dict())
    x = torch.randn(2, 3, 7)
    before = model(x)
    monitor = lc.convert(model, linearclass=linearclass)
    assert isinstance(model[0], lc.get_layer_class("Conv1D", linearclass)) and (model[0].nf, model[0].nx) == (9, 7)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True)) and list(model.state_dict()) == keys
    assert not monitor.unconverted and [n for n, _, _ in monitor.tracked] == keys
    torch.testing.assert_close(model(x), before)


def test_conv1d_under_sogns_is_listed_with_the_reason():
    model = nn.Sequential(Conv1D(4, 3), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="1 module\\(s\\) not converted"):
        monitor = lc.convert(model, linearclass="sogns")
    assert type(model[0]) is Conv1D and "linearclass='sogns' has no Conv1D layer" in monitor.unconverted["0"]


# -----------------------------------------------------------------------------
# the examples


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_example_logs_every_parameter_and_gns_analysis_reads_it(name, tmp_path, capsys):
    example(name).main([f"--out_dir={tmp_path}", "--steps=3", "--batch_size=4"])
    printed = capsys.readouterr().out
    assert f"{name}: 3 steps" in printed and "final running GNS" in printed
    df = load_csv(tmp_path)
    assert len(df) == 3
    vocab_size, _ = example(name).shakespeare_batches(block_size=8, batch_size=1)
    model = example(name).build(vocab_size)
    monitor = lc.convert(model)
    for param, _, _ in monitor.tracked:
        for metric in ("norm", "pegn", "batch_size"):
            column = f"train/gns/{param}/{metric}"
            assert column in df.columns and df[column].notna().all(), column
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    assert "Final GNS: " in capsys.readouterr().out


def test_fused_gpt2_close_to_brute_force():
    """Conv1D, Linear and LayerNorm fused, float32 (Triton's interpreter on CPU): within float32 rounding of brute
    force. (Llama's fused RMSNorm is checked layer by layer above.)"""
    name = "hf_gpt2"
    model, monitor = converted(name, torch.float32, ("fused", "gns", "fused"))
    assert tracked_names(monitor) == parameter_names(model)
    x = torch.zeros(1)
    assert fused_gns.kernel_unavailable_reason(x) is None  # the kernels, not the fallback
    x, y = torch.randint(0, VOCAB, (2, 3, T), generator=torch.Generator().manual_seed(4))
    measurements = accumulated_measurements(name, model, monitor, x, y)
    want = brute_force(name, model, x, y)
    for param, m in measurements.items():
        sq_norm, pe_sqnorm = want[param.split("+")[0]]
        assert m.norm**2 == pytest.approx(sq_norm, rel=1e-4), param
        assert m.rms_pe_norm**2 == pytest.approx(pe_sqnorm, rel=1e-4), param
