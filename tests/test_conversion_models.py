"""
convert() on the models people train, each against a brute-force loop over examples:
transformers' mixtures of experts (Mixtral on its default and eager experts, Qwen2-MoE
with shared experts, Qwen3-MoE, OLMoE), OPT (flattened rows, its position embedding),
Gemma and Gemma 3 (scaled embedding, tied head), BERT (the MLM head's aliased bias),
T5 (relative-position table refused), ViT (Conv2d patches, class token and position
embeddings broadcast over the batch), torch's nn.TransformerEncoder (both layouts), a
packed Llama batch, nanochat's casting Linear under bf16 autocast, and in-place ops after
converted layers. float64, two uneven micro-batches, padded sequences.

    python -m pytest -q tests/test_conversion_models.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from oracle import loss_sqnorms_from_batched_forward

import nanogns as lc
from nanogns.core.buffers import zero_pe_sqnorm_buffers

V, B, T = 31, 5, 7
SPLIT = 2  # micro-batches: examples [0, 2) and [2, 5)
TINY = dict(
    vocab_size=V,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=32,
)
NO_DROPOUT = dict(
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    dropout_rate=0.0,
)


def config(cls, **kwargs):
    """A transformers config (keyword arguments a class does not use, such as another model's dropouts, are kept
    as attributes and ignored)."""
    return cls(**kwargs)


def lm_batch(seed=1, pad=True):
    """(ids (B, T), attention mask with two padded examples)."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[1, -2:] = 0
        mask[3, -3:] = 0
    return ids, mask


def lm_losses(model, ids, mask, positions=False):
    """Each example's mean next-token loss over its unpadded tokens, (n,)."""
    extra = dict(position_ids=torch.arange(ids.shape[1]).expand(ids.shape)) if positions else {}
    logits = model(input_ids=ids, attention_mask=mask, **extra).logits.double()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(ids), -1)
    kept = mask[:, 1:].double()
    return (losses * kept).sum(1) / kept.sum(1)


def brute_force(model, loss_of, n):
    """{parameter name: (|mean_i g_i|^2, mean_i |g_i|^2)} by the oracle: each example's gradient from the batched
    forward of all n (loss_of(part) -> the examples' losses)."""
    per_example, batch = loss_sqnorms_from_batched_forward(model, loss_of(slice(0, n)))
    zero_pe_sqnorm_buffers(model)
    return {name: (batch[name], per_example[name]) for name in batch}


def measured(monitor, model, loss_of, parts, n):
    """{logged name: Measurement} of one step over micro-batches `parts`, each loss a share of the mean over n."""
    for part in parts:
        (loss_of(part).sum() / n).backward()
    found = {m.metadata["name"]: m for m in monitor.measure(batch_size=n)}
    model.zero_grad(set_to_none=True)
    zero_pe_sqnorm_buffers(model)
    return found


def check_exact(model, monitor, want, got, coverage=1.0, atol=1e-20):
    """Every measurement within 1e-6 of brute force (atol for gradients that are zero up to rounding, as a key
    projection's bias is, softmax being blind to it); the tracked elements the given share of the model's."""
    for name, m in got.items():
        sq_norm, pe_sqnorm = want[name.split("+")[0]]
        assert m.norm**2 == pytest.approx(sq_norm, rel=1e-6, abs=atol), name
        assert m.rms_pe_norm**2 == pytest.approx(pe_sqnorm, rel=1e-6, abs=atol), name
    tracked = sum(model.get_parameter(name.split("+")[0]).numel() for name in got)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert tracked == pytest.approx(coverage * total), (tracked, total, monitor.unconverted, monitor.untracked)


def run_lm(model, positions=False, micro_batches=((0, SPLIT), (SPLIT, B))):
    """Brute force, convert, one accumulated step; returns (monitor, brute force, measurements)."""
    ids, mask = lm_batch()
    loss_of = lambda part: lm_losses(model, ids[part], mask[part], positions)  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(*p) for p in micro_batches], B)
    return monitor, want, got


# -----------------------------------------------------------------------------
# mixtures of experts

MOE = {
    "Mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=4)),
    "Qwen2-MoE": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(num_experts=4, moe_intermediate_size=12, shared_expert_intermediate_size=20),
    ),
    "Qwen3-MoE": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=4, moe_intermediate_size=12, head_dim=8),
    ),
    "OLMoE": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(num_experts=4)),
    # a bank of one expert, every token routed to it (the kind's probe routed each token to 2 before)
    "HunYuan-1": (
        transformers.HunYuanMoEV1Config,
        transformers.HunYuanMoEV1ForCausalLM,
        dict(num_experts=1, num_experts_per_tok=1, head_dim=8),
    ),
}


