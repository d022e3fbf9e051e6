"""
Tied embedding / output matrix (nanogns/core/tied.py): the monitor logs the shared tensor once,
as `<names joined by +>`, with the exact per-example norm of its whole gradient,
checked against a brute-force loop over examples on small tied GPTs.

    python -m pytest -q tests/test_layers_tied.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward

import nanogns as lc
from model import GPT, GPTConfig
from nanogns import monitor as gnstracking
from nanogns.core import tied
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.kinds.embedding import PerExampleEmbedding
from nanogns.kinds.linear import PerExampleLinear

CONFIG = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab_size=67, dropout=0.0)
TIED = "transformer.wte.weight+lm_head.weight"


def build(linearclass="gns", embeddingclass="gns", lnclass="gns", dtype=torch.float64):
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes(linearclass, embeddingclass, lnclass)):
        return GPT(GPTConfig(**CONFIG)).to(dtype)


def brute_force(model, losses_fn, x, y):
    """Per parameter: (||batch-mean gradient||^2, mean_i ||g_i||^2), by the oracle (each example's gradient from the
    batched forward); losses_fn gives the examples' losses."""
    per_example, batch = loss_sqnorms_from_batched_forward(model, losses_fn(model, x, y))
    zero_pe_sqnorm_buffers(model)
    return batch, per_example


def gpt_loss(model, x, y):
    """Each example's mean token loss, all positions (nanoGPT computes every position's logits given targets)."""
    logits, _ = model(x, y)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def last_position_loss(model, x, y):
    """nanoGPT without targets runs lm_head on the last position only: S = 1 output rows against T ids."""
    logits, _ = model(x)
    return F.cross_entropy(logits[:, -1, :].float(), y[:, -1], reduction="none").to(logits.dtype)


def tracked_step(model, loss_fn, x, y, micro_batches=(None,)):
    """Backward over micro-batches (each scaled to the mean over the whole batch), then one monitor step."""
    monitor = gnstracking.GNSMonitor(model)
    model.zero_grad(set_to_none=True)
    B = x.shape[0]
    for part in micro_batches:
        sl = slice(None) if part is None else part
        n = x[sl].shape[0]
        (loss_fn(model, x[sl], y[sl]).mean() * n / B).backward()
    measurements = {m.metadata["name"]: m for m in monitor.measure(batch_size=B)}
    zero_pe_sqnorm_buffers(model)
    return measurements


@pytest.mark.parametrize(
    "classes",
    [("gns", "gns"), ("shim", "shim"), ("fused", "gns"), ("gns", "shim")],
    ids=lambda c: f"linear={c[0]}-embedding={c[1]}",
)
@pytest.mark.parametrize("loss_fn", [gpt_loss, last_position_loss], ids=["all-positions", "last-position"])
@pytest.mark.filterwarnings("ignore:.*Triton kernel not used:RuntimeWarning")
def test_tied_matrix_norm_matches_brute_force(classes, loss_fn):
    model = build(linearclass=classes[0], embeddingclass=classes[1])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 67, (2, 5, 11), generator=gen)
    m = tracked_step(
        model, loss_fn, x, y, micro_batches=[slice(0, 2), slice(2, 5)]
    )  # accumulation over 2 micro-batches
    batch, per_example = brute_force(model, loss_fn, x, y)
    assert TIED in m and "transformer.wte.weight" not in m and "lm_head.weight" not in m
    # rel 1e-6: the last-position loss is computed in float32 (as nanoGPT does), and the buffers are float32
    assert m[TIED].norm ** 2 == pytest.approx(batch["transformer.wte.weight"], rel=1e-6)
    assert m[TIED].rms_pe_norm ** 2 == pytest.approx(per_example["transformer.wte.weight"], rel=1e-6)
    # the other parameters are untouched by the linking
    assert m["transformer.wpe.weight"].rms_pe_norm ** 2 == pytest.approx(
        per_example["transformer.wpe.weight"], rel=1e-6
    )


