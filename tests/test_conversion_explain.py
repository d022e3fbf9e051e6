"""
Which of convert()'s paths measures each module, and why (conversion/convert.py's PATHS, one table tried in order;
GNSMonitor.explain() reports it): a kind's layer by its class, a norm found by a probe, a module kept with its own
forward or replayed per example, a parametrised weight replayed, a module excluded, a layer the model was built
with, and a child measured with its parent's subtree.

    python -m pytest -q tests/test_conversion_explain.py
"""

import warnings

import torch
import torch.nn as nn

import nanogns as lc
from nanogns.conversion.convert import PATHS
from nanogns.kinds.linear import PerExampleLinear


class ScaledNorm(nn.Module):
    """An RMSNorm of the model's own class: found by the probe."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_explain_names_the_path_and_why_for_every_module_with_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8),
        ScaledNorm(8),
        nn.GroupNorm(2, 8),
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
        nn.MultiheadAttention(8, 2, batch_first=True),
        nn.Linear(8, 2),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the excluded layer's warning
        monitor = lc.convert(model, exclude=["5"])
    found = monitor.explain()
    assert found["0"].startswith("a kind's layer: the Linear kind's PerExampleLinear; its class")
    assert found["1"].startswith("probed: the RMSNorm kind's PerExampleRMSNorm(ScaledNorm); it owns parameters")
    assert found["2"].startswith("a kind's layer: the GroupNorm kind's PerExampleGroupNorm")
    assert found["3"].startswith("replayed with its parametrisation: replayed per example; its weight is computed")
    assert (
        found["3.parametrizations.weight"]
        == "measured with 3 (replayed with its parametrisation: replayed per example)"
    )
    assert found["4"].startswith("a kind's layer: the MultiheadAttention kind's")
    assert found["4.out_proj"].startswith("measured with 4 (a kind's layer")
    assert found["5"] == "not measured: Linear excluded by the caller (convert(exclude=...))"
    assert set(found) == {"0", "1", "2", "3", "3.parametrizations.weight", "4", "4.out_proj", "5"}


def test_a_layer_the_model_was_built_with_is_explained_by_its_class():
    model = nn.Sequential(PerExampleLinear(3, 2), nn.Linear(2, 2))
    found = lc.GNSMonitor(model).explain()
    assert found["0"] == "the Linear kind's PerExampleLinear, which the model was built with"
    assert found["1"].startswith("not measured: ")


def test_the_paths_are_one_table_most_specific_first():
    """The precedence is PATHS' order; a module's class never decides it before an exclusion or a replay its parent
    needs, and a kind's class before any probe."""
    names = [path.name for path in PATHS]
    assert names == [
        "excluded",
        "converted already",
        "followed with its parent's calls",
        "replayed with its parent's calls",
        "replayed with its parametrisation",
        "a kind's layer",
        "probed",
        "replayed with its children",
        "the model's own forward",
    ]
    assert [path.name for path in PATHS if not path.descends] == names[:2] + names[3:6]
