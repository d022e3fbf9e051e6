"""
nanogns.verify(model, batch, per_example_loss) (nanogns/verification.py): "exact" on a model that is exact,
converted or not; "differs" on a loss that couples the examples (a two-tower model's in-batch softmax) and on a
forward that mixes them, each with the cause it observed; "refused" with the monitor's reason; the user's model left
exactly as it was (weights and their dtype, gradients, buffers, training mode, random number generators, what its
monitor accumulated); the trainers' first-step option; the docs' example.

    python -m pytest -q tests/test_verify.py
"""

import io
import math
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import REPO

import nanogns
from nanogns.core.buffers import zero_pe_sqnorm_buffers

pytestmark = pytest.mark.filterwarnings("ignore:convert")


class TinyLM(nn.Module):
    def __init__(self, vocab=20, width=8):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(vocab, width), nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def lm_losses(model, ids):
    return F.cross_entropy(model(ids).transpose(1, 2), ids, reduction="none").mean(1)


@pytest.mark.parametrize("converted", [False, True])
def test_an_exact_model_is_exact(converted):
    torch.manual_seed(0)
    model = TinyLM()
    if converted:
        nanogns.convert(model)
    out = io.StringIO()
    result = nanogns.verify(model, torch.randint(0, 20, (6, 6)), lm_losses, file=out)  # B == T on purpose
    assert result.verdict == "exact" and result.exact, out.getvalue()
    assert [c.name for c in result.parameters] == ["emb.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert all(
        c.verdict == "exact" and c.rms_pe_norm == pytest.approx(c.true_rms_pe_norm, rel=1e-4) for c in result.parameters
    )
    assert result.dtype == torch.float64 and result.examples == 6
    assert out.getvalue().startswith("nanogns.verify: exact (6 examples, float64")
    assert not converted or not any(name.endswith("_pe_sqnorm") for name, _ in TinyLM().named_buffers())


class TwoTower(nn.Module):
    """A retrieval model: a query tower and a document tower, trained with in-batch negatives."""

    def __init__(self):
        super().__init__()
        self.query, self.document = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, queries, documents):
        return self.query(queries), self.document(documents)


def in_batch_softmax_losses(model, batch):
    """Example i's loss: the cross-entropy of its query against every document of the batch, its own the target."""
    q, d = model(*batch)
    return F.cross_entropy(q @ d.t(), torch.arange(q.shape[0]), reduction="none")


def test_a_loss_coupling_the_examples_differs_and_is_named():
    torch.manual_seed(0)
    model = TwoTower()
    result = nanogns.verify(model, (torch.randn(5, 6), torch.randn(5, 6)), in_batch_softmax_losses, show=False)
    assert result.verdict == "differs"
    checks = result.by_name()
    # the softmax is invariant to the document bias: every example's own gradient of it is 0, yet its rows' part is not
    assert checks["document.bias"].true_rms_pe_norm < 1e-12 < 0.1 < checks["document.bias"].rms_pe_norm
    assert checks["document.bias"].verdict == checks["document.weight"].verdict == "differs"
    assert checks["query.weight"].verdict == "exact"  # (each query's row is its own example's only)
    assert result.causes[0].startswith("the loss couples the examples: example 0's loss depends on the model's outputs")
    assert result.refusal is None  # the monitor alone would log these numbers: what verify is for


