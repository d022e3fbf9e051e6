"""
Steps that differentiate twice, or not through autograd's usual backward: a gradient penalty (R1: a backward with
create_graph=True, then the penalty's own backward) is refused naming create_graph, never a crash or a spurious
record, and the converted layers' gradients are still torch's; a SAM step is exact on either pass with the calls
docs/integrations.md shows; torch.func's transforms over a converted model run and give torch's gradients, and a step
read after them is refused naming torch.func. Exact means against tests/oracle.py's loop (float64, each example's
gradient from the same batched forward).

    python -m pytest -q tests/test_monitor_twice.py
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
from oracle import loss_sqnorms_from_batched_forward

import nanogns
from nanogns.core.buffers import zero_pe_sqnorm_buffers

pytestmark = pytest.mark.filterwarnings("ignore:convert")


def mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).double()


def conv_discriminator():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(64, 1)
    ).double()


def r1_step(model, x, gamma=10.0):
    """A discriminator's loss with the R1 penalty gamma/2 ||d D(x_i)/d x_i||^2 (a backward with create_graph=True)."""
    x = x.clone().requires_grad_(True)
    scores = model(x).flatten()
    (input_grad,) = torch.autograd.grad(scores.sum(), x, create_graph=True)
    penalty = input_grad.pow(2).flatten(1).sum(1)
    (nn.functional.softplus(-scores) + gamma / 2 * penalty).mean().backward()


@pytest.mark.parametrize("linearclass", ["gns", "shim"])
@pytest.mark.parametrize("make, shape", [(mlp, (6, 5)), (conv_discriminator, (6, 3, 6, 6))])
def test_a_gradient_penalty_is_refused_naming_create_graph_and_its_gradients_are_torchs(make, shape, linearclass):
    torch.manual_seed(0)
    plain = make()
    model = copy.deepcopy(plain)
    monitor = nanogns.convert(model, linearclass=linearclass)
    x = torch.randn(*shape, dtype=torch.float64)
    r1_step(plain, x)
    r1_step(model, x)  # before: bmm(out=...) under autograd raised in the conv's backward
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(
        ValueError, match=r"a backward with create_graph=True ran through its layer \(a gradient penalty"
    ):
        monitor.step(batch_size=6)  # before: refused as a wrong batch size (the penalty's backward recorded norms)
    model.zero_grad()  # the next step, without the penalty (a lazy R1), is measured
    scores = model(x).flatten()
    losses = nn.functional.softplus(-scores)
    losses.mean().backward(retain_graph=True)
    monitor.step(batch_size=6)
    zero_pe_sqnorm_buffers(model)
    pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses)
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(pe_sq[m.metadata["name"]]), rel=1e-5)


def sam_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 11)).double()


def sam_losses(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)


def perturb(model, rho=0.05):
    """SAM's ascent step: w + rho g / ||g||; returns the perturbations."""
    grads = [p.grad for p in model.parameters()]
    scale = rho / torch.stack([g.norm() for g in grads]).norm()
    with torch.no_grad():
        steps = [g * scale for g in grads]
        for p, e in zip(model.parameters(), steps):
            p.add_(e)
    return steps


def expected(model, ids):
    """The oracle's mean_i ||g_i||^2 of each parameter at the model's current weights (on a copy)."""
    twin = copy.deepcopy(model)
    return loss_sqnorms_from_batched_forward(twin, sam_losses(twin, ids))[0]


@pytest.mark.parametrize("measured_pass", ["first", "second"])
def test_a_sam_step_is_exact_on_either_pass_with_the_documented_calls(measured_pass):
    model = sam_model()
    monitor = nanogns.convert(model)
    ids = torch.randint(0, 11, (5, 4))
    want = expected(model, ids)
    sam_losses(model, ids).mean().backward()  # first pass, at w
    if measured_pass == "first":
        monitor.step(batch_size=5)  # reads and zeroes the buffers: the second pass starts from zero
    else:
        zero_pe_sqnorm_buffers(model)  # forget the first pass's norms: the second pass is the one measured
    steps = perturb(model)
    if measured_pass == "second":
        want = expected(model, ids)
    model.zero_grad()
    sam_losses(model, ids).mean().backward()  # second pass, at w + e: the gradient the optimizer uses
    if measured_pass == "second":
        monitor.step(batch_size=5)
    else:
        zero_pe_sqnorm_buffers(model)  # (the second pass's norms are not this step's measurement)
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(want[m.metadata["name"]]), rel=1e-5), m
    with torch.no_grad():
        for p, e in zip(model.parameters(), steps):
            p.sub_(e)


def test_a_sam_step_read_after_both_passes_is_refused_as_two_forwards():
    model = sam_model()
    monitor = nanogns.convert(model)
    ids = torch.randint(0, 11, (5, 4))
    sam_losses(model, ids).mean().backward()
    perturb(model)
    model.zero_grad()
    sam_losses(model, ids).mean().backward()
    with pytest.raises(
        ValueError,
        match=r"counted 10 examples but step\(batch_size=5\).*Observed this step: 2 forwards.*a SAM step's second pass\), "
        r"measure one pass: nanogns.zero_pe_sqnorm_buffers\(model\) between the passes",
    ):
        monitor.step(batch_size=5)


def test_torch_func_over_a_converted_model_runs_and_the_step_is_refused_naming_it():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    plain = transformers.GPT2LMHeadModel(config).double()
    model = copy.deepcopy(plain)
    monitor = nanogns.convert(model)
    ids = torch.randint(0, 20, (3, 5))

    def loss_of(module):
        def loss(params):
            return torch.func.functional_call(module, params, (ids,), {"labels": ids}).loss

        return loss

    params = {k: v.detach() for k, v in model.named_parameters()}
    grads, value = torch.func.grad_and_value(loss_of(model))(params)  # before: setup_context RuntimeError
    want, want_value = torch.func.grad_and_value(loss_of(plain))({k: v.detach() for k, v in plain.named_parameters()})
    assert value.item() == pytest.approx(want_value.item(), rel=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=1e-10, atol=1e-12, msg=name)
    for name, p in model.named_parameters():
        p.grad = grads[name]
    with pytest.raises(ValueError, match="it ran under a torch.func transform"):
        monitor.step(batch_size=3)
    model.zero_grad()  # a forward by torch.func.functional_call, differentiated by autograd, is measured exactly
    losses = sam_losses_of_gpt2(torch.func.functional_call(model, dict(model.named_parameters()), (ids,)), ids)
    losses.mean().backward(retain_graph=True)
    monitor.step(batch_size=3)
    zero_pe_sqnorm_buffers(model)
    pe_sq, _ = loss_sqnorms_from_batched_forward(model, losses)
    for m in monitor.measurements:
        assert m.rms_pe_norm == pytest.approx(math.sqrt(pe_sq[m.metadata["name"].split("+")[0]]), rel=1e-5), m


def sam_losses_of_gpt2(output, ids):
    logits = output.logits[:, :-1]
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
