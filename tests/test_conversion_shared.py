"""
Tables shared by every example (core/shared.py) and parameters used many times per forward (core/uses.py),
each model against the brute-force loop over examples (float64, two uneven micro-batches, padded sequences), called
as a user calls it (no position ids passed):

- shared tables: BART's and mBART's positions, CLIP's vision positions and class token, Whisper's decoder positions
  (rows of its weight), Swin's relative-position biases (inside windows), DeBERTa's relative-position embeddings
  (a LayerNorm of the weight itself, through the query and key projections);
- many uses: ALBERT's layer group shared by every layer, Pegasus's and BART's matrix shared by the embeddings and
  the head, DeBERTa's projections (each example's rows and the shared table);
- a table meeting the examples in expand_as, torch.cat, torch.bmm and torch.einsum, and a parameter read by its
  module in torch.einsum (XLM, RoCBert, LED, Funnel, Pegasus-X: the architecture sweep's classes);
- a table meeting the examples in an op that per-example norms do not follow is refused, naming the op;
- a table dropped out by a custom autograd.Function (SEW-D's XDropout: the ops of its forward followed), a Function
  given the examples' data refused, a table's statistic under no_grad a constant where it meets the examples.

    python -m pytest -q tests/test_conversion_shared.py

Models are built from tiny configs with random weights (nothing is downloaded). T5's relative-position biases and
GPT-2's, BERT's and ELECTRA's default positions: tests/test_conversion_models.py.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from oracle import loss_sqnorms_from_batched_forward
from test_conversion_models import (
    NO_DROPOUT,
    SPLIT,
    TINY,
    B,
    V,
    brute_force,
    check_exact,
    config,
    lm_batch,
    lm_losses,
    measured,
)

import nanogns as lc

SEQ2SEQ = dict(
    vocab_size=V,
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=24,
    max_position_embeddings=32,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def seq2seq(name):
    """(model, loss_of) of a tiny encoder-decoder: padded inputs, 5 labels per example."""
    torch.manual_seed(0)
    if name == "Whisper":
        model = transformers.WhisperForConditionalGeneration(
            transformers.WhisperConfig(
                **{k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"},
                num_mel_bins=8,
                max_source_positions=8,
                max_target_positions=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        ).double()
        inputs = dict(
            input_features=torch.randn(B, 8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        )
    else:
        config_cls, model_cls, ids = {
            "BART": (transformers.BartConfig, transformers.BartForConditionalGeneration, dict(pad_token_id=1)),
            "mBART": (transformers.MBartConfig, transformers.MBartForConditionalGeneration, dict(pad_token_id=1)),
            "Pegasus": (transformers.PegasusConfig, transformers.PegasusForConditionalGeneration, dict(pad_token_id=0)),
        }[name]
        model = model_cls(
            config_cls(**SEQ2SEQ, **ids, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        ).double()
        input_ids, mask = lm_batch()
        inputs = dict(input_ids=input_ids, attention_mask=mask)
    labels = torch.randint(3, V, (B, 5), generator=torch.Generator().manual_seed(2))

    def loss_of(part):
        logits = model(**{k: v[part] for k, v in inputs.items()}, labels=labels[part]).logits
        return F.cross_entropy(logits.flatten(0, 1), labels[part].flatten(), reduction="none").view(-1, 5).mean(1)

    return model, loss_of


@pytest.mark.parametrize("name", ["BART", "mBART", "Pegasus", "Whisper"])
def test_encoder_decoders_positions_and_shared_matrix_exact(name):
    """Positions looked up as one row for the batch (or read as rows of the weight: Whisper) get one copy per
    example; the matrix shared by the encoder's and the decoder's embeddings and the head sums its uses."""
    model, loss_of = seq2seq(name)
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # sinusoidal positions (Pegasus, ...)
    assert not monitor.unconverted and set(monitor.untracked) == frozen
    if name != "Whisper":
        assert any(n.count("+") >= 2 for n in got), sorted(got)  # one matrix, three or four uses
    check_exact(model, monitor, want, got)


def images(name):
    torch.manual_seed(0)
    if name == "CLIP":
        model = transformers.CLIPVisionModelWithProjection(
            transformers.CLIPVisionConfig(
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=8,
                patch_size=4,
                projection_dim=8,
                attention_dropout=0.0,
            )
        ).double()
        size, head = 8, lambda out: out.image_embeds
    else:
        model = transformers.SwinForImageClassification(
            transformers.SwinConfig(
                image_size=16,
                patch_size=2,
                num_channels=3,
                embed_dim=8,
                depths=[1, 1],
                num_heads=[2, 2],
                window_size=4,
                num_labels=3,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                drop_path_rate=0.0,
            )
        ).double()
        size, head = 16, lambda out: out.logits
    pixels = torch.randn(B, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, lambda part: head(model(pixel_values=pixels[part])).pow(2).sum(1)


@pytest.mark.parametrize("name", ["CLIP", "Swin"])
def test_vision_positions_class_token_and_windowed_relative_bias_exact(name):
    """CLIP's positions (a (1, P) buffer of ids) and class token; Swin's relative-position table, looked up by an
    index it holds and added to every window's scores (each example's windows share its copy)."""
    model, loss_of = images(name)
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got, atol=1e-24)


@pytest.mark.parametrize("name", ["ALBERT", "DeBERTa-v2"])
def test_a_layer_group_shared_by_every_layer_and_a_table_through_projections_exact(name):
    """ALBERT's one layer group runs at every depth (3 uses of each of its parameters); DeBERTa's relative-position
    embeddings pass through a LayerNorm and the query and key projections, which also serve each example's tokens:
    each example's gradient is the sum over its uses."""
    torch.manual_seed(0)
    if name == "ALBERT":
        model = transformers.AlbertForMaskedLM(
            config(
                transformers.AlbertConfig,
                **{**TINY, "num_hidden_layers": 3},
                **NO_DROPOUT,
                embedding_size=8,
                classifier_dropout_prob=0.0,
            )
        )
    else:
        model = transformers.DebertaV2ForMaskedLM(
            config(
                transformers.DebertaV2Config,
                **TINY,
                **NO_DROPOUT,
                relative_attention=True,
                position_biased_input=False,
                pos_att_type=["p2c", "c2p"],
                max_relative_positions=8,
                position_buckets=4,
                norm_rel_ebd="layer_norm",
            )
        )
    model.double()
    monitor, want, got = run_lm(model)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


