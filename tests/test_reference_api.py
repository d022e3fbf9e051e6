"""
The reference implementation's documented API (CerebrasResearch/nanoGNS exact/, its README's train.py diff) runs
unchanged on this project's faces (buffered.py, fused_gns.py, layer_config.py, gnstracking.py, tracker.py,
ddpgns.py), and the numbers it logs are exact: a tiny nanoGPT with gradient accumulation, against the brute-force
loop over examples (float64, each example's gradient from the same batched forward).

    python -m pytest -q tests/test_reference_api.py
"""

import copy
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward

import ddpgns
import gnstracking
import layer_config as lc
from buffered import (
    PEGradNormEmbedding,
    PEGradNormLinear,
    PEGradNormSeparatedLayerNorm,
    PEGradNormShimEmbedding,
    PEGradNormShimLinear,
    zero_sqgradnorm_buffers,
)
from fused_gns import PEGradNormFusedLayerNorm
from nanogns import estimator
from nanogns.runlog.reader import load_csv
from tracker import LogWrapper

GA_STEPS, BATCH, BLOCK, VOCAB, STEPS = 2, 3, 8, 11, 2


def build(linearclass, embeddingclass, lnclass):
    """The model as the reference's train.py builds it: the classes from dicts, model.py read inside the context."""
    Linear = {"gns": PEGradNormLinear, "nn": torch.nn.Linear, "shim": PEGradNormShimLinear}[linearclass]
    Embedding = {"gns": PEGradNormEmbedding, "nn": torch.nn.Embedding, "shim": PEGradNormShimEmbedding}[embeddingclass]
    LayerNorm = {"shim": PEGradNormSeparatedLayerNorm, "nn": torch.nn.LayerNorm, "fused": PEGradNormFusedLayerNorm}[
        lnclass
    ]
    with lc.set_contextual_config(Linear=Linear, Embedding=Embedding, LayerNorm=LayerNorm):
        from model import GPT, GPTConfig

        torch.manual_seed(0)
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=BLOCK, vocab_size=VOCAB, dropout=0.0, bias=True)
        return GPT(config).double()


def oracle_step(model, micro_batches):
    """(mean_i ||g_i||^2, ||mean_i g_i||^2) per parameter over every example of the step, g_i the gradient of
    example i's mean token loss, from a copy of the model (its buffers are the copy's)."""
    twin = copy.deepcopy(model)
    losses = []
    for x, y in micro_batches:
        logits, _ = twin(x, y)  # targets given: logits at every position
        losses.append(F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1))
    return loss_sqnorms_from_batched_forward(twin, losses)


