"""
What issue 43's look at every architecture found, each against the oracle (tests/oracle.py: float64, each example's
gradient from the same batched forward, two uneven micro-batches) or as a refusal whose stated cause is checked:

- BLOOM exact again: a module reading a child's weight only in a branch its settings never take keeps its children
  converted (it is not replayed as one unit, whose ALiBi (batch x heads) rows a replay cannot slice);
- 0-d parameters (CLIP's logit_scale, a replayed module's scalar) and a sparse EmbeddingBag: a number or a listing,
  never a crash; every failure of a replay's bookkeeping a refusal naming it;
- the count refusal says what it observed (the counts, the forwards, their examples) and remedies that work: a
  reward model's chosen and rejected rows, text queries per image, sequences packed behind a block mask are exact
  once described; a vision tower's unequal images are refused for their real cause;
- an Embedding and a Linear tied, the Embedding recorded by the replay of a module above it, exact (Gemma 4);
- a router's (N*T, k) top-k weights with k equal to a micro-batch's N (Laguna, MiniMax-M2, HY-V3, PhiMoE), latents
  expanded to the batch size their forward is given (Perceiver), a replayed embedding of choices' ids (I-BERT):
  exact (each was refused); rows moved to dim 1 by the model's own transpose, mapped from the autograd history
  (Longformer, LED); ids written into a tensor of zeros (a decoder's shifted inputs) still the examples' ids
  (T5Gemma, MVP).

    python -m pytest -q tests/test_conversion_sweep_findings.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from oracle import loss_sqnorms_from_batched_forward
from test_conversion_third_wave import assert_exact, next_token_losses

import nanogns as lc
from nanogns.conversion import replay
from nanogns.conversion.intercept import InterceptedForward
from nanogns.core import layout, rowmaps
from nanogns.core.buffers import zero_pe_sqnorm_buffers

V = 40


def ids_batch(B, T, seed=1):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def step(model, monitor, loss_of, parts, n):
    """One step over `parts`; the per-example losses of each (their graphs kept for the oracle)."""
    losses = []
    for part in parts:
        loss = loss_of(part)
        (loss.sum() / n).backward(retain_graph=True)
        losses.append(loss)
    return losses


def assert_matches_oracle(model, monitor, losses, n, rel=1e-6):
    """Every measurement of the step whose losses are `losses` is the oracle's, and every parameter with a
    gradient is measured."""
    got = {m.metadata["name"]: m for m in monitor.measure(batch_size=n)}
    with_gradient = {name for name, p in model.named_parameters() if p.grad is not None}
    per_example, batch = loss_sqnorms_from_batched_forward(model, losses)
    zero_pe_sqnorm_buffers(model)
    assert {part for name in got for part in name.split("+")} >= with_gradient
    for name, m in got.items():
        first = name.split("+")[0]
        assert m.norm**2 == pytest.approx(batch[first], rel=rel, abs=1e-20), name
        assert m.rms_pe_norm**2 == pytest.approx(per_example[first], rel=rel, abs=1e-20), name
    return got


# -----------------------------------------------------------------------------
# what was found 1: a regression


def test_bloom_is_exact_again():
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=V, hidden_size=16, n_layer=2, n_head=2, pad_token_id=0)
    model = transformers.BloomForCausalLM(config).double()
    ids = ids_batch(3, 6)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, -2:] = 0
    monitor = lc.convert(model)
    attention = model.transformer.h[0].self_attention
    assert not isinstance(attention, replay.ReplayedForward)  # its Linears are converted each
    assert_exact(
        model,
        lambda part: next_token_losses(
            model(input_ids=ids[part], attention_mask=mask[part]).logits, ids[part], mask[part]
        ),
        3,
        monitor=monitor,
    )


class _SplitProjection(nn.Module):
    """Reads its child's weight itself only when `split` (as BLOOM's attention does under pretraining_tp > 1)."""

    def __init__(self, split):
        super().__init__()
        self.split = split
        self.dense = nn.Linear(4, 4)

    def forward(self, x):
        if self.split > 1 and self.dense.in_features > 2:
            return F.linear(x, self.dense.weight) + self.dense.bias
        return self.dense(x)


@pytest.mark.parametrize("split", [1, 2])
def test_a_child_s_weight_read_in_a_branch_never_taken_keeps_the_child_converted(split):
    model = nn.Sequential(_SplitProjection(split), nn.Linear(4, 2)).double()
    lc.convert(model)
    assert isinstance(model[0], replay.ReplayedForward) == (split > 1)
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 3)


# -----------------------------------------------------------------------------
# what was found 2: crashes on 0-d parameters and sparse bags


def tiny_clip():
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        ),
        projection_dim=8,
    )
    return transformers.CLIPModel(config).double()


def test_clip_text_and_vision_with_its_0d_logit_scale_exact():
    model = tiny_clip()
    ids = ids_batch(3, 5)
    pixels = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def loss_of(part):  # each example's own text and image pair
        return -F.logsigmoid(model(input_ids=ids[part], pixel_values=pixels[part]).logits_per_text.diagonal())

    monitor = assert_exact(model, loss_of, 3)
    assert "logit_scale" in {m.metadata["name"] for m in monitor.measurements}


class _ScaledProjection(nn.Module):
    """Reads its child's weight itself in an op its kept forward cannot follow (tensordot: so it is replayed per
    example as one unit, conversion/probe.py:read_children_problem) and scales by a 0-d parameter."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.alpha = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return torch.tanh(torch.tensordot(x, self.proj.weight.t(), dims=1) * self.alpha)


