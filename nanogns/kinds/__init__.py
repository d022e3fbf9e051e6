"""
The layer kinds: one module per kind of layer that records exact per-example squared gradient norms, and KINDS,
the one list of them that everything else reads (core/registry.py's Registry).

Each kind module states everything the project knows about its kind in one LayerKind (KIND): its maths as pure
functions of the inputs and the output gradients (in its docstring and code, shared where kinds share it:
affine.py for the norms, core/matmul.py for the matrix products), its autograd Functions, the classes of its
variants (shim, gns, fused, and any others such as sogns), how convert() recognises and probes modules of that kind,
and its group in the analysis. Adding a kind is one module, one line in KINDS below and one entry in
tests/test_layers_registry.py's table of kinds (docs/architecture.md, "Adding a layer kind").

Beside the kinds: affine.py and norm.py (what the norm kinds share), choice.py (which variant class a user's choice
means; the classes model.py builds with), functional.py (the kinds as functions, for layers that are not modules)
and grouped.py (the experts' grouped computation).
"""

from nanogns.core.registry import LayerKind, Probe, Registry  # noqa: F401
from nanogns.kinds import (
    attention,
    batchnorm,
    conv,
    conv1d,
    embedding,
    experts,
    experts_dbrx,
    experts_dense,
    experts_parallel,
    groupnorm,
    layernorm,
    linear,
    rmsnorm,
)

# every kind, in the order convert()'s probe tries them on a module no kind replaces by class
KINDS = Registry(
    embedding.KIND,
    layernorm.KIND,
    linear.KIND,
    rmsnorm.KIND,
    attention.KIND,
    batchnorm.KIND,
    groupnorm.KIND,
    conv.KIND,
    conv1d.KIND,
    experts.KIND,
    experts_dbrx.KIND,
    experts_dense.KIND,
    experts_parallel.KIND,
)


def get(name: str) -> LayerKind:
    """The LayerKind `name`; ValueError naming the kinds otherwise."""
    return KINDS.kind(name)


def group_of(kind_name: str) -> str:
    """The analysis group of a recorded layer kind (Registry.group_of)."""
    return KINDS.group_of(kind_name)
