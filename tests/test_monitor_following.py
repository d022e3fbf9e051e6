"""
The monitor follows the model (nanogns/monitor/following.py): parameters added, removed, resized, frozen or unfrozen
after convert() are noticed at the next step, measured exactly (against tests/oracle.py's loop: float64, each
example's gradient from the same batched forward) or listed in `monitor.untracked` with their reason, and named in
one warning; never a silent drop.

    python -m pytest -q tests/test_monitor_following.py
"""

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import loss_sqnorms_from_batched_forward

import nanogns
from nanogns.core.buffers import zero_pe_sqnorm_buffers
from nanogns.kinds.linear import PerExampleLinear


def check_exact(model, monitor, losses, B, names=None):
    """Step with the mean of `losses` and compare every measured norm and pegn with the oracle; returns the row."""
    losses.mean().backward(retain_graph=True)
    row = monitor.step(batch_size=B)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    zero_pe_sqnorm_buffers(model)
    pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses)
    zero_pe_sqnorm_buffers(model)
    measured = [m.metadata["name"] for m in monitor.measurements]
    assert measured, row
    for m in monitor.measurements:
        first = m.metadata["name"].split("+")[0]
        assert m.norm == pytest.approx(grads[first].norm().item(), rel=1e-9), m
        assert m.rms_pe_norm == pytest.approx(math.sqrt(pe_sq[first]), rel=1e-5), m
    if names is not None:
        assert set(names) <= set(measured), (names, measured)
    return row


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(17, 8), nn.LayerNorm(8)

    def forward(self, ids):
        out = self.norm(self.emb(ids))
        return self.head(out) if hasattr(self, "head") else out


def test_a_head_attached_after_convert_is_converted_and_measured_from_its_first_step():
    torch.manual_seed(0)
    model = Body().double()
    monitor = nanogns.convert(model)
    ids = torch.randint(0, 17, (5, 6))
    check_exact(model, monitor, model(ids).pow(2).flatten(1).mean(1), 5)
    model.zero_grad()
    model.head = nn.Linear(8, 3).double()  # a task head, after convert()
    with pytest.warns(UserWarning, match=r"changed after step 1: added head.weight \(measured\), head.bias"):
        losses = model(ids).pow(2).flatten(1).mean(1)  # the step's first forward converts it before it runs
    assert isinstance(model.head, PerExampleLinear) and isinstance(model.head, nn.Linear)
    check_exact(model, monitor, losses, 5, names=["head.weight", "head.bias"])
    assert monitor.untracked == {}


def test_a_head_attached_to_a_model_built_with_per_example_layers_is_listed_with_its_reason():
    torch.manual_seed(0)
    model = nn.Sequential(PerExampleLinear(4, 4).double())
    monitor = nanogns.GNSMonitor(model)  # no convert(): nothing converts layers attached later
    model.append(nn.Linear(4, 2).double())
    with pytest.warns(UserWarning, match=r"added 1.weight \(not measured: attached after step 0: its layer records"):
        losses = model(torch.randn(3, 4, dtype=torch.float64)).pow(2).mean(1)
    row = check_exact(model, monitor, losses, 3, names=["0.weight"])
    assert monitor.untracked["1.weight"].startswith("attached after step 0: its layer records no per-example norms")
    assert "train/gns/1.weight/norm" not in row and "train/gns/0.weight/norm" in row


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_after_convert_is_measured_exactly(tied):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16, intermediate_size=32,
        vocab_size=40, tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = nanogns.convert(model)
        model.resize_token_embeddings(46)  # special tokens added: untied, a new plain lm_head module
        ids = torch.randint(0, 46, (4, 5))  # B = 4 != T = 5; the new rows are used
        ids[:, 0] = 45
        logits = model(ids).logits
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    head = "model.embed_tokens.weight+lm_head.weight" if tied else "lm_head.weight"
    check_exact(model, monitor, losses, 4, names=[head, "model.embed_tokens.weight" if not tied else head])
    assert not any("embed" in name or "lm_head" in name for name in monitor.untracked)


def test_a_block_unfrozen_after_convert_is_measured_and_a_frozen_one_is_listed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    monitor = nanogns.convert(model)
    assert set(monitor.untracked) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    x = torch.randn(4, 5, dtype=torch.float64)
    check_exact(model, monitor, model(x).pow(2).mean(1), 4)
    model.zero_grad()
    model[2].requires_grad_(True)  # gradual unfreezing
    with pytest.warns(UserWarning, match=r"unfrozen 2.weight \(measured\), 2.bias \(measured\)"):
        losses = model(x).pow(2).mean(1)
    check_exact(model, monitor, losses, 4, names=["2.weight", "2.bias", "4.weight"])
    assert set(monitor.untracked) == {"0.weight", "0.bias"}
    model.zero_grad()
    model[4].requires_grad_(False)  # frozen between steps, noticed at the read as well as at the forward
    with pytest.warns(UserWarning, match=r"frozen 4.weight, 4.bias \(not measured: frozen"):
        losses = model(x).pow(2).mean(1)
    check_exact(model, monitor, losses, 4, names=["2.weight"])
    assert monitor.untracked["4.weight"].startswith("frozen (requires_grad=False)")


def test_a_change_between_the_forward_and_the_read_is_noticed_at_the_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    monitor = nanogns.convert(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    losses = model(x).pow(2).mean(1)
    losses.mean().backward()
    model[0].requires_grad_(False)  # frozen after the backward: its gradient is not a measurement any more
    with pytest.warns(UserWarning, match="frozen 0.weight"):
        row = monitor.step(batch_size=5)
    assert "train/gns/0.weight/norm" not in row and "train/gns/1.weight/norm" in row
    assert monitor.untracked["0.weight"].startswith("frozen")


def test_a_removed_layer_is_named_and_nothing_breaks():
    torch.manual_seed(0)
    model = Body().double()
    model.head = nn.Linear(8, 2).double()
    monitor = nanogns.convert(model)
    del model.head
    ids = torch.randint(0, 17, (3, 4))
    with pytest.warns(UserWarning, match="removed head.weight, head.bias"):
        losses = model(ids).pow(2).flatten(1).mean(1)
    check_exact(model, monitor, losses, 3, names=["emb.weight"])


def test_an_unchanged_model_is_looked_at_without_a_walk_and_new_parameter_objects_of_the_same_shape_change_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    monitor = nanogns.convert(model)
    reader = monitor.reader
    x = torch.randn(5, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing changed
        check_exact(model, monitor, model(x).pow(2).mean(1), 5)
        assert monitor.reader is reader  # the tracked list was not made again
        model.zero_grad()
        # an engine re-registering every parameter as a new object of the same name and shape (FSDP2's sharding)
        for module in model:
            for name, p in list(module._parameters.items()):
                module._parameters[name] = nn.Parameter(p.detach().clone())
        check_exact(model, monitor, model(x).pow(2).mean(1), 5, names=["0.weight", "1.weight"])
    assert monitor.reader is not reader and monitor.shape.same()