def test_a_0d_parameter_of_a_replayed_module_exact():
    model = nn.Sequential(_ScaledProjection(), nn.Linear(4, 2)).double()
    lc.convert(model)
    assert isinstance(model[0], replay.ReplayedForward)
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    monitor = assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 3)
    assert "0.alpha" in {m.metadata["name"] for m in monitor.measurements}


class _Bag(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean", sparse=sparse)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.bag(ids))


def test_a_sparse_embedding_bag_is_listed_unconverted_and_the_rest_exact():
    model = _Bag(sparse=True).double()
    monitor = lc.convert(model)
    assert "sparse" in monitor.unconverted["bag"]
    assert "bag.weight" in monitor.untracked
    ids = torch.randint(0, 20, (3, 4), generator=torch.Generator().manual_seed(0))
    losses = step(model, monitor, lambda part: model(ids[part]).pow(2).sum(1), [slice(0, 1), slice(1, 3)], 3)
    got = {m.metadata["name"]: m for m in monitor.measure(batch_size=3)}
    assert set(got) == {"head.weight", "head.bias"}
    per_example, _ = loss_sqnorms_from_batched_forward(model, losses)
    for name, m in got.items():
        assert m.rms_pe_norm**2 == pytest.approx(per_example[name], rel=1e-6)


def test_a_dense_embedding_bag_of_whole_rows_exact():
    model = _Bag(sparse=False).double()
    ids = torch.randint(0, 20, (3, 4), generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(ids[part]).pow(2).sum(1), 3)


def test_a_failure_of_a_replay_s_bookkeeping_refuses_the_step_naming_it(monkeypatch):
    model = nn.Sequential(_ScaledProjection(), nn.Linear(4, 2)).double()
    monitor = lc.convert(model)

    def broken(self, per_item):
        raise RuntimeError("bookkeeping broke")

    monkeypatch.setattr(rowmaps.Items, "to_examples", broken)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    step(model, monitor, lambda part: model(x[part]).pow(2).mean((1, 2)), [slice(0, 1), slice(1, 3)], 3)
    with pytest.raises(
        ValueError,
        match=r"nanogns failed while summing each example.s units of the per-example gradients of _ScaledProjection.*bookkeeping broke",
    ):
        monitor.measure(batch_size=3)


# -----------------------------------------------------------------------------
# what was found 3: the count refusal says what it observed, and its remedies work


def tiny_gpt2_reward_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, num_labels=1, pad_token_id=0
    )
    return transformers.GPT2ForSequenceClassification(config).double()


def pairs_loss(model, ids):
    """Each example's pairwise loss: its chosen row 2i and rejected row 2i + 1, interleaved in one forward."""

    def loss_of(part):
        reward = model(input_ids=ids[2 * part.start : 2 * part.stop]).logits[:, 0]
        return -F.logsigmoid(reward[0::2] - reward[1::2])

    return loss_of


def assert_observed_not_guessed(message):
    for guess in ("ran more than once", "DPO", "cannot measure", "has no per-example gradient"):
        assert guess not in message
    assert "Observed this step" in message and "forwards of the converted model" in message


def test_interleaved_chosen_and_rejected_rows_are_refused_naming_the_counts_then_exact_as_pairs():
    B, T = 3, 6
    ids = ids_batch(2 * B, T)
    model = tiny_gpt2_reward_model()
    monitor = lc.convert(model)
    step(model, monitor, pairs_loss(model, ids), [slice(0, 1), slice(1, B)], B)
    with pytest.raises(ValueError) as refused:
        monitor.measure(batch_size=B)
    message = str(refused.value)
    assert_observed_not_guessed(message)
    assert "counted 6 examples but step(batch_size=3)" in message
    assert "2 forwards of the converted model with gradients" in message
    assert "2 ((2, 6) token grid), 4 ((4, 6) token grid) examples" in message
    assert "layout_of=nanogns.core.layout.grouped(2)" in message

    model = tiny_gpt2_reward_model()  # the remedy the refusal gives
    layout.install(model, layout_of=layout.grouped(2))
    monitor = lc.convert(model)
    losses = step(model, monitor, pairs_loss(model, ids), [slice(0, 1), slice(1, B)], B)
    assert_matches_oracle(model, monitor, losses, B)


