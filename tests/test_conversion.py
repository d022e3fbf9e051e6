"""
nanogns.convert (swap the torch layers of a model built elsewhere) and
nanogns/kinds/functional.py (per-example norm functions for layers that are not nn modules),
checked against a brute-force loop over examples.

    python -m pytest -q tests/test_conversion.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward, per_example_sqnorms_by_loop

import nanogns as lc
from nanogns import monitor as gnstracking
from nanogns.conversion import probe as swapcheck
from nanogns.conversion.replay import ReplayedForward
from nanogns.core.buffers import PerExampleNormLayer, zero_pe_sqnorm_buffers
from nanogns.kinds import functional
from nanogns.kinds.embedding import PerExampleEmbedding
from nanogns.kinds.linear import PerExampleLinear


class Nested(nn.Module):
    """Embedding, LayerNorm, RMSNorm with a weight, a weightless RMSNorm, a module registered under two
    paths (called once), nested containers and a tied output layer; plus modules convert cannot handle."""

    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(2)]
        )
        self.norm = nn.RMSNorm(d)
        self.bare_norm = nn.RMSNorm(d, elementwise_affine=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.alias = self.proj  # the same module under a second path
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.conv = nn.Conv1d(d, d, 1)  # converted; unused in forward: no gradient, so not measured
        self.padded = nn.Embedding(4, d, max_norm=1.0)  # unsupported option: listed

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.proj(self.bare_norm(self.norm(h))))


def example_losses(model, ids, targets):
    """Each example's mean token loss (a 1-D batch of ids: one token per example)."""
    logits = model(ids)
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.view(ids.shape[0], -1).mean(dim=1)


def loss_fn(model, ids, targets):
    return example_losses(model, ids, targets).mean()


def brute_force_pe(model, ids, targets):
    """{name: mean_i ||g_i||^2} by the oracle (each example's gradient from the batched forward)."""
    per_example, _ = loss_sqnorms_from_batched_forward(model, example_losses(model, ids, targets))
    zero_pe_sqnorm_buffers(model)
    return per_example


