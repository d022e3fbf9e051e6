"""
The third wave of models through nanogns.convert, each against the oracle (tests/oracle.py: each example's gradient
from the same batched forward, float64), over two uneven micro-batches:

- rows mapped by where they come from, not by their sizes: every layout the row map knows, with a batch size
  equal to the sequence length, to a patch count or to a small dim of another input (the coincidence test);
- one example, many rows: multiple choice (B x C x T), PatchTST's channels, SmolVLM's and Idefics3's image tiles,
  Llama 4's experts (E x N x T), summed per example before squaring;
- PEFT's adapters: LoRA, DoRA, LoRA on the embeddings, trainable tokens, IA3, LoHa, LoKr, VeRA, OFT;
- a subclass of a known layer, and weights reparametrised by torch.nn.utils.parametrize or the old hooks;
- the replay in the forward's autocast state and with its random numbers, and its failures named truly;
- parameters run outside forward (Gemma 3n's AltUp), and the check that refuses an impossible pegn;
- vision-language towers (Qwen2-VL, Qwen2.5-VL, SmolVLM, Idefics3, SigLIP, SigLIP2, Gemma 3, ViTMAE, CLIP), Llama 4,
  PhiMoE's sampled routing, LFM2.

    python -m pytest -q tests/test_conversion_third_wave.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import math

import peft
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from oracle import loss_sqnorms_from_batched_forward
from torch.nn.utils import parametrizations

import nanogns as lc
from nanogns.conversion import replay
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.kinds.linear import PerExampleLinear

V = 40  # the vocabulary of the language models; 28..31 are image, video and vision start / end tokens
IMAGE, VIDEO, START, END = 30, 31, 28, 29


def measured(model, monitor, loss_of, parts, n):
    """{logged name: Measurement} of one step over micro-batches `parts`, each loss a share of the mean over n."""
    for part in parts:
        (loss_of(part).sum() / n).backward()
    found = {m.metadata["name"]: m for m in monitor.measure(batch_size=n)}
    found_gradients.clear()
    found_gradients.update(name for name, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    zero_pe_sqnorm_buffers(model)
    return found


found_gradients = set()  # the parameters the last step of `measured` gave a gradient


def assert_exact(model, loss_of, n, parts=None, monitor=None, rel=1e-6, everything=True, before_oracle=None):
    """Convert (unless given a monitor), one step over `parts` (default: examples [0, 1) and [1, n)), and every
    measurement within `rel` of the oracle; with `everything`, every trainable parameter is measured.
    before_oracle(): called between the step and the oracle's forward."""
    monitor = monitor or lc.convert(model)
    parts = parts or [slice(0, 1), slice(1, n)]
    got = measured(model, monitor, loss_of, parts, n)
    if before_oracle is not None:
        before_oracle()
    per_example, batch = loss_sqnorms_from_batched_forward(model, loss_of(slice(0, n)))
    zero_pe_sqnorm_buffers(model)
    if everything:  # every parameter with a gradient (a vision tower's unused head has none)
        assert {name.split("+")[0] for name in got} == found_gradients, (monitor.unconverted, monitor.untracked)
    for name, m in got.items():
        first = name.split("+")[0]
        assert m.batch_size == n
        assert m.norm**2 == pytest.approx(batch[first], rel=rel, abs=1e-20), name
        assert m.rms_pe_norm**2 == pytest.approx(per_example[first], rel=rel, abs=1e-20), name
    return monitor


def next_token_losses(logits, ids, mask=None):
    """Each example's mean next-token loss over its unmasked tokens, (n,)."""
    losses = F.cross_entropy(logits[:, :-1].double().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    kept = torch.ones_like(ids[:, 1:], dtype=torch.float64) if mask is None else mask[:, 1:].double()
    return (losses.view(len(ids), -1) * kept).sum(1) / kept.sum(1)


def token_batch(B, T, seed=1, pad=True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE - 2, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad and B > 1:
        mask[1, -2:] = 0
    return ids, mask


def causal_lm(config_cls, model_cls, B=3, T=6, **options):
    """A tiny decoder (2 layers) and its examples' losses on a padded batch."""
    sizes = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**sizes, **options})).double()
    ids, mask = token_batch(B, T)
    return model, lambda part: next_token_losses(
        model(input_ids=ids[part], attention_mask=mask[part]).logits, ids[part], mask[part]
    )