def test_text_queries_per_image_are_refused_naming_the_counts_then_exact_grouped():
    B, Q = 3, 2
    ids = ids_batch(B * Q, 5)
    pixels = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def queries_loss(model):
        def loss_of(part):  # each image's score for its own first query against its second
            out = model(input_ids=ids[Q * part.start : Q * part.stop], pixel_values=pixels[part])
            own = torch.stack([out.logits_per_image[i, Q * i : Q * (i + 1)] for i in range(part.stop - part.start)])
            return -F.log_softmax(own, -1)[:, 0]

        return loss_of

    model = tiny_clip()
    monitor = lc.convert(model)
    step(model, monitor, queries_loss(model), [slice(0, 1), slice(1, B)], B)
    with pytest.raises(ValueError) as refused:
        monitor.measure(batch_size=B)
    assert_observed_not_guessed(str(refused.value))
    assert "grouped(2)" in str(refused.value)

    model = tiny_clip()
    layout.install(model, layout_of=layout.grouped(Q))
    monitor = lc.convert(model)
    losses = step(model, monitor, queries_loss(model), [slice(0, 1), slice(1, B)], B)
    assert_matches_oracle(model, monitor, losses, B)


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation("eager")
    return model


LENGTHS = (4, 3, 5)


def packed_loss(model, seqs, positions):
    """Each sequence's mean next-token loss, the micro-batch's sequences packed in one row behind a block-diagonal
    4-D mask; positions 'continue' (0..R-1) or 'restart' at each sequence."""

    def loss_of(part):
        chosen = range(part.start, part.stop)
        ids = torch.cat([seqs[i] for i in chosen])[None]
        segment = torch.cat([torch.full((LENGTHS[i],), j) for j, i in enumerate(chosen)])
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment)).bool().tril()
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
        if positions == "restart":
            position_ids = torch.cat([torch.arange(LENGTHS[i]) for i in chosen])[None]
        else:
            position_ids = torch.arange(len(segment))[None]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[0]
        token = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        inside = segment[:-1] == segment[1:]
        return torch.stack([token[inside & (segment[:-1] == j)].mean() for j in range(len(chosen))])

    return loss_of


def test_sequences_packed_behind_a_block_mask_are_refused_naming_the_counts_then_exact_described():
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, V, (n,), generator=gen) for n in LENGTHS]
    parts = [slice(0, 1), slice(1, 3)]
    model = tiny_llama()
    monitor = lc.convert(model)
    step(model, monitor, packed_loss(model, seqs, "continue"), parts, 3)
    with pytest.raises(ValueError) as refused:
        monitor.measure(batch_size=3)
    message = str(refused.value)
    assert_observed_not_guessed(message)
    assert "counted 2 examples but step(batch_size=3)" in message
    assert "position_ids restarting at 0" in message and "layout.ragged(" in message

    model = tiny_llama()  # remedy 1: positions restarting at each sequence
    monitor = lc.convert(model)
    losses = step(model, monitor, packed_loss(model, seqs, "restart"), parts, 3)
    assert_matches_oracle(model, monitor, losses, 3, rel=1e-4)

    model = tiny_llama()  # remedy 2: the positions kept, the packing described by a layout_of
    segments = {}

    def layout_of(args, kwargs):
        R = kwargs["input_ids"].shape[1]
        example_of_row = segments[R]
        count = int(example_of_row.max()) + 1
        return layout.Layout(count, (R,), packed=layout.ragged(example_of_row, count))

    for part in parts:
        chosen = range(part.start, part.stop)
        segments[sum(LENGTHS[i] for i in chosen)] = torch.cat(
            [torch.full((LENGTHS[i],), j) for j, i in enumerate(chosen)]
        )
    layout.install(model, layout_of=layout_of)
    monitor = lc.convert(model)
    losses = step(model, monitor, packed_loss(model, seqs, "continue"), parts, 3)
    assert_matches_oracle(model, monitor, losses, 3, rel=1e-4)