@pytest.mark.parametrize(
    "name, implementation", [("Mixtral", "eager"), ("HunYuan-1", "eager")] + [(name, "default") for name in MOE]
)
def test_mixture_of_experts_every_parameter_exact(name, implementation):
    """Routers (kept with their own forward), expert banks (the Experts kind) and shared experts: 100% of the
    elements, each within 1e-6. The brute force runs the eager experts (the default grouped matmuls refuse
    float64); the model is converted on its default implementation, probed in float32."""
    config_cls, model_cls, extra = MOE[name]
    torch.manual_seed(0)
    model = model_cls(
        config(
            config_cls,
            **TINY,
            **{
                **dict(num_key_value_heads=1, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                **extra,
            },
        )
    )
    default = model.config._experts_implementation
    model.config._experts_implementation = "eager"
    ids, mask = lm_batch()
    loss_of = lambda part: lm_losses(model, ids[part], mask[part])  # noqa: E731
    want = brute_force(model.double(), loss_of, B)
    model.config._experts_implementation = default if implementation == "default" else "eager"
    monitor = lc.convert(model.float())
    model.double()
    assert not monitor.unconverted and not monitor.untracked
    assert any(type(m).__name__.startswith("PerExampleExperts") for m in model.modules())
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    check_exact(model, monitor, want, got)


def test_a_token_routed_to_no_expert_adds_nothing():
    """transformers' eager experts skip the sentinel index E (a token dropped by its router): its rows add nothing
    to any expert's norms, and the forward's examples are still counted once."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    experts = MixtralExperts(transformers.MixtralConfig(hidden_size=6, intermediate_size=8, num_local_experts=3))
    experts.config._experts_implementation = "eager"
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    experts.double()
    model = nn.Sequential(experts)  # convert() needs a model around it; the layout comes from the experts' input
    hidden = torch.randn(4, 6, dtype=torch.float64)
    index = torch.tensor([[0, 2], [3, 3], [1, 0], [2, 3]])  # token 1 routed nowhere, tokens 1 and 3 once
    weights = torch.rand(4, 2, dtype=torch.float64)
    grad = torch.randn(4, 6, dtype=torch.float64)
    per_token = []
    for i in range(4):
        experts.zero_grad()
        out = experts(hidden[i : i + 1], index[i : i + 1], weights[i : i + 1])
        if out.requires_grad:  # a token routed to no expert: its output is a constant zero
            out.backward(grad[i : i + 1])
        per_token.append(experts.gate_up_proj.grad.pow(2).sum().item() if experts.gate_up_proj.grad is not None else 0)
    lc.convert(model)
    experts.zero_grad()
    experts(hidden, index, weights).backward(grad)
    total, count = experts.gate_up_proj_pe_sqnorm.tolist()
    assert count == 4 and per_token[1] == 0
    assert total == pytest.approx(sum(per_token), rel=1e-6)


@pytest.mark.parametrize("batch, top_k", [(B, 2), (T, 2), (B, 1)], ids=["B5-top2", "B7-top2", "B5-top1"])
def test_jetmoe_banks_of_rows_regrouped_by_expert_exact(batch, top_k):
    """JetMoE's expert banks (JetMoeParallelExperts: `bank(rows, expert_size)`, the rows regrouped by expert, whose
    examples the ParallelExperts kind reads from the router's gather) in its MLP and in its attention, whose mixture
    of attention heads the attention runs through map and reduce (their bias followed in each call, the banks each a
    kind's layer): every parameter, 100% of the elements, within 1e-6; also with as many examples as tokens (B == T)
    and one expert per token (top-1: as many rows as tokens, which no size tells from the tokens' own)."""
    torch.manual_seed(0)
    # (JetMoE's RMSNorm computes in float32 in a float64 model too, the converted norm in float64: gradients agree to
    # about 1e-7, which weights drawn larger than JetMoE's 0.01 keep far below the router's gradient)
    jetmoe = dict(num_key_value_heads=2, kv_channels=4, num_local_experts=3, num_experts_per_tok=top_k)
    jetmoe.update(initializer_range=0.2)
    model = transformers.JetMoeForCausalLM(
        transformers.JetMoeConfig(**{**TINY, "num_attention_heads": None}, **jetmoe, pad_token_id=0)
    )
    model.config.num_attention_heads = 2 * top_k
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # (JetMoE leaves its biases as torch.empty made them)
                p.normal_(std=0.1)
    ids = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, T, dtype=torch.long)
    mask[1, -2:] = 0
    mask[3, -3:] = 0
    model.double()
    loss_of = lambda part: lm_losses(model, ids[part], mask[part])  # noqa: E731
    want = brute_force(model, loss_of, batch)
    monitor = lc.convert(model)
    assert not monitor.unconverted and not monitor.untracked
    explained = monitor.explain()
    assert explained["model.layers.0.mlp.input_linear"].startswith("a kind's layer: the ParallelExperts kind's")
    assert explained["model.layers.0.self_attention.experts"].startswith("followed with its parent's calls")
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, batch)], batch)
    check_exact(model, monitor, want, got)