# -----------------------------------------------------------------------------
# vision-language models, built with their image tokens in input_ids


def qwen2_vl(images, B, T, qwen25=False):
    """Qwen2-VL (or 2.5) with `images`, ((example, (t, h, w)), ...) in order; each image's t*h*w patches of 2x2x2
    pixels merge 2x2 into t*h*w/4 tokens."""
    text = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0),
    )
    vision = dict(depth=1, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    if qwen25:
        vision.update(
            hidden_size=16, out_hidden_size=16, intermediate_size=24, window_size=4, fullatt_block_indexes=[0]
        )
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=16, hidden_size=16)
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    ids_of = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision, **ids_of)).double()
    ids, _ = token_batch(B, T, pad=False)
    filled = [1] * B
    for example, (t, h, w) in images:
        n = t * h * w // 4
        ids[example, filled[example] - 1] = START
        ids[example, filled[example] : filled[example] + n] = IMAGE
        ids[example, filled[example] + n] = END
        filled[example] += n + 2
    grid = torch.tensor([list(g) for _, g in images])
    patches = grid.prod(-1)
    pixels = torch.randn(
        int(patches.sum()), 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    first = torch.cumsum(patches, 0) - patches
    owner = [example for example, _ in images]

    def loss_of(part):
        mine = [j for j, example in enumerate(owner) if part.start <= example < part.stop]
        inputs = {}
        if mine:
            inputs = dict(
                pixel_values=torch.cat([pixels[first[j] : first[j] + patches[j]] for j in mine]),
                image_grid_thw=grid[mine],
                mm_token_type_ids=(ids[part] == IMAGE).long(),
            )
        return next_token_losses(model(input_ids=ids[part], **inputs).logits, ids[part])

    return model, loss_of


def idefics3(tiles, B, T, smolvlm=False):
    """Idefics3 (or SmolVLM) whose example i has tiles[i] image tiles of 8x8 pixels (padded with zero tiles to the
    most), 4 image tokens each."""
    text = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2
    )
    config_cls, model_cls = (
        (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration)
        if smolvlm
        else (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration)
    )
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision, image_token_id=IMAGE, scale_factor=2))
    model.double()
    gen = torch.Generator().manual_seed(2)
    ids, _ = token_batch(B, T, pad=False)
    pixels = torch.zeros(B, max(tiles), 3, 8, 8, dtype=torch.float64)
    for example, n in enumerate(tiles):
        ids[example, 1 : 1 + 4 * n] = IMAGE
        pixels[example, :n] = torch.randn(n, 3, 8, 8, generator=gen, dtype=torch.float64)
    masks = torch.ones(B, max(tiles), 8, 8, dtype=torch.bool)

    def loss_of(part):
        inputs = dict(pixel_values=pixels[part], pixel_attention_mask=masks[part]) if sum(tiles[part]) else {}
        return next_token_losses(model(input_ids=ids[part], **inputs).logits, ids[part])

    return model, loss_of


def gemma3_multimodal(images, B=3, T=14):
    """Gemma 3 with images[i] images in example i (4 tokens each, from 16 patches pooled 2x2)."""
    text = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=4,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_id=31
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).double()
    gen = torch.Generator().manual_seed(2)
    ids, _ = token_batch(B, T, pad=False)
    pixels, owner = [], []
    for example, n in enumerate(images):
        for j in range(n):
            ids[example, 1 + 5 * j : 5 + 5 * j] = IMAGE
            pixels.append(torch.randn(3, 8, 8, generator=gen, dtype=torch.float64))
            owner.append(example)
    pixels, owner = torch.stack(pixels), torch.tensor(owner)
    token_types = (ids == IMAGE).long()

    def loss_of(part):
        mine = (owner >= part.start) & (owner < part.stop)
        inputs = dict(pixel_values=pixels[mine]) if mine.any() else {}
        logits = model(input_ids=ids[part], token_type_ids=token_types[part], **inputs).logits
        return next_token_losses(logits, ids[part])

    return model, loss_of


