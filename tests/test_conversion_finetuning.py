"""
Fine-tuning and unusual parameter layouts, against a brute-force loop over examples:
frozen parameters (BitFit, LoRA) are never measurements, a parameter with no
gradient is an error, a parameter bank (disjoint slices of one Parameter used by
several layers, modded-nanogpt style) is logged once and exactly, and an embedding
whose one row of input is broadcast over the batch is refused with the fix.

    python -m pytest -q tests/test_conversion_finetuning.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward

import nanogns as lc
from nanogns import monitor as gnstracking
from nanogns.core.buffers import PerExampleNormLayer, zero_pe_sqnorm_buffers
from nanogns.kinds import functional
from nanogns.kinds.embedding import PerExampleEmbedding

VOCAB, D = 11, 6


def lm_losses(model, ids, targets):
    """Each example's mean token loss."""
    logits = model(ids)
    return (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        .view(ids.shape[0], -1)
        .mean(dim=1)
    )


def lm_loss(model, ids, targets):
    return lm_losses(model, ids, targets).mean()


def data(B, T=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, B, T), generator=gen).unbind(0)


def measure(monitor, model, ids, targets, micro_batches=2):
    """Forward/backward over `micro_batches` parts of the batch (gradient accumulation), then one monitor step."""
    B = ids.shape[0]
    model.zero_grad(set_to_none=True)  # a step's gradient starts from none
    for part in torch.arange(B).chunk(micro_batches):
        (lm_loss(model, ids[part], targets[part]) * len(part) / B).backward()
    measurements = {m.metadata["name"]: m for m in monitor.measure(batch_size=B)}
    zero_pe_sqnorm_buffers(model)
    return measurements


def assert_matches_brute_force(model, measurements, ids, targets, rel=1e-6):  # buffers are float32
    pe_sq, batch_sq = loss_sqnorms_from_batched_forward(model, lm_losses(model, ids, targets))
    zero_pe_sqnorm_buffers(model)
    for name, m in measurements.items():
        first = name.split("+")[0]
        assert m.rms_pe_norm**2 == pytest.approx(pe_sq[first], rel=rel), name
        assert m.norm**2 == pytest.approx(batch_sq[first], rel=rel), name


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update B A (LoRA)."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(self.ln(h)))


@pytest.mark.parametrize("classes", [("gns", "gns", "gns"), ("shim", "shim", "shim")], ids="-".join)
def test_bitfit_frozen_weights_are_skipped_and_biases_exact(classes):
    torch.manual_seed(0)
    model = TinyLM().double()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))  # BitFit: only the biases train
    monitor = lc.convert(model, *classes)
    assert [t.name for t in monitor.tracked] == ["ln.bias", "mlp.0.bias", "mlp.2.bias", "head.bias"]
    assert all(
        monitor.untracked[n].startswith("frozen") for n in ("emb.weight", "ln.weight", "mlp.0.weight", "head.weight")
    )
    ids, targets = data(5)
    measurements = measure(monitor, model, ids, targets)
    assert set(measurements) == {"ln.bias", "mlp.0.bias", "mlp.2.bias", "head.bias"}
    assert_matches_brute_force(model, measurements, ids, targets)
    lm_loss(model, ids, targets).backward()
    assert model.head.weight_pe_sqnorm.sum() == 0 and model.emb.weight_pe_sqnorm.sum() == 0  # nothing recorded


@pytest.mark.parametrize("linearclass", ["gns", "shim"])
def test_lora_trainable_tensors_are_exact(linearclass):
    torch.manual_seed(0)
    model = TinyLM()
    model.requires_grad_(False)
    model.mlp[0], model.mlp[2] = LoRALinear(model.mlp[0]), LoRALinear(model.mlp[2])  # LoRA layers: trainable
    model.double()
    monitor = lc.convert(model, linearclass=linearclass)
    assert [t.name for t in monitor.tracked] == [
        "mlp.0.lora_a.weight",
        "mlp.0.lora_b.weight",
        "mlp.2.lora_a.weight",
        "mlp.2.lora_b.weight",
    ]
    assert monitor.untracked["mlp.0.base.weight"].startswith("frozen") and monitor.unconverted == {}
    ids, targets = data(4)
    measurements = measure(monitor, model, ids, targets)
    assert len(measurements) == 4
    assert_matches_brute_force(model, measurements, ids, targets)


def test_a_counted_parameter_without_gradient_is_an_error_not_a_zero():
    torch.manual_seed(0)
    model = TinyLM()
    monitor = lc.convert(model)
    ids, targets = data(4)
    lm_loss(model, ids, targets).backward()
    model.zero_grad(set_to_none=True)  # too early: the gradients are gone before the monitor reads them
    with pytest.raises(
        ValueError, match="emb.weight: its layer recorded 4 examples in this step but the parameter has no gradient"
    ):
        monitor.measure(batch_size=4)


