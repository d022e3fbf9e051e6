"""
Which share of the trainable elements of real-size models `nanogns.convert` tracks exactly, and why the rest is not.

    python bench/coverage.py                       # every model; a Markdown table (the README's and docs/results.md's model tables)
    python bench/coverage.py --models=Llama-3-8B,ResNet-50

Each model is built twice from configs written below (transformers 5.23, nothing downloaded):

- at its real size on the meta device (no memory): the inventory of its trainable parameters and their elements;
- as a narrow replica of the same classes (the real config with tiny widths and few layers, every layer type
  present) on the CPU, which `convert` turns into per-example norm layers, probing each module numerically as it does for any model,
  and which then runs one training step (two micro-batches of padded inputs, read by the monitor), so that what is
  decided only while training (a table met where it cannot be followed, a parameter used several times, a step
  refused for batch statistics) is seen too.

A real parameter is counted as tracked when its replica counterpart (the same name, layer indices aside) was tracked
and measured in that step; the replica's reasons explain the rest. The probes cannot run at the real size (they form
the module's parameters in float64: a DeepSeek-V3 expert bank alone is 11e9 elements), and what they decide depends
on the module's code and structure, not its widths. "Tracked" means exact: every layer kind, the generic replay and
the shared-table and many-use paths are checked against the brute-force loop over examples in tests/
(test_conversion_*.py), on tiny configs of these models.
"""

import argparse
import collections
import re
import sys
import warnings

import torch
import torch.nn.functional as F
import transformers

import nanogns as lc

V = 48  # the replicas' vocabulary


def lm(config_cls, model_cls, real, replica, **options):
    return dict(config=config_cls, model=model_cls, real=real, replica=replica, task="lm", **options)


MOE_REPLICA = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1, vocab_size=V)