@pytest.mark.parametrize("classes", [("gns", "gns", "gns"), ("shim", "shim", "shim")], ids="-".join)
@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (6,)], ids=str)  # 2-D ids, a batch of 1, 1-D ids (T = 1)
def test_converted_model_matches_brute_force(classes, shape):
    torch.manual_seed(0)
    model = Nested().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before convert: must keep working
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="1 module\\(s\\) not converted"):
        monitor = lc.convert(model, *classes)
    assert set(monitor.unconverted) == {"padded"}
    assert type(model.blocks[1][1]).__name__.startswith(("PerExample", "Shim")) and model.alias is model.proj
    assert model.head.weight is model.emb.weight and isinstance(model.bare_norm, nn.RMSNorm)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[n], rtol=0, atol=0)  # same values, same dtype
    gen = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(1, 13, (2, *shape), generator=gen)
    B = shape[0]
    for part in [slice(0, B)] if B == 1 else [slice(0, B // 2), slice(B // 2, B)]:  # accumulation
        n = ids[part].shape[0]
        (loss_fn(model, ids[part], targets[part]) * n / B).backward()
    measurements = {m.metadata["name"]: m for m in monitor.measure(batch_size=B)}
    optimizer.step()  # the optimizer still holds the model's parameters
    assert not torch.equal(model.proj.weight.detach(), weights["proj.weight"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    expected = brute_force_pe(model, ids, targets)
    assert set(measurements) == {
        "emb.weight+head.weight",
        "blocks.0.0.weight",
        "blocks.0.0.bias",
        "blocks.0.1.weight",
        "blocks.0.1.bias",
        "blocks.0.3.weight",
        "blocks.0.3.bias",
        "blocks.1.0.weight",
        "blocks.1.0.bias",
        "blocks.1.1.weight",
        "blocks.1.1.bias",
        "blocks.1.3.weight",
        "blocks.1.3.bias",
        "norm.weight",
        "proj.weight",
    }
    for name, m in measurements.items():
        reference = expected[name.split("+")[0]]
        assert m.rms_pe_norm**2 == pytest.approx(reference, rel=1e-6), name


def test_convert_keeps_device_dtype_and_training_mode():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).to(torch.bfloat16).eval()
    lc.convert(model)
    assert model[0].weight.dtype == torch.bfloat16 and not model[0].training
    assert model[0].weight_pe_sqnorm.dtype == torch.float32 and model[0].weight_pe_sqnorm.device.type == "cpu"


def test_convert_leaves_nn_kinds_and_rejects_a_bare_layer():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    monitor = lc.convert(model, linearclass="nn", lnclass="gns")
    assert type(model[0]) is nn.Linear and [n for n, _, _ in monitor.tracked] == ["1.weight", "1.bias"]
    with pytest.raises(ValueError, match="wrap it in a module"):
        lc.convert(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown linearclass 'fast'"):
        lc.convert(model, linearclass="fast")


def test_a_module_used_twice_per_forward_sums_its_uses_exactly():
    """A Linear applied twice per forward: example i's gradient is the sum of both uses' (core/uses.py), against
    the loop over examples (float64)."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2)).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    want, batch = loss_sqnorms_from_batched_forward(model, model(x).pow(2).flatten(1).mean(dim=1))
    monitor = lc.convert(model)
    model(x).pow(2).mean().backward()
    measured = {m.metadata["name"]: m for m in monitor.measure(batch_size=3)}
    assert set(measured) == {"0.weight", "0.bias", "3.weight", "3.bias"} and not monitor.untracked
    for name, m in measured.items():
        assert m.rms_pe_norm**2 == pytest.approx(want[name], rel=1e-6), name
        assert m.norm**2 == pytest.approx(batch[name], rel=1e-9), name


def test_two_forwards_before_their_backward_refuse_a_module_used_twice():
    """Forward, forward, then one backward of both losses: the uses of a module used twice per forward cannot be
    attributed to their forwards, so the step is refused for it (never a number); a module used once per forward is
    measured as usual."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2)).double()
    monitor = lc.convert(model)
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    (model(x[:2]).pow(2).sum() + model(x[2:]).pow(2).sum()).backward()
    with pytest.raises(ValueError, match=r"0.weight: this step is not measured.*a forward began before the backward"):
        monitor.measure(batch_size=4)
    zero_pe_sqnorm_buffers(model)
    model.zero_grad()
    for part in (slice(0, 2), slice(2, 4)):  # each forward's backward before the next forward: measured
        model(x[part]).pow(2).sum().backward()
    assert {m.metadata["name"] for m in monitor.measure(batch_size=4)} == {"0.weight", "0.bias", "3.weight", "3.bias"}


def test_a_module_whose_kind_gives_no_factors_used_twice_is_dropped_with_a_warning():
    """A convolution applied twice per forward (the Conv kind hands over no per-example gradients to sum): its
    parameters stop being measured, with the reason; the others are measured."""
    shared = nn.Conv1d(4, 4, 3, padding=1)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Flatten(), nn.Linear(20, 2))
    monitor = lc.convert(model)
    model(torch.randn(3, 4, 5)).sum().backward()
    with pytest.warns(
        UserWarning, match="not tracking 0.weight: counted 2 x 3 examples, used 2 times in the last forward"
    ):
        names = [m.metadata["name"] for m in monitor.measure(batch_size=3)]
    assert names == ["4.weight", "4.bias"]


# -----------------------------------------------------------------------------
# functional API


class TransposedLinear(PerExampleNormLayer, nn.Module):
    """W stored (in, out), used as x @ W cast to the input dtype: modded-nanogpt's layout."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        functional.register_buffers(self, "weight")

    def forward(self, x):
        return functional.linear(x, self.weight.t().type_as(x), weight_buffer=self.weight_pe_sqnorm)


class FunctionalNorms(PerExampleNormLayer, nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, d))
        self.ln_w, self.ln_b, self.rms_w = (nn.Parameter(torch.randn(d)) for _ in range(3))
        functional.register_buffers(self, "table", "ln_w", "ln_b", "rms_w")

    def forward(self, ids):
        h = functional.embedding(ids, self.table, self.table_pe_sqnorm)
        h = functional.layer_norm(h, self.ln_w, self.ln_b, 1e-5, self.ln_w_pe_sqnorm, self.ln_b_pe_sqnorm)
        return functional.rms_norm(h, self.rms_w, 1e-6, self.rms_w_pe_sqnorm)


def per_example_by_loop(model, inputs, grad_out):
    """{name: sum_i ||g_i||^2} by the oracle."""
    return {n: v.sum().item() for n, v in per_example_sqnorms_by_loop(model, inputs, grad_out).items()}


@pytest.mark.parametrize("shape", [(4, 7), (1, 7), (3, 5, 7), (2, 3, 2, 7)], ids=str)
def test_functional_linear_with_a_transposed_weight(shape):
    torch.manual_seed(0)
    layer = TransposedLinear(7, 9).double()
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 9, dtype=torch.float64)
    layer(x).backward(g)
    recorded = layer.weight_pe_sqnorm.clone()
    grad = layer.weight.grad.clone()
    zero_pe_sqnorm_buffers(layer)
    expected = per_example_by_loop(layer, x, g)
    assert recorded[0].item() == pytest.approx(expected["weight"], rel=1e-6) and recorded[1] == shape[0]
    layer.zero_grad()
    (x @ layer.weight).backward(g)
    torch.testing.assert_close(grad, layer.weight.grad)


def test_functional_embedding_and_norms():
    torch.manual_seed(0)
    model = FunctionalNorms(11, 6).double()
    ids = torch.randint(0, 11, (5, 8))
    g = torch.randn(5, 8, 6, dtype=torch.float64)
    model(ids).backward(g)
    recorded = {n: model.get_buffer(n + "_pe_sqnorm")[0].item() for n, _ in model.named_parameters()}
    zero_pe_sqnorm_buffers(model)
    expected = per_example_by_loop(model, ids, g)
    for name in expected:
        assert recorded[name] == pytest.approx(expected[name], rel=1e-6), name


@pytest.mark.parametrize("padding_idx", [2, -1])
def test_functional_embedding_with_padding_idx(padding_idx):
    """The padding row gets no gradient (as F.embedding's), so padding tokens add nothing to any example's norm."""
    torch.manual_seed(0)
    table = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    buffer = torch.zeros(2)
    ids = torch.randint(0, 11, (4, 9))
    ids[:, ::3] = padding_idx % 11
    g = torch.randn(4, 9, 6, dtype=torch.float64)
    functional.embedding(ids, table, buffer, padding_idx=padding_idx).backward(g)
    expected_grad, table.grad = table.grad, None
    expected = 0.0
    for i in range(ids.shape[0]):
        F.embedding(ids[i : i + 1], table, padding_idx=padding_idx).backward(g[i : i + 1])
        expected += table.grad.pow(2).sum().item()
        if i == 0:
            assert table.grad[padding_idx].abs().sum() == 0
        table.grad = None
    F.embedding(ids, table, padding_idx=padding_idx).backward(g)
    torch.testing.assert_close(expected_grad, table.grad)
    assert buffer[0].item() == pytest.approx(expected, rel=1e-6) and buffer[1] == 4


class PaddedTiedLM(nn.Module):
    """An embedding with a padding row, tied to the output layer (as transformers builds one with pad_token_id)."""

    def __init__(self, vocab=13, d=6, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(h))


@pytest.mark.parametrize("classes", [("gns", "gns", "gns"), ("shim", "shim", "shim")], ids="-".join)
@pytest.mark.parametrize("shape", [(5, 7), (1, 7)], ids=str)
def test_padding_idx_embedding_converted_and_exact_tied_or_not(classes, shape):
    """Padding tokens in the input: their rows of the tied matrix get gradient from the head only."""
    for tied in (True, False):
        torch.manual_seed(0)
        model = PaddedTiedLM().double()
        if not tied:
            model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
        monitor = lc.convert(model, *classes)
        assert not monitor.unconverted and model.emb.padding_idx == 0
        assert type(model.emb).__name__.startswith(("PerExample", "Shim"))
        gen = torch.Generator().manual_seed(1)
        ids, targets = torch.randint(0, 13, (2, *shape), generator=gen)
        ids[:, ::2] = 0  # padding in every example
        B = shape[0]
        for part in [slice(0, B)] if B == 1 else [slice(0, 2), slice(2, B)]:
            (loss_fn(model, ids[part], targets[part]) * ids[part].shape[0] / B).backward()
        measurements = {m.metadata["name"]: m for m in monitor.measure(batch_size=B)}
        model.zero_grad(set_to_none=True)
        expected = brute_force_pe(model, ids, targets)
        assert ("emb.weight+head.weight" in measurements) == tied
        assert len(measurements) == len(expected)
        for name, m in measurements.items():
            assert m.rms_pe_norm**2 == pytest.approx(expected[name.split("+")[0]], rel=1e-6), (tied, name)


def test_functional_under_bf16_autocast_within_tolerance():
    torch.manual_seed(0)
    layer = TransposedLinear(16, 8)
    x, g = torch.randn(4, 6, 16), torch.randn(4, 6, 8)
    layer(x).backward(g)
    reference = layer.weight_pe_sqnorm[0].item()
    zero_pe_sqnorm_buffers(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.backward(g.to(torch.bfloat16))
    assert layer.weight_pe_sqnorm[0].item() == pytest.approx(reference, rel=3e-2)
    assert layer.weight.grad.dtype == torch.float32


def test_register_buffers_names_the_missing_parameter():
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['weight'\]"):
        functional.register_buffers(nn.Module(), "weight")


def test_functional_layers_are_found_by_the_monitor():
    model = nn.Sequential(TransposedLinear(4, 3), PerExampleLinear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    monitor = gnstracking.GNSMonitor(model)
    assert [m.metadata["name"] for m in monitor.measure(batch_size=5)] == ["0.weight", "1.weight", "1.bias"]
    assert isinstance(PerExampleEmbedding(3, 2), nn.Embedding)


# -----------------------------------------------------------------------------
# modules convert does not know by class: swapped when the probe (conversion/probe.py) passes


class NanoGPTLayerNorm(nn.Module):
    """nanoGPT's LayerNorm(ndim, bias): F.layer_norm with eps 1e-5, stored nowhere."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class HandRMSNorm(nn.Module):
    """RMSNorm written out, eps under any name; `offset=1.0` is Gemma's (1 + weight) scale."""

    def __init__(self, d, tiny=1e-6, offset=0.0):
        super().__init__()
        self.tiny, self.offset = tiny, offset
        self.weight = nn.Parameter(torch.full((d,), 1.0 - offset))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.tiny) * (self.offset + self.weight)


class EpsOutsideRMSNorm(HandRMSNorm):
    """Almost an RMSNorm: eps added outside the square root, which only rows of small scale show."""

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.tiny) * self.weight


class HiddenEpsRMSNorm(HandRMSNorm):
    """eps 3e-7 written in the forward only: no attribute, no common value."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 3e-7) * self.weight


class StoredWrongEps(HandRMSNorm):
    """Stores eps 1e-6 but computes with 1e-5: the probe, not the attribute, decides."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class InOutLinear(nn.Module):
    """A Linear that stores its weight (in, out), as transformers' Conv1D does."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class SameLayerNorm(nn.LayerNorm):
    """A torch subclass whose own forward computes what nn.LayerNorm computes."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class DefaultEpsRMSNorm(nn.RMSNorm):
    """A torch subclass with eps=None (the input dtype's machine epsilon) and its own forward."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class ScaledEmbedding(nn.Embedding):
    """A torch subclass that scales its output (as BART's and Gemma 3's do): no per-example norm layer does that."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


class MaxNormEmbedding(nn.Embedding):
    """Renormalises its rows in place in forward (max_norm): gradients as a plain embedding's, but a swap would
    drop the renormalisation."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, max_norm=1.0)


class LookAlikes(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.ln = NanoGPTLayerNorm(d, bias=True)
        self.ln_nobias = NanoGPTLayerNorm(d, bias=False)
        self.proj = InOutLinear(d, 2 * d)
        self.rms = HandRMSNorm(2 * d, tiny=1e-7)
        self.gemma = HandRMSNorm(2 * d, offset=1.0)
        self.out = nn.Linear(2 * d, d)
        self.sub = SameLayerNorm(d)

    def forward(self, x):
        h = self.proj(self.ln_nobias(self.ln(x)))
        return self.sub(self.out(self.gemma(self.rms(h))))


@pytest.mark.parametrize("lnclass", ["gns", "shim"])
@pytest.mark.parametrize("shape", [(5, 6), (1, 6), (4, 3, 6), (1, 3, 6)], ids=str)
def test_lookalikes_swapped_and_exact(lnclass, shape):
    """float64, 2-D and 3-D input, a batch of 1, two micro-batches: every buffer equals the loop over examples."""
    torch.manual_seed(0)
    model = LookAlikes().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    x, g = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    before = model(x)
    rng = torch.get_rng_state()
    monitor = lc.convert(model, lnclass=lnclass)
    assert torch.equal(torch.get_rng_state(), rng)  # the probe draws from its own generator
    assert not monitor.unconverted and not monitor.untracked
    ln, rms, conv1d = (
        lc.get_layer_class(k, c) for k, c in (("LayerNorm", lnclass), ("RMSNorm", lnclass), ("Conv1D", "gns"))
    )
    expected = dict(ln=ln, ln_nobias=ln, proj=conv1d, rms=rms, gemma=rms, out=PerExampleLinear, sub=ln)
    originals = dict(
        ln=NanoGPTLayerNorm,
        ln_nobias=NanoGPTLayerNorm,
        proj=InOutLinear,
        rms=HandRMSNorm,
        gemma=HandRMSNorm,
        out=nn.Linear,
        sub=SameLayerNorm,
    )
    for name, module in model.named_children():  # the variant's forward, and still an instance of its own class
        assert isinstance(module, expected[name]) and isinstance(module, originals[name]), name
    assert (model.rms.eps, model.rms.weight_offset, model.gemma.eps, model.gemma.weight_offset) == (1e-7, 0, 1e-6, 1)
    assert model.ln.eps == 1e-5 and model.ln_nobias.bias is None and model.rms.tiny == 1e-7  # attributes carried
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys  # the same Parameters
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    B = shape[0]
    for part in [slice(0, B)] if B == 1 else [slice(0, 2), slice(2, B)]:
        model(x[part]).backward(g[part])
    recorded = {n: model.get_buffer(n + "_pe_sqnorm").tolist() for n, _, _ in monitor.tracked}
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x, g)
    assert set(recorded) == set(loop)
    for name, (total, count) in recorded.items():
        assert count == B and total == pytest.approx(loop[name].sum().item(), rel=1e-6), name


def probe_failure(module, **convert_kwargs):
    """convert() a model holding `module`: (its unconverted reason, the module now at its place)."""
    model = nn.Sequential(nn.Linear(6, 6), module)
    with pytest.warns(UserWarning, match="1 module\\(s\\) not converted"):
        monitor = lc.convert(model, **convert_kwargs)
    return monitor.unconverted.get("1", ""), model[1]


class DiagonalNorm(HandRMSNorm):
    """Scales through a diagonal matrix: no kind's layer computes it, and a matmul by diag(weight) is a use of the
    weight that per-example norms do not follow."""

    def forward(self, x):
        return x @ torch.diag(self.weight)


def test_a_module_that_changes_its_parameters_is_listed_and_left_alone():
    """Listed with why no layer stands in, why its own forward cannot be followed, and why it is not replayed
    per example (its forward renormalises its weight in place); the module, its parameters and its output are
    untouched (the probes run on copies)."""
    torch.manual_seed(0)
    module = MaxNormEmbedding(10, 6)
    with torch.no_grad():
        module.weight.add_(0.1 * torch.randn_like(module.weight))
    x = torch.randint(0, 10, (3, 4))
    before = module(x).detach()  # (MaxNormEmbedding renormalises its weight here, once)
    weight = module.weight.detach().clone()
    reason, now = probe_failure(module)
    assert now is module and type(module).__module__ == __name__
    assert "changes its parameters in place" in reason and "embedding with max_norm" not in reason, reason
    assert "nor replayed per example" in reason, reason
    assert torch.equal(module.weight, weight) and module.weight.grad is None
    assert torch.equal(module(x), before)


def test_a_module_no_layer_computes_nor_follows_is_replayed_per_example_exactly():
    """A diagonal matmul by its weight: no kind's layer computes it and per-example norms do not follow
    torch.diag, so its forward is replayed per example in backward (conversion/replay.py), against the loop."""
    torch.manual_seed(0)
    module = DiagonalNorm(6).double()
    with torch.no_grad():
        module.weight.add_(0.1 * torch.randn_like(module.weight))
    model = nn.Sequential(nn.Linear(6, 6), module).double()
    x, g = torch.randn(5, 4, 6, dtype=torch.float64), torch.randn(5, 4, 6, dtype=torch.float64)
    before = model(x)
    monitor = lc.convert(model)
    assert not monitor.unconverted and isinstance(module, ReplayedForward) and torch.equal(model(x), before)
    for part in (slice(0, 2), slice(2, 5)):
        model(x[part]).backward(g[part])
    recorded = {n: model.get_buffer(n + "_pe_sqnorm").tolist() for n, _, _ in monitor.tracked}
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x, g)
    assert set(recorded) == set(loop) and monitor.describe()["1.weight"]["kind"] == "Replayed"
    for name, (total, count) in recorded.items():
        assert count == 5 and total == pytest.approx(loop[name].sum().item(), rel=1e-6), name


class NormWithMask(HandRMSNorm):
    def forward(self, x, mask=None):
        return super().forward(x)


class TwoWeights(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight, self.gain = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight * self.gain


class Gate(nn.Module):
    """Owns a parameter and has a child (whose training mode convert leaves as it was)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(6))
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(x) * self.gain


@pytest.mark.parametrize(
    "make",
    [lambda: EpsOutsideRMSNorm(6), lambda: HiddenEpsRMSNorm(6), lambda: NormWithMask(6), lambda: TwoWeights(6), Gate],
    ids=["EpsOutsideRMSNorm", "HiddenEpsRMSNorm", "NormWithMask", "TwoWeights", "Gate"],
)
def test_a_norm_no_layer_computes_keeps_its_forward_and_is_exact(make):
    """No kind's layer computes these (eps outside the root, an eps found nowhere, a forward with a second input,
    two scales, a child module), but their parameters only scale every row: followed with their own forward (the
    scale broadcast over the examples), each example's norm is exact, and the output unchanged."""
    torch.manual_seed(0)
    module = make().double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model = nn.Sequential(nn.Linear(6, 6), module).double()
    x, g = torch.randn(5, 4, 6, dtype=torch.float64), torch.randn(5, 4, 6, dtype=torch.float64)
    before = model(x)
    monitor = lc.convert(model)
    assert not monitor.unconverted and model[1] is module and isinstance(module, make().__class__)
    assert torch.equal(model(x), before)
    for part in (slice(0, 2), slice(2, 5)):
        model(x[part]).backward(g[part])
    recorded = {n: model.get_buffer(n + "_pe_sqnorm").tolist() for n, _, _ in monitor.tracked}
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x, g)
    assert set(recorded) == set(loop)
    for name, (total, count) in recorded.items():
        assert count == 5 and total == pytest.approx(loop[name].sum().item(), rel=1e-6), name