def test_a_vision_tower_s_unequal_images_are_refused_for_their_real_cause():
    """Pixtral's tower (Mistral 3) takes images of several sizes; each fills (its size / patch / merge)^2 tokens. The
    tower's images are mapped to examples by an equal share of the image tokens, which unequal images break."""
    torch.manual_seed(0)
    config = transformers.Mistral3Config(
        text_config=dict(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=4,
            head_dim=8,
        ),
        image_token_index=V - 1,
        spatial_merge_size=2,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).double()
    monitor = lc.convert(model)
    small, large = (16 // 4 // 2) ** 2, (32 // 4 // 2) ** 2  # 4 and 16 image tokens
    ids = torch.randint(1, V - 2, (2, 2 + large + 3), generator=torch.Generator().manual_seed(1))
    ids[0, 1 : 1 + small] = V - 1
    ids[1, 1 : 1 + large] = V - 1
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, pixel_values=pixels, image_sizes=torch.tensor([[16, 16], [32, 32]])).logits
    out.pow(2).mean().backward()
    with pytest.raises(ValueError) as refused:
        monitor.measure(batch_size=2)
    message = str(refused.value)
    assert "equal share of input_ids' 20 image tokens" in message
    assert "image 0's share would lie in examples [0, 1]" in message
    assert "fill unequal numbers of tokens" in message
    assert "lie in several examples" not in message and "expanded" not in message
    assert "exclude=" in message


# -----------------------------------------------------------------------------
# what the sweep found besides


def test_a_tied_pair_whose_embedding_a_replay_records_is_exact():
    """Gemma 4's text model reads its embedding's weight itself (to reverse embeddings given without ids), so it is
    replayed per example as one unit, its embedding included: the tied head's per-example gradient is summed with the
    replay's, as any shared tensor's (tied.py's cross term needs an Embedding layer's own forward)."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=V,
        pad_token_id=0,
    )
    model = transformers.Gemma4ForCausalLM(config).double()
    model.set_attn_implementation("eager")
    ids = ids_batch(3, 6)
    monitor = assert_exact(
        model, lambda part: next_token_losses(model(input_ids=ids[part]).logits, ids[part]), 3, rel=1e-4
    )
    assert "model.embed_tokens.weight+lm_head.weight" in {m.metadata["name"] for m in monitor.measurements}


# -----------------------------------------------------------------------------
# refused where an exact number exists (issue 43's "what was found" 4): refusals with their observations, never a
# crash, until the example dimension is followed through these layouts


class _PackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(20, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][-1])


class _OffsetsBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(20, 8, mode="sum"), nn.Linear(8, 2)

    def forward(self, flat, offsets):
        return self.head(self.bag(flat, offsets))


class _SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # batch_first=False: (T, B, D)

    def forward(self, ids):  # ids (T, B)
        return self.head(self.enc(self.emb(ids)))


def _packed_gru():
    model, gen = _PackedGRU().double(), torch.Generator().manual_seed(0)
    ids, lengths = torch.randint(0, 20, (3, 5), generator=gen), torch.tensor([5, 3, 4])
    return model, lambda part: model(ids[part], lengths[part]).pow(2).sum(1), "none of its inputs has the forward's"


def _offsets_bag():
    model, gen = _OffsetsBag().double(), torch.Generator().manual_seed(0)
    bags = [torch.randint(0, 20, (k,), generator=gen) for k in (3, 2, 4)]

    def loss_of(part):
        chosen = bags[part]
        offsets = torch.tensor([0] + [len(b) for b in chosen[:-1]]).cumsum(0)
        return model(torch.cat(chosen), offsets).pow(2).sum(1)

    return model, loss_of, "an output with a gradient does not hold the forward's 6 examples"


def _sequence_first():
    model, ids = _SequenceFirst().double(), torch.randint(0, 20, (5, 3), generator=torch.Generator().manual_seed(0))
    return model, lambda part: model(ids[:, part]).pow(2).sum((0, 2)), "reading 5 ((5, 1) token grid), 5 ((5, 2)"


@pytest.mark.parametrize("make", [_packed_gru, _offsets_bag, _sequence_first], ids=lambda f: f.__name__.strip("_"))
def test_layouts_not_yet_followed_are_refused_with_what_was_observed(make):
    model, loss_of, observed = make()
    monitor = lc.convert(model)
    step(model, monitor, loss_of, [slice(0, 1), slice(1, 3)], 3)
    with pytest.raises(ValueError, match="this step is not measured|buffer counted") as refused:
        monitor.measure(batch_size=3)
    assert observed in str(refused.value)


class _LayerDrop(nn.Module):
    """Its middle layer is skipped in the forwards `skip` says (LayerDrop, as Wav2Vec2 and HuBERT train)."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.skip = False

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.last(h if self.skip else torch.tanh(self.middle(h)))


