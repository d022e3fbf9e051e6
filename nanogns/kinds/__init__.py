"""
The layer kinds: one module per kind of layer that records exact per-example squared
gradient norms. Each kind module states everything the project knows about its kind
and registers it once (core/registry.py): its maths (in its docstring), its autograd
Functions, the classes of its variants (shim, gns, fused, and any others such as
sogns), how convert() recognises and probes modules of that kind, and its group in
the analysis. Adding a kind is one module, one import line below and one test entry
(tests/test_layers_registry.py's table of kinds).

Beside the kinds: choice.py (which variant class a user's choice means; the classes
model.py builds with), functional.py (the kinds as functions, for layers that are
not modules) and grouped.py (the experts' grouped computation).
"""

from nanogns.core.registry import KINDS, LayerKind, Probe, get, group_of, register  # noqa: F401
from nanogns.kinds import (  # noqa: F401  (each import registers its kind)
    attention,
    batchnorm,
    conv,
    conv1d,
    embedding,
    experts,
    experts_dbrx,
    experts_dense,
    layernorm,
    linear,
    rmsnorm,
)
