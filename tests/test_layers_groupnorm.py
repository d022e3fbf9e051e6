"""
The GroupNorm kind (nanogns/kinds/groupnorm.py) and the channels-first affine it shares with BatchNorm
(kinds/affine.py): exact against the brute-force loop over examples (float64, two uneven micro-batches, odd sizes,
1-d, 2-d and channel-only inputs), a faithful drop-in (output, dtype and input gradient under float32, a bfloat16
input with float32 parameters and CPU autocast), nothing recorded without affine parameters, and both kinds'
layers constructible on their own.

    python -m pytest -q tests/test_layers_groupnorm.py
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_conversion_models import SPLIT, B, brute_force, check_exact, measured

import nanogns as lc
from nanogns.kinds.batchnorm import PerExampleBatchNorm
from nanogns.kinds.groupnorm import PerExampleGroupNorm


class ConvNet(nn.Module):
    """A convolution, a GroupNorm of odd sizes (6 channels in 3 groups, 5 x 3 positions) and a head."""

    def __init__(self, affine=True, dims=2):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        self.conv = conv(2, 6, 3, padding=1)
        self.norm = nn.GroupNorm(3, 6, eps=1e-3, affine=affine)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = F.silu(self.norm(self.conv(x)))
        return self.head(h.flatten(2).mean(-1))


def images(dims):
    gen = torch.Generator().manual_seed(1)
    shape = (B, 2, 5, 3) if dims == 2 else (B, 2, 7)
    return torch.randn(*shape, generator=gen, dtype=torch.float64), torch.randint(0, 3, (B,), generator=gen)


@pytest.mark.parametrize("dims", [1, 2])
def test_group_norm_is_a_kind_exact_over_uneven_micro_batches(dims):
    torch.manual_seed(0)
    model = ConvNet(dims=dims).double()
    with torch.no_grad():  # an affine away from its initial (1, 0)
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    x, labels = images(dims)
    loss_of = lambda part: F.cross_entropy(model(x[part]), labels[part], reduction="none")  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    assert isinstance(model.norm, PerExampleGroupNorm) and isinstance(model.norm, nn.GroupNorm)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert not monitor.unconverted and not monitor.untracked
    assert monitor.describe()["norm.weight"]["kind"] == "GroupNorm"
    assert monitor.describe()["norm.weight"]["group"] == "LayerNorm"
    check_exact(model, monitor, want, got)


def test_group_norm_of_channels_alone_is_exact():
    """An (N, C) input: each example's only position is its row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.Linear(6, 1)).double()
    x = torch.randn(B, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loss_of = lambda part: model(x[part]).squeeze(-1).pow(2)  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    check_exact(model, monitor, want, got)


def test_group_norm_without_affine_parameters_records_nothing_and_stays_torch_s():
    torch.manual_seed(0)
    model = ConvNet(affine=False).double()
    x, labels = images(2)
    loss_of = lambda part: F.cross_entropy(model(x[part]), labels[part], reduction="none")  # noqa: E731
    want = brute_force(model, loss_of, B)
    monitor = lc.convert(model)
    assert type(model.norm) is nn.GroupNorm and not monitor.unconverted and not monitor.untracked
    got = measured(monitor, model, loss_of, [slice(0, SPLIT), slice(SPLIT, B)], B)
    assert set(got) == {"conv.weight", "conv.bias", "head.weight", "head.bias"}
    check_exact(model, monitor, want, got)


@pytest.mark.parametrize("case", ["float32", "bfloat16 input", "cpu autocast"])
def test_group_norm_is_a_drop_in(case):
    """The converted layer returns torch's output in torch's dtype, and gives the input the same gradient."""
    torch.manual_seed(0)
    plain = nn.GroupNorm(3, 6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-0.5, 0.5)
    converted = copy.deepcopy(plain)
    lc.convert(nn.Sequential(converted))
    x = torch.randn(4, 6, 5, 3, dtype=torch.bfloat16 if case == "bfloat16 input" else torch.float32)
    outs, grads = [], []
    for layer in (plain, converted):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "cpu autocast"):
            out = layer(xi)
        out.float().pow(2).sum().backward()
        outs.append(out)
        grads.append(xi.grad)
    assert outs[1].dtype == outs[0].dtype
    tolerance = 1e-5 if case == "float32" else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grads[1].float(), grads[0].float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(converted.weight.grad, plain.weight.grad, rtol=tolerance, atol=tolerance)


def test_the_channels_first_norms_are_constructible_on_their_own():
    """PerExampleBatchNorm(3) and PerExampleGroupNorm(2, 4) are layers with their buffers, as the other kinds' are
    (before: PerExampleBatchNorm(3) raised TypeError, a mixin with no module of its own)."""
    for layer, x in (
        (PerExampleBatchNorm(3).eval(), torch.randn(4, 3, 5)),
        (PerExampleGroupNorm(2, 4), torch.randn(4, 4, 5)),
    ):
        buffers = {n for n, _ in layer.named_buffers() if n.endswith("_pe_sqnorm")}
        assert buffers == {"weight_pe_sqnorm", "bias_pe_sqnorm"}
        layer(x).pow(2).sum().backward()
        assert layer.weight_pe_sqnorm[1].item() == 4 and layer.weight_pe_sqnorm[0].item() > 0
    with pytest.raises(ValueError, match="at least 2 dims"):
        PerExampleBatchNorm(3)(torch.randn(3))


def test_a_converted_batchnorm_keeps_its_own_input_check():
    norm = nn.BatchNorm1d(3).eval()
    lc.convert(nn.Sequential(norm))
    assert isinstance(norm, PerExampleBatchNorm)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        norm(torch.randn(2, 3, 4, 5))