def test_a_layer_skipped_in_one_micro_batch_is_exact_with_zero_for_its_examples():
    """Its examples of the forward it skipped have a zero gradient of it: the step's count of examples, read from
    every forward, is the batch's, and the layer's norms are exact (LayerDrop)."""
    model = _LayerDrop().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss_of(part):
        model.skip = part.start == 0  # the first micro-batch skips the middle layer
        return model(x[part]).pow(2).mean((1, 2))

    monitor = lc.convert(model)
    losses = step(model, monitor, loss_of, [slice(0, 1), slice(1, 3)], 3)
    got = assert_matches_oracle(model, monitor, losses, 3)
    assert "middle.weight" in got


class _Float32LayerNorm(nn.LayerNorm):
    """diffusers' FP32LayerNorm: computed in float32 whatever the input's and weights' dtypes, returned in the
    input's."""

    def forward(self, inputs):
        origin = inputs.dtype
        return F.layer_norm(inputs.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps).to(
            origin
        )


class _CastsIntoItsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(4, 6), _Float32LayerNorm(6), nn.Linear(6, 2)

    def forward(self, x):
        return self.last(self.norm(self.first(x).float()).type_as(x))


def test_a_norm_computing_in_a_dtype_of_its_own_is_kept_and_exact():
    """A LayerNorm subclass that casts its input and weights is no LayerNorm of the kind (which would get a float32
    input and float64 weights, and fail): it keeps its forward, replayed per example."""
    model = _CastsIntoItsNorm().double()
    lc.convert(model)
    assert isinstance(model.norm, replay.ReplayedForward)
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 3, rel=1e-4)


class _ReadsItsChildsWeight(nn.Module):
    """The model itself computes with its child's weight, never calling the child (GPT-NeoX-Japanese's dense_bias
    added by its layer's code): the child's layer sees no example of that use."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.proj.weight)))


def test_a_parameter_used_outside_its_layer_is_refused_and_the_stated_cause_is_true():
    model = _ReadsItsChildsWeight().double()
    monitor = lc.convert(model)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    calls = []
    model.proj.register_forward_hook(lambda *args: calls.append(1))
    step(model, monitor, lambda part: model(x[part]).pow(2).sum(1), [slice(0, 1), slice(1, 3)], 3)
    assert model.proj.weight.grad is not None and not calls  # a gradient, and the layer's forward never ran
    with pytest.raises(ValueError, match="proj.weight has a gradient .* but its layer recorded no example"):
        monitor.measure(batch_size=3)


class _Router(nn.Module):
    """A mixture's router as Laguna's and MiniMax-M2's are written: flattened (N*T, E) logits and top-k weights,
    a frozen score correction (a parameter without gradient)."""

    def __init__(self, top_k):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(4, 6) / 3)
        self.correction = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, hidden):
        return self.route(hidden, self.correction)

    def route(self, hidden, correction):
        hidden = hidden.reshape(-1, hidden.shape[-1])
        scores = torch.sigmoid(F.linear(hidden, self.weight))
        _, chosen = torch.topk(scores + correction, self.top_k, dim=-1)
        weights = scores.gather(-1, chosen)
        return weights / weights.sum(-1, keepdim=True), chosen


class _RouterGivenItsCorrection(_Router):
    """HY-V3's: the correction is an input of its forward (no probe can feed it: the router is replayed)."""

    def forward(self, hidden, correction):
        return self.route(hidden, correction)


class _Routed(nn.Module):
    def __init__(self, router):
        super().__init__()
        self.router, self.experts = router, nn.Linear(6, 6 * 4)

    def forward(self, x):
        given = isinstance(self.router, _RouterGivenItsCorrection)
        weights, chosen = self.router(x, self.router.correction) if given else self.router(x)
        outs = self.experts(x).view(-1, 4, 6)  # every expert's output; the chosen ones weighted
        picked = outs.gather(1, chosen.unsqueeze(-1).expand(-1, -1, 6))
        return (weights.unsqueeze(-1) * picked).sum(1).view(*x.shape)


@pytest.mark.parametrize("correction_as_input", [False, True])
def test_a_router_s_top_k_weights_with_k_equal_to_the_batch_exact(correction_as_input):
    """The (N*T, k) weights of a micro-batch of N == k examples: their examples are the flattened rows of dim 0 (as
    the autograd history says), not dim 1, whose size only happens to be N (the replay sliced them as examples and
    failed). A frozen correction no longer sends the router to the replay: its own forward, its weight's uses
    followed; the correction passed as an input (HY-V3), it is replayed."""
    torch.manual_seed(0)
    model = _Routed((_RouterGivenItsCorrection if correction_as_input else _Router)(2)).double()
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    monitor = lc.convert(model)
    expected = replay.ReplayedForward if correction_as_input else lc.conversion.intercept.InterceptedForward
    assert isinstance(model.router, expected)
    assert_exact(
        model, lambda part: model(x[part]).pow(2).mean((1, 2)), 3, parts=[slice(0, 1), slice(1, 3)], monitor=monitor
    )