# name: (config class, model class, real-size config, replica overrides, task, options)
MODELS = {
    "Llama-3-8B": lm(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
        dict(MOE_REPLICA, num_hidden_layers=2),
    ),
    "Mistral-7B": lm(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=4096,
        ),
        dict(MOE_REPLICA, num_hidden_layers=2, sliding_window=4),
    ),
    "Mixtral-8x7B": lm(
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        dict(MOE_REPLICA, num_hidden_layers=2, num_local_experts=4),
        checkpointing=True,
    ),
    "Qwen3-30B-A3B": lm(
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
        ),
        dict(
            MOE_REPLICA, num_hidden_layers=2, moe_intermediate_size=12, head_dim=8, num_experts=4, num_experts_per_tok=2
        ),
        checkpointing=True,
    ),
    "DeepSeek-V3": lm(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
        ),
        dict(
            MOE_REPLICA,
            num_hidden_layers=2,
            num_key_value_heads=2,
            moe_intermediate_size=12,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
    ),
    "DBRX": lm(
        transformers.DbrxConfig,
        transformers.DbrxForCausalLM,
        dict(
            vocab_size=100352,
            d_model=6144,
            n_heads=48,
            n_layers=40,
            max_seq_len=32768,
            attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0),
            ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4),
        ),
        dict(
            vocab_size=V,
            d_model=16,
            n_heads=2,
            n_layers=2,
            max_seq_len=32,
            attn_config=dict(kv_n_heads=1, clip_qkv=8.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=12, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    "GPT-OSS-20B": lm(
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
        ),
        dict(
            MOE_REPLICA, num_hidden_layers=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4
        ),
    ),
    "Gemma-3-1B": lm(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
        ),
        dict(MOE_REPLICA, num_hidden_layers=6, head_dim=8, sliding_window=4),  # 5 local layers, then a global one
    ),
    "BERT-base": lm(
        transformers.BertConfig,
        transformers.BertForMaskedLM,
        dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        dict(MOE_REPLICA, num_hidden_layers=2, num_attention_heads=2),
    ),
    "DeBERTa-v3-base": lm(
        transformers.DebertaV2Config,
        transformers.DebertaV2ForMaskedLM,
        dict(
            vocab_size=128100,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            relative_attention=True,
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            pos_att_type=["p2c", "c2p"],
            max_relative_positions=-1,
            position_biased_input=False,
        ),
        dict(MOE_REPLICA, num_hidden_layers=2, num_attention_heads=2, position_buckets=4, max_relative_positions=8),
    ),
    "ALBERT-base": lm(
        transformers.AlbertConfig,
        transformers.AlbertForMaskedLM,
        dict(
            vocab_size=30000,
            embedding_size=128,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
        ),
        dict(MOE_REPLICA, num_hidden_layers=3, num_attention_heads=2, embedding_size=8),
    ),
    "T5-base": dict(
        config=transformers.T5Config,
        model=transformers.T5ForConditionalGeneration,
        real=dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12),
        replica=dict(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, decoder_start_token_id=0),
        task="seq2seq",
    ),
    "BART-base": dict(
        config=transformers.BartConfig,
        model=transformers.BartForConditionalGeneration,
        real=dict(
            vocab_size=50265,
            d_model=768,
            encoder_layers=6,
            decoder_layers=6,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            max_position_embeddings=1024,
        ),
        replica=dict(
            vocab_size=V,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=24,
            decoder_ffn_dim=24,
            max_position_embeddings=32,
        ),
        task="seq2seq",
    ),
    "Whisper-small": dict(
        config=transformers.WhisperConfig,
        model=transformers.WhisperForConditionalGeneration,
        real=dict(
            vocab_size=51865,
            d_model=768,
            encoder_layers=12,
            decoder_layers=12,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            num_mel_bins=80,
            max_source_positions=1500,
            max_target_positions=448,
        ),
        replica=dict(
            vocab_size=V,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=24,
            decoder_ffn_dim=24,
            num_mel_bins=8,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
        task="speech2text",
    ),
    "ViT-B/16": dict(
        config=transformers.ViTConfig,
        model=transformers.ViTForImageClassification,
        real=dict(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, num_labels=1000
        ),
        replica=dict(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8, patch_size=4
        ),
        task="image",
    ),
    "CLIP ViT-B/32 (vision)": dict(
        config=transformers.CLIPVisionConfig,
        model=transformers.CLIPVisionModelWithProjection,
        real=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=32,
            projection_dim=512,
        ),
        replica=dict(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
            projection_dim=8,
        ),
        task="embedding",
    ),
    "Wav2Vec2-base": dict(
        config=transformers.Wav2Vec2Config,
        model=transformers.Wav2Vec2ForCTC,
        real=dict(vocab_size=32, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        replica=dict(
            vocab_size=V,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=24,
            conv_dim=(8, 8),
            conv_stride=(4, 2),
            conv_kernel=(8, 4),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
        ),
        task="audio",
    ),
    "Mamba-130m": lm(
        transformers.MambaConfig,
        transformers.MambaForCausalLM,
        dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16),
        dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=4, conv_kernel=3),
    ),
    "Jamba": lm(
        transformers.JambaConfig,
        transformers.JambaForCausalLM,
        dict(
            vocab_size=65536,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_experts=16,
            num_experts_per_tok=2,
        ),
        dict(
            MOE_REPLICA,
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=4,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_dt_rank=4,
        ),
    ),
    "ResNet-50 (eval-mode BatchNorm)": dict(
        config=transformers.ResNetConfig,
        model=transformers.ResNetForImageClassification,
        real=dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], layer_type="bottleneck"),
        replica=dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck", num_labels=3),
        task="image",
        eval_mode=True,
    ),
}
# the third wave: vision-language models (their images' tokens in input_ids), SigLIP, and more MoE and hybrid LMs
TEXT_REPLICA = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1, vocab_size=V)
VISION_REPLICA = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8)
MODELS.update(
    {
        "Llama-4-Scout": dict(
            config=transformers.Llama4Config,
            model=transformers.Llama4ForConditionalGeneration,
            real=dict(
                text_config=dict(
                    vocab_size=202048,
                    hidden_size=5120,
                    intermediate_size=8192,
                    intermediate_size_mlp=16384,
                    num_hidden_layers=48,
                    num_attention_heads=40,
                    num_key_value_heads=8,
                    head_dim=128,
                    num_local_experts=16,
                    num_experts_per_tok=1,
                    interleave_moe_layer_step=1,
                    use_qk_norm=True,
                ),
                vision_config=dict(
                    hidden_size=1408,
                    intermediate_size=5632,
                    num_hidden_layers=34,
                    num_attention_heads=16,
                    image_size=336,
                    patch_size=14,
                    vision_output_dim=4096,
                    projector_input_dim=4096,
                    projector_output_dim=4096,
                    pixel_shuffle_ratio=0.5,
                ),
                image_token_index=200092,
            ),
            replica=dict(
                text_config=dict(
                    TEXT_REPLICA,
                    intermediate_size_mlp=24,
                    num_hidden_layers=2,
                    head_dim=8,
                    num_local_experts=4,
                    no_rope_layers=[1, 0],
                    attn_temperature_tuning=False,
                    pad_token_id=0,
                ),
                vision_config=dict(
                    VISION_REPLICA,
                    intermediate_size=64,  # the pixel-shuffled width (16 / 0.5^2)
                    patch_size=2,
                    vision_output_dim=16,
                    projector_input_dim=16,
                    projector_output_dim=16,
                ),
                image_token_index=V - 2,
                boi_token_index=V - 3,
                eoi_token_index=V - 4,
            ),
            task="vlm",
            images="images",
        ),
        "Qwen2-VL-7B": dict(
            config=transformers.Qwen2VLConfig,
            model=transformers.Qwen2VLForConditionalGeneration,
            real=dict(
                text_config=dict(
                    vocab_size=152064,
                    hidden_size=3584,
                    intermediate_size=18944,
                    num_hidden_layers=28,
                    num_attention_heads=28,
                    num_key_value_heads=4,
                    rope_parameters=dict(rope_type="default", mrope_section=[16, 24, 24], rope_theta=1e6),
                ),
                vision_config=dict(
                    depth=32,
                    embed_dim=1280,
                    hidden_size=3584,
                    num_heads=16,
                    patch_size=14,
                    temporal_patch_size=2,
                    spatial_merge_size=2,
                ),
                image_token_id=151655,
                video_token_id=151656,
                vision_start_token_id=151652,
                vision_end_token_id=151653,
            ),
            replica=dict(
                text_config=dict(
                    TEXT_REPLICA,
                    num_hidden_layers=2,
                    rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=1e6),
                ),
                vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2),
                image_token_id=V - 2,
                video_token_id=V - 3,
                vision_start_token_id=V - 4,
                vision_end_token_id=V - 5,
            ),
            task="vlm",
            images="grid",
        ),
        "SmolVLM-256M": dict(
            config=transformers.SmolVLMConfig,
            model=transformers.SmolVLMForConditionalGeneration,
            real=dict(
                text_config=dict(
                    vocab_size=49280,
                    hidden_size=576,
                    intermediate_size=1536,
                    num_hidden_layers=30,
                    num_attention_heads=9,
                    num_key_value_heads=3,
                ),
                vision_config=dict(
                    hidden_size=768,
                    intermediate_size=3072,
                    num_hidden_layers=12,
                    num_attention_heads=12,
                    image_size=512,
                    patch_size=16,
                ),
                scale_factor=4,
                image_token_id=49190,
            ),
            replica=dict(
                text_config=dict(TEXT_REPLICA, num_hidden_layers=2, pad_token_id=0),
                vision_config=dict(VISION_REPLICA, patch_size=2),
                scale_factor=2,
                image_token_id=V - 2,
            ),
            task="vlm",
            images="tiles",
        ),
        "SigLIP-base": dict(
            config=transformers.SiglipConfig,
            model=transformers.SiglipModel,
            real=dict(
                text_config=dict(
                    vocab_size=32000,
                    hidden_size=768,
                    intermediate_size=3072,
                    num_hidden_layers=12,
                    num_attention_heads=12,
                    max_position_embeddings=64,
                ),
                vision_config=dict(
                    hidden_size=768,
                    intermediate_size=3072,
                    num_hidden_layers=12,
                    num_attention_heads=12,
                    image_size=224,
                    patch_size=16,
                ),
            ),
            replica=dict(
                text_config=dict(
                    vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2
                ),
                vision_config=dict(VISION_REPLICA, patch_size=4),
            ),
            task="contrastive",
        ),
        "Gemma-3-4B": dict(
            config=transformers.Gemma3Config,
            model=transformers.Gemma3ForConditionalGeneration,
            real=dict(
                text_config=dict(
                    vocab_size=262208,
                    hidden_size=2560,
                    intermediate_size=10240,
                    num_hidden_layers=34,
                    num_attention_heads=8,
                    num_key_value_heads=4,
                    head_dim=256,
                    sliding_window=1024,
                ),
                vision_config=dict(
                    hidden_size=1152,
                    intermediate_size=4304,
                    num_hidden_layers=27,
                    num_attention_heads=16,
                    image_size=896,
                    patch_size=14,
                    vision_use_head=False,
                ),
                mm_tokens_per_image=256,
                image_token_id=262144,
                boi_token_id=255999,
                eoi_token_id=256000,
            ),
            replica=dict(
                text_config=dict(TEXT_REPLICA, num_hidden_layers=6, head_dim=8, sliding_window=4, pad_token_id=0),
                vision_config=dict(VISION_REPLICA, patch_size=2, vision_use_head=False),
                mm_tokens_per_image=4,
                image_token_id=V - 2,
                boi_token_id=V - 3,
                eoi_token_id=V - 4,
            ),
            task="vlm",
            images="images",
        ),
        "Phi-3.5-MoE": lm(
            transformers.PhimoeConfig,
            transformers.PhimoeForCausalLM,
            dict(
                vocab_size=32064,
                hidden_size=4096,
                intermediate_size=6400,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                num_local_experts=16,
                num_experts_per_tok=2,
            ),
            dict(MOE_REPLICA, num_hidden_layers=2, num_local_experts=4),
        ),
        "LFM2-1.2B": lm(
            transformers.Lfm2Config,
            transformers.Lfm2ForCausalLM,
            dict(
                vocab_size=65536,
                hidden_size=2048,
                intermediate_size=12288,
                block_ff_dim=12288,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                layer_types=[
                    "full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)
                ],  # 10 short-convolution blocks, 6 attention blocks
            ),
            dict(
                MOE_REPLICA,
                num_hidden_layers=2,
                block_ff_dim=24,
                block_auto_adjust_ff_dim=False,
                layer_types=["conv", "full_attention"],
            ),
        ),
    }
)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
B, SPLIT, T = 4, 1, 7  # the replica's step: 4 examples in micro-batches of 1 and 3, 7 tokens (2 padded in one)