class Router(nn.Module):
    """A mixture-of-experts router: F.linear on its weight, then softmax and top-k; returns a tuple."""

    def __init__(self, d=6, experts=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d) / d**0.5)

    def forward(self, x):
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        top, index = torch.topk(logits.softmax(dim=-1), 2, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


class CastingLinear(nn.Linear):
    """nanochat's Linear: the weight cast to the input's dtype in forward, through a view of it."""

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype).t().T)


@pytest.mark.parametrize(
    "make",
    [lambda: ScaledEmbedding(10, 6), Router, lambda: CastingLinear(6, 5, bias=False)],
    ids=["ScaledEmbedding", "Router", "CastingLinear"],
)
def test_a_module_keeping_its_own_forward_is_exact(make):
    """A subclass whose forward scales its output, a router returning a tuple, a Linear casting its weight: each
    keeps its forward (and class, and buffers), and its parameter's uses through F.linear / F.embedding are
    recorded exactly, with flattened rows (the router's (B*T, D)) mapped to the forward's examples."""
    torch.manual_seed(0)
    module = make().double()
    model = nn.Sequential(module)
    x = torch.randint(0, 10, (5, 4)) if isinstance(module, nn.Embedding) else torch.randn(5, 4, 6, dtype=torch.float64)

    def output(inputs):  # the router's logits, rows (B*T) back to (B, T, E); any other module's output
        out = model(inputs)
        return out[0].view(inputs.shape[0], 4, -1) if isinstance(out, tuple) else out

    before = model(x)
    monitor = lc.convert(model)
    assert not monitor.unconverted and model[0] is module and isinstance(module, type(make()))
    for want, got in zip(*(out if isinstance(out, tuple) else (out,) for out in (before, model(x)))):
        assert torch.equal(got, want)
    g = torch.randn_like(output(x))
    for part in (slice(0, 2), slice(2, 5)):
        output(x[part]).backward(g[part])
    total, count = module.weight_pe_sqnorm.tolist()
    zero_pe_sqnorm_buffers(model)
    loop = 0.0
    for i in range(5):
        model.zero_grad()
        output(x[i : i + 1]).backward(g[i : i + 1])
        loop += module.weight.grad.pow(2).sum().item()
    assert count == 5 and total == pytest.approx(loop, rel=1e-6)


