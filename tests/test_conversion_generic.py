"""
Modules no kind describes, each against the brute-force loop over examples (float64, two uneven micro-batches,
padded sequences): their forward is kept, with their parameters' uses followed (intercept.py) or, where those
cannot be followed, replayed per example in backward (replay.py): Mamba's, Mamba2's, Jamba's, Zamba2's, Bamba's and
FalconH1's mixers (their forward kept, A_log, D and the children it reads, conv1d and dt_proj, followed), the gated norm of Mamba2, Zamba2, Bamba and FalconH1 (never swapped for a one-input
RMSNorm), Jamba, GPT-OSS's attention sinks, Cohere's per-head q/k norms, Nemotron's LayerNorm1P, RWKV's time
mixing, DeepSeek-V3's router, Wav2Vec2's GroupNorm and weight-normed position convolution, ConvNeXt's channel
LayerNorm and layer scale, DBRX's expert banks (a kind of their own). A module whose output for one example
depends on the others is refused with that reason.

    python -m pytest -q tests/test_conversion_generic.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from oracle import loss_sqnorms_from_batched_forward
from test_conversion_models import SPLIT, TINY, B, V, brute_force, check_exact, config, lm_batch, lm_losses, measured

import nanogns as lc
from nanogns.conversion.intercept import InterceptedForward
from nanogns.conversion.replay import ReplayedForward
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.core.module_state import state_of
from nanogns.kinds.experts_dbrx import PerExampleDbrxExperts

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAMBA2 = dict(mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4)
NO_DROPOUT = {k: 0.0 for k in ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout")}


def causal_lms():
    """{name: a function building the tiny model (float32; the test makes it float64)}."""
    return {
        "Mamba": lambda: transformers.MambaForCausalLM(
            transformers.MambaConfig(
                vocab_size=TINY["vocab_size"], hidden_size=16, num_hidden_layers=1, state_size=4, conv_kernel=3
            )
        ),
        "Mamba2": lambda: transformers.Mamba2ForCausalLM(
            transformers.Mamba2Config(
                vocab_size=TINY["vocab_size"],
                hidden_size=16,
                num_hidden_layers=1,
                state_size=4,
                n_groups=1,
                head_dim=8,
                num_heads=4,
                chunk_size=4,
                conv_kernel=3,
            )
        ),
        "Jamba": lambda: transformers.JambaForCausalLM(
            config(
                transformers.JambaConfig,
                **{**TINY, "num_hidden_layers": 2},
                **IDS,
                num_key_value_heads=1,
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
            )
        ),
        "Zamba2": lambda: transformers.Zamba2ForCausalLM(
            config(
                transformers.Zamba2Config,
                **{**TINY, "num_hidden_layers": 2},
                **IDS,
                **{k: v for k, v in MAMBA2.items() if k != "mamba_chunk_size"},
                num_key_value_heads=2,
                mamba_ngroups=1,
                mamba_headdim=8,
                n_mamba_heads=4,
                layers_block_type=["mamba", "hybrid"],
                num_mem_blocks=1,
                use_shared_attention_adapter=False,
                chunk_size=4,
                use_mem_rope=False,
            )
        ),
        "Bamba": lambda: transformers.BambaForCausalLM(
            config(
                transformers.BambaConfig,
                **{**TINY, "num_hidden_layers": 2},
                **IDS,
                **MAMBA2,
                num_key_value_heads=1,
                mamba_n_groups=1,
                mamba_d_head=8,
                mamba_n_heads=4,
                attn_layer_indices=[1],
            )
        ),
        "FalconH1": lambda: transformers.FalconH1ForCausalLM(
            config(
                transformers.FalconH1Config,
                **TINY,
                **IDS,
                **MAMBA2,
                num_key_value_heads=1,
                head_dim=8,
                mamba_d_ssm=32,
                mamba_n_groups=1,
                mamba_d_head=8,
                mamba_n_heads=4,
                mamba_rms_norm=True,
            )
        ),
        "GPT-OSS": lambda: transformers.GptOssForCausalLM(
            config(
                transformers.GptOssConfig,
                **TINY,
                **IDS,
                num_key_value_heads=1,
                head_dim=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["full_attention"],
            )
        ),
        "Cohere": lambda: transformers.CohereForCausalLM(
            config(transformers.CohereConfig, **TINY, **IDS, num_key_value_heads=1, use_qk_norm=True)
        ),
        "Nemotron": lambda: transformers.NemotronForCausalLM(
            config(transformers.NemotronConfig, **TINY, **IDS, num_key_value_heads=1)
        ),
        "RWKV": lambda: transformers.RwkvForCausalLM(
            transformers.RwkvConfig(
                vocab_size=TINY["vocab_size"],
                hidden_size=16,
                num_hidden_layers=2,
                attention_hidden_size=16,
                intermediate_size=24,
                context_length=32,
            )
        ),
        "DeepSeek-V3": lambda: transformers.DeepseekV3ForCausalLM(
            config(
                transformers.DeepseekV3Config,
                **TINY,
                **IDS,
                num_key_value_heads=2,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=12,
                n_shared_experts=1,
                first_k_dense_replace=0,
                kv_lora_rank=8,
                q_lora_rank=8,
                qk_rope_head_dim=4,
                qk_nope_head_dim=4,
                v_head_dim=8,
                n_group=2,
                topk_group=1,
            )
        ),
        "DBRX": lambda: transformers.DbrxForCausalLM(
            transformers.DbrxConfig(
                vocab_size=TINY["vocab_size"],
                d_model=16,
                n_heads=2,
                n_layers=1,
                max_seq_len=32,
                attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                ffn_config=dict(ffn_hidden_size=12, moe_num_experts=4, moe_top_k=2),
                **IDS,
            )
        ),
    }


# the state-space mixers, whose code reads their children's weights (conv1d.weight.squeeze(1) into a depthwise
# convolution, dt_proj.weight @ x): kept with their own forward, their own and those children's parameters' uses
# followed (intercept.py; a probe shows it computes the same), the children they only call converted by kind (Mamba2's
# norm and out_proj are read too: handed by keyword to its CUDA kernel, a branch the CPU does not take)
FOLLOWED_WITH_CHILDREN = {
    "Mamba": ("backbone.layers.0.mixer", ("conv1d", "dt_proj", "out_proj", "x_proj")),
    "Mamba2": ("backbone.layers.0.mixer", ("conv1d", "norm", "out_proj")),
    "Jamba": ("model.layers.0.mamba", ("conv1d", "dt_proj")),
    "Zamba2": ("model.layers.0.mamba", ("conv1d", "norm", "out_proj")),
    "Bamba": ("model.layers.0.mamba", ("conv1d", "norm", "out_proj")),
    "FalconH1": ("model.layers.0.mamba", ("conv1d", "norm", "out_proj")),
}
# blocks kept with their own forward, their parameters' uses followed (intercept.py): GPT-OSS's sinks reshaped and
# expanded over the examples (a table the examples share, core/shared.py); RWKV's attention is replayed alone
INTERCEPTED = {"GPT-OSS": "model.layers.0.self_attn"}
REPLAYED_ALONE = {"RWKV": "rwkv.blocks.0.attention", "Cohere": "model.layers.0.self_attn.q_norm"}


@pytest.mark.parametrize("name", list(causal_lms()))
def test_modules_no_kind_describes_are_exact(name):
    """100% of the elements, each within 1e-6 of the loop over examples."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: kernels falling back to their torch implementations
        model = causal_lms()[name]()
        for key in ("_experts_implementation", "_attn_implementation"):
            setattr(model.config, key, "eager")
        model.double()
        ids, mask = lm_batch()
        loss_of = lambda part: lm_losses(model, ids[part], mask[part])  # noqa: E731
        want = brute_force(model, loss_of, B)
        monitor = lc.convert(model)
        got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    if name in FOLLOWED_WITH_CHILDREN:
        path, children = FOLLOWED_WITH_CHILDREN[name]
        assert isinstance(model.get_submodule(path), InterceptedForward)
        assert state_of(model.get_submodule(path)).read_children == children
    if name in INTERCEPTED:
        assert isinstance(model.get_submodule(INTERCEPTED[name]), InterceptedForward)
    if name in REPLAYED_ALONE:  # its own parameters only, its children converted by kind
        assert not state_of(model.get_submodule(REPLAYED_ALONE[name])).replay_subtree
    if name == "DBRX":  # banks this large get a kind, not the replay
        assert isinstance(model.transformer.blocks[0].ffn.experts, PerExampleDbrxExperts)
    check_exact(model, monitor, want, got)


