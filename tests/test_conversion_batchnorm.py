"""
Batch statistics: a forward that mixes the examples of a batch is refused before any number is read, with one error
naming the layer and why (a BatchNorm or SyncBatchNorm in training mode, converted or not, with or without affine
parameters); in eval mode (running statistics) a BatchNorm is per-example, and its affine parameters are tracked
exactly, with a ResNet's convolutions, against the brute-force loop over examples (float64, two uneven micro-batches).

    python -m pytest -q tests/test_conversion_batchnorm.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from test_conversion_models import SPLIT, B, brute_force, check_exact, measured

import nanogns as lc
from nanogns.kinds.batchnorm import PerExampleBatchNorm


def resnet():
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck", num_labels=3
        )
    ).double()
    with torch.no_grad():  # running statistics away from their initial (0, 1)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, 16, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (B,), generator=gen)
    loss_of = lambda part: F.cross_entropy(model(pixel_values=images[part]).logits, labels[part], reduction="none")  # noqa: E731
    return model, loss_of


def test_resnet_in_eval_mode_is_exact_batchnorm_affine_included():
    model, loss_of = resnet()
    model.eval()
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    norm = model.resnet.embedder.embedder.normalization
    assert isinstance(norm, PerExampleBatchNorm) and isinstance(norm, nn.BatchNorm2d)
    assert monitor.describe()["resnet.embedder.embedder.normalization.weight"]["group"] == "LayerNorm"
    check_exact(model, monitor, want, got)


def test_resnet_in_training_mode_refuses_the_step_naming_the_layer():
    """Before: the convolutions before each BatchNorm were logged as if exact (pegn^2 30.5 against 32.3 for the
    stem). Now nothing is read or logged for the step; the buffers are cleared, and an eval-mode step after it is
    measured."""
    model, loss_of = resnet()
    logged = []
    monitor = lc.convert(model, log=logged.append)
    loss_of(slice(0, B)).mean().backward()
    with pytest.raises(ValueError) as refused:
        monitor.step(batch_size=B)
    message = str(refused.value)
    assert message.startswith("GNS: this step is not measured: resnet.embedder.embedder.normalization (BatchNorm2d)")
    assert "statistics of the batch" in message and "eval mode" in message and "more such layers" in message
    assert logged == [] and all(b.abs().sum() == 0 for n, b in model.named_buffers() if n.endswith("_pe_sqnorm"))
    model.zero_grad(set_to_none=True)
    model.eval()
    loss_of(slice(0, B)).mean().backward()
    assert len(monitor.step(batch_size=B)) > 1 and len(logged) == 1


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(6, affine=False), nn.BatchNorm1d(6, track_running_stats=False)])
def test_batch_statistics_without_parameters_or_running_stats_are_refused(norm):
    """A BatchNorm with no parameters to track (nothing to convert), or without running statistics (in eval mode
    too), still mixes the examples, so every layer before it is wrong: the step is refused."""
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 2)).eval()
    norm.train(norm.track_running_stats)
    monitor = lc.convert(model)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d\) mixes the examples of the batch"):
        monitor.measure(batch_size=5)


def test_sync_batchnorm_in_eval_mode_is_exact():
    """SyncBatchNorm (its eval-mode forward runs anywhere) is the BatchNorm kind: exact per example."""
    from oracle import per_example_sqnorms_by_loop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU()).double().eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-0.5, 0.5)
        model[1].running_mean.uniform_(-0.5, 0.5), model[1].running_var.uniform_(0.5, 2.0)
    x, g = torch.randn(5, 3, 7, dtype=torch.float64), torch.randn(5, 4, 5, dtype=torch.float64)
    want = per_example_sqnorms_by_loop(model, x, g)
    lc.convert(model)
    model(x).backward(g)
    for name in ("1.weight", "1.bias"):
        total, count = model.get_buffer(name + "_pe_sqnorm").tolist()
        assert count == 5 and total == pytest.approx(want[name].sum().item(), rel=1e-6), name