def normalised(name):
    """A parameter's name with its layer indices taken out: the real model's and the replica's match."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _merged(real, replica):
    """The replica's config: the real one with the replica's values, sub-configs (text_config, ...) merged too."""
    found = dict(real)
    for key, value in replica.items():
        found[key] = _merged(real[key], value) if isinstance(value, dict) and isinstance(real.get(key), dict) else value
    return found


def build(spec, which):
    kwargs = dict(spec["real"]) if which == "real" else _merged(spec["real"], spec["replica"])
    if which == "replica" and spec["task"] in ("lm", "seq2seq") and "pad_token_id" not in kwargs:
        kwargs.update(IDS)
    config = spec["config"](**kwargs)
    if which == "real":
        with torch.device("meta"):
            return spec["model"](config)
    torch.manual_seed(0)
    model = spec["model"](config)
    for key in ("_experts_implementation", "_attn_implementation"):
        if hasattr(model.config, key):
            setattr(model.config, key, "eager")  # float64 runs (the default implementations refuse it)
    return model.double()


def losses(spec, model):
    """loss_of(part) -> each example's loss on a fixed padded batch of B examples."""
    gen = torch.Generator().manual_seed(1)
    task = spec["task"]
    if task in ("lm", "seq2seq"):
        ids = torch.randint(3, V, (B, T), generator=gen)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, -2:] = 0
        if task == "lm":

            def loss_of(part):
                logits = model(input_ids=ids[part], attention_mask=mask[part]).logits
                token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[part, 1:].flatten(), reduction="none")
                kept = mask[part, 1:].double()
                return (token.view(len(kept), -1) * kept).sum(1) / kept.sum(1)

            return loss_of
        labels = torch.randint(3, V, (B, 5), generator=gen)
        return lambda part: _seq2seq(
            model(input_ids=ids[part], attention_mask=mask[part], labels=labels[part]), labels[part]
        )
    if task == "speech2text":
        features = torch.randn(B, spec["replica"]["num_mel_bins"], 16, generator=gen, dtype=torch.float64)
        labels = torch.randint(3, V, (B, 5), generator=gen)
        return lambda part: _seq2seq(model(input_features=features[part], labels=labels[part]), labels[part])
    if task == "audio":
        audio = torch.randn(B, 400, generator=gen, dtype=torch.float64)
        return lambda part: model(input_values=audio[part]).logits.pow(2).mean((1, 2))
    if task == "vlm":
        return _vlm_losses(spec, model, gen)
    if task == "contrastive":  # each example's own text and image pair: its logit (no loss over the batch's pairs)
        ids = torch.randint(3, V, (B, T), generator=gen)
        size = model.config.vision_config.image_size
        pixels = torch.randn(B, 3, size, size, generator=gen, dtype=torch.float64)

        def contrastive(part):
            out = model(input_ids=ids[part], pixel_values=pixels[part])
            return -F.logsigmoid(out.logits_per_text.diagonal())

        return contrastive
    size = spec["replica"].get("image_size", 16)
    pixels = torch.randn(B, 3, size, size, generator=gen, dtype=torch.float64)
    if task == "embedding":
        return lambda part: model(pixel_values=pixels[part]).image_embeds.pow(2).sum(1)
    labels = torch.randint(0, model.config.num_labels, (B,), generator=gen)
    return lambda part: F.cross_entropy(model(pixel_values=pixels[part]).logits, labels[part], reduction="none")