@pytest.mark.parametrize("name", ["Mamba2", "Zamba2", "Bamba", "FalconH1"])
def test_the_gated_norm_is_never_swapped_for_a_one_input_rmsnorm(name):
    """MambaRMSNormGated's forward (and Zamba2's, Bamba's, FalconH1's copies) takes (hidden_states, gate): a one-input
    RMSNorm would crash on the model's call (before: TypeError, forward() takes 2 positional arguments but 3 were
    given) or drop the gate."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = causal_lms()[name]()
        for layer in model.modules():  # the gated norms stand alone, outside a replayed mixer
            if type(layer).__name__.endswith("RMSNormGated"):
                gated = layer
        lc.convert(nn.ModuleDict({"norm": gated}))
    assert type(gated).__mro__[1].__name__ != "PerExampleRMSNorm" and "forward" not in vars(type(gated))
    x, gate = torch.randn(3, 4, gated.weight.shape[0]), torch.randn(3, 4, gated.weight.shape[0])
    out = gated(x, gate)
    assert out.shape == x.shape and not torch.allclose(out, gated(x))  # the gate is applied


def images_and_audio():
    """{name: (model, input keyword, inputs)}: Wav2Vec2 (GroupNorm, weight norm) and ConvNeXt (layer scale)."""
    gen = torch.Generator().manual_seed(1)
    wav2vec2 = transformers.Wav2Vec2ForSequenceClassification(
        transformers.Wav2Vec2Config(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=24,
            conv_dim=(8, 8),
            conv_stride=(4, 2),
            conv_kernel=(8, 4),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
            feat_extract_norm="group",
            mask_time_prob=0.0,
            layerdrop=0.0,
            final_dropout=0.0,
            num_labels=3,
            **NO_DROPOUT,
        )
    )
    convnext = transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(
            num_channels=3,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_labels=3,
            image_size=16,
            layer_scale_init_value=0.5,
        )
    )
    return {
        "Wav2Vec2": (wav2vec2, "input_values", torch.randn(B, 400, generator=gen, dtype=torch.float64)),
        "ConvNeXt": (convnext, "pixel_values", torch.randn(B, 3, 16, 16, generator=gen, dtype=torch.float64)),
    }


@pytest.mark.parametrize("name", ["Wav2Vec2", "ConvNeXt"])
def test_group_norm_weight_norm_channel_norm_and_layer_scale_are_exact(name):
    torch.manual_seed(0)
    model, key, inputs = images_and_audio()[name]
    model.double()
    labels = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(2))
    loss_of = lambda part: F.cross_entropy(model(**{key: inputs[part]}).logits, labels[part], reduction="none")  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


def _stepped(model, x, parts):
    """`model` converted and stepped on inputs `x` (its examples on dim 0) in micro-batches `parts`, each example's
    loss the mean square of its output, with the brute force over the same forwards: (monitor, want, got)."""
    loss_of = lambda part: model(x[part]).pow(2).mean((1, 2))  # noqa: E731
    want = brute_force(model, loss_of, len(x))
    monitor = lc.convert(model)
    return monitor, want, measured(monitor, model, loss_of, parts, len(x))


def _converted_and_stepped(model):
    """`model` converted and stepped on (4, 4, 6) frames, B == T on purpose, in micro-batches of 1 and 3, with the
    brute force over the same forwards: (monitor, want, got)."""
    x = torch.randn(4, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return _stepped(model, x, [slice(0, 1), slice(1, 4)])


class BatchScaled(nn.Module):
    """Divides every row by the batch's mean norm: a module that mixes the examples of a batch."""

    def __init__(self, d=6):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x, mask=None):
        return x / x.norm(dim=-1).mean() * self.gain.exp()


