"""
Tiny configs made from a model library's config classes, generically (no hub, no per-model table): every field
of the default config is read by what its name says it is (a width, a depth, a number of heads, a vocabulary, a
token id, a per-layer list, ...) and shrunk, nested sub-configs (text_config, vision_config, ...) alike, then the
config class is built again from the shrunk values (so what it derives, and what it validates, follow).

    tiny_config(config_cls, attempt=0)   the config; a later attempt shrinks less (wider, deeper), for the models
                                         whose constraints the first one breaks
"""

import re

WIDTH = 16  # every width: hidden sizes, embedding dims, projections (equal, so towers that must agree do)
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 8
INTERMEDIATE = 32
DEPTH = 2
VOCAB = 128  # token ids of the config are renumbered into its top (image, audio, start and end tokens)
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
IMAGE, PATCH = 32, 4
POSITIONS = 512  # position tables longer than this are cut to it
RANK = 8  # low-rank projections (MLA's q/kv, LoRA-like ranks)
STATE = 8  # state-space widths
MEL = 16  # audio feature bins

# the widths of the later attempts (the first is WIDTH); a model whose constraints need more room gets it
ATTEMPTS = (
    dict(width=WIDTH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate=INTERMEDIATE),
    dict(width=WIDTH, heads=HEADS, kv_heads=HEADS, head_dim=HEAD_DIM, intermediate=INTERMEDIATE),  # no grouped queries
    dict(width=WIDTH, heads=4, kv_heads=2, head_dim=HEAD_DIM, intermediate=INTERMEDIATE),  # heads x head_dim = 2 width
    dict(width=32, heads=4, kv_heads=2, head_dim=8, intermediate=64),
    dict(width=64, heads=4, kv_heads=4, head_dim=16, intermediate=128),
)
# fields the sweep leaves as the config class made them: bookkeeping, and numbers that are not sizes
KEEP = {
    "transformers_version",
    "architectures",
    "_name_or_path",
    "id2label",
    "label2id",
    "num_labels",
    "seed",
    "sampling_rate",
    "sample_rate",
    "semantic_loss_ignore_index",
    "max_length",
    "model_max_length",
    "max_new_tokens",
    "t2u_max_new_tokens",
    "num_inference_steps",
    "num_parallel_samples",
    "prediction_length",
    "context_length",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "scale",
    "floor_scale",
    "query_pre_attn_scalar",
    "rotary_embedding_base",
    "diffusion_max_period",
    "max_timescale",
    "out_indices",  # a backbone's stages: derived again from the new depths
    "_out_indices",
    "out_features",
    "_out_features",
    "stage_names",
    "num_feat_extract_layers",  # the length of a conv feature extractor's lists (kept)
}
_RULES = [  # (name pattern, kind), the first match decides; applied to int fields (and lists of ints)
    (r"(^|_)(vocab_offset)$", "keep"),
    (
        r"token_ids?$|token_index$|^(pad|bos|eos|sep|cls|mask|unk|blank|im_start|im_end|im_newline|tag_pad|subs_pad)_id$|"
        r"_token$|^decoder_start_token_id$|image_patch_id$|^question_token_id$",
        "token",
    ),
    (r"vocab", "vocab"),
    (r"num_kv_shared_layers|first_k_dense_replace|max_window_layers|moe_layer_end_index", "layer_index"),
    (
        r"(^|_)(num_hidden_layers|num_layers|n_layers?|layers|depth|encoder_layers|decoder_layers|num_encoder_layers|"
        r"num_decoder_layers|speech_encoder_layers|conf_num_hidden_layers|num_self_attends_per_block|l_layers|"
        r"x_layers|r_layers|num_blocks|num_layers_per_stack|num_hidden_groups)$",
        "depth",
    ),
    (r"period$", "period"),
    (r"^num_groups$|norm_groups$|^num_norm_groups$|^resnet_groups$|^norm_num_groups$", "groups"),
    (r"^sample_size$", "sample"),
    (r"offset$", "offset"),
    (r"key_value_heads|kv_heads|kv_n_heads|num_query_groups", "kv_heads"),
    (r"heads|(^|_)n_head$|^num_head$", "heads"),
    (
        r"head_dim|^d_kv$|^d_head$|^dim_head$|head_size$|^kv_channels$|^resampler_dim_head$|^mamba_headdim$|"
        r"^rotary_dim$|^d_rel$",
        "head_dim",
    ),
    (r"experts_per_tok|moe_top_?k$|^top_k$|num_experts_per_token|topk_group", "experts_per_token"),
    (r"shared_experts$|^n_shared_experts$", "one"),
    (r"experts$|^n_group$|^num_centroids$", "experts"),
    (
        r"intermediate|ffn|^d_ff$|mlp_dim|^dim_ff$|^d_inner$|^dff$|feed_forward_size|_ff_dim$|ffn_hidden_size|"
        r"expert_ffn_hidden_size|moe_hidden_size|^mlp_hidden_size$",
        "intermediate",
    ),
    (r"lora_rank|_rank$|^hc_lowrank$|^adapter_rank$", "rank"),
    (r"state_size|d_state$|state_dim$|^state_size$|^mamba_d_ssm$", "state"),
    (
        r"position|^n_positions$|^n_ctx$|^max_seq_len$|^max_source_positions$|^max_target_positions$|"
        r"_positions$|^max_pos_emb$|^block_size$",
        "positions",
    ),
    (r"^image_size$|^img_size$|^max_img_size$|^resolution$|^crop_size$|^max_image_size$", "image"),
    (r"^patch_size$|^patch_sizes$", "patch"),
    (r"sliding_window$|^sliding_window_size$|^attention_window$|^local_attention$|^attention_window_size$", "window"),
    (r"num_mel_bins|^n_mel_bins$|^feature_size$|^input_feat_size$|^input_feat_per_channel$|^num_chroma$", "mel"),
    (
        r"^hidden_sizes$|^embed_dims$|^neck_hidden_sizes$|^conv_dim$|^tdnn_dim$|^stage_(in|mid|out)_channels$|"
        r"^stem_channels$|^downsample_channels$|^sscp_conv_channel_size$|^out_channels$|^in_channels$|"
        r"^base_attn_unit_dims$|^channel_multiplier$",
        "widths",
    ),
    (
        r"^depths$|^num_block_repeats$|^block_repeats$|^stage_num_blocks$|^stage_numb_of_layers$|"
        r"^n_attn_blocks$",
        "depths",
    ),
    (
        r"hidden_size|^d_model$|^n_embd$|embed_dim$|^dim$|embedding_size$|hidden_dim$|^emb_dim$|^d_latents$|"
        r"projection_dim$|^output_dim$|codevector_dim$|classifier_proj_size$|xvector_output_dim$|^input_dim$|"
        r"^embedding_dim$|_embed_dim$|^num_filters$|^base_channels$|^hidden_channels$|_channels$|^lru_width$|"
        r"^projector_(input|output)_dim$|^adapter_(in|out)_dim$|^(output|input)_embedding_size$|_proj_size$|"
        r"^true_hidden_size$|^intra_bottleneck_size$|^entity_emb_size$|^visual_feat_dim$|^pooler_output_size$|"
        r"^latent_size$|^frequency_embedding_size$|^encoder_hidden_size$|^num_pos_feats$|^base_dim$|_dim$",
        "width",
    ),
    (
        r"^num_query_tokens$|^num_latents$|^resampler_n_latents$|^resampler_num_latents$|^latent_query_num$|"
        r"^num_image_tokens$|^image_seq_length$|^mm_tokens_per_image$",
        "queries",
    ),
    (r"relative_attention_num_buckets|^position_buckets$|^num_buckets$|rel_pos_bins$", "buckets"),
    (
        r"relative_attention_max_distance|^max_relative_positions$|max_distance$|^max_rel_pos$|^max_rel_2d_pos$",
        "buckets",
    ),
    (r"^codebook_size$|^num_codevectors_per_group$|^num_embeddings$|^codebook_vocab_size$", "vocab"),
]
_FILLED = {"vocab_size", "head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size", "intermediate_size"}
_COMPILED = [(re.compile(pattern), kind) for pattern, kind in _RULES]