IMAGES = (1, 0, 2, 1)  # images of the replica's examples (example 1 has none; a micro-batch of 1 and one of 3)
VLM_T = 12


def _vlm_losses(spec, model, gen):
    """loss_of(part) for a vision-language replica: each example's images as its image tokens in input_ids (4 per
    image: Qwen2-VL's 4x4 patches merged 2x2, SmolVLM's tiles of 4x4 patches shuffled 2x2, Gemma 3's pooled
    patches, Llama 4's pixel-shuffled patches), each example's mean next-token loss."""
    config = model.config
    token = getattr(config, "image_token_id", None) or config.image_token_index
    ids = torch.randint(3, V - 6, (B, VLM_T), generator=gen)
    start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
    for example, count in enumerate(IMAGES):
        for j in range(count):  # each image's tokens, between its start and end tokens where the model has them
            ids[example, 1 + 6 * j : 5 + 6 * j] = token
            if start is not None:
                ids[example, 6 * j], ids[example, 5 + 6 * j] = start, end
    size = getattr(config.vision_config, "image_size", 8)
    kind = spec["images"]
    if kind == "grid":  # Qwen2-VL: (patches, C * t * p * p) rows and each image's (t, h, w)
        width = 3 * 2 * 2 * 2
        pixels = torch.randn(sum(IMAGES), 16, width, generator=gen, dtype=torch.float64)
    elif kind == "tiles":  # SmolVLM: (B, tiles, C, H, W), zero tiles padding an example with fewer
        pixels = torch.zeros(B, max(IMAGES), 3, size, size, dtype=torch.float64)
        for example, count in enumerate(IMAGES):
            pixels[example, :count] = torch.randn(count, 3, size, size, generator=gen, dtype=torch.float64)
    else:  # (images, C, H, W)
        pixels = torch.randn(sum(IMAGES), 3, size, size, generator=gen, dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(B), torch.tensor(IMAGES))

    def loss_of(part):
        mine = (owner >= part.start) & (owner < part.stop)
        inputs = {}
        if kind == "tiles" and sum(IMAGES[part]):
            inputs = dict(
                pixel_values=pixels[part], pixel_attention_mask=torch.ones(*pixels[part].shape[:2], size, size)
            )
        elif kind == "grid" and mine.any():
            grid = torch.tensor([[1, 4, 4]] * int(mine.sum()))
            inputs = dict(
                pixel_values=pixels[mine].flatten(0, 1),
                image_grid_thw=grid,
                mm_token_type_ids=(ids[part] == token).long(),
            )
        elif kind == "images" and mine.any():
            inputs = dict(pixel_values=pixels[mine])
            if "Gemma3" in type(model).__name__:
                inputs["token_type_ids"] = (ids[part] == token).long()
        logits = model(input_ids=ids[part], **inputs).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[part, 1:].flatten(), reduction="none")
        return losses.view(len(ids[part]), -1).mean(1)

    return loss_of