def test_convert_called_again_leaves_the_expert_banks_as_they_are():
    """A bank a first convert() made a kind's layer (the Experts kind's, by structure; the ParallelExperts kind's) is
    no bank to convert again: the second call leaves it as it is (it had raised, building an impossible class)."""
    torch.manual_seed(0)
    jetmoe = transformers.JetMoeForCausalLM(
        transformers.JetMoeConfig(**{**TINY, "num_attention_heads": None}, num_key_value_heads=2, kv_channels=4)
    )
    mixtral = transformers.MixtralForCausalLM(
        config(transformers.MixtralConfig, **TINY, num_local_experts=3, num_key_value_heads=1)
    )
    for model, bank in ((jetmoe, "model.layers.0.mlp.input_linear"), (mixtral, "model.layers.0.mlp.experts")):
        first = lc.convert(model).explain()[bank]
        cls = type(model.get_submodule(bank))
        monitor = lc.convert(model)
        assert type(model.get_submodule(bank)) is cls and monitor.explain()[bank] == first
        assert not monitor.unconverted


# -----------------------------------------------------------------------------
# language models with their own layouts and layers


def test_opt_flattened_rows_and_position_embedding_exact():
    """OPT runs fc1, fc2 and the final norm on (B*T, D) rows, and its position embedding takes the attention mask."""
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(
        config(
            transformers.OPTConfig,
            **TINY,
            **NO_DROPOUT,
            ffn_dim=24,
            word_embed_proj_dim=16,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            layerdrop=0.0,
        )
    ).double()
    monitor, want, got = run_lm(model)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


