"""
The monitor's mixing check (nanogns/monitor/mixing.py): an op without parameters in a model's own code that mixes
the examples of the batch (attention whose heads' projections are tiled over the batch folded into one sequence, in
training mode) is refused as a BatchNorm is, naming the module and the layers around the op; the same model in eval
mode is measured exactly (tests/oracle.py); the check runs once per training mode and leaves the step's numbers, the
random number generators and the buffers as they were; exact models are not refused.

    python -m pytest -q tests/test_monitor_mixing.py
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward
from test_verify import MixingLM, TinyLM, lm_losses

import nanogns
from nanogns.core.buffers import zero_pe_sqnorm_buffers


def counting_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(module.training))
    return calls


def test_an_op_mixing_the_examples_in_training_mode_is_refused_naming_where():
    torch.manual_seed(0)
    model = MixingLM().double()
    monitor = nanogns.convert(model)
    calls = counting_forwards(model)
    ids = torch.randint(0, 20, (4, 4))  # B == T on purpose
    lm_losses(model, ids).mean().backward()
    with pytest.raises(ValueError) as refused:
        monitor.step(batch_size=4)
    assert str(refused.value).startswith(
        "GNS: this step is not measured: an op in attn (FoldedAttention) mixes the examples of the batch: the outputs "
        "of example 3 depend on the inputs of example"
    )
    assert "in its forward, after attn.qkv, before attn.proj" in str(refused.value)
    assert calls == [True, True]  # the step's forward, and the check's once
    model.eval()  # each example computed alone: checked once more (another mode), and measured exactly
    model.zero_grad()
    losses = lm_losses(model, ids)
    losses.mean().backward(retain_graph=True)
    monitor.step(batch_size=4)
    zero_pe_sqnorm_buffers(model)
    pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses)
    assert len(monitor.measurements) == 9
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(pe_sq[m.metadata["name"]]), rel=1e-5), m
    model.train()
    model.zero_grad()
    zero_pe_sqnorm_buffers(model)
    lm_losses(model, ids).mean().backward()
    with pytest.raises(ValueError, match="an op in attn"):
        monitor.step(batch_size=4)  # refused again, without a check of its own
    assert calls == [True, True, False, False, True]


class Noisy(nn.Module):
    """Dropout (the random number generators) and a BatchNorm in eval mode (running statistics it must not change)."""

    def __init__(self):
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(11, 6), nn.Dropout(0.2), nn.Linear(6, 11)
        self.bn = nn.BatchNorm1d(6).eval()

    def forward(self, ids):
        h = self.drop(self.emb(ids))
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))


def test_the_check_leaves_the_steps_numbers_and_the_model_as_they_were():
    torch.manual_seed(0)
    model, twin = Noisy(), Noisy()
    twin.load_state_dict(model.state_dict())
    twin.bn.eval()
    checked, unchecked = nanogns.convert(model), nanogns.convert(twin, check_mixing=False)
    ids = torch.randint(0, 11, (3, 5))
    rows, states = [], []
    for m, monitor in ((model, checked), (twin, unchecked)):
        torch.manual_seed(1)
        lm_losses(m, ids).mean().backward()
        rows.append(monitor.step(batch_size=3))
        states.append((torch.get_rng_state(), m.bn.running_mean.clone(), m.bn.num_batches_tracked.clone()))
    assert rows[0] == rows[1]
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])
    assert checked.mixing.found == {True: None} and unchecked.mixing is None


@pytest.mark.parametrize("packed", [False, True])
def test_a_library_models_attention_across_packed_sequences_is_refused_and_its_batch_is_not(packed):
    """transformers' Llama (eager or sdpa attention) given sequences packed in one row with position_ids restarting
    at 0, and no mask between them, lets each sequence attend to the ones before it: the sequences are no examples of
    their own (nanogns.verify: differs), and the check refuses the step naming the attention; a batch is exact."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16, intermediate_size=32,
        vocab_size=30,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    monitor = nanogns.convert(model)
    if packed:  # three sequences packed in one row
        ids, positions, B = torch.randint(0, 30, (1, 12)), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]), 3
        logits = model(ids, position_ids=positions).logits
    else:
        ids, B = torch.randint(0, 30, (4, 6)), 4
        logits = model(ids).logits
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    if packed:
        with pytest.raises(
            ValueError, match=r"an op in model.layers.0.self_attn \(LlamaAttention\) mixes the examples"
        ):
            monitor.step(batch_size=B)
    else:
        row = monitor.step(batch_size=B)
        assert monitor.mixing.found == {True: None} and math.isfinite(row["train/gns/lm_head.weight/pegn"])


def test_an_exact_model_is_checked_once_per_training_mode():
    torch.manual_seed(0)
    model = TinyLM()
    monitor = nanogns.convert(model)
    calls = counting_forwards(model)
    ids = torch.randint(0, 20, (3, 4))
    for _ in range(3):
        lm_losses(model, ids).mean().backward()
        monitor.step(batch_size=3)
        model.zero_grad()
    assert calls == [True, True, True, True]  # three steps, one check