class BankGPT(PerExampleNormLayer, nn.Module):
    """modded-nanogpt style: the MLP matrices of every block live in one Parameter, sliced per layer."""

    def __init__(self, n_layer=3, reuse_slice=False):
        super().__init__()
        self.n_layer, self.reuse_slice = n_layer, reuse_slice
        self.emb = nn.Embedding(VOCAB, D)
        self.mlp_bank = nn.Parameter(torch.randn(n_layer, 2, 2 * D, D) / D**0.5)  # [i, 0]: fc, [i, 1]: proj^T
        functional.register_buffers(self, "mlp_bank", kind="Linear", bank_dims=2)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for i in range(self.n_layer):
            j = 0 if self.reuse_slice else i
            h = F.relu(functional.linear(x, self.mlp_bank[j, 0], weight_buffer=self.mlp_bank_pe_sqnorm[j, 0]))
            x = x + functional.linear(h, self.mlp_bank[j, 1].t(), weight_buffer=self.mlp_bank_pe_sqnorm[j, 1])
        return self.head(F.rms_norm(x, (D,)))


def test_a_bank_of_slices_is_logged_once_and_exactly():
    torch.manual_seed(0)
    model = BankGPT().double()
    monitor = lc.convert(model)
    assert [t.name for t in monitor.tracked] == ["mlp_bank", "emb.weight", "head.weight"]
    record = monitor.describe()["mlp_bank"]
    assert record["kind"] == "Linear" and record["bank_slices"] == 6 and record["block"] is None
    ids, targets = data(5)
    measurements = measure(monitor, model, ids, targets)
    assert measurements["mlp_bank"].batch_size == 5
    assert_matches_brute_force(model, measurements, ids, targets)
    # batch of 1 (the GNS itself is undefined there, the norms are not)
    measurements = measure(monitor, model, ids[:1], targets[:1], micro_batches=1)
    assert_matches_brute_force(model, measurements, ids[:1], targets[:1])


def test_a_bank_slice_used_three_times_per_forward_is_summed_exactly():
    """One slice of the bank used by every block: its uses' gradients are summed (core/uses.py), as the other
    slices' norms are added."""
    torch.manual_seed(0)
    model = BankGPT(reuse_slice=True).double()
    monitor = lc.convert(model)
    ids, targets = data(4)
    measurements = measure(monitor, model, ids, targets)
    assert "mlp_bank" in measurements and not monitor.untracked
    assert_matches_brute_force(model, measurements, ids, targets)


def test_bank_registration_errors():
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="bank_dims=2 for w of shape \\(2, 3\\)"):
        functional.register_buffers(module, "w", bank_dims=2)
    with pytest.raises(ValueError, match="unknown layer kind 'Conv3d'; choose from"):
        functional.register_buffers(module, "w", kind="Conv3d")


class BroadcastPositions(nn.Module):
    """Positions looked up once, as (1, T), and broadcast over the batch (Hugging Face GPT-2's default)."""

    def __init__(self):
        super().__init__()
        self.wte = PerExampleEmbedding(VOCAB, D)
        self.wpe = PerExampleEmbedding(8, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, positions=None):
        T = ids.shape[1]
        positions = torch.arange(T).unsqueeze(0) if positions is None else positions
        return self.head(self.wte(ids) + self.wpe(positions))


def test_positions_looked_up_once_for_the_batch_are_exact_as_called():
    """Positions looked up as one (1, T) row for every example (transformers' default for GPT-2 and BERT): each
    example gets its own copy of the rows where they are added to its tokens (core/shared.py), and the same
    output; odd-sized micro-batches, float64, against the loop."""
    torch.manual_seed(0)
    model = BroadcastPositions().double()
    ids, targets = data(5)
    before = model(ids)
    monitor = gnstracking.GNSMonitor(model)
    assert torch.equal(model(ids), before)
    measurements = measure(monitor, model, ids, targets)
    assert set(measurements) == {"wte.weight", "wpe.weight"} and set(monitor.untracked) == {"head.weight", "head.bias"}
    assert_matches_brute_force(model, measurements, ids, targets)


def test_a_frozen_tied_matrix_costs_nothing_and_is_listed_frozen():
    """A tied wte/lm_head frozen for fine-tuning: no cross-term hooks (their backward is O(B T^2 D)), listed frozen."""
    from nanogns.core import tied

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, D)
            self.ln = nn.LayerNorm(D)
            self.head = nn.Linear(D, VOCAB, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids):
            return self.head(self.ln(self.wte(ids)))

    model = Tied()
    model.wte.weight.requires_grad_(False)
    monitor = lc.convert(model)
    assert tied.link_tied_parameters(model) == {} and not model.head._forward_hooks
    assert monitor.untracked["wte.weight"].startswith("frozen")
    ids, targets = data(3)
    measurements = measure(monitor, model, ids, targets, micro_batches=1)
    assert set(measurements) == {"ln.weight", "ln.bias"}