def test_a_module_mixing_examples_refuses_the_step_with_the_reason():
    """The replayed output of one example alone is not that example's rows in the batch: the step is refused,
    naming the module and why (never a number)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), BatchScaled()).double()
    monitor = lc.convert(model)
    assert isinstance(model[1], ReplayedForward)
    model(torch.randn(4, 3, 6, dtype=torch.float64)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"1.gain: this step is not measured.*BatchScaled's output for one example "):
        monitor.step(batch_size=4)


def test_wav2vec2_masked_frames_take_each_example_its_copy_of_the_mask_embedding():
    """SpecAugment in training writes masked_spec_embed into the masked frames (hidden[mask] = W): each example's
    frames get its own copy, so its gradient is exact (masks given, so that the loop draws the same)."""
    reference, _, audio = images_and_audio()["Wav2Vec2"]
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(
        transformers.Wav2Vec2Config(**{**reference.config.to_dict(), "mask_time_prob": 0.5})
    )
    model.double()
    frames = model(audio[:1]).last_hidden_state.shape[1]
    masks = torch.rand(B, frames, generator=torch.Generator().manual_seed(3)) < 0.5
    loss_of = lambda part: model(audio[part], mask_time_indices=masks[part]).last_hidden_state.pow(2).mean((1, 2))  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked and got["masked_spec_embed"].rms_pe_norm > 0
    check_exact(model, monitor, want, got)


class _GatedHeadNorm(nn.Module):
    """Qwen3.5's and OLMo-Hybrid's gated RMSNorm: a module of its own (no kind), called on heads flattened into rows
    ((N, T, H * d) reshaped to (N*T*H, d)) with a gate flattened the same way."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x, gate):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(gate)


