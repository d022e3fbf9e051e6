"""
Activation checkpointing: a recompute is not a use. Every kind stays exact under every form, against the
brute-force loop over examples (float64, two uneven micro-batches, padded sequences): transformers'
gradient_checkpointing_enable with reentrant and non-reentrant checkpoints, torch.utils.checkpoint with a
selective policy (which ops are saved, which recomputed), and FSDP2 on 2 CPU ranks (test_monitor_distributed.py
runs the same worker for DDP). Expert banks and routers included (Mixtral, Qwen3-MoE), a tied head (GPT-2), a
layer shared across depth (its uses summed, core/uses.py), a table dropped out inside the region (drawn again as
it was drawn where its pull-back computes it again).

    python -m pytest -q tests/test_conversion_checkpointing.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from test_conversion_models import MOE, SPLIT, TINY, B, brute_force, check_exact, config, lm_batch, lm_losses, measured
from test_conversion_shared import DroppedRelativeEmbeddings, MaskedDropout, V
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import nanogns as lc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_matmuls(ctx, op, *args, **kwargs):
    """A selective checkpoint policy: matmuls' outputs saved, everything else recomputed."""
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


FORMS = {
    "reentrant": {"use_reentrant": True},
    "non-reentrant": {"use_reentrant": False},
    "selective": {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, save_matmuls),
    },
}


def causal_lm(name):
    """A tiny transformers causal LM in float64: Llama, GPT-2 (tied head), or a mixture of experts (eager)."""
    torch.manual_seed(0)
    if name == "Llama":
        return transformers.LlamaForCausalLM(config(transformers.LlamaConfig, **TINY, num_key_value_heads=1)).double()
    if name == "GPT-2":
        gpt2 = dict(vocab_size=TINY["vocab_size"], n_embd=16, n_layer=2, n_head=2, n_positions=32)
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**gpt2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        ).double()
    config_cls, model_cls, extra = MOE[name]
    model = model_cls(
        config(
            config_cls,
            **TINY,
            **extra,
            num_key_value_heads=1,
            num_experts_per_tok=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    model.config._experts_implementation = "eager"
    return model.double()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["Llama", "GPT-2", "Mixtral", "Qwen3-MoE"])
def test_gradient_checkpointing_every_form_every_parameter_exact(name, form):
    """transformers' gradient_checkpointing_enable (its kwargs go to torch.utils.checkpoint): 100% of the elements,
    each within 1e-6; before, non-reentrant checkpoints dropped every expert bank as used twice per example."""
    model = causal_lm(name)
    ids, mask = lm_batch()
    loss_of = lambda part: lm_losses(model, ids[part], mask[part], positions=name == "GPT-2")  # noqa: E731
    want = brute_force(model, loss_of, B)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: gradient_checkpointing_enable is deprecated, use_cache off
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=FORMS[form])
        monitor = lc.convert(model)
        got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    assert model.is_gradient_checkpointing
    check_exact(model, monitor, want, got)


class SharedDepth(nn.Module):
    """One block applied at every depth (ALBERT-style), each application checkpointed."""

    def __init__(self, form, V=19, D=8, depth=3):
        super().__init__()
        self.form, self.depth = form, depth
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.block = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 12), nn.GELU(), nn.Linear(12, D))

    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(self.depth):
            h = h + checkpoint(self.block, h, **FORMS[self.form]) if self.form else h + self.block(h)
        return self.head(h)


@pytest.mark.parametrize("form", [None, *FORMS])
def test_a_block_shared_across_depth_is_exact_under_checkpointing(form):
    """Three uses of one block per forward, each checkpointed: its parameters are tracked exactly (uses summed),
    whatever the checkpoint does in backward."""
    torch.manual_seed(0)
    model = SharedDepth(form).double()
    ids = torch.randint(0, 19, (B, 6), generator=torch.Generator().manual_seed(1))

    def loss_of(part):
        logits = model(ids[part])
        return F.cross_entropy(logits.flatten(0, 1), ids[part].flatten(), reduction="none").view(-1, 6).mean(1)

    model.form = None  # the oracle's backwards of each example from one forward: checkpointing computes the same
    want = brute_force(model, loss_of, B)  # maths but allows one backward per forward (reentrant, selective)
    model.form = form
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