@pytest.mark.parametrize("name", ["Gemma", "Gemma3"])
def test_gemma_scaled_embedding_with_tied_head_exact(name):
    """The embedding scales its output by a buffer (kept, with its own forward); the head is tied to it."""
    config_cls, model_cls = {
        "Gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "Gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[name]
    torch.manual_seed(0)
    model = model_cls(
        config(
            config_cls,
            **TINY,
            num_key_value_heads=1,
            head_dim=8,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            sliding_window=4,
        )
    ).double()
    monitor, want, got = run_lm(model)
    assert not monitor.unconverted and not monitor.untracked
    assert "model.embed_tokens.weight+lm_head.weight" in got
    check_exact(model, monitor, want, got)


def test_bert_aliased_head_bias_logged_once_and_exact():
    """cls.predictions.bias is cls.predictions.decoder.bias: one tensor, recorded by the decoder, logged once."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config(transformers.BertConfig, **TINY, **NO_DROPOUT)).double()
    monitor, want, got = run_lm(model, positions=True)
    assert not monitor.unconverted and not monitor.untracked
    assert "cls.predictions.bias" in got and "cls.predictions.decoder.bias" not in got
    assert monitor.describe()["cls.predictions.bias"]["kind"] == "Linear"
    check_exact(model, monitor, want, got)


@pytest.mark.parametrize("name", ["BERT", "ELECTRA", "GPT-2"])
def test_default_position_ids_looked_up_once_for_the_batch_are_exact(name):
    """Called as every Trainer data collator calls them, without position_ids: the models look their positions up
    as one (1, T) row for the whole batch, which each example now gets a copy of (core/shared.py): every
    parameter exact, with nothing changed by the user."""
    torch.manual_seed(0)
    model = {
        "BERT": lambda: transformers.BertForMaskedLM(config(transformers.BertConfig, **TINY, **NO_DROPOUT)),
        "ELECTRA": lambda: transformers.ElectraForMaskedLM(
            config(transformers.ElectraConfig, **TINY, **NO_DROPOUT, embedding_size=8)
        ),
        "GPT-2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=V,
                n_embd=16,
                n_layer=2,
                n_head=2,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
    }[name]().double()
    monitor, want, got = run_lm(model)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


def test_position_table_of_t_rows_is_exact_when_t_equals_the_batch():
    """wpe(torch.arange(T)) gives T rows broadcast over the batch: with T == B they have the sizes of one row per
    example, but their ids were not computed from the examples' (core/layout.py's tag), so they are a table the
    examples share (core/shared.py), exact; expanded to (B, T) as well."""

    class TinyLM(nn.Module):
        def __init__(self, expand):
            super().__init__()
            self.expand, self.wte, self.wpe, self.head = expand, nn.Embedding(V, 6), nn.Embedding(8, 6), nn.Linear(6, V)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1])
            return self.head(self.wte(idx) + self.wpe(pos.expand(idx.shape) if self.expand else pos))

    ids = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(3))
    for expand in (False, True):
        torch.manual_seed(0)
        model = TinyLM(expand).double()

        def loss_of(part):
            logits = model(ids[part])
            return F.cross_entropy(logits.flatten(0, 1), ids[part].flatten(), reduction="none").view(-1, 4).mean(1)

        want = brute_force(model, loss_of, 4)
        monitor = lc.convert(model)
        check_exact(model, monitor, want, measured(monitor, model, loss_of, [slice(0, 4)], 4))


@pytest.mark.parametrize("masked", [True, False], ids=["padded", "no-mask"])
def test_t5_relative_position_tables_and_shared_matrix_exact(masked):
    """T5's relative_attention_bias looks up a (query, key) table of buckets shared by the batch, added to every
    example's scores (with the padding mask, once; without, at every layer): each example gets its own copy of the
    table (core/shared.py). Its input/output matrix is used by the encoder's and the decoder's embeddings and
    the head: its uses are summed (core/uses.py). Every parameter exact."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(
        config(
            transformers.T5Config,
            vocab_size=V,
            d_model=16,
            d_kv=8,
            d_ff=24,
            num_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
    ).double()
    ids, mask = lm_batch()
    labels = torch.randint(0, V, (B, 5), generator=torch.Generator().manual_seed(2))

    def loss_of(part):
        extra = dict(attention_mask=mask[part]) if masked else {}
        logits = model(input_ids=ids[part], labels=labels[part], **extra).logits
        return F.cross_entropy(logits.flatten(0, 1), labels[part].flatten(), reduction="none").view(-1, 5).mean(1)

    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    assert not monitor.unconverted and not monitor.untracked
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert "shared.weight+encoder.embed_tokens.weight+decoder.embed_tokens.weight+lm_head.weight" in got
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in got
    check_exact(model, monitor, want, got)


def test_vit_patches_class_token_and_position_embeddings_exact():
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(
        config(
            transformers.ViTConfig,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=8,
            patch_size=4,
            num_channels=3,
            num_labels=5,
            **NO_DROPOUT,
        )
    ).double()
    images = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.randint(0, 5, (B,), generator=torch.Generator().manual_seed(2))
    loss_of = lambda part: F.cross_entropy(
        model(pixel_values=images[part]).logits,
        labels[part],  # noqa: E731
        reduction="none",
    )
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    assert not monitor.unconverted and not monitor.untracked
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"} <= set(got)
    check_exact(model, monitor, want, got, atol=1e-24)


class EncoderLM(nn.Module):
    """torch's nn.TransformerEncoder (its layers call nn.MultiheadAttention) between an embedding and a head."""

    def __init__(self, batch_first, d=16):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, d)
        layer = nn.TransformerEncoderLayer(d, 2, 24, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, V)

    def forward(self, ids, padding):
        h = self.emb(ids)
        h = h if self.batch_first else h.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype)
        h = self.encoder(h, mask=causal, src_key_padding_mask=padding, is_causal=True)
        return self.head(h if self.batch_first else h.transpose(0, 1))


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_multihead_attention_exact(batch_first):
    torch.manual_seed(0)
    model = EncoderLM(batch_first).double()
    ids, mask = lm_batch()
    padding = mask == 0

    def loss_of(part):
        logits = model(ids[part], padding[part])
        losses = F.cross_entropy(logits.flatten(0, 1), ids[part].flatten(), reduction="none").view(-1, T)
        return (losses * mask[part]).sum(1) / mask[part].sum(1)

    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    assert not monitor.unconverted and not monitor.untracked
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert "encoder.layers.0.self_attn.in_proj_weight" in got and "encoder.layers.1.self_attn.out_proj.bias" in got
    check_exact(model, monitor, want, got)