class _FlattensItsHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.gate, self.norm, self.head = (
            nn.Linear(6, 8),
            nn.Linear(6, 8),
            _GatedHeadNorm(2),
            nn.Linear(8, 3),
        )

    def forward(self, x):
        N, T, _ = x.shape
        heads = self.proj(x).view(N, T, 4, 2).transpose(1, 2).reshape(-1, 2)  # (N*H*T, d), heads first
        return self.head(
            self.norm(heads, self.gate(x).view(N, T, 4, 2).transpose(1, 2).reshape(-1, 2)).view(N, 8, T).transpose(1, 2)
        )


def test_a_replayed_module_on_rows_a_reshape_flattened_from_the_examples_exact():
    """The norm's (N*H*T, d) rows: no input's length, so sizes say nothing; the autograd history (a reshape of
    (N, ...) data) says each example holds H*T of them, one example after the other. Replayed, exact, B == T."""
    torch.manual_seed(0)
    model = _FlattensItsHeads().double()
    monitor, want, got = _converted_and_stepped(model)
    assert isinstance(model.norm, ReplayedForward)
    check_exact(model, monitor, want, got)


class _RowsAndAScale(nn.Module):
    """I-BERT's QuantEmbedding, unquantised: a lookup returning (rows, its scale), whose forward takes more than
    its ids (no kind's layer, no probe on rows of floats): replayed per example."""

    def __init__(self, n, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d))

    def forward(self, ids, positions=None):
        return F.embedding(ids, self.weight), None


class _LooksUpIdsMadeForTheBatch(nn.Module):
    """Token types made with torch.zeros of the ids' shape, (N, T), and positions from torch.arange, one (1, T) row
    for the batch: ids no example's inputs made, looked up by replayed modules."""

    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(V, 6), nn.Linear(6, V)
        self.positions, self.types = _RowsAndAScale(8, 6), _RowsAndAScale(2, 6)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        types = torch.zeros(ids.shape, dtype=torch.long)
        return self.head(self.wte(ids) + self.positions(positions)[0] * self.types(types)[0])


def test_a_replayed_module_given_ids_no_example_made_computes_a_table_exact():
    """Ids the examples' inputs did not make (untagged) are a table's, whatever their sizes (core/ids.py): the
    replayed modules looking them up compute tables the examples share (replay.py's pe_table), each example given
    its copy of the positions' row and its own rows of the token types' where they meet its tokens. Exact, the
    second micro-batch of 4 examples of 4 tokens. Before, the replay looked for the examples among the ids' dims by
    their sizes: the positions' (1, T) row, T == N, was replayed one position at a time as if each were an example
    (wrong numbers, which this test caught), and with T != N refused; the token types' (N, T) zeros taken for the
    examples' rows."""
    torch.manual_seed(0)
    model = _LooksUpIdsMadeForTheBatch().double()
    ids = torch.randint(0, V, (5, 4), generator=torch.Generator().manual_seed(1))
    monitor, want, got = _stepped(model, ids, [slice(0, 1), slice(1, 5)])
    assert isinstance(model.positions, ReplayedForward) and isinstance(model.types, ReplayedForward)
    assert {"positions.weight", "types.weight"} <= set(got)
    check_exact(model, monitor, want, got)