def run_lm(model):
    ids, mask = lm_batch()
    loss_of = lambda part: lm_losses(model, ids[part], mask[part])  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    return monitor, want, measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)


def assert_exact_on(model_class, shape):
    """A model_class() in float64 on random ids of `shape`, one step over micro-batches of 1 and the rest, exact
    against brute force; returns the ids and the monitor."""
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = model_class().double()
    loss_of = lambda part: model(ids[part]).pow(2).mean((1, 2))  # noqa: E731
    want = brute_force(model, loss_of, shape[0])
    monitor = lc.convert(model)
    check_exact(model, monitor, want, measured(monitor, model, loss_of, [slice(0, 1), slice(1, shape[0])], shape[0]))
    return ids, monitor


class GatheredPositions(nn.Module):
    """Positions looked up once for the batch, then joined to each example's tokens by torch.cat: an op in which
    per-example norms cannot follow the table."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(V, 4), nn.Embedding(8, 4), nn.Linear(8, V)

    def forward(self, ids):
        positions = self.wpe(torch.arange(ids.shape[1]).unsqueeze(0))
        return self.head(torch.cat([self.wte(ids), positions.expand(ids.shape[0], -1, -1) * 1.0], dim=-1))


class RelativeAttention(nn.Module):
    """Funnel's relative attention, reduced: a parameter read by its own module in torch.einsum
    ("bind,snd->bnis", its seg_embed), and a table computed from another ("td,dnh->tnh", its r_kernel) met by the
    examples' queries in torch.einsum ("binh,tnh->bnit")."""

    def __init__(self):
        super().__init__()
        self.seg = nn.Parameter(torch.randn(3, 2, 4))
        self.kernel = nn.Parameter(torch.randn(5, 2, 4))
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x).view(*x.shape[:2], 2, 4)  # (b, i, n, h)
        by_segment = torch.einsum("bind,snd->bnis", q, self.seg)
        r_head = torch.einsum("td,dnh->tnh", torch.ones(6, 5, dtype=q.dtype), self.kernel)
        return by_segment.sum(-1) + torch.einsum("binh,tnh->bnit", q, r_head).sum(-1)