def llama4(images, B=3, T=14):
    """Llama 4: dense experts (every token through every expert: E x N x T rows) and a vision tower whose 16
    patches per image pixel-shuffle into 4 tokens; images[i] images in example i."""
    text = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        intermediate_size_mlp=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 0],
        attn_temperature_tuning=False,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=2,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
        pixel_shuffle_ratio=0.5,
    )
    config = transformers.Llama4Config(
        text_config=text, vision_config=vision, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END
    )
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).double()
    gen = torch.Generator().manual_seed(2)
    ids, _ = token_batch(B, T, pad=False)
    pixels, owner = [], []
    for example, n in enumerate(images):
        for j in range(n):
            ids[example, 1 + 5 * j : 5 + 5 * j] = IMAGE
            pixels.append(torch.randn(3, 8, 8, generator=gen, dtype=torch.float64))
            owner.append(example)
    pixels, owner = torch.stack(pixels), torch.tensor(owner)

    def loss_of(part):
        mine = (owner >= part.start) & (owner < part.stop)
        inputs = dict(pixel_values=pixels[mine]) if mine.any() else {}
        return next_token_losses(model(input_ids=ids[part], **inputs).logits, ids[part])

    return model, loss_of


VISION = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
)


def siglip(B):
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION)).double()
    pixels = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return model, lambda part: model(pixel_values=pixels[part]).pooler_output.pow(2).sum(1)


def siglip2(B, patches=6):
    """SigLIP2 (NaFlex): B images of `patches` patches (the first one's last 2 padding), spatial shapes (2, 3) and
    (2, 2): a micro-batch of 2 has the sizes of its (2, 2) spatial_shapes."""
    config = transformers.Siglip2VisionConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_patches=16, patch_size=2
    )
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(config).double()
    pixels = torch.randn(B, patches, 3 * 2 * 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    masks = torch.ones(B, patches, dtype=torch.long)
    masks[0, -2:] = 0
    shapes = torch.tensor([[2, 2]] + [[2, 3]] * (B - 1))

    def loss_of(part):
        out = model(pixel_values=pixels[part], pixel_attention_mask=masks[part], spatial_shapes=shapes[part])
        return out.pooler_output.pow(2).sum(1)

    return model, loss_of


# -----------------------------------------------------------------------------
# rows mapped by provenance: batch sizes that coincide with other sizes


class FlatLM(nn.Module):
    """Rows flattened to (B*T, D) between its layers, and nanoGPT's positions: torch.arange(T), one row per position."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.mlp, self.head = (
            nn.Embedding(V, 8),
            nn.Embedding(16, 8),
            nn.Linear(8, 8),
            nn.Linear(8, V),
        )

    def forward(self, ids):
        B, T = ids.shape
        h = self.wte(ids) + self.wpe(torch.arange(T))
        return self.head(torch.tanh(self.mlp(h.flatten(0, 1)))).view(B, T, -1)


class SequenceFirstLM(nn.Module):
    """torch's TransformerEncoder with batch_first=False: (T, B, D) rows inside it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, V)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids).transpose(0, 1)).transpose(0, 1))


def language_model_with(model, B, T):
    ids, _ = token_batch(B, T, pad=False)
    return model, lambda part: next_token_losses(model(ids[part]), ids[part])


def tiny_bert_config(**options):
    """One layer, width 16, no dropout."""
    sizes = dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    return transformers.BertConfig(
        **sizes, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **options
    )


def bert_classifier_padded_by_the_collator(B):
    """BERT sequence classification on B sentences padded by DataCollatorWithPadding: the longest has B tokens, so
    the micro-batch's size is its padded length."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_bert_config(num_labels=3)).double()
    gen = torch.Generator().manual_seed(1)
    sentences = [{"input_ids": torch.randint(1, V, (n,), generator=gen).tolist()} for n in [B] + [B - 1] * (B - 1)]
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), pad_token="[PAD]")
    collator = transformers.DataCollatorWithPadding(tokenizer)
    batch = collator(sentences)
    assert batch["input_ids"].shape == (B, B)
    labels = torch.randint(0, 3, (B,), generator=gen)

    def loss_of(part):
        logits = model(input_ids=batch["input_ids"][part], attention_mask=batch["attention_mask"][part]).logits
        return F.cross_entropy(logits, labels[part], reduction="none")

    return model, loss_of


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return Tokenizer(WordLevel({"[PAD]": 0, **{f"w{i}": i for i in range(1, V)}}, unk_token="w1"))


def gpt2(B, T):
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    ids, mask = token_batch(B, T)
    return model, lambda part: next_token_losses(
        model(input_ids=ids[part], attention_mask=mask[part]).logits, ids[part], mask[part]
    )


def multiple_choice(B, C, T):
    torch.manual_seed(0)
    model = transformers.BertForMultipleChoice(tiny_bert_config()).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, C, T), generator=gen)
    answers = torch.randint(0, C, (B,), generator=gen)
    return model, lambda part: F.cross_entropy(model(input_ids=ids[part]).logits, answers[part], reduction="none")


def patchtst(B, channels=3):
    config = transformers.PatchTSTConfig(
        num_input_channels=channels,
        context_length=16,
        patch_length=4,
        patch_stride=4,
        d_model=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        ffn_dim=24,
        prediction_length=4,
        norm_type="layernorm",
        dropout=0.0,
        attention_dropout=0.0,
        ff_dropout=0.0,
        path_dropout=0.0,
        head_dropout=0.0,
        positional_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.PatchTSTForPrediction(config).double()
    gen = torch.Generator().manual_seed(1)
    series = torch.randn(B, 16, channels, generator=gen, dtype=torch.float64)
    future = torch.randn(B, 4, channels, generator=gen, dtype=torch.float64)
    return model, lambda part: (model(past_values=series[part]).prediction_outputs - future[part]).pow(2).mean((1, 2))


def gemma3n(B):
    """Gemma 3n: AltUp stacks K=2 copies of the (B, T, D) states into (K, B, T, D), run by its predict() and
    correct(), which its decoder layer calls besides its forward."""
    return causal_lm(
        transformers.Gemma3nTextConfig,
        transformers.Gemma3nForCausalLM,
        B,
        vocab_size_per_layer_input=V,
        hidden_size_per_layer_input=8,
        head_dim=8,
        sliding_window=4,
        num_kv_shared_layers=0,
        laurel_rank=4,
        altup_num_inputs=2,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0],
    )


def packed_llama(lengths):
    """A Llama batch of sequences packed into one row (position_ids restarting at 0, a block-diagonal mask)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config).double()
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, V, (n,), generator=gen) for n in lengths]

    def loss_of(part):
        group = sequences[part]
        segment = torch.cat([torch.full((len(s),), i) for i, s in enumerate(group)])
        mask = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment), dtype=torch.bool).tril()
        positions = torch.cat([torch.arange(len(s)) for s in group])[None]
        logits = model(
            input_ids=torch.cat(group)[None], position_ids=positions, attention_mask=mask[None, None]
        ).logits[0]
        ends = torch.tensor([0] + [len(s) for s in group]).cumsum(0)
        return torch.stack([F.cross_entropy(logits[a : b - 1], s[1:]) for s, a, b in zip(group, ends, ends[1:])])

    return model, loss_of