def test_the_probe_tells_apart_eps_and_layernorm_from_rmsnorm():
    found, reason = swapcheck.find_replacement(HiddenEpsRMSNorm(6), ["LayerNorm", "RMSNorm"])
    assert found is None and reason.startswith("computes none of LayerNorm, RMSNorm on a probe input"), reason
    model = nn.Sequential(StoredWrongEps(6), NanoGPTLayerNorm(6, bias=False))
    monitor = lc.convert(model)
    assert model[0].eps == 1e-5 and isinstance(model[1], lc.get_layer_class("LayerNorm", "gns"))
    assert not monitor.unconverted


def test_torch_subclasses_are_probed_as_their_base_kind():
    model = nn.Sequential(DefaultEpsRMSNorm(6), SameLayerNorm(6, bias=False))
    x = torch.randn(2, 3, 6)
    before = model(x)
    monitor = lc.convert(model)
    assert not monitor.unconverted and model[0].eps is None and model[1].bias is None
    assert isinstance(model[0], lc.get_layer_class("RMSNorm", "gns"))
    torch.testing.assert_close(model(x), before)


def test_treat_as_names_a_kind_and_its_options():
    model = nn.Sequential(HiddenEpsRMSNorm(6), NanoGPTLayerNorm(6, bias=False))
    with pytest.warns(UserWarning, match="1 module\\(s\\) not converted"):
        monitor = lc.convert(
            model, treat_as={HiddenEpsRMSNorm: ("RMSNorm", {"eps": 3e-7}), NanoGPTLayerNorm: "RMSNorm"}
        )  # wrongly named
    assert isinstance(model[0], lc.get_layer_class("RMSNorm", "gns")) and model[0].eps == 3e-7
    assert type(model[1]) is NanoGPTLayerNorm
    assert "computes none of RMSNorm on a probe input" in monitor.unconverted["1"]
    for bad, match in [
        ({HiddenEpsRMSNorm: "Norm"}, "unknown kind 'Norm'"),
        ({nn.Linear: "Linear"}, "by its class"),
        ({HiddenEpsRMSNorm: ("RMSNorm", {"bias": True})}, "takes options"),
        ({"HiddenEpsRMSNorm": "RMSNorm"}, "nn.Module classes"),
        ({HiddenEpsRMSNorm: ("RMSNorm", 1e-7)}, "a kind or \\(kind, "),
    ]:
        with pytest.raises(ValueError, match=match):
            lc.convert(nn.Sequential(HiddenEpsRMSNorm(6)), treat_as=bad)