@pytest.mark.parametrize("way", [None, "gather", "table"])
def test_small_vocabulary_cross_term_both_ways(way, force_strategy):
    """A vocabulary smaller than the sequence (a character model): the cross term from the head's per-example
    gradient table (the default there) and from the gathered logits' gradients give the brute-force norm."""
    force_strategy(cross_term=way)
    torch.manual_seed(0)
    with lc.set_contextual_config(**lc.layer_classes("gns", "gns", "gns")):
        model = GPT(GPTConfig(**{**CONFIG, "vocab_size": 5})).double()
    x, y = torch.randint(0, 5, (2, 5, 11), generator=torch.Generator().manual_seed(7))
    m = tracked_step(model, gpt_loss, x, y, micro_batches=[slice(0, 2), slice(2, 5)])
    _, per_example = brute_force(model, gpt_loss, x, y)
    assert m[TIED].rms_pe_norm ** 2 == pytest.approx(per_example["transformer.wte.weight"], rel=1e-6)


def test_cross_term_is_needed():
    """Leaving the cross term out (or logging one use only) gives a different number: the test above is not vacuous."""
    model = build()
    x, y = torch.randint(0, 67, (2, 4, 9), generator=torch.Generator().manual_seed(2))
    monitor = gnstracking.GNSMonitor(model)
    _, loss = model(x, y)
    loss.backward()
    ((_, _, terms),) = [t for t in monitor.tracked if t[0] == TIED]
    emb, head, cross = [module._buffers[name] for module, name, _ in terms]
    two = terms[2][2]
    assert two == 2.0 and abs(cross[0].item()) > 1e-3 * (emb[0].item() + head[0].item())
    assert cross[1].item() == emb[1].item() == head[1].item() == 4


def test_batch_of_one_and_2d_inputs():
    """ids (N,) and an output layer on (N, D): one position per example."""

    class TinyTied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = PerExampleEmbedding(13, 6)
            self.mix = PerExampleLinear(6, 6)
            self.head = PerExampleLinear(6, 13, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.mix(self.emb(ids))))

    torch.manual_seed(0)
    model = TinyTied().double()

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    for B in (1, 7):
        x, y = torch.randint(0, 13, (2, B), generator=torch.Generator().manual_seed(B))
        m = tracked_step(model, loss_fn, x, y)
        _, per_example = brute_force(model, loss_fn, x, y)
        assert m["emb.weight+head.weight"].rms_pe_norm ** 2 == pytest.approx(per_example["emb.weight"], rel=1e-6)


def test_embedding_without_the_head_in_backward():
    """A backward that never reaches the output layer: the cross term is 0 and the norm is the embedding's."""
    model = build()
    x = torch.randint(0, 67, (3, 8), generator=torch.Generator().manual_seed(3))
    monitor = gnstracking.GNSMonitor(model)
    model.transformer.wte(x).pow(2).mean().backward()
    ((_, _, terms),) = [t for t in monitor.tracked if t[0] == TIED]
    emb, _, cross = [m._buffers[b] for m, b, _ in terms]
    assert cross[0].item() == 0.0 and emb[0].item() > 0
    zero_pe_sqnorm_buffers(model)


def test_flattened_output_layer_input_is_exact():
    """An output layer fed the hidden states flattened to (B*T, D) (as OPT feeds its layers): its rows map to the
    forward's examples (layout.py), so the tied matrix is exact, as with (B, T, D)."""

    class Flattening(nn.Module):
        def __init__(self, flatten):
            super().__init__()
            self.flatten = flatten
            self.emb = PerExampleEmbedding(11, 4)
            self.head = PerExampleLinear(4, 11, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h.reshape(-1, 4) if self.flatten else h).view(*ids.shape, 11)

    def loss(model, x, y):
        return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(dim=1)

    x, y = torch.randint(0, 11, (2, 3, 5), generator=torch.Generator().manual_seed(5))
    found = []
    for flatten in (False, True):
        torch.manual_seed(0)
        model = Flattening(flatten).double()
        batch, per_example = brute_force(model, loss, x, y)
        measured = tracked_step(model, loss, x, y, micro_batches=(slice(0, 1), slice(1, 3)))["emb.weight+head.weight"]
        assert measured.rms_pe_norm**2 == pytest.approx(per_example["emb.weight"], rel=1e-6)
        assert measured.norm**2 == pytest.approx(batch["emb.weight"], rel=1e-6)
        found.append(measured.rms_pe_norm)
    assert found[0] == pytest.approx(found[1], rel=1e-9)