class FoldedAttention(nn.Module):
    """Attention whose heads' projections are tiled over the batch in training mode: the batch is folded into one
    causal sequence, so each example attends to the examples before it (eval mode computes each example alone)."""

    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, -1)
        rows = (1, B * T) if self.training else (B, T)
        q, k, v = (t.reshape(*rows, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MixingLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.attn = FoldedAttention()

    def forward(self, ids):
        return self.head(self.attn(self.norm(self.emb(ids))))


def test_a_forward_mixing_the_examples_differs_and_is_named():
    torch.manual_seed(0)
    model = MixingLM()
    ids = torch.randint(0, 20, (4, 5))
    result = nanogns.verify(model, ids, lm_losses, show=False)
    assert result.verdict == "differs"
    checks = result.by_name()
    assert checks["attn.qkv.weight"].verdict == "differs" and checks["head.weight"].verdict == "exact"
    assert result.causes == [result.causes[0]] and result.causes[0].startswith(
        "a forward mixing the examples: an op in attn (FoldedAttention) mixes the examples of the batch: the outputs of "
        "example 3 depend on the inputs of example"
    )
    assert "after attn.qkv, before attn.proj" in result.causes[0]
    model.eval()  # the same model in eval mode computes each example alone
    assert nanogns.verify(model, ids, lm_losses, show=False).verdict == "exact"


class Broadcast(nn.Module):
    """A layer given the first example's rows broadcast over the batch: its rows cannot be mapped to examples."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) + self.b(x[:1]).expand_as(x)


def test_rows_that_cannot_be_mapped_are_refused_with_the_monitors_reason():
    torch.manual_seed(0)
    result = nanogns.verify(Broadcast(), torch.randn(3, 5, 4), lambda m, x: m(x).pow(2).flatten(1).mean(1), show=False)
    assert result.verdict == "refused"
    checks = result.by_name()
    assert checks["a.weight"].verdict == "exact"
    assert checks["b.weight"].verdict == "refused" and "its input has one row for the forward's 3 examples" in (
        checks["b.weight"].why
    )
    assert "this step is not measured" in result.refusal


class Recorded(nn.Module):
    """Dropout (the RNG), a BatchNorm in training mode (running statistics change), one frozen layer."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.drop, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Linear(6, 2)
        self.a.requires_grad_(False)

    def forward(self, x):
        return self.b(self.drop(self.bn(self.a(x))))


def test_the_users_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = Recorded()
    twin = Recorded()
    twin.load_state_dict(model.state_dict())
    monitor, twin_monitor = nanogns.convert(model), nanogns.convert(twin)
    x = torch.randn(5, 4)

    def loss(m, batch):
        return m(batch).pow(2).mean(1)

    torch.manual_seed(1)
    loss(model, x).mean().backward()  # a step under way: gradients and per-example norms accumulated
    torch.manual_seed(1)
    loss(twin, x).mean().backward()
    before = {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "rng": torch.get_rng_state(),
        "modes": [m.training for m in model.modules()],
    }
    pending = monitor.mixing.pending  # the inputs of the step's first forward, kept for the first step's check
    result = nanogns.verify(model, x, loss, show=False)
    assert monitor.mixing.pending is pending and pending[1][0] is x  # not verify's (float64) inputs
    assert result.verdict == "refused" and "BatchNorm" in (result.refusal or "")  # (the batch statistics mix them)
    assert all(torch.equal(before["state"][k], v) for k, v in model.state_dict().items())
    assert {n: p.dtype for n, p in model.named_parameters()} == before["dtypes"]
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == before["grads"].keys() and all(torch.equal(before["grads"][n], g) for n, g in grads.items())
    assert all(torch.equal(before["buffers"][n], b) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), before["rng"])
    assert [m.training for m in model.modules()] == before["modes"]
    # the monitor reads the step under way as if verify had not run (the same as the twin's, which did not)
    model.eval(), twin.eval()  # (an eval-mode step: a training-mode BatchNorm's step is refused)
    model.zero_grad(), twin.zero_grad()
    zero_pe_sqnorm_buffers(model), zero_pe_sqnorm_buffers(twin)
    loss(model, x).mean().backward()
    loss(twin, x).mean().backward()
    assert monitor.step(batch_size=5) == twin_monitor.step(batch_size=5)


def test_a_per_example_loss_that_is_not_one_loss_per_example_is_one_clear_error():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(\); it returns each example's loss, a \(B,\)"):
        nanogns.verify(model, torch.randint(0, 20, (3, 4)), lambda m, ids: lm_losses(m, ids).mean(), show=False)


class Float32Only(nn.Module):
    """A forward that casts its input to float32 itself: it cannot run in float64."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x.float())


def test_a_model_that_cannot_run_in_float64_is_checked_in_its_own_dtype():
    torch.manual_seed(0)
    result = nanogns.verify(Float32Only(), torch.randn(4, 3), lambda m, x: m(x).pow(2).mean(1), show=False)
    assert result.verdict == "exact" and result.dtype == torch.float32
    assert result.notes[0].startswith("the forward failed in float64") and result.notes[0].endswith(
        "checked in float32"
    )


def docs_block(marker):
    """The python block of docs/integrations.md whose marker comment names `marker`."""
    text = open(os.path.join(REPO, "docs", "integrations.md")).read()
    found = re.search(r"<!-- run by tests/test_verify.py: " + marker + r".*?-->\n```python\n(.*?)```", text, re.S)
    assert found, marker
    return found.group(1)


def test_the_docs_example_runs_as_shown(capsys):
    namespace = {}
    exec(docs_block("the two-tower example"), namespace)
    printed = capsys.readouterr().out
    assert namespace["result"].verdict == "differs" and "likely cause: the loss couples the examples" in printed
    assert namespace["grouped"].verdict == "exact"


def test_the_trainers_verify_the_first_step_when_asked(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from nanogns.integrations import AccelerateGNS, TrainerGNSCallback, causal_lm_losses

    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
            intermediate_size=32, vocab_size=30,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    examples = [{"input_ids": torch.randint(0, 30, (8,))} for _ in range(8)]
    for example in examples:
        example["labels"] = example["input_ids"].clone()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=1, per_device_train_batch_size=4, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(model=llama(), args=args, train_dataset=examples)
    callback = TrainerGNSCallback(trainer, verify_loss=causal_lm_losses)
    trainer.add_callback(callback)
    trainer.train()
    assert callback.verification is not None and callback.verification.verdict == "exact"
    assert callback.verification.examples == 4
    off = TrainerGNSCallback(transformers.Trainer(model=llama(), args=args, train_dataset=examples))
    assert off.verify_loss is None  # off by default

    accelerate = pytest.importorskip("accelerate")
    model = llama()
    with AccelerateGNS(
        accelerate.Accelerator(cpu=True), model, out_dir=str(tmp_path / "acc"), verify_loss=causal_lm_losses
    ) as gns:
        batch = {"input_ids": torch.randint(0, 30, (3, 7))}
        causal_lm_losses(model, batch).mean().backward()
        with pytest.raises(ValueError, match=r"pass the first step's batch, monitor.step\(batch=batch\)"):
            gns.step()
        row = gns.step(batch=batch)
        assert gns.verification.verdict == "exact" and math.isfinite(row["train/gns/lm_head.weight/pegn"])


def test_lightning_verifies_the_first_batch_when_asked(tmp_path):
    L = pytest.importorskip("lightning")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from nanogns.integrations import LightningGNSCallback, causal_lm_losses

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=30, n_positions=16)
            )

        def training_step(self, batch, batch_idx):
            return causal_lm_losses(self.model, batch).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callback = LightningGNSCallback(out_dir=str(tmp_path), verify_loss=lambda m, b: causal_lm_losses(m.model, b))
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[callback],
    )  # fmt: skip
    examples = [{"input_ids": torch.randint(0, 30, (6,))} for _ in range(4)]
    trainer.fit(CausalLM(), torch.utils.data.DataLoader(examples, batch_size=4))
    assert callback.verification is not None and callback.verification.verdict == "exact", callback.verification
    assert callback.verification.examples == 4