class _NormsItsRow(nn.Module):
    """A module given a row the forward built from no example ((1, T, D) sinusoidal positions), which it normalises
    with its own weight; two inputs, so no probe can check its forward: replayed."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, pos, other=None):
        return F.layer_norm(pos, (6,), self.w, None) if other is None else pos


class _AddsANormedRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.pos, self.head = nn.Embedding(V, 6), _NormsItsRow(), nn.Linear(6, V)

    def forward(self, ids):
        steps = torch.arange(ids.shape[1], dtype=torch.float64)[None, :, None]
        return self.head(self.wte(ids) + self.pos(torch.sin(steps * torch.arange(1, 7, dtype=torch.float64))))


def test_a_replayed_module_given_a_built_row_whose_length_is_the_batch_never_takes_it_for_the_examples():
    """(1, T, D) positions with T == N: the only dim of the examples' size is not dim 0, and no op made the row from
    the examples' data, so it holds none (it was replayed one position at a time, as if each were an example: a wrong
    number). The step is refused, as at any other T."""
    torch.manual_seed(0)
    model = _AddsANormedRow().double()
    ids = torch.randint(0, V, (5, 4), generator=torch.Generator().manual_seed(1))
    loss_of = lambda part: model(ids[part]).pow(2).mean((1, 2))  # noqa: E731
    monitor = lc.convert(model)
    assert isinstance(model.pos, ReplayedForward)
    with pytest.raises(ValueError, match=r"pos\.w: this step is not measured.*none of its inputs has the forward's 4"):
        measured(monitor, model, loss_of, [slice(0, 1), slice(1, 5)], 5)


class _ReadsItsConv(nn.Module):
    """Reads its children's weights itself, as Mamba's mixer does: a depthwise causal convolution of
    conv.weight.squeeze(1) (F.conv1d of a table computed from the child's weight), proj.weight @ x, and a child it
    only calls (inp); with `unfollowed`, the conv weight also meets the examples in an op no rule follows; without
    `bias`, the convolution called with keywords and no parameter among its arguments, only a table (Qwen3.5's and
    Qwen3-Next's gated DeltaNet)."""

    def __init__(self, unfollowed=False, bias=True):
        super().__init__()
        self.unfollowed = unfollowed
        self.inp, self.conv, self.proj = nn.Linear(6, 4), nn.Conv1d(4, 4, 3, groups=4, bias=bias), nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)  # (N, C, T)
        weight = self.conv.weight.squeeze(1)
        if self.unfollowed:  # (N, T, C) x (C, K) -> (N, T, K): a meeting no rule follows
            h = h + torch.tensordot(h.transpose(1, 2), weight, dims=([2], [0])).sum(-1)[:, None, :]
        if self.conv.bias is None:
            h = F.conv1d(h, weight=weight.unsqueeze(1), bias=None, padding=2, groups=4)[..., : x.shape[1]]
        else:
            h = F.conv1d(h, weight.unsqueeze(1), self.conv.bias, padding=2, groups=4)[..., : x.shape[1]]
        h = torch.tanh(h) * self.scale[:, None]
        return (self.proj.weight @ h).transpose(1, 2) + self.proj.bias


@pytest.mark.parametrize("unfollowed, bias", [(False, True), (True, True), (False, False)])
def test_a_module_reading_its_children_s_weights_keeps_its_forward_or_is_replayed(unfollowed, bias):
    """Its forward kept with the children it reads followed where the probe passes (the child it only calls a
    Linear of its own), else replayed per example with its children; exact either way, B == T on purpose."""
    torch.manual_seed(0)
    model = nn.Sequential(_ReadsItsConv(unfollowed, bias), nn.Linear(6, 3)).double()
    monitor, want, got = _converted_and_stepped(model)
    if unfollowed:
        assert isinstance(model[0], ReplayedForward) and state_of(model[0]).replay_subtree
    else:
        assert isinstance(model[0], InterceptedForward) and state_of(model[0]).read_children == ("conv", "proj")
        assert type(model[0].inp).__name__ == "PerExampleLinear"
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


class _Text(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.proj = nn.Embedding(7, 6), nn.Linear(6, 6)

    def forward(self, h):
        return self.proj(h)


class _ReadsAGrandchildsRow(nn.Module):
    """Gemma 4's placeholders, cut down: the positions of one token id take the row of another id, read by this
    module straight from its grandchild's table (self.text.embed.weight[pad]), not through the child."""

    def __init__(self):
        super().__init__()
        self.text = _Text()

    def forward(self, ids):
        h = torch.where((ids == 1)[..., None], self.text.embed.weight[0, :].view(1, 1, -1), self.text.embed(ids))
        return self.text(h)


def test_a_grandchild_s_parameter_read_by_a_module_is_a_read_and_the_module_replayed_exact():
    """A parameter read through a child (self.text.embed.weight) is read by this module's own code: the module is
    replayed with its children, and the row it reads is each example's where that example's placeholders are.
    B == T on purpose; only some examples hold the placeholder."""
    torch.manual_seed(0)
    model = nn.Sequential(_ReadsAGrandchildsRow(), nn.Linear(6, 3)).double()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 2, 3], [1, 1, 4, 6], [2, 5, 1, 3]])
    monitor, want, got = _stepped(model, ids, [slice(0, 1), slice(1, 4)])
    assert isinstance(model[0], ReplayedForward) and state_of(model[0]).replay_subtree
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