def test_linking_is_idempotent():
    model = build()
    x, y = torch.randint(0, 67, (2, 3, 7), generator=torch.Generator().manual_seed(4))
    once = tracked_step(model, gpt_loss, x, y)[TIED].rms_pe_norm
    for _ in range(2):
        gnstracking.GNSMonitor(model)
    assert len(model.transformer.wte._forward_hooks) == 1 and len(model.lm_head._forward_hooks) == 1
    assert tracked_step(model, gpt_loss, x, y)[TIED].rms_pe_norm == pytest.approx(once, rel=1e-12)


def test_no_grad_forward_records_nothing():
    model = build()
    gnstracking.GNSMonitor(model)
    with torch.no_grad():
        model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=3)
    assert all(b.abs().sum() == 0 for n, b in model.named_buffers() if n.endswith("_pe_sqnorm"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tied_norm_under_autocast_within_tolerance(dtype):
    """Autocast (bf16, fp16) against float32: within 3e-2 relative, the tolerance of every layer under autocast."""
    x, y = torch.randint(0, 67, (2, 6, 16), generator=torch.Generator().manual_seed(5))
    reference = tracked_step(build(dtype=torch.float32), gpt_loss, x, y)
    model = build(dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        got = tracked_step(model, gpt_loss, x, y)
    for name in (TIED, "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight", "transformer.ln_f.weight"):
        assert got[name].rms_pe_norm == pytest.approx(reference[name].rms_pe_norm, rel=3e-2), name
        assert got[name].norm == pytest.approx(reference[name].norm, rel=3e-2), name


def test_a_tie_with_a_plain_torch_layer_is_skipped():
    class PlainEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.lm_head = PerExampleLinear(4, 10, bias=False)
            self.lm_head.weight = self.wte.weight

    model = PlainEmbedding()
    with pytest.warns(UserWarning, match="not tracking wte.weight"):
        monitor = gnstracking.GNSMonitor(model, expect_tracked=False)
    assert monitor.tracked == [] and "tied to" in monitor.untracked["wte.weight"]
    assert tied.link_tied_parameters(model) == {}


def test_a_matrix_tied_between_two_linears_sums_its_uses_exactly():
    """Two Linears sharing one weight (no cross-term formula of tied.py): the uses' per-example gradients are summed
    (core/uses.py) and recorded once, in the first layer's buffer, against the loop over examples."""
    from oracle import per_example_sqnorms_by_loop

    class TwoLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = PerExampleLinear(4, 4, bias=False)
            self.b = PerExampleLinear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = TwoLinears().double()
    monitor = gnstracking.GNSMonitor(model)
    assert [name for name, _, _ in monitor.tracked] == ["a.weight+b.weight"] and not monitor.untracked
    x, g = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
    want = per_example_sqnorms_by_loop(model, x, g)["a.weight"].sum().item()
    zero_pe_sqnorm_buffers(model)
    model(x).backward(g)
    monitor.row_map.finish()
    assert model.a.weight_pe_sqnorm.tolist() == [pytest.approx(want, rel=1e-6), 5]  # float32 buffers
    assert model.b.weight_pe_sqnorm.tolist() == [0, 0]


def test_gather_in_chunks_gives_the_same_cross_term(monkeypatch):
    x, y = torch.randint(0, 67, (2, 5, 11), generator=torch.Generator().manual_seed(6))
    whole = tracked_step(build(), gpt_loss, x, y)[TIED].rms_pe_norm
    monkeypatch.setattr(tied, "GATHER_CHUNK_ELEMENTS", 11 * 11 * 2)  # two examples per chunk: 3 chunks for B = 5
    assert tracked_step(build(), gpt_loss, x, y)[TIED].rms_pe_norm == pytest.approx(whole, rel=1e-12)