def run_worker(tmp_path, name, nproc=None):
    out = tmp_path / f"{name}.json"
    worker = os.path.join(REPO, "tests", "scripts", "checkpoint_worker.py")
    launch = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [] if nproc is None else [f"--nproc_per_node={nproc}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([*launch, worker, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp2_with_non_reentrant_checkpointing_matches_one_process(tmp_path):
    """A tiny Mixtral (routers, expert banks, RMSNorms, the rest) with non-reentrant checkpointing, fully_shard on
    each decoder layer and the root, 2 ranks (gloo): every norm and pegn equals one process on the same 8 examples,
    and that one process equals the brute-force loop."""
    single = run_worker(tmp_path, "single")
    fsdp = run_worker(tmp_path, "fsdp", nproc=2)
    assert single.pop("untracked") == fsdp.pop("untracked") == {}
    exact = single.pop("brute_force")
    assert set(fsdp) == set(single) and len(single) > 20
    for key, value in single.items():
        assert fsdp[key] == pytest.approx(value, rel=1e-4), key
        assert value == pytest.approx(exact[key], rel=1e-4), key


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["Mamba", "GPT-OSS", "DBRX"])
def test_replayed_modules_and_dbrx_banks_exact_under_every_form(name, form):
    """The generic path (a Mamba mixer replayed with its children; GPT-OSS's attention sinks replayed alone) and
    DBRX's expert banks under each checkpoint form: a recompute is not a use, and the replay reads the forward's
    own inputs."""
    from test_conversion_generic import causal_lms

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kernels falling back to torch, use_cache off under checkpointing
        model = causal_lms()[name]()
        for key in ("_experts_implementation", "_attn_implementation"):
            setattr(model.config, key, "eager")
        model.double()
        ids, mask = lm_batch()
        loss_of = lambda part: lm_losses(model, ids[part], mask[part])  # noqa: E731
        want = brute_force(model, loss_of, B)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=FORMS[form])
        monitor = lc.convert(model)
        got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    check_exact(model, monitor, want, got)


class CheckpointedEncoder(nn.Module):
    """torch's TransformerEncoder layers (nn.MultiheadAttention inside), each checkpointed in the given form."""

    def __init__(self, form, V=19, D=8):
        super().__init__()
        self.form = form
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0, batch_first=True) for _ in range(2)
        )

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = checkpoint(layer, h, **FORMS[self.form]) if self.form else layer(h)
        return self.head(h)


@pytest.mark.parametrize("form", FORMS)
def test_multihead_attention_is_exact_under_checkpointing(form):
    """nn.MultiheadAttention counts each forward's examples once: a recompute in backward is no second use."""
    torch.manual_seed(0)
    model = CheckpointedEncoder(form).double()
    ids = torch.randint(0, 19, (B, 6), generator=torch.Generator().manual_seed(1))

    def loss_of(part):
        logits = model(ids[part])
        return F.cross_entropy(logits.flatten(0, 1), ids[part].flatten(), reduction="none").view(-1, 6).mean(1)

    model.form = None  # the oracle without checkpoints (one backward per example from one forward)
    want = brute_force(model, loss_of, B)
    model.form = form
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    assert "layers.0.self_attn.in_proj_weight" in got
    check_exact(model, monitor, want, got)


class CheckpointedDroppedTable(DroppedRelativeEmbeddings):
    """DroppedRelativeEmbeddings with its attention checkpointed in the given form, the table dropped out inside the
    region by the custom Function (SEW-D's XDropout) or F.dropout (DeBERTa's nn.Dropout). Each forward draws from
    the same seed, so the oracle's forward (without checkpoints) draws the same mask."""

    def __init__(self, form, dropout):
        super().__init__(p=0.5)
        self.form, self.dropout = form, dropout

    def forward(self, ids):
        torch.manual_seed(7)
        x = self.wte(ids)
        h = (
            checkpoint(self.attend, x, self.rel.weight, **FORMS[self.form])
            if self.form
            else self.attend(x, self.rel.weight)
        )
        return self.head(h)

    def attend(self, x, weight):
        table = self.norm(weight)
        table = MaskedDropout.apply(table, self.p) if self.dropout == "function" else F.dropout(table, self.p)
        by_position = self.q(x) @ self.q(table).transpose(-1, -2)
        T = x.shape[1]
        distance = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-4, 3) + 4
        return by_position.gather(-1, distance.expand(x.shape[0], -1, -1)).softmax(-1) @ x


@pytest.mark.parametrize("dropout", ["function", "F.dropout"])
@pytest.mark.parametrize("form", ["non-reentrant", "selective"])
def test_a_table_dropped_out_in_a_checkpointed_region_is_exact(form, dropout):
    """Where the forward's graph of the table cannot run backward again, its pull-back computes the table again from
    its recipe: its dropout draws the mask it drew in the forward (before, a new one: wrong numbers), B == T."""
    torch.manual_seed(0)
    model = CheckpointedDroppedTable(None, dropout).double()
    ids = torch.randint(0, V, (4, 4), generator=torch.Generator().manual_seed(1))
    loss_of = lambda part: model(ids[part]).pow(2).mean((1, 2))  # noqa: E731
    want = brute_force(model, loss_of, 4)
    model.form = form
    monitor = lc.convert(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first step's check that no op mixes the examples cannot run (selective)
        got = measured(monitor, model, loss_of, [slice(0, 1), slice(1, 4)], 4)
    check_exact(model, monitor, want, got)