def swin(B):
    """Swin on 16x16 images of 2x2 patches in windows of 4x4 patches: 4 windows per image, and B images."""
    config = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        num_channels=3,
        embed_dim=8,
        depths=[1],
        num_heads=[2],
        window_size=4,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(config).double()
    pixels = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, lambda part: model(pixel_values=pixels[part]).logits.pow(2).sum(1)


# layout: (build() -> (model, loss_of), B, micro-batches) with sizes that coincide
COINCIDING = {
    "dim0: pooled head, B == padded length": (lambda: bert_classifier_padded_by_the_collator(4), 4, [slice(0, 4)]),
    "flat (B*T,) rows, B == T, positions (T,)": (
        lambda: language_model_with(FlatLM().double(), 5, 5),
        5,
        [slice(0, 5)],
    ),
    "shared (1, T) positions, B == T": (lambda: gpt2(4, 4), 4, [slice(0, 4)]),
    "sequence first, B == T": (
        lambda: language_model_with(SequenceFirstLM().double(), 4, 4),
        4,
        [slice(0, 4)],
    ),
    "choices B x C x T, B == C == T": (lambda: multiple_choice(3, 3, 3), 3, [slice(0, 3)]),
    "channels B x C, B == C": (lambda: patchtst(3, channels=3), 3, [slice(0, 3)]),
    "tower patches, 36 = 3 x 12 == B x T": (
        lambda: qwen2_vl(((0, (1, 4, 4)), (2, (1, 2, 2)), (2, (1, 4, 4))), 3, 12),
        3,
        [slice(0, 3)],
    ),
    "tower tiles, 3 tiles == B": (lambda: idefics3((1, 0, 2), 3, 12), 3, [slice(0, 3)]),
    "NaFlex, B == 2 == spatial_shapes' dims": (lambda: siglip2(3), 3, [slice(0, 1), slice(1, 3)]),
    "stacked (K, B, ...), B == K": (lambda: gemma3n(2), 2, [slice(0, 2)]),
    "packed, 3 sequences of 3 tokens": (lambda: packed_llama((3, 3, 3)), 3, [slice(0, 3)]),
    "windows, B == 4 windows per image": (lambda: swin(4), 4, [slice(0, 4)]),
}