class ScaleRMSNorm(nn.Module):
    """An RMSNorm whose gain is a parameter named `scale` (as in Flax-style or hand-written models)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


@pytest.mark.parametrize(
    "treat_as",
    [None, {ScaleRMSNorm: "RMSNorm"}, {ScaleRMSNorm: ("RMSNorm", {"weight": "scale"})}],
    ids=["probed", "kind", "kind-and-parameter"],
)
@pytest.mark.parametrize("lnclass", ["gns", "shim"])
def test_a_norm_whose_parameter_is_named_scale_is_converted_and_exact(treat_as, lnclass):
    """Matched by what it computes (its only parameter is its gain), or named; its `scale` logged under its own name
    and equal to the loop over examples, in two micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), ScaleRMSNorm(8), nn.Linear(8, 5)).double()
    with torch.no_grad():
        model[1].scale.add_(0.3 * torch.randn(8, dtype=torch.float64))
    scale = model[1].scale
    x, g = torch.randn(5, 3, 6, dtype=torch.float64), torch.randn(5, 3, 5, dtype=torch.float64)
    before = model(x)
    tracker = lc.convert(model, lnclass=lnclass, treat_as=treat_as)
    assert not tracker.unconverted and not tracker.untracked
    assert isinstance(model[1], lc.get_layer_class("RMSNorm", lnclass)) and isinstance(model[1], ScaleRMSNorm)
    assert model[1].scale is scale and list(dict(model[1].named_parameters())) == ["scale"] and model[1].eps == 1e-6
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    for part in (slice(0, 2), slice(2, 5)):
        model(x[part]).backward(g[part])
    recorded = {n: model.get_buffer(n + "_pe_sqnorm").tolist() for n, _, _ in tracker.tracked}
    assert "1.scale" in recorded
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x, g)
    assert set(recorded) == set(loop)
    for name, (total, count) in recorded.items():
        assert count == 5 and total == pytest.approx(loop[name].sum().item(), rel=1e-6), name  # float32 buffers