class _Heads(nn.Module):
    """JetMoE's mixture of attention heads, reduced: its parent calls its map and reduce (its forward is never
    called), which call its children (a Linear each) and add its own bias to every example's rows; with `reads`,
    reduce computes with its child's weight itself."""

    def __init__(self, reads):
        super().__init__()
        self.reads = reads
        self.inp, self.out = nn.Linear(6, 4), nn.Linear(4, 6)
        self.bias = nn.Parameter(torch.randn(6))

    def map(self, x):
        return torch.tanh(self.inp(x))

    def reduce(self, h):
        y = F.linear(h, self.out.weight * 2.0, self.out.bias) if self.reads else self.out(h)
        return y + self.bias

    def forward(self, x):
        raise NotImplementedError("its parent calls map and reduce")


class _CallsItsChildsMethods(nn.Module):
    def __init__(self, reads):
        super().__init__()
        self.heads, self.head = _Heads(reads), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.heads.reduce(self.heads.map(x)))


@pytest.mark.parametrize("reads", [False, True], ids=["calls its children", "reads a child's weight"])
def test_a_module_whose_parent_calls_its_methods_has_its_own_parameters_followed_or_is_replayed(reads):
    """A module whose parent calls its methods besides its forward (JetMoE's attention calls its heads' map and
    reduce): where its code only calls its children, its own parameters' uses are followed in each call and its
    children are each a kind's layer; where it computes with a child's weight itself, it is replayed per example with
    its children in each call. Exact either way, B == T on purpose."""
    torch.manual_seed(0)
    model = _CallsItsChildsMethods(reads).double()
    monitor, want, got = _converted_and_stepped(model)
    found = monitor.explain()
    if reads:
        assert found["heads"].startswith("replayed with its parent's calls: replayed per example")
        assert isinstance(model.heads, ReplayedForward)
    else:
        assert found["heads"].startswith("followed with its parent's calls: its own forward, its parameters' uses")
        assert isinstance(model.heads, InterceptedForward)
        assert type(model.heads.inp).__name__ == type(model.heads.out).__name__ == "PerExampleLinear"
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


class _ReadsAChildsTableByName(nn.Module):
    """GLM-4V's vision position embeddings, cut down: the child's table given a name, asked its shape, then viewed
    and added to every example's rows (resampled to their size in GLM-4V); with `frozen`, the table has no
    gradient, so the read is no use to follow and the child stays an Embedding layer."""

    def __init__(self, frozen):
        super().__init__()
        self.position = nn.Embedding(4, 6)
        self.position.weight.requires_grad_(not frozen)

    def forward(self, x):
        table = self.position.weight
        rows = table.shape[0]
        return x + table.view(1, rows, -1) + self.position(torch.arange(rows)[None])


@pytest.mark.parametrize("frozen", [False, True])
def test_a_child_s_parameter_given_a_name_then_computed_with_is_a_read(frozen):
    """A child's trainable parameter given a name that the code then computes with is a read of the module's own
    (the module replayed with its children); one frozen is no read. B == T on purpose."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _ReadsAChildsTableByName(frozen), nn.Linear(6, 3)).double()
    monitor, want, got = _converted_and_stepped(model)
    assert isinstance(model[1], ReplayedForward) != frozen
    assert (type(model[1].position).__name__ == "PerExampleEmbedding") == frozen
    assert not monitor.unconverted and list(monitor.untracked) == (["1.position.weight"] if frozen else [])
    check_exact(model, monitor, want, got)


class _ReturnsItsBias(nn.Module):
    """GPT-NeoX-Japanese's attention, cut down: it returns its own bias for its caller to add (own_forward: the
    bias also used inside, so the module keeps its forward with its parameters' uses followed)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6, bias=False)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.proj(x) * self.scale, self.bias


class _AddsTheReturnedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.out = _ReturnsItsBias(), nn.Linear(6, 3)

    def forward(self, x):
        h, bias = self.attention(x)
        return self.out(torch.tanh(h + bias.expand_as(h)))