@pytest.mark.parametrize("layout", list(COINCIDING))
def test_rows_mapped_by_provenance_whatever_the_sizes(layout):
    """Each layout the row map knows, at a batch size equal to a length, a patch count or a dim of another input:
    exact, every parameter (a decision by sizes would refuse the step or, worse, give other numbers)."""
    build, n, parts = COINCIDING[layout]
    model, loss_of = build()
    assert_exact(model, loss_of, n, parts)


class PositionsFromTheIdsDtype(nn.Module):
    """A user's language model whose learned positions are looked up with ids made from the input ids' dtype or
    shape only: a table, whatever the sizes."""

    def __init__(self, how, D=8):
        super().__init__()
        self.how = how
        self.tokens, self.positions, self.head = nn.Embedding(V, D), nn.Embedding(16, D), nn.Linear(D, V)

    def forward(self, ids):
        B, T = ids.shape
        if self.how == "type_as":
            positions = torch.arange(T).type_as(ids)
        elif self.how == "new_tensor":
            positions = ids.new_tensor(list(range(T)))
        elif self.how == "ones_like of one example":
            positions = torch.ones_like(ids[0]).cumsum(0) - 1
        else:  # expanded to (B, T)
            positions = torch.arange(T).type_as(ids).expand(B, T)
        return self.head(torch.tanh(self.tokens(ids) + self.positions(positions)))


@pytest.mark.parametrize("how", ["type_as", "new_tensor", "ones_like of one example", "expanded"])
@pytest.mark.parametrize("B, T", [(5, 5), (3, 5)])
def test_positions_made_from_the_ids_dtype_are_a_table_whatever_the_sizes(how, B, T):
    """`torch.arange(T).type_as(ids)`, `ids.new_tensor(...)`, `torch.ones_like(ids[0])`: they take the ids' dtype
    or one example's shape, not the examples' ids, so the tag does not follow them. Before, they were tagged, and at
    B == T their (T,) lookup was taken for the examples' rows: norms 13% off, silently."""
    torch.manual_seed(0)
    model = PositionsFromTheIdsDtype(how).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))

    def loss_of(part):
        return F.cross_entropy(model(ids[part]).transpose(1, 2), ids[part], reduction="none").mean(1)

    assert_exact(model, loss_of, B)


# -----------------------------------------------------------------------------
# the families, each exact


FAMILIES = {
    "Qwen2-VL": lambda: (*qwen2_vl(((0, (1, 4, 4)), (2, (1, 2, 2)), (2, (1, 4, 4))), 3, 12), 3),
    "Qwen2.5-VL": lambda: (*qwen2_vl(((0, (1, 4, 4)), (2, (1, 4, 4))), 3, 12, qwen25=True), 3),
    "Idefics3 tiles": lambda: (*idefics3((2, 0, 3), 3, 16), 3),
    "SmolVLM tiles": lambda: (*idefics3((2, 1, 3), 3, 16, smolvlm=True), 3),
    "Gemma 3 multimodal": lambda: (*gemma3_multimodal((1, 0, 2)), 3),
    "SigLIP": lambda: (*siglip(3), 3),
    "SigLIP2": lambda: (*siglip2(3), 3),
    "multiple choice": lambda: (*multiple_choice(3, 4, 5), 3),
    "PatchTST channels": lambda: (*patchtst(3), 3),
    "Llama 4 (experts, vision)": lambda: (*llama4((1, 0, 2)), 3),
    "LFM2": lambda: (
        *causal_lm(
            transformers.Lfm2Config,
            transformers.Lfm2ForCausalLM,
            layer_types=["conv", "full_attention"],
            conv_L_cache=3,
            block_ff_dim=24,
            block_auto_adjust_ff_dim=False,
        ),
        3,
    ),
    "Gemma 3n AltUp": lambda: (*gemma3n(3), 3),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_exact(family):
    model, loss_of, n = FAMILIES[family]()
    assert_exact(model, loss_of, n)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["Qwen2-VL", "Idefics3 tiles"])