def test_multihead_attention_converted_computes_what_torch_computes():
    """Cross-attention, need_weights=True (the default) and a key padding mask: the same outputs and gradients."""
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, batch_first=True).double()
    converted = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True)).double()
    converted[0].load_state_dict(plain.state_dict())
    lc.convert(converted)
    q, kv = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    padding = torch.tensor([[False, False, True, True], [False] * 4, [False, False, False, True]])
    outs = [m(q, kv, kv, key_padding_mask=padding) for m in (plain, converted[0])]
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    for (out, _), m in zip(outs, (plain, converted[0])):
        out.sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), converted[0].named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_packed_llama_batch_one_example_per_sequence():
    """Four sequences packed two per row (position_ids restarting at 0, a block-diagonal mask): batch_size is
    the number of sequences, and each sequence's norm is its own."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(transformers.LlamaConfig, **TINY, num_key_value_heads=1)).double()
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, V, (n,), generator=gen) for n in (5, 3, 7, 4)]

    def sequence_loss(s, logits):
        return F.cross_entropy(logits[:-1], s[1:])

    def packed_losses(group):
        ids = torch.cat(group)[None]
        positions = torch.cat([torch.arange(len(s)) for s in group])[None]
        segment = torch.cat([torch.full((len(s),), i) for i, s in enumerate(group)])
        mask = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment), dtype=torch.bool).tril()
        logits = model(input_ids=ids, position_ids=positions, attention_mask=mask[None, None]).logits[0]
        starts = torch.tensor([0] + [len(s) for s in group]).cumsum(0)
        return torch.stack([sequence_loss(s, logits[a:b]) for s, a, b in zip(group, starts, starts[1:])])

    loss_of = lambda part: packed_losses(sequences[part])  # noqa: E731  (a one-sequence row: unpacked)
    want = brute_force(model, loss_of, 4)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, 2), slice(2, 4)], 4)
    check_exact(model, monitor, want, got)


# -----------------------------------------------------------------------------
# faithful swaps: dtypes, in-place ops


class CastingLinear(nn.Linear):
    """nanochat's Linear: its weight cast to the input's dtype in forward."""

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype))


def test_nanochat_casting_linear_runs_in_bf16_after_conversion():
    """The probe tries a bf16 input with float32 weights: the swap keeps the cast, so the converted model runs in
    bf16 (output dtype as before), under autocast too, with norms within 3e-2 of float32's."""
    torch.manual_seed(0)
    model = nn.Sequential(CastingLinear(6, 8, bias=False), nn.ReLU(), CastingLinear(8, 4, bias=False))
    x = torch.randn(5, 3, 6)
    reference = model(x.bfloat16())
    monitor = lc.convert(model)
    assert not monitor.unconverted and all(m.cast_weight for m in (model[0], model[2]))
    out = model(x.bfloat16())
    assert out.dtype == reference.dtype == torch.bfloat16 and torch.equal(out, reference)
    out.float().pow(2).sum().backward()
    bf16 = {n: b.clone() for n, b in model.named_buffers()}
    zero_pe_sqnorm_buffers(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().pow(2).sum().backward()
    autocast = {n: b.clone() for n, b in model.named_buffers()}
    zero_pe_sqnorm_buffers(model)
    model(x).pow(2).sum().backward()
    for name, buffer in model.named_buffers():
        for other in (bf16, autocast):
            assert other[name][1] == buffer[1] == 5
            assert other[name][0].item() == pytest.approx(buffer[0].item(), rel=3e-2), name


@pytest.mark.parametrize("variant", ["shim", "gns", "fused"])
def test_in_place_ops_on_converted_outputs_work_and_stay_exact(variant):
    """nn.ReLU(inplace=True) after a Linear and a LayerNorm, and `y += 1` on the model's output: as with torch's
    layers, and the norms those of the loop over examples."""
    from oracle import per_example_sqnorms_by_loop

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3), nn.LayerNorm(3), nn.ReLU(inplace=True), nn.Linear(3, 2)
    ).double()
    lc.convert(model, linearclass=variant, lnclass=variant)
    x, g = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 2, dtype=torch.float64)
    y = model(x)
    y += 1
    y.backward(g)
    recorded = {n: b[0].item() for n, b in model.named_buffers()}
    zero_pe_sqnorm_buffers(model)
    loop = per_example_sqnorms_by_loop(model, x, g)
    for name, values in loop.items():
        assert recorded[name + "_pe_sqnorm"] == pytest.approx(values.sum().item(), rel=1e-6), name