def _seq2seq(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none").view(len(labels), -1).mean(1)


def replica_verdicts(spec, train_mode=False):
    """({normalised name: None (tracked and measured) or why not}, {kind: normalised names}, step error or None)."""
    model = build(spec, "replica")
    model.train(True)
    if spec.get("eval_mode") and not train_mode:
        model.eval()
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    monitor = lc.convert(model)
    loss_of = losses(spec, model)
    error = None
    try:
        for part in (slice(0, SPLIT), slice(SPLIT, B)):
            (loss_of(part).sum() / B).backward()
        measured = {m.metadata["name"] for m in monitor.measure(batch_size=B)}
    except ValueError as e:
        measured, error = set(), str(e)
    verdicts, kinds = {}, collections.defaultdict(set)
    described = monitor.describe()
    for entry in monitor.tracked:
        reason = None if entry.name in measured else (error or monitor.untracked.get(entry.name, "not measured"))
        for part in entry.name.split("+"):
            verdicts[normalised(part)] = reason
            kinds[_how(entry.name, described[entry.name])].add(normalised(part))
    for name, reason in monitor.untracked.items():
        verdicts[normalised(name)] = reason
    return verdicts, kinds, error


def _how(name, record):
    """How a tracked tensor is measured, in the table's words."""
    kind = record["kind"]
    if kind == "Replayed":
        return "replayed"
    return f"{kind} (shared)" if "+" in name else kind


def coverage(name, spec):
    """A table row: (model, trainable elements, share tracked, how, the remainder's reasons)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' fallbacks and deprecations, convert's listing
        verdicts, kinds, error = replica_verdicts(spec)
        real = build(spec, "real")
    params = [(n, p.numel()) for n, p in real.named_parameters() if p.requires_grad]
    total = sum(n for _, n in params)
    tracked, remainder, by_kind = 0, collections.Counter(), collections.Counter()
    for param, numel in params:
        key = normalised(param)
        reason = verdicts.get(key, "no counterpart in the replica")
        if reason is None:
            tracked += numel
            by_kind[next(k for k, names in kinds.items() if key in names)] += numel
        else:
            remainder[reason] += numel
    how = ", ".join(f"{k} {100 * n / total:.1f}%" for k, n in by_kind.most_common())
    notes = "; ".join(f"{100 * n / total:.2f}%: {reason}" for reason, n in remainder.most_common())
    if spec.get("eval_mode"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, _, train_error = replica_verdicts(spec, train_mode=True)
        notes = "; ".join(x for x in (notes, f"in training mode the step is refused: {train_error[:140]}...") if x)
    if spec.get("checkpointing"):
        how += " (non-reentrant activation checkpointing)"
    return name, total, tracked / total, how, notes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names (default: all)")
    args = parser.parse_args()
    print("| model | trainable elements | tracked exactly | how (share of the elements) | the rest |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        model, total, share, how, notes = coverage(name, MODELS[name])
        print(f"| {model} | {total / 1e9:.3g}e9 | {100 * share:.1f}% | {how} | {notes or '-'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