def test_vision_towers_exact_under_gradient_checkpointing(family, reentrant):
    """Hugging Face's gradient checkpointing recomputes each vision block on its own in backward, without entering
    the tower whose scope maps its rows: the recomputed layers map them as in the forward (the scope each layer ran
    in is kept: layout.rows_for), over two micro-batches. Before, the recompute mapped a tower's rows as the text's:
    a CheckpointError, or a refusal naming the wrong cause, or (one micro-batch, reentrant) norms 34% off."""
    model, loss_of, n = FAMILIES[family]()
    monitor = lc.convert(model)
    for parts in ([slice(0, 1), slice(1, n)], [slice(0, n)]):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        assert model.is_gradient_checkpointing
        # (the oracle takes torch.autograd.grad, which reentrant checkpointing refuses)
        assert_exact(model, loss_of, n, parts, monitor, before_oracle=model.gradient_checkpointing_disable)


def test_vitmae_mask_token_and_clip_exact():
    """ViTMAE's mask token repeated over the batch and joined by torch.cat; CLIP's two towers and their tables."""
    config = transformers.ViTMAEConfig(
        **VISION,
        decoder_hidden_size=8,
        decoder_intermediate_size=12,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=2,
        mask_ratio=0.5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.ViTMAEForPreTraining(config).double()
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(3, 3, 8, 8, generator=gen, dtype=torch.float64)
    noise = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    assert_exact(model, lambda part: model(pixel_values=pixels[part], noise=noise[part]).logits.pow(2).mean((1, 2)), 3)
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2
        ),
        vision_config=VISION,
        projection_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).double()
    ids = torch.randint(1, V, (4, 6), generator=gen)
    pixels = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64)

    def loss_of(part):
        out = model(input_ids=ids[part], pixel_values=pixels[part])
        return (out.text_embeds * out.image_embeds).sum(1) + out.text_embeds.pow(2).sum(1)

    assert_exact(model, loss_of, 4)


def test_phimoe_sampled_routing_exact():
    """PhiMoE in training mode draws its routing (Gumbel samples, Heun's mask) and jitters its router's input: the
    step and the oracle see the same draws (one seed before each forward), and every parameter is exact."""
    model, loss_of = causal_lm(
        transformers.PhimoeConfig,
        transformers.PhimoeForCausalLM,
        num_local_experts=4,
        num_experts_per_tok=2,
        input_jitter_noise=0.1,
    )

    def seeded(part):
        torch.manual_seed(7)
        return loss_of(part)

    assert_exact(model.train(), seeded, 3, parts=[slice(0, 3)])


# -----------------------------------------------------------------------------
# PEFT's adapters


ADAPTERS = {
    "LoRA": lambda: peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], lora_dropout=0.0),
    "DoRA": lambda: peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], use_dora=True, lora_dropout=0.0),
    "LoRA on the embeddings": lambda: peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]),
    "trainable tokens": lambda: peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[3, 5]),
    "IA3": lambda: peft.IA3Config(target_modules=["v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "LoHa": lambda: peft.LoHaConfig(r=2, target_modules=["q_proj", "down_proj"]),
    "LoKr": lambda: peft.LoKrConfig(r=2, target_modules=["q_proj", "down_proj"]),
    "VeRA": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "OFT": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=["q_proj", "down_proj"]),
}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_peft_adapter_exact(adapter):
    """Every trainable tensor of a PEFT model (the adapters') exact; adapters that start at zero get random values,
    so that each gets a gradient."""
    base, _ = causal_lm(transformers.LlamaConfig, transformers.LlamaForCausalLM)
    model = peft.get_peft_model(base, ADAPTERS[adapter]()).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    ids, mask = token_batch(3, 6)
    assert_exact(
        model,
        lambda part: next_token_losses(
            model(input_ids=ids[part], attention_mask=mask[part]).logits, ids[part], mask[part]
        ),
        3,
    )


# -----------------------------------------------------------------------------
# subclasses and reparametrised weights


class MyConv(nn.Conv2d):
    pass