class NormWithBuffer(HandRMSNorm):
    def __init__(self, d):
        super().__init__(d)
        self.register_buffer("scale", torch.ones(d))


def test_a_converted_module_keeps_its_buffers_and_class():
    """Conversion is in place: a buffer the module's forward does not read stays, and so does its class."""
    model = nn.Sequential(NormWithBuffer(6))
    monitor = lc.convert(model)
    assert not monitor.unconverted and isinstance(model[0], NormWithBuffer)
    assert torch.equal(model[0].scale, torch.ones(6)) and "scale" in dict(model[0].named_buffers())


def test_a_module_on_the_meta_device_is_probed_on_the_cpu():
    with torch.device("meta"):
        model = nn.Sequential(HandRMSNorm(6, offset=1.0), InOutLinear(6, 3))
    monitor = lc.convert(model)
    assert not monitor.unconverted and model[0].weight.is_meta and model[0].weight_pe_sqnorm.is_meta
    assert model[0].weight_offset == 1.0 and isinstance(model[1], lc.get_layer_class("Conv1D", "gns"))


def test_nn_for_a_kind_leaves_its_lookalikes_alone_unlisted():
    model = nn.Sequential(HandRMSNorm(6), nn.LayerNorm(6))
    monitor = lc.convert(model, lnclass="nn")
    assert (
        type(model[0]) is HandRMSNorm
        and not monitor.unconverted
        and set(monitor.untracked) == {"0.weight", "1.weight", "1.bias"}
    )