def test_a_parameter_a_module_returns_for_its_caller_to_use_is_a_table_exact():
    """The bias handed back by a module that keeps its own forward is a table the examples share: where the caller
    broadcasts it over them, each example gets its copy. B == T on purpose."""
    torch.manual_seed(0)
    model = _AddsTheReturnedBias().double()
    monitor, want, got = _converted_and_stepped(model)
    assert isinstance(model.attention, InterceptedForward)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


class _TorchAttentionWithBias(nn.Module):
    """WavLM's attention, cut down: F.multi_head_attention_forward reads the projections' weights (q, k and v by
    keyword) and drops out inside torch; the first layer's position bias, from a table of distances, is repeated over
    the batch with the heads folded in ((N*H, T, T)), returned, and passed on to the next layer."""

    def __init__(self, dropout, first, how, width=6, heads=2):
        super().__init__()
        self.heads, self.dropout, self.how = heads, dropout, how
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.distance = nn.Embedding(9, heads) if first else None  # (WavLM's layers after the first have none)

    def forward(self, x, bias=None):
        N, T, _ = x.shape
        if bias is None:
            steps = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-4, 4) + 4
            bias = self.distance(steps).permute(2, 0, 1).unsqueeze(0).repeat(N, 1, 1, 1).view(N * self.heads, T, T)
        if self.how == "kernel":  # torch's fused attention, called by the module itself: its dropout is inside it
            q, k, v = (F.linear(x, p.weight, p.bias).view(N, T, self.heads, -1).transpose(1, 2) for p in self.qkv())
            dropout = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, bias.view(N, self.heads, T, T), dropout_p=dropout)
            return self.out_proj(out.transpose(1, 2).reshape(N, T, -1)), bias
        q = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            q, q, q, x.shape[-1], self.heads, torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), None, None, False, self.dropout,
            self.out_proj.weight, self.out_proj.bias, self.training, None, need_weights=self.how == "weights",
            attn_mask=bias,
            use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
        )  # fmt: skip
        return out.transpose(0, 1), bias

    def qkv(self):
        return self.q_proj, self.k_proj, self.v_proj


class _TwoAttentions(nn.Module):
    def __init__(self, dropout, how):
        super().__init__()
        self.first = _TorchAttentionWithBias(dropout, True, how)
        self.second = _TorchAttentionWithBias(dropout, False, how)

    def forward(self, x):
        h, bias = self.first(x)
        return self.second(h, bias)[0]