@pytest.mark.parametrize("classes", [("gns", "gns", "shim"), ("shim", "shim", "shim")])
def test_reference_train_py_calls_log_exact_numbers(classes, tmp_path):
    linearclass, embeddingclass, lnclass = classes
    model = build(*classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype, scaler = "float32", None
    tracked = linearclass != "nn" or embeddingclass != "nn" or lnclass != "nn"
    assert tracked
    accumulate_gns = gnstracking.AccumulateMeasurements(prefix="train/gns/")  # for logging
    gns_tracker = gnstracking.MeasurementTracker.from_model(
        model,
        callback=accumulate_gns,
        scaler=scaler if dtype == "float16" else None,
    )
    logged = []
    tracker = LogWrapper(logged.append, config={"linearclass": linearclass}, out_dir=str(tmp_path))
    generator = torch.Generator().manual_seed(1)
    expected = []
    for iter_num in range(STEPS):
        micro_batches = [
            tuple(torch.randint(0, VOCAB, (BATCH, BLOCK), generator=generator) for _ in "XY") for _ in range(GA_STEPS)
        ]
        expected.append(oracle_step(model, micro_batches))
        for X, Y in micro_batches:
            logits, loss = model(X, Y)
            loss = loss / GA_STEPS  # scale the loss to account for gradient accumulation
            loss.backward()
        gns_tracker.step(batch_size=GA_STEPS * BATCH * 1)  # track gradient noise scaling
        if tracked:
            zero_sqgradnorm_buffers(model)
        grad_norm = math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.log({"dt": 0.1, "lr": 1e-2, "grad_norm": grad_norm, "train/lossf": loss.item() * GA_STEPS})
        tracker.print(f"{iter_num=}: " + "{train_lossf=:.4f}, dt={dt:.3f}s")
        tracker.log({**accumulate_gns.get_msg()})
        if tracker.log_dict:  # if we're going to log something, log the index vars
            tracker.log({"iter_num": iter_num, "tokens_processed": (iter_num + 1) * GA_STEPS * BATCH * BLOCK})
        tracker.step()
    tracker.close()

    frame = load_csv(str(tmp_path))
    assert list(frame["iter_num"]) == list(range(STEPS)) and len(logged) == STEPS
    names = {
        c[len("train/gns/") : -len("/norm")]
        for c in frame.columns
        if c.startswith("train/gns/") and c.endswith("/norm")
    }
    assert "transformer.wte.weight+lm_head.weight" in names  # the tied matrix, once and exactly
    assert len(names) == sum(1 for _ in model.parameters())  # every parameter tracked
    for step, (pe_sq, batch_sq) in enumerate(expected):
        row = frame.iloc[step]
        for name in names:
            first = name.split("+")[0]
            assert row[f"train/gns/{name}/batch_size"] == GA_STEPS * BATCH
            assert row[f"train/gns/{name}/norm"] ** 2 == pytest.approx(batch_sq[first], rel=1e-6), (step, name)
            assert row[f"train/gns/{name}/pegn"] ** 2 == pytest.approx(pe_sq[first], rel=1e-6), (step, name)


def test_measurement_msg_and_the_ddp_gns_accumulator():
    """gnstracking.Measurement(...).msg(prefix=...) and ddpgns.GradientNoiseScale as the reference's DDP block uses
    them: update with each step's small- and big-batch squared norms, get_msg for the log."""
    m = gnstracking.Measurement(2.0, 3.0, 8, 4)
    assert m.msg(prefix="ddp/") == {
        "ddp/big_batch_norm": 2.0,
        "ddp/small_batch_norm": 3.0,
        "ddp/big_batch_size": 8,
        "ddp/small_batch_size": 4,
    }
    stats = ddpgns.GradientNoiseScale(decay=0.9)
    running = estimator.RunningGNS(decay=0.9)
    for small, big in ((9.0, 5.0), (10.0, 6.0), (8.0, 4.5)):
        stats.update(small, big, 4, 8)
        running.add(*estimator.two_batch_stats(small, big, 4, 8))
    msg = stats.get_msg(prefix="ddp/")
    assert math.isfinite(running.gns)
    assert msg["ddp/gns"] == pytest.approx(running.gns) and stats.get_gns() == pytest.approx(running.gns)
    assert msg["ddp/gtg_ema"] == pytest.approx(running.gtg.value)


def test_reference_read_and_zeroing_take_the_monitors_count_of_ops():
    """Issue 39: MeasurementTracker.step then zero_sqgradnorm_buffers(model), as the reference's train.py calls
    them, dispatch as many ops as GNSMonitor.step (read and zeroing) for GPT-2's structure: the buffers of a model
    a tracker reads are views of one flat tensor, zeroed in one op (bench/read_ops.py prints both counts)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import read_ops

    for choice in ("LayerNorm-only gns", "all-layer gns"):
        monitor_ops = read_ops.counts(choice, 4)[1]  # the count does not grow with the depth (test_monitor.py)
        reference_ops = read_ops.counts(choice, 4, reference=True)[1]
        assert reference_ops == monitor_ops <= 40, (choice, reference_ops, monitor_ops)


def test_zeroing_finds_buffers_registered_or_replaced_after_the_tracker():
    """zero_sqgradnorm_buffers clears the tracker's table in one op; a layer attached after the tracker was made,
    and buffers replaced by model.to(...), are found (torch's registration hooks, the table's identity check)."""
    model = build("gns", "gns", "shim")
    gnstracking.MeasurementTracker.from_model(model)
    model.extra = PEGradNormLinear(4, 3).double()  # attached after: its buffers are not yet the table's views
    model.float()  # every buffer replaced (cast back to float32 by the layers, but new tensors)
    buffers = [b for n, b in model.named_buffers() if n.endswith("_pe_sqnorm")]
    for buffer in buffers:
        buffer.fill_(1.0)
    zero_sqgradnorm_buffers(model)
    assert all(b.abs().sum() == 0 for n, b in model.named_buffers() if n.endswith("_pe_sqnorm"))
    assert any(n.startswith("extra.") for n, _ in model.named_buffers())
