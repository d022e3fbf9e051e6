"""
The layer registry and the contextual config of layer_config.py.

    python -m pytest tests/test_layer_config.py -q
"""

import pytest
import torch
import torch.nn as nn

import buffered
import layer_config as lc


# how each kind is built, and an input for it: (constructor args, input)
BUILD = {
    "Linear": ((5, 3), lambda: torch.randn(4, 2, 5)),
    "Embedding": ((11, 3), lambda: torch.randint(0, 11, (4, 2))),
    "LayerNorm": ((5,), lambda: torch.randn(4, 2, 5)),
    "RMSNorm": ((5,), lambda: torch.randn(4, 2, 5)),
    "Conv1D": ((3, 5), lambda: torch.randn(4, 2, 5)),  # transformers' (nf, nx): 5 in, 3 out
}
ENTRIES = [(kind, name) for kind, choices in lc.LAYER_CLASSES.items() for name in choices]


@pytest.mark.parametrize("kind, name", ENTRIES, ids=[f"{k}-{n}" for k, n in ENTRIES])
def test_every_registered_class_is_a_drop_in_for_its_kind(kind, name):
    """Each entry builds with its kind's constructor, has the torch class's parameter names and shapes, gives
    its output (a registry entry pointing at the wrong class fails here), and, unless 'nn', records every
    trainable parameter's per-example norms for the 4 examples of the input."""
    args, make_input = BUILD[kind]
    torch.manual_seed(0)
    reference = lc.get_layer_class(kind, "nn")(*args)
    layer = lc.get_layer_class(kind, name)(*args)
    assert [(n, p.shape) for n, p in layer.named_parameters()] == [(n, p.shape) for n, p in reference.named_parameters()]
    layer.load_state_dict(reference.state_dict())
    x = make_input()
    out = layer(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)
    out.pow(2).sum().backward()
    recorded = {n[: -len(buffered.BUFFER_SUFFIX)]: b for n, b in layer.named_buffers() if n.endswith(buffered.BUFFER_SUFFIX)}
    if name == "nn":
        assert not recorded
    elif "sogns" in name:
        assert {n.split("_sogns")[0] for n in recorded} == {n for n, _ in layer.named_parameters()}
    else:
        assert set(recorded) == {n for n, _ in layer.named_parameters()}
        assert all(b[1].item() == 4 and b[0].item() > 0 for b in recorded.values())


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