class TablesMetEverywhere(nn.Module):
    """A table meeting the examples in each op of transformers' models that per-example copies follow:
    expand_as (XLM's positions; Flaubert's, looked up from ids expanded over the batch), torch.cat along the features and torch.bmm of a table with one row per example
    (RoCBert's and LED's lookups of ids made for the batch, not from it), torch.einsum (Funnel, Pegasus-X)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.wse = nn.Embedding(V, 8), nn.Embedding(8, 8), nn.Embedding(3, 8)
        self.rel, self.head = RelativeAttention(), nn.Linear(2, V)

    def forward(self, ids):
        tokens = self.wte(ids)
        x = tokens + self.wpe(torch.arange(ids.shape[1]).unsqueeze(0)).expand_as(tokens)
        x = x + self.wpe(torch.arange(ids.shape[1]).expand(ids.shape)).expand_as(tokens)  # Flaubert: ids expanded
        segments = self.wse(ids.new_zeros(ids.shape))  # (N, T, 8): ids made for the batch, looked up once
        x = torch.cat([x, segments], dim=-1)[..., :8] + torch.bmm(x, segments.transpose(1, 2)).softmax(-1) @ x
        return self.head(self.rel(x).transpose(1, 2))


@pytest.mark.parametrize("shape", [(4, 4), (5, 3)])
def test_tables_met_in_expand_as_cat_bmm_and_einsum_exact(shape):
    """Each op of TablesMetEverywhere gives every example its copy (or its own row) of the table, and the
    parameter read in einsum its copy: exact against brute force, batch size equal to the sequence length on
    purpose, and a micro-batch of one example (whose table of one row is its own)."""
    _, monitor = assert_exact_on(TablesMetEverywhere, shape)
    assert "its own forward" in monitor.explain()["rel"]  # seg read in einsum by the module's own forward
    assert not monitor.unconverted and not monitor.untracked


class HeadsFoldedIntoTheBatch(nn.Module):
    """Attention with its heads folded into the batch ((N, T, H, d) reshaped to (N*H, T, d)), as older models
    write it, and a relative-position table (T, T) looked up from distances (ids made for the batch) added to the
    (N*H, T, T) scores: dim 0 holds N*H rows that no input's size names; tokens folded (H, N*T, d) and queries
    (T, N*H, d), each met by a table in torch.bmm or torch.matmul: dim 1 holds the examples' rows."""

    def __init__(self):
        super().__init__()
        self.wte, self.rel, self.head = nn.Embedding(V, 8), nn.Embedding(15, 1), nn.Linear(8, V)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.per_head, self.pos = nn.Embedding(2, 16), nn.Embedding(8, 4)

    def forward(self, ids):
        N, T = ids.shape
        x = self.wte(ids)
        heads = lambda t: t.view(N, T, 2, 4).transpose(1, 2).reshape(N * 2, T, 4)  # noqa: E731 (N*H, T, d)
        q, k = heads(self.q(x)), heads(self.k(x))
        distance = torch.arange(T)[None, :] - torch.arange(T)[:, None] + 7
        scores = torch.bmm(q, k.transpose(1, 2)) + self.rel(distance).squeeze(-1)  # (N*H, T, T) + (T, T)
        out = torch.bmm(scores.softmax(-1), k).view(N, 2, T, 4).transpose(1, 2).reshape(N, T, 8)
        tokens = x.reshape(N * T, 2, 4).transpose(0, 1)  # (H, N*T, d): tokens folded, heads first (DeepSeek-V4)
        mixed = torch.bmm(tokens, self.per_head(torch.arange(2)).view(2, 4, 4))  # a table per head
        by_position = q.view(N * 2, T, 4).transpose(0, 1)  # (T, N*H, d) (SpeechT5's relative positions)
        bias = torch.matmul(by_position, self.pos(torch.arange(T)).view(T, 4, 1))  # a table per position
        bias = bias.transpose(0, 1).reshape(N, 2, T, 1).sum(1)  # (N, T, 1)
        return self.head(out + x + mixed.transpose(0, 1).reshape(N, T, 8) + bias)


def test_a_table_meeting_heads_folded_into_the_batch_exact():
    """The scores' rows are N*H: their autograd history (a reshape of (N, ...) data) says each example holds H of
    them, one example after the other; the table gets one copy per row, summed per example: exact, B == T."""
    assert_exact_on(HeadsFoldedIntoTheBatch, (4, 4))