def kind_of(name):
    """What a config field is, by its name: one of _RULES's kinds, or None (left as it is)."""
    if name in KEEP:
        return None
    return next((kind for pattern, kind in _COMPILED if pattern.search(name)), None)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v):
    return isinstance(v, (list, tuple)) and v and all(_is_int(x) for x in v)


class Shrinker:
    """One tiny config's choices: the sizes of one attempt, and the token ids renumbered across the whole config
    (the same id in a sub-config and its parent stays the same)."""

    def __init__(self, attempt=0, fill_none=True):
        self.sizes = ATTEMPTS[min(attempt, len(ATTEMPTS) - 1)]
        self.fill_none = fill_none  # a None the default leaves in a size transformers needs set (see _FILLED)
        self.tokens = {}  # original token id -> its id in the tiny vocabulary

    def token(self, value):
        if value < 0 or value < 3:
            return value  # pad 0, bos 1, eos 2 kept (and -100 style ignores)
        if value not in self.tokens:
            self.tokens[value] = VOCAB - 1 - len(self.tokens)
        return self.tokens[value]

    def value(self, kind, v, depth):
        """The shrunk value of one int field of `kind`."""
        s = self.sizes
        small = {
            "vocab": VOCAB,
            "depth": min(v, DEPTH),
            "layer_index": min(v, depth - 1),
            "period": min(v, 2),
            "offset": min(v, 1),
            "kv_heads": min(v, s["kv_heads"]),
            "heads": min(v, s["heads"]),
            "head_dim": min(v, s["head_dim"]),
            "experts_per_token": min(v, EXPERTS_PER_TOKEN),
            "one": min(v, 1),
            "experts": min(v, EXPERTS),
            "intermediate": min(v, s["intermediate"]),
            "rank": min(v, RANK),
            "state": min(v, STATE),
            "positions": min(v, POSITIONS),
            "image": min(v, IMAGE),
            "patch": min(v, PATCH),
            "window": min(v, 4),
            "mel": min(v, MEL),
            "width": min(v, s["width"]),
            "queries": min(v, 4),
            "buckets": min(v, 8),
            "groups": min(v, 2),
            "sample": min(v, 16),
        }
        if kind == "token":
            return self.token(v)
        return small.get(kind, v)

    def fit_rotarysections(self, out):
        """Rotary sections that must add up to the (shrunk) head size: Qwen2-VL's mrope_section (half a head),
        diffusers' axes_dims_rope (a head)."""
        head = out.get("head_dim") or out.get("attention_head_dim")
        if not _is_int(head) and _is_int(out.get("hidden_size")) and _is_int(out.get("num_attention_heads")):
            head = out["hidden_size"] // out["num_attention_heads"]
        if not _is_int(head):
            return
        for key in ("rope_parameters", "rope_scaling"):
            rope = out.get(key)
            if (
                isinstance(rope, dict)
                and _int_list(rope.get("mrope_section"))
                and sum(rope["mrope_section"]) != head // 2
            ):
                out[key] = {**rope, "mrope_section": sections(rope["mrope_section"], head // 2)}
        for key, v in list(out.items()):
            if key.startswith("axes_dim") and _int_list(v) and sum(v) != head:
                out[key] = type(v)(sections(list(v), head))

    def shrink(self, values, subconfigs):
        """The shrunk dict of one (sub-)config's to_dict() values; `subconfigs` names the keys holding configs."""
        out = {}
        old_depths = {v for k, v in values.items() if _is_int(v) and kind_of(k) == "depth"}
        new_depth = DEPTH
        for key, v in values.items():
            kind = kind_of(key)
            if key in subconfigs and isinstance(v, dict):
                out[key] = self.shrink(v, subconfigs[key])
            elif _is_int(v) and kind == "depth" and _int_list(values.get("depths")) and v == len(values["depths"]):
                out[key] = v  # the number of stages of a backbone whose `depths` has one entry per stage
            elif _is_int(v):
                out[key] = self.value(kind, v, new_depth) if kind else v
            elif (
                v is None and key in _FILLED and self.fill_none
            ):  # a size the default leaves unset (its model would fail on None)
                out[key] = self.value(kind, 1 << 30, new_depth)
            elif _int_list(v) and kind in ("widths",):
                out[key] = type(v)(min(x, self.sizes["width"]) for x in v)
            elif _int_list(v) and kind in ("depths",):
                out[key] = type(v)(min(x, 1) for x in v)
            elif _int_list(v) and kind in ("heads", "kv_heads"):
                out[key] = type(v)(self.value(kind, x, new_depth) for x in v)
            elif _int_list(v) and kind == "token":
                out[key] = type(v)(self.token(x) for x in v)
            elif _int_list(v) and kind in ("image", "patch", "intermediate", "width"):
                out[key] = type(v)(self.value(kind, x, new_depth) for x in v)
            else:
                out[key] = v
        # per-layer lists (layer types, per-layer widths, sparsity patterns) follow the new depth; index lists
        # (the layers with full attention, deepstack taps) point into it
        for key, v in list(out.items()):
            if key in subconfigs or not v:
                continue
            if not isinstance(v, (list, tuple)):
                pass
            elif len(v) in old_depths and len(v) > new_depth and kind_of(key) not in ("widths", "depths"):
                picked = [v[round(i * (len(v) - 1) / (new_depth - 1))] for i in range(new_depth)]
                out[key] = type(v)(
                    self.value(kind_of(key), x, new_depth) if _is_int(x) and kind_of(key) else x for x in picked
                )
            elif _int_list(v) and re.search(r"index|indexes|indices|idxs|_layers$|layer_ids$|layers_indices$", key):
                if key == "vision_feature_layer" or any(x < 0 for x in v):
                    out[key] = type(v)(sorted({max(x, -(new_depth + 1)) if x < 0 else min(x, new_depth) for x in v}))
                else:
                    out[key] = type(v)(sorted({min(x, new_depth - 1) for x in v}))
            elif key == "vision_feature_layer" and _is_int(v):
                out[key] = max(v, -(new_depth + 1)) if v < 0 else min(v, new_depth)
            if isinstance(v, dict) and v and all(_is_int(k) or (isinstance(k, str) and k.isdigit()) for k in v):
                # per-layer settings keyed by layer index (Gemma 4's per_layer_config): each index into the new depth
                remapped = {}
                for k, setting in v.items():
                    remapped.setdefault(type(k)(int(k) % new_depth), setting)
                out[key] = remapped
        self.fit_rotarysections(out)
        if _is_int(out.get("vision_feature_layer")):
            v = out["vision_feature_layer"]
            out["vision_feature_layer"] = max(v, -(new_depth + 1)) if v < 0 else min(v, new_depth)
        return out


def sections(sizes, total):
    """`sizes` rescaled to sum to `total`, each at least 1 where total allows, in proportion."""
    whole = sum(sizes) or 1
    found = [max(1, round(x * total / whole)) for x in sizes]
    while sum(found) > total and max(found) > 1:
        found[found.index(max(found))] -= 1
    while sum(found) < total:
        found[found.index(min(found))] += 1
    return found


def _subconfig_keys(config):
    """{key: its own subconfig keys} of the values of `config` that are configs themselves."""
    from transformers import PretrainedConfig

    return {key: _subconfig_keys(value) for key, value in vars(config).items() if isinstance(value, PretrainedConfig)}


DROP = ("transformers_version", "architectures", "_name_or_path", "_attn_implementation_autoset", "dtype")


def tiny_arguments(defaults, attempt=0):
    """The shrunk keyword arguments of a class configured by its constructor's arguments (diffusers' models, timm's):
    `defaults` {name: default}, only those that changed."""
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in defaults.items()}
    shrunk = Shrinker(attempt, fill_none=False).shrink(values, {})
    return {k: (tuple(v) if isinstance(defaults[k], tuple) else v) for k, v in shrunk.items() if values[k] != v}


def _class_defaults(config):
    try:
        return type(config)().to_dict()
    except Exception:  # a config class that cannot be built alone: every value counts as its own
        return {}


def _kwargs(config, shrinker, own=False):
    """The keyword arguments that build `config` again shrunk: the values the shrinker changed, each sub-config's
    as a dict (with its model_type, which names its class), and with `own` the values of `config` its class would
    not give by default (what a parent config chose for its sub-config). Values left out are derived again by
    the config class (layer types, backbone stages, head sizes)."""
    subconfigs = _subconfig_keys(config)
    full = {k: v for k, v in config.to_dict().items() if k not in DROP and k not in subconfigs}
    shrunk = shrinker.shrink(full, {})
    kwargs = {key: value for key, value in shrunk.items() if full[key] != value}
    if own:
        defaults = _class_defaults(config)
        kwargs = {
            **{k: v for k, v in full.items() if k == "model_type" or k not in defaults or defaults[k] != v},
            **kwargs,
        }
    for key in subconfigs:
        kwargs[key] = _kwargs(getattr(config, key), shrinker, own=True)
    return kwargs


def tiny_config(config_cls, attempt=0):
    """A tiny config of `config_cls` (see the module's docstring); raises what the config class raises."""
    return config_cls(**_kwargs(config_cls(), Shrinker(attempt)))