class _Latents(nn.Module):
    """Perceiver's latents: forward(batch_size: int) expands its parameter over the batch."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(3, 6))

    def forward(self, batch_size: int):
        return self.latents.expand(batch_size, -1, -1)


class _CrossAttends(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings, self.proj = _Latents(), nn.Linear(6, 6)

    def forward(self, x):
        latents = self.embeddings(x.shape[0])
        scores = (latents @ self.proj(x).transpose(1, 2)).softmax(-1)
        return scores @ x


def test_parameters_expanded_to_a_batch_size_their_forward_is_given_exact():
    """No input of the latents' forward carries the examples (a replay has nothing to slice): its own forward is
    kept, and its expand over the batch gives each example its copy."""
    torch.manual_seed(0)
    model = _CrossAttends().double()
    x = torch.randn(4, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 4)
    assert "its own forward" in lc.convert(_CrossAttends()).explain()["embeddings"]


@pytest.mark.parametrize("types_given", [True, False], ids=["token types given", "token types made by the model"])
def test_a_replayed_embedding_of_multiple_choice_ids_exact(types_given):
    """I-BERT's QuantEmbedding is replayed per example; its input is the (B*C, T) ids of the choices, integers:
    each example's choices are its units. Token types not given are zeros the model makes itself (torch.zeros of
    the ids' shape): no example's ids, so the replay does not take them for the examples' by their size; the
    embedding of them is a table the examples share (replay.py's pe_table), each choice given its own rows where
    it meets the choices' embeddings."""
    from test_conversion_models import TINY, config

    torch.manual_seed(0)
    model = transformers.IBertForMultipleChoice(
        config(transformers.IBertConfig, **TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 30, (3, 2, 5), generator=gen)
    answers = torch.randint(0, 2, (3,), generator=gen)
    monitor = lc.convert(model)
    assert isinstance(model.ibert.embeddings.word_embeddings, replay.ReplayedForward)
    assert_exact(
        model,
        lambda part: F.cross_entropy(
            model(input_ids=ids[part], token_type_ids=torch.zeros_like(ids[part]) if types_given else None).logits,
            answers[part],
            reduction="none",
        ),
        3,
        monitor=monitor,
    )


class _TransposesAndPads(nn.Module):
    """Longformer's and LED's self-attention input: the hidden states transposed to (T', N, D), T' padded to a
    length no input of the model has; the projection's rows are sequence-first, as the autograd history says."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        x = self.embed(x)  # (the history starts at a tensor with a gradient)
        padded = F.pad(x, (0, 0, 0, 3)).transpose(0, 1)  # (T + 3, N, D)
        return self.head(torch.tanh(self.proj(padded)).transpose(0, 1)[:, : x.shape[1]])


@pytest.mark.parametrize("shape", [(4, 4, 6), (3, 5, 6)])
def test_rows_moved_to_dim_1_by_the_model_s_own_transpose_exact(shape):
    """(T', N, D) rows whose T' is no input's length: mapped sequence-first from the autograd history (a transpose
    of data with the examples on dim 0), not from sizes (N == T on purpose in the first case)."""
    torch.manual_seed(0)
    model = _TransposesAndPads().double()
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), shape[0])


class _TransposesItsIds(nn.Module):
    """XLNet's layout: the ids transposed to (T, N) before the lookup, every layer on (T, N, D) rows, the output
    transposed back to (N, T, D) for the head."""

    def __init__(self):
        super().__init__()
        self.wte, self.proj, self.head = nn.Embedding(V, 8), nn.Linear(8, 8), nn.Linear(8, V)

    def forward(self, ids):
        x = self.wte(ids.transpose(0, 1).contiguous())  # (T, N, 8)
        return self.head(torch.tanh(self.proj(x)).permute(1, 0, 2))


class _RelativeAttentionSequenceFirst(nn.Module):
    """XLNet's relative attention, reduced, on (T, N, D) states: its projections are parameters in torch.einsum
    ("ibh,hnd->ibnd"), a bias broadcast over (T, N, n, d), and a table computed from a parameter and constant
    positions expanded over the batch ((2T, N, D): no gradient) met by the queries in torch.einsum under the batch
    letter, which both hold on dim 1."""

    def __init__(self):
        super().__init__()
        self.q, self.r = nn.Parameter(torch.randn(8, 2, 4) / 3), nn.Parameter(torch.randn(8, 2, 4) / 3)
        self.bias, self.o = nn.Parameter(torch.randn(2, 4)), nn.Parameter(torch.randn(8, 2, 4) / 3)
        self.norm = nn.LayerNorm(8)  # (its residual's, as XLNet's; the probe's inputs take its width)

    def forward(self, h):
        T, N, _ = h.shape
        positions = torch.sin(torch.arange(2 * T, dtype=h.dtype)[:, None] * torch.arange(8, dtype=h.dtype) / 8)
        r_head = torch.einsum("ibh,hnd->ibnd", positions[:, None].expand(-1, N, -1), self.r)  # (2T, N, n, d) table
        q = torch.einsum("ibh,hnd->ibnd", h, self.q) + self.bias
        scores = torch.einsum("ibnd,jbnd->bnij", q, r_head)[..., :T].softmax(-1)
        return self.norm(h + torch.einsum("ibnd,hnd->ibh", torch.einsum("bnij,jbnd->ibnd", scores, q), self.o))


class _SequenceFirstAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.attn, self.head = nn.Embedding(V, 8), _RelativeAttentionSequenceFirst(), nn.Linear(8, V)

    def forward(self, ids):
        h = self.wte(ids.transpose(0, 1).contiguous())  # (T, N, 8), as XLNet's forward makes it
        return self.head(self.attn(h).permute(1, 0, 2))


@pytest.mark.parametrize("shape", [(5, 4), (3, 6)])
def test_parameters_and_tables_in_einsum_on_sequence_first_states_exact(shape):
    """XLNet: the examples on dim 1 (the ids transposed by the model, so the tag says so) in every einsum, broadcast
    and table meeting: each example's copy there, exact (micro-batches of 2 and 3, and of 2 and 1 examples)."""
    torch.manual_seed(0)
    model = _SequenceFirstAttention().double()
    ids = ids_batch(*shape)
    monitor = lc.convert(model)
    assert isinstance(model.attn, InterceptedForward)  # (not replayed per example)
    parts = [slice(0, 2), slice(2, shape[0])]
    assert_exact(model, lambda part: next_token_losses(model(ids[part]), ids[part]), shape[0], parts, monitor)


class _SequenceFirstChoices(nn.Module):
    """XLNet's multiple choice: (N, C, T) ids flattened to (N*C, T), then transposed by the model: dim 1 holds each
    example's C choices, one example after the other."""

    def __init__(self):
        super().__init__()
        self.inner = _SequenceFirstAttention()

    def forward(self, ids):
        N, C, T = ids.shape
        return self.inner(ids.view(N * C, T)).view(N, C, T, -1)


def test_choices_on_dim_1_of_sequence_first_states_exact():
    """Each layer's (T, N*C, ...) rows, einsum and broadcast give example i the choices 2i and 2i + 1: exact."""
    torch.manual_seed(0)
    model = _SequenceFirstChoices().double()
    ids = torch.randint(1, V, (3, 2, 5), generator=torch.Generator().manual_seed(1))
    monitor = lc.convert(model)
    assert isinstance(model.inner.attn, InterceptedForward)
    parts = [slice(0, 2), slice(2, 3)]
    assert_exact(model, lambda part: model(ids[part]).pow(2).mean((1, 2, 3)), 3, parts, monitor)


def test_ids_moved_then_flattened_are_refused_saying_so():
    """Ids transposed and then flattened: where their examples are is no longer known, and the lookup refuses the
    step saying what the forward did (never a guess from sizes)."""

    class MovesThenFlattens(_TransposesItsIds):
        def forward(self, ids):
            return self.head(self.wte(ids.t().reshape(-1)))

    torch.manual_seed(0)
    model = MovesThenFlattens().double()
    monitor = lc.convert(model, exclude=["head"])
    model(ids_batch(3, 5)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"wte.weight.*moved their examples off dim 0, then reshaped them"):
        monitor.measure(batch_size=3)


def test_the_ids_tag_follows_the_examples_through_moves_of_dims():
    """examples_dim: where tagged ids hold their examples, through transposes, permutes, unsqueezes and ops that
    keep the rank; unknown (None) once the rank changes after a move; 0 for untouched ids."""
    from nanogns.core.ids import ExampleIds, examples_dim

    ids = torch.arange(12).view(3, 4).as_subclass(ExampleIds)
    moved = ids.transpose(0, 1).contiguous()
    assert [examples_dim(t) for t in (ids, moved, moved.unsqueeze(-1), moved.unsqueeze(0), ids.T)] == [0, 1, 1, 2, 1]
    assert [examples_dim(t) for t in (ids.permute(1, 0), torch.movedim(ids.unsqueeze(-1), 0, 2), moved[:, 1:] + 1)] == [
        1,
        2,
        1,
    ]
    assert examples_dim(moved.reshape(-1)) is None and examples_dim(ids.reshape(-1)) == 0
    assert examples_dim(torch.cat([moved, moved])) == 1 and examples_dim(torch.cat([moved, moved]).sum(0)) is None


@pytest.mark.parametrize("model_of", [_TransposesItsIds, _TransposesAndPads])
def test_rows_of_n_by_n_where_the_forward_moved_its_examples_are_refused_not_guessed(model_of):
    """A micro-batch of as many examples as the rows the forward moved to dim 0 (XLNet's ids transposed, N == T;
    Longformer's padded states, N == T'): (N, N, D) rows hold the examples on dim 0 or dim 1, sizes cannot tell,
    and the step is refused saying so (they were taken as dim 0's: wrong numbers). Other sizes stay exact."""
    torch.manual_seed(0)
    model = model_of().double()
    if model_of is _TransposesItsIds:
        data, loss_of = ids_batch(6, 5), lambda x: next_token_losses(model(x), x)
    else:
        data, loss_of = torch.randn(8, 4, 6, dtype=torch.float64), lambda x: model(x).pow(2).mean((1, 2))
    n = len(data)
    assert_exact(model, lambda part: loss_of(data[part]), n, parts=[slice(0, 2), slice(2, n)])
    monitor = lc.convert(model)
    loss_of(data[1:]).sum().backward()  # 5 ids of 5 tokens; 7 states padded to 7 positions
    with pytest.raises(ValueError, match=r"rows \((5, 5|7, 7)\) for the forward's \d examples.*size other than"):
        monitor.measure(batch_size=n - 1)


class _FoldsItsFrames(nn.Module):
    """A video model's layout (SanaVideo, Cosmos' autoencoder, ACE-Step): each example's F frames folded into the
    batch by a reshape of (N, F, ...) data, then convolutions, a group norm, a pad, a split, attention over each
    frame's pixels ((N*F, heads, H*W, d): scaled_dot_product_attention) and a LayerNorm before the rows are unfolded:
    no input has N*F rows, so only how the rows were made says which example each belongs to."""

    def __init__(self):
        super().__init__()
        self.inp, self.conv, self.norm = nn.Linear(3, 8), nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16)
        self.depth, self.ln, self.out = nn.Conv2d(8, 8, 3, groups=8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # x (N, F, H, W, 3)
        N, F_, H, W, _ = x.shape
        h = self.inp(x).permute(0, 1, 4, 2, 3).reshape(N * F_, 8, H, W)  # (N*F, C, H, W)
        a, b = F.silu(self.norm(self.conv(h))).split(8, dim=1)
        h = self.depth(F.pad(a * b, (1, 1, 1, 1)))  # (N*F, 8, H, W)
        tokens = self.ln(h.flatten(2).transpose(1, 2))  # (N*F, H*W, 8)
        q = tokens.view(N * F_, H * W, 2, 4).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(N * F_, H * W, 8)
        return self.head(self.out(attended).reshape(N, F_ * H * W, 8))


def test_frames_folded_into_the_batch_are_mapped_from_how_they_were_made_exact():
    """The (N*F, ...) rows of every layer after the first: their autograd history (convolutions, norms, a pad, a
    split, attention, permutes) leads back to the reshape of (N, F, ...) data; exact, F equal to the micro-batch's
    examples on purpose."""
    torch.manual_seed(0)
    model = _FoldsItsFrames().double()
    x = torch.randn(4, 3, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 4, parts=[slice(0, 1), slice(1, 4)])


class _ShiftsItsIds(nn.Module):
    """A decoder's inputs as T5's, MVP's and T5Gemma's shift_right makes them: ids written into a tensor of zeros
    (shifted[:, 1:] = ids[:, :-1]), then looked up and split into heads folded into the batch, (N*H, T, d)."""

    def __init__(self):
        super().__init__()
        self.wte, self.proj, self.head = nn.Embedding(V, 8), nn.Linear(8, 8), nn.Linear(8, V)

    def forward(self, ids):
        N, T = ids.shape
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 1
        heads = lambda t: t.view(N, T, 2, 4).transpose(1, 2).reshape(N * 2, T, 4)  # noqa: E731
        q, k = heads(self.proj(self.wte(ids))), heads(self.wte(shifted))
        out = torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), k)
        return self.head(out.view(N, 2, T, 4).transpose(1, 2).reshape(N, T, 8))


def test_ids_written_into_zeros_stay_the_examples_ids_exact():
    """The shifted ids hold the examples' ids (they were a table the examples share, whose heads folded into the
    batch met the queries in bmm, refused): B == T on purpose."""
    torch.manual_seed(0)
    model = _ShiftsItsIds().double()
    ids = ids_batch(4, 4)
    assert_exact(model, lambda part: next_token_losses(model(ids[part]), ids[part]), 4)