def reparametrised(how):
    layer = nn.Conv1d(4, 4, 3, padding=1) if how == "ParametrizedConv1d" else nn.Linear(4, 4)
    if how in ("weight_norm", "ParametrizedConv1d"):
        parametrizations.weight_norm(layer)
    elif how == "spectral_norm":
        parametrizations.spectral_norm(layer)
    elif how == "orthogonal":
        parametrizations.orthogonal(layer)
    elif how == "old weight_norm":
        layer = torch.nn.utils.weight_norm(layer)
    elif how == "old spectral_norm":
        layer = torch.nn.utils.spectral_norm(layer)
    return layer


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize(
    "how",
    [
        "subclass",
        "weight_norm",
        "spectral_norm",
        "orthogonal",
        "old weight_norm",
        "old spectral_norm",
        "ParametrizedConv1d",
    ],
)
def test_subclasses_and_reparametrised_weights_exact(how):
    """`class MyConv(nn.Conv2d): pass` is a Conv; a weight computed by a parametrisation is followed to its original
    parameters, each example's gradient of those exact (spectral norm's power iteration replayed from its state)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if how == "subclass":
        model = nn.Sequential(MyConv(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).double()
        x = torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64)
    elif how == "ParametrizedConv1d":  # as EnCodec's and Wav2Vec2's convolutions
        model = nn.Sequential(reparametrised(how), nn.Tanh(), nn.Conv1d(4, 2, 1)).double()
        x = torch.randn(4, 4, 7, generator=gen, dtype=torch.float64)
    else:
        model = nn.Sequential(reparametrised(how), nn.Tanh(), nn.Linear(4, 2)).double()
        x = torch.randn(4, 3, 4, generator=gen, dtype=torch.float64)
    monitor = lc.convert(model)
    assert not monitor.unconverted and not monitor.untracked
    if how == "subclass":
        assert isinstance(model[0], lc.get_layer_class("Conv", "gns"))
    state = {name: b.clone() for name, b in model.named_buffers() if not name.endswith("_pe_sqnorm")}

    def loss_of(part):  # every forward from the same spectral norm state (its power iteration updates u and v)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in state:
                    b.copy_(state[name])
        return model(x[part]).pow(2).flatten(1).sum(1)

    assert_exact(model, loss_of, 4, monitor=monitor)


# -----------------------------------------------------------------------------
# the replay: autocast, random numbers, failures named


class Scaled(nn.Module):
    """A module only the replay follows (its parameter in exp and tanh), with dropouts inside."""

    def __init__(self, d):
        super().__init__()
        self.scale, self.drop = nn.Parameter(torch.randn(d)), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.tanh(x * self.scale.exp())) + F.dropout(x.sin(), 0.2, training=self.training)


def test_replay_draws_the_forward_s_random_numbers():
    """The replay serves each example its rows of what the forward drew (dropout masks): exact, where drawing anew
    would differ from the batch and be refused as mixing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), Scaled(6), nn.Linear(6, 3)).double()
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss_of(part):
        torch.manual_seed(123)  # the step and the oracle draw the same masks
        return model(x[part]).pow(2).sum((1, 2))

    monitor = lc.convert(model)
    assert type(model[1]).__name__ == "ReplayedForward(Scaled)"
    assert_exact(model, loss_of, 4, parts=[slice(0, 4)], monitor=monitor)


def test_wav2vec2_in_bf16_autocast_is_measured_close_to_float32():
    """Wav2Vec2's replayed modules (group norm, weight-normed positional convolution) replay under the forward's
    bf16 autocast: measured, within bf16's rounding of float32 (they were refused as 'mixing' every step)."""
    config = transformers.Wav2Vec2Config(
        vocab_size=12,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config)
    monitor = lc.convert(model)
    audio = torch.randn(3, 400, generator=torch.Generator().manual_seed(1))
    loss_of = lambda part: model(input_values=audio[part]).logits.float().pow(2).mean((1, 2))  # noqa: E731
    want = measured(model, monitor, loss_of, [slice(0, 1), slice(1, 3)], 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = measured(model, monitor, loss_of, [slice(0, 1), slice(1, 3)], 3)
    assert set(got) == set(want) and len(got) == len(monitor.tracked)
    largest = max(m.rms_pe_norm for m in want.values())  # (a key projection's bias has a gradient of rounding only)
    for name, m in got.items():
        assert m.rms_pe_norm == pytest.approx(want[name].rms_pe_norm, rel=5e-2, abs=1e-4 * largest), name


class OneAtATime(nn.Module):
    """Fails on a batch of one: its replay per example fails in its own code."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        if x.shape[0] < 2:
            raise ValueError("needs two examples")
        return torch.tanh(torch.einsum("bi,i->bi", x, self.scale))  # (einsum: only a replay follows it)


def test_replay_failures_name_their_true_cause(monkeypatch):
    """A module's forward failing on one example's inputs is named as such; a failure of this project's code in the
    replay is named as this project's, with where; neither as the examples mixing."""
    for ours, pattern in (
        (False, r"scale: .*OneAtATime's forward, replayed on one example's inputs, fails \(ValueError: needs two"),
        (True, r"scale: .*nanogns failed while replaying OneAtATime's forward per example, in replay.py:\d+"),
    ):
        if ours:  # (a stand-in for a bug of the replay's own)
            monkeypatch.setattr(replay, "REPLAY_TOLERANCE", None)
            monkeypatch.setattr(
                OneAtATime, "forward", lambda self, x: torch.tanh(torch.einsum("bi,i->bi", x, self.scale))
            )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), OneAtATime())
        monitor = lc.convert(model)
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(ValueError, match=pattern) as error:
            monitor.measure(batch_size=3)
        assert "mixes" not in str(error.value)


