"""
The layer registry and the contextual config of layer_config.py.

    python -m pytest tests/test_layer_config.py -q
"""

import pytest
import torch.nn as nn

import buffered
import layer_config as lc


@pytest.mark.parametrize("kind, name, expected", [
    ("Linear", "nn", nn.Linear), ("Linear", "shim", buffered.PEGradNormShimLinear),
    ("Linear", "gns", buffered.PEGradNormLinear),
    ("Embedding", "nn", nn.Embedding), ("Embedding", "shim", buffered.PEGradNormShimEmbedding),
    ("Embedding", "gns", buffered.PEGradNormEmbedding),
    ("LayerNorm", "nn", nn.LayerNorm), ("LayerNorm", "shim", buffered.PEGradNormSeparatedLayerNorm),
    ("LayerNorm", "gns", buffered.PEGradNormLayerNorm),
])
def test_registry_names(kind, name, expected):
    assert lc.get_layer_class(kind, name) is expected


def test_every_registered_name_resolves():
    for kind, choices in lc.LAYER_CLASSES.items():
        for name in choices:
            assert isinstance(lc.get_layer_class(kind, name), type)


def test_unknown_name_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown lnclass 'fast'; choose from \['fused', 'gns', 'nn', 'shim'\]"):
        lc.layer_classes(lnclass="fast")
    with pytest.raises(ValueError, match="unknown layer kind"):
        lc.get_layer_class("Conv2d", "nn")


def test_context_manager_sets_and_restores():
    with lc.set_contextual_config(**lc.layer_classes(linearclass="gns", lnclass="shim")) as config:
        assert config.Linear is buffered.PEGradNormLinear
        assert lc.config.LayerNorm is buffered.PEGradNormSeparatedLayerNorm
        assert lc.config.Embedding is nn.Embedding
    assert lc.config.Linear is nn.Linear and lc.config.LayerNorm is nn.LayerNorm
    with pytest.raises(RuntimeError):
        with lc.set_contextual_config(Linear=buffered.PEGradNormLinear):
            raise RuntimeError("boom")
    assert lc.config.Linear is nn.Linear  # restored after an exception too
    with pytest.raises(ValueError, match="unknown layer kind"):
        with lc.set_contextual_config(Conv=nn.Conv1d):
            pass


def test_tracking_flag():
    assert not lc.tracks_per_example_norms()
    assert lc.tracks_per_example_norms(lnclass="fused")