class TypedLM(nn.Module):
    """A BERT-like model: token types read from a registered buffer of zeros (token_type_ids), expanded per batch."""

    def __init__(self, vocab=20, width=8):
        super().__init__()
        self.tokens, self.types = nn.Embedding(vocab, width), nn.Embedding(2, width)
        self.register_buffer("token_type_ids", torch.zeros(1, 16, dtype=torch.long), persistent=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        types = self.token_type_ids[:, : ids.shape[1]].expand_as(ids)
        return self.head(self.tokens(ids) + self.types(types))


def test_the_check_leaves_a_buffer_saved_for_the_step_s_backward_unwritten():
    """The check puts back only the buffers its forward changed: writing an unchanged one (token_type_ids, saved by
    an Embedding for a backward still to run) bumped its version and made that backward fail (the sweep's ALBERT)."""
    torch.manual_seed(0)
    model = TypedLM().double()
    monitor = nanogns.convert(model)
    ids = torch.randint(0, 20, (5, 5))  # B == T on purpose
    version = model.token_type_ids._version
    losses = F.cross_entropy(model(ids).transpose(1, 2), ids, reduction="none").mean(1)
    losses.mean().backward(retain_graph=True)
    monitor.step(batch_size=5)
    assert model.token_type_ids._version == version
    zero_pe_sqnorm_buffers(model)
    pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses)  # the same graph's backward again
    assert len(monitor.measurements) == 4  # every parameter measured, the shared types table too
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(pe_sq[m.metadata["name"]]), rel=1e-5), m


class BatchMeanLM(nn.Module):
    """Subtracts the batch's mean between two Linears: example j's outputs depend on every example's inputs."""

    def __init__(self):
        super().__init__()
        self.emb, self.inner, self.head = nn.Embedding(20, 6), nn.Linear(6, 6), nn.Linear(6, 20)

    def forward(self, ids):
        h = self.inner(self.emb(ids))
        return self.head(h - h.mean(dim=0, keepdim=True))


def accumulate(model, shapes):
    """One step's gradients, from micro-batches of random ids of `shapes`, each loss a share of the step's mean."""
    model.zero_grad()
    examples = sum(shape[0] for shape in shapes)
    for shape in shapes:
        lm_losses(model, torch.randint(0, 20, shape)).sum().div(examples).backward()


def test_a_step_whose_first_micro_batch_holds_one_example_is_checked_on_a_later_one():
    """Micro-batches of 1 and 3 examples at every step: a forward of one example tells nothing, so the check takes
    the step's next forward (before, every step's first forward had one example and the mixing went unseen)."""
    torch.manual_seed(0)
    model = BatchMeanLM().double()
    monitor = nanogns.convert(model)
    calls = counting_forwards(model)
    for step in range(2):
        accumulate(model, [(1, 3), (3, 3)])  # B == T on purpose
        with pytest.raises(
            ValueError,
            match=r"BatchMeanLM\) mixes the examples of the batch: the outputs of example 0 depend on the inputs of example 1",
        ):
            monitor.step(batch_size=4)
        zero_pe_sqnorm_buffers(model)
    assert calls == [True, True, True, True, True]  # the check's forward once, at the first step


class Similarities(nn.Module):
    """CLIP's head, cut down: each example's text and image embedded, and every text scored against every image."""

    def __init__(self):
        super().__init__()
        self.text, self.image = nn.Linear(5, 4), nn.Linear(6, 4)

    def forward(self, texts, images):
        per_text = self.text(texts) @ self.image(images).T  # (N, N): example j's row holds every image
        return per_text, per_text.T  # (and every text, the row of its image)


@pytest.mark.parametrize("loss", ["own pair", "contrastive"])
def test_the_check_follows_the_gradient_the_loss_gives_the_outputs(loss):
    """Outputs holding every example's image (and text) in each example's row mix them only for a loss that reads
    the rows: scored on the diagonal (each text with its own image) the step is exact; with a softmax over the row (a
    contrastive loss) it is refused. Micro-batches of 1 and 3: the check runs on the 3."""
    torch.manual_seed(0)
    model = Similarities().double()
    texts, images = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def losses_of(part):
        per_text, per_image = model(texts[part], images[part])
        if loss == "own pair":
            return -per_text.diagonal()
        return -(per_text.log_softmax(1).diagonal() + per_image.log_softmax(1).diagonal()) / 2

    monitor = nanogns.convert(model)
    for part in (slice(0, 1), slice(1, 4)):
        losses_of(part).sum().div(4).backward()
    if loss == "contrastive":
        with pytest.raises(ValueError, match=r"Similarities\) mixes the examples of the batch"):
            monitor.step(batch_size=4)
        return
    monitor.step(batch_size=4)
    zero_pe_sqnorm_buffers(model)
    total = {}  # the oracle: each example's loss from its micro-batch's forward
    for part in (slice(0, 1), slice(1, 4)):
        pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses_of(part))
        for name, value in pe_sq.items():  # (a mean over the part's examples)
            total[name] = total.get(name, 0.0) + value * (part.stop - part.start)
    assert {m.metadata["name"] for m in monitor.measurements} == set(total)
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(total[m.metadata["name"]] / 4), rel=1e-6), m


def test_steps_of_one_example_per_forward_run_no_check_forward():
    """A forward of one example cannot mix examples: steps whose every micro-batch holds one run no forward of the
    check (before, each such step ran one more forward); the first step with a forward of two runs it, once."""
    torch.manual_seed(0)
    model = BatchMeanLM().double()
    monitor = nanogns.convert(model)
    calls = counting_forwards(model)
    for _ in range(3):
        accumulate(model, [(1, 3), (1, 3)])
        monitor.step(batch_size=2)
    assert calls == [True] * 6  # the steps' forwards only
    accumulate(model, [(2, 2)])  # B == T on purpose
    with pytest.raises(ValueError, match=r"BatchMeanLM\) mixes the examples of the batch"):
        monitor.step(batch_size=2)
    assert calls == [True] * 8  # the step's forward, and the check's