class UnboundHeadsAttention(nn.Module):
    """SAM's attention (GOT-OCR's vision tower), on tokens: q, k, v made by one projection, reshaped (N, T, 3, H, d),
    permuted and reshaped to (3, N*H, T, d), then unbound; a relative-position parameter indexed by distance meets
    the queries in einsum. The examples are folded into dim 1 of the reshape, not dim 0."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.rel_pos = nn.Parameter(torch.randn(9, 4))

    def forward(self, x):
        N, T, _ = x.shape
        q, k, v = self.qkv(x).reshape(N, T, 3, 2, 4).permute(2, 0, 3, 1, 4).reshape(3, N * 2, T, 4).unbind(0)
        distance = torch.arange(T)[:, None] - torch.arange(T)[None, :] + 4
        rel = torch.einsum("btc,tkc->btk", q, self.rel_pos[distance])  # (N*H, T, T)
        out = (torch.bmm(q, k.transpose(1, 2)) + rel).softmax(-1) @ v
        return self.proj(out.view(N, 2, T, 4).permute(0, 2, 1, 3).reshape(N, T, 8))


class UnboundHeadsLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.attn, self.head = nn.Embedding(V, 8), UnboundHeadsAttention(), nn.Linear(8, V)

    def forward(self, ids):
        return self.head(self.attn(self.wte(ids)))


def test_a_table_meeting_heads_folded_into_dim_1_of_a_reshape_then_unbound_exact():
    """(3, N*H, T, d) from (3, N, H, T, d): the examples sit on dim 1 of the reshape's input (its history: a permute
    of the (N, ...) projection), and unbind takes dim 0 away; the queries' rows are each example's H: exact, B == T."""
    assert_exact_on(UnboundHeadsLM, (4, 4))


def test_a_table_meeting_the_examples_where_it_cannot_be_followed_is_refused():
    """expand(N, ...) is followed (each example its copy); the same table, met in torch.tensordot (an op no copy
    follows), is refused with the op named (never a number)."""

    class Joined(GatheredPositions):
        def forward(self, ids):
            positions = self.wpe(torch.arange(ids.shape[1]))
            scores = torch.tensordot(self.wte(ids), positions, dims=([2], [1]))  # (N, T, T)
            return self.head(torch.cat([self.wte(ids), scores.softmax(-1) @ self.wte(ids)], dim=-1))

    ids, _ = assert_exact_on(GatheredPositions, (4, 5))
    model = Joined().double()
    monitor = lc.convert(model)
    model(ids).pow(2).mean().backward()
    with pytest.raises(ValueError, match=r"wpe.weight: this step is not measured.*in torch.functional.tensordot"):
        monitor.measure(batch_size=4)


def test_a_constant_whose_rows_happen_to_be_the_batch_is_not_taken_for_the_examples():
    """The relative positions (a constant, no gradient) have as many rows as a micro-batch has examples: their
    einsum with the kernel is not an example's use (copies per row gave Funnel's multiple choice wrong numbers, and
    refusing it left Funnel's multiple choice unmeasured): the kernel and the constant alone make a table, which the
    examples' queries meet in the next einsum, each example given its copy. Exact against brute force, the second
    micro-batch of 6 examples meeting 6 rows of positions."""
    _, monitor = assert_exact_on(TablesMetEverywhere, (7, 5))
    assert not monitor.unconverted and not monitor.untracked


class MaskedDropout(torch.autograd.Function):
    """SEW-D's XDropout, reduced: a dropout written as a custom autograd.Function, its keep-mask drawn inside its
    forward (which torch runs without gradients) and kept for its backward. Function.apply is no op that a table's
    __torch_function__ sees; the ops of its forward are."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.scale = 1.0 / (1 - p)
        if p == 0:
            return x
        mask = (1 - torch.empty_like(x).bernoulli_(1 - p)).to(torch.bool)
        ctx.save_for_backward(mask)
        return x.masked_fill(mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        if ctx.scale == 1:
            return grad, None
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(mask, 0) * ctx.scale, None


class ScaledByTheExamples(torch.autograd.Function):
    """A custom Function given the table and the examples' data: its output (N, ...) is no table."""

    @staticmethod
    def forward(ctx, table, x):
        ctx.save_for_backward(table, x)
        return table * x.mean(1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        table, x = ctx.saved_tensors
        grad_x = (grad * table).sum(1, keepdim=True).expand_as(x) / x.shape[1]
        return (grad * x.mean(1, keepdim=True)).sum(0, keepdim=True), grad_x


class DroppedRelativeEmbeddings(nn.Module):
    """SEW-D's disentangled attention, reduced: the relative-position embeddings' weight, a LayerNorm of it, dropped
    out by a custom autograd.Function (one mask for the table, which every example shares), projected by the query
    projection that also serves the tokens, and met by each example's queries in a matmul (through `through`:
    MaskedDropout at p, or ScaledByTheExamples given the tokens)."""

    def __init__(self, p=0.5, through="dropout"):
        super().__init__()
        self.p, self.through = p, through
        self.wte, self.rel = nn.Embedding(V, 8), nn.Embedding(8, 8)
        self.norm, self.q, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, V)

    def forward(self, ids):
        x = self.wte(ids)
        table = self.norm(self.rel.weight)
        if self.through == "dropout":
            table = MaskedDropout.apply(table, self.p)
        else:
            table = ScaledByTheExamples.apply(table.unsqueeze(0), x)
        by_position = self.q(x) @ self.q(table).transpose(-1, -2)  # (N, T, 8 relative positions)
        distance = (torch.arange(ids.shape[1])[None, :] - torch.arange(ids.shape[1])[:, None]).clamp(-4, 3) + 4
        scores = by_position.gather(-1, distance.expand(ids.shape[0], -1, -1)).softmax(-1)  # (N, T, T)
        return self.head(scores @ x)


@pytest.mark.parametrize("shape", [(4, 4), (5, 3)])
@pytest.mark.parametrize("p", [0.5, 0.0])
def test_a_table_dropped_out_by_a_custom_autograd_function_exact(shape, p):
    """The table's dropout is a custom autograd.Function (SEW-D's XDropout): its output is still the table (its
    forward's ops are on the table alone), met by each example's queries; each example's gradient reaches the
    embeddings' weight and the LayerNorm through the Function's backward. The mask is drawn at random, so the oracle
    takes each example's gradient from the step's own forwards (training mode, B == T on purpose)."""
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = DroppedRelativeEmbeddings(p).double()
    monitor = lc.convert(model)
    losses = []
    for part in (slice(0, 1), slice(1, shape[0])):
        losses.append(model(ids[part]).pow(2).mean((1, 2)))
        (losses[-1].sum() / shape[0]).backward(retain_graph=True)
    got = {m.metadata["name"]: m for m in monitor.measure(batch_size=shape[0])}
    per_example, batch = loss_sqnorms_from_batched_forward(model, losses)
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, m in got.items():
        assert m.norm**2 == pytest.approx(batch[name], rel=1e-6), name
        assert m.rms_pe_norm**2 == pytest.approx(per_example[name], rel=1e-6), name


def test_a_table_given_to_a_custom_autograd_function_with_the_examples_data_is_refused():
    """A custom Function given the table and the examples' data returns the examples' data, no table: the query
    projection's rows are the examples', but no example's own gradient of the table reaches its sources, and their
    step is refused (never a number)."""
    ids = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = DroppedRelativeEmbeddings(through="examples").double()
    monitor = lc.convert(model)
    model(ids).pow(2).mean().backward()
    with pytest.raises(ValueError, match=r"rel.weight has a gradient .* recorded no example"):
        monitor.measure(batch_size=4)


class TableUnderNoGrad(GatheredPositions):
    """A table's statistic computed under torch.no_grad() in the forward (a constant: no gradient reaches the
    positions through it), met by the examples in torch.tensordot, an op per-example copies do not follow."""

    def forward(self, ids):
        positions = self.wpe(torch.arange(ids.shape[1]).unsqueeze(0))  # (1, T, 4)
        with torch.no_grad():
            scale = positions.abs().mean(-1)  # (1, T)
        tokens = self.wte(ids)
        mixed = torch.tensordot(tokens, scale.squeeze(0), dims=([1], [0]))  # (N, 4)
        x = tokens + positions.expand(ids.shape[0], -1, -1) + mixed.unsqueeze(1)
        return self.head(torch.cat([x, tokens], dim=-1))


def test_a_table_computed_under_no_grad_is_a_constant_where_it_meets_the_examples():
    """A table made under no_grad carries no gradient to its sources: meeting the examples in an op not followed is
    no refusal of them, and the step is exact (the positions' gradient comes from their expand alone)."""
    assert_exact_on(TableUnderNoGrad, (4, 4))