# -----------------------------------------------------------------------------
# a parameter used outside its layer's forward


def test_layers_run_without_the_model_s_forward_are_named_as_the_cause():
    """A loop that calls a converted model's submodules itself (model.transformer(...), then model.lm_head) never
    runs the model's forward, which tells the layers whose rows are whose: the step is refused naming that, and the
    fix (before: the error blamed batch_size); calling the model itself is exact."""
    model, _ = gpt2(4, 4)
    ids = torch.randint(1, V - 12, (4, 4), generator=torch.Generator().manual_seed(1))
    monitor = lc.convert(model)

    def by_parts(part):
        logits = model.lm_head(model.transformer(input_ids=ids[part]).last_hidden_state)
        return next_token_losses(logits, ids[part])

    with pytest.raises(ValueError, match=r"no forward of the converted model ran this step.*model\.transformer"):
        measured(model, monitor, by_parts, [slice(0, 4)], 4)
    zero_pe_sqnorm_buffers(model)
    monitor.row_map.clear()
    model.zero_grad(set_to_none=True)
    assert_exact(
        model, lambda part: next_token_losses(model(input_ids=ids[part]).logits, ids[part]), 4, monitor=monitor
    )


def test_an_impossible_pegn_is_refused_naming_the_parameter():
    """A weight also read by its parent's code (with a gradient) in a model built with the layer classes, not
    converted: its layer records part of its gradient only, and pegn^2 < norm^2 is refused, never logged."""

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = PerExampleLinear(4, 4)

        def forward(self, x):
            return self.lin(x) + x @ (10 * self.lin.weight)

    torch.manual_seed(0)
    model = Reads()
    monitor = lc.GNSMonitor(model)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"lin.weight: this step is not measured: its per-example norms give .* below"):
        monitor.measure(batch_size=8)


def test_measurements_never_fall_below_the_batch_gradient():
    """pegn^2 >= norm^2 (Jensen) for every logged parameter of the families above: a sanity bound the monitor
    enforces at every step, checked here on one of the models whose parameters run outside forward."""
    model, loss_of = gemma3n(3)
    monitor = lc.convert(model)
    for m in measured(model, monitor, loss_of, [slice(0, 3)], 3).values():
        assert m.rms_pe_norm**2 >= m.norm**2 * (1 - 1e-9) or math.isclose(m.norm, 0.0, abs_tol=1e-15)


def test_without_the_tag_ids_that_could_be_either_are_refused():
    """Where no forward tags its ids (torch.compile traces no tag), positions (T,) at B == T could be one id per
    example: the step is refused with the fix, never a number; with the tag (eager) the same model is exact."""
    ids = torch.randint(1, V, (5, 5), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = FlatLM().double()
    loss_of = lambda part: next_token_losses(model(ids[part]), ids[part])  # noqa: E731
    monitor = lc.convert(model)
    monitor.row_map.tags_ids = False  # as under torch.compile
    loss_of(slice(0, 5)).mean().backward()
    with pytest.raises(ValueError, match=r"wpe.weight: .*no tag says where the ids come from.*expanded to \(B, T\)"):
        monitor.measure(batch_size=5)
    model.zero_grad(set_to_none=True)
    zero_pe_sqnorm_buffers(model)
    monitor.row_map.tags_ids = True
    assert_exact(model, loss_of, 5, parts=[slice(0, 5)], monitor=monitor)