@pytest.mark.parametrize("how", ["weights", "weights not asked", "kernel"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_parent_handing_its_children_s_weights_to_torch_s_attention_is_replayed_exact(dropout, how):
    """Children's weights read by keyword are reads (the module is replayed with its children, not left with its
    own parameters followed and the children recording nothing); torch's attention drops out inside itself (with its
    weights asked for, by F.dropout; without, in the fused kernel, as F.scaled_dot_product_attention called by the
    module itself), and its replay is given the same masks; a position bias repeated over the batch and folded with
    the heads is each example's copy, through a replay's output into the next layer. B == T on purpose: uneven
    micro-batches without dropout; with it, every example's gradient from the same forward."""
    torch.manual_seed(0)
    model = _TwoAttentions(dropout, how).double()
    x = torch.randn(4, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss_of = lambda part: model(x[part]).pow(2).mean((1, 2))  # noqa: E731
    if not dropout:
        want = brute_force(model, loss_of, 4)
    monitor = lc.convert(model)
    assert isinstance(model.first, ReplayedForward) and state_of(model.first).replay_subtree
    if not dropout:
        check_exact(model, monitor, want, measured(monitor, model, loss_of, [slice(0, 1), slice(1, 4)], 4))
        return
    losses = loss_of(slice(0, 4))
    losses.mean().backward(retain_graph=True)
    monitor.step(batch_size=4)
    got = {m.metadata["name"]: m for m in monitor.measurements}
    zero_pe_sqnorm_buffers(model)
    per_example, _ = loss_sqnorms_from_batched_forward(model, losses)
    assert set(got) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, m in got.items():
        assert m.rms_pe_norm**2 == pytest.approx(per_example[name], rel=1e-6, abs=1e-20), name  # (check_exact's)


class _ShufflesItsTokens(nn.Module):
    """Token rows (N*T, D) taken by an index in another order, across examples (as a router's dispatch sorts them),
    through a Linear and a LayerNorm, then put back: as many rows as the tokens, so their number alone would map them
    example after example. `refold`: the rows as they are ("rows"), folded back to (N, T, D) after the Linear and
    flattened again for the norm ("after"), or folded to (N, T, D) before the Linear ("before"), whose dims alone
    would map them as the examples' own; or taken by torch.gather with the order expanded over the features
    ("torch.gather")."""

    def __init__(self, refold):
        super().__init__()
        self.refold = refold
        self.inp, self.lin, self.norm = nn.Linear(6, 6), nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x):
        flat = self.inp(x).reshape(-1, 6)
        order = torch.randperm(len(flat), generator=torch.Generator().manual_seed(len(flat)))
        gathered = torch.gather(flat, 0, order[:, None].expand(-1, 6)) if self.refold == "torch.gather" else flat[order]
        if self.refold == "before":
            h = self.lin(gathered.view(x.shape)).reshape(-1, 6)
        else:
            h = self.lin(gathered)
        if self.refold == "after":
            h = torch.tanh(h.view(x.shape)).reshape(-1, 6)
        return torch.zeros_like(flat).index_add(0, order, self.norm(h)).view(x.shape)


@pytest.mark.parametrize("refold", ["rows", "after", "before", "torch.gather"])
def test_token_rows_gathered_in_another_order_are_mapped_by_the_gather_not_their_number(refold):
    """Row s of a gathered input is the source's row order[s], of that row's example (core/history.py's
    rows_if_gathered), whatever the number of rows or the dims they were viewed as; mapped by their number, the
    Linear gave 34.97 against the oracle's 29.99. Micro-batches of 1 and 3 examples of 3 tokens: the batch's size is
    the sequence's on purpose."""
    torch.manual_seed(0)
    model = _ShufflesItsTokens(refold).double()
    monitor, want, got = _stepped(model, torch.randn(4, 3, 6, dtype=torch.float64), [slice(0, 1), slice(1, 4)])
    assert {"lin.weight", "norm.weight"} <= set(got)
    check_exact(model, monitor, want, got)


class _UsesItsLinearInTwoOrders(nn.Module):
    """One Linear on the examples' (N, T, D) data and on the same data with its examples in reverse order (put back
    after): each example's gradient of the Linear is the sum of its two uses', which the dims of the second use
    assign to the wrong examples."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x):
        h = self.inp(x)
        order = torch.arange(len(h)).flip(0)
        return self.lin(h) + self.lin(h[order])[order] * 0.5


def test_a_layer_given_the_examples_in_another_order_maps_them_by_the_gather():
    """(N, T, D) data whose examples an index took in another order: each of its rows is the source's row of the
    example the index names (core/history.py's _gather_index: a gather of slabs of rows), not the example its position
    names (lin.weight 58.13 against the oracle's 62.27 before). Micro-batches of 1 and 3 examples of 3 tokens."""
    torch.manual_seed(0)
    model = _UsesItsLinearInTwoOrders().double()
    monitor, want, got = _stepped(model, torch.randn(4, 3, 5, dtype=torch.float64), [slice(0, 1), slice(1, 4)])
    assert {"lin.weight", "lin.bias"} <= set(got)
    check_exact(model, monitor, want, got)


class _LooksUpPositions(nn.Module):
    """A table's rows by position, `table[pos]` (as a parameter, or computed from one), one row per token."""

    def __init__(self, computed):
        super().__init__()
        self.computed = computed
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, pos):
        return (self.table * 2 if self.computed else self.table)[pos]


class _ScalesByPosition(nn.Module):
    def __init__(self, computed):
        super().__init__()
        self.look, self.inp, self.lin = _LooksUpPositions(computed), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        n, t, d = x.shape
        return self.lin(self.look(torch.arange(t).repeat(n)) * self.inp(x).reshape(-1, d)).view(x.shape)


@pytest.mark.parametrize("computed", [False, True])
def test_rows_gathered_from_a_table_of_the_batch_s_size_are_not_taken_for_the_examples(computed):
    """A table of 3 rows looked up by position for 3 examples of 3 tokens: a gather, but of a table's rows, each taken
    once per example; the layer given them is mapped as any input (mapped by the gather, each row was given the
    example whose number is its position: 19.42 against the oracle's 17.46)."""
    torch.manual_seed(0)
    model = _ScalesByPosition(computed).double()
    monitor, want, got = _stepped(model, torch.randn(3, 3, 4, dtype=torch.float64), [slice(0, 3)])
    assert {"lin.weight", "look.table"} <= set(got)
    check_exact(model, monitor, want, got)