class Float32OnlyRMSNorm(HandRMSNorm):
    """A forward that refuses float64 (as a custom kernel might): probed in its own dtype only."""

    def forward(self, x):
        if x.dtype == torch.float64:
            raise TypeError("float64 is not supported")
        return super().forward(x)


def test_a_module_that_refuses_float64_is_probed_in_its_own_dtype():
    model = nn.Sequential(Float32OnlyRMSNorm(6, tiny=1e-5))
    monitor = lc.convert(model)
    assert not monitor.unconverted and model[0].eps == 1e-5 and model[0].weight_offset == 0
    model = nn.Sequential(nn.Linear(6, 6), Float32OnlyRMSNorm(6, tiny=1e-5).double())
    monitor = lc.convert(model)  # in float64 no probe runs its forward: it is replayed per example instead
    assert not monitor.unconverted and isinstance(model[1], ReplayedForward)


def test_convert_keeps_every_training_mode():
    gate = Gate()
    model = nn.Sequential(nn.Linear(6, 6), gate).eval()
    gate.train()
    gate.drop.eval()
    lc.convert(model)
    assert not model.training and not model[0].training and gate.training and not gate.drop.training


def test_excluded_modules_are_left_alone_and_listed():
    model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 3)), nn.Linear(3, 2))
    with pytest.warns(UserWarning, match="2 module\\(s\\) not converted"):
        monitor = lc.convert(model, exclude=["1", "2"])
    assert type(model[1][0]) is nn.LayerNorm and type(model[1][1]) is nn.Linear and type(model[2]) is nn.Linear
    assert isinstance(model[0], PerExampleLinear)
    assert monitor.unconverted == {
        "1": "Sequential excluded by the caller (convert(exclude=...))",
        "2": "Linear excluded by the caller (convert(exclude=...))",
    }
    assert [t.name for t in monitor.tracked] == ["0.weight", "0.bias"]
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
    monitor = lc.convert(model, exclude=[nn.LayerNorm])
    assert type(model[1]) is nn.LayerNorm and "1" in monitor.unconverted
