"""
Layers that record exact per-example squared gradient norms, one module per layer
kind, and the registry that every other part of the project reads (registry.py).

Each kind module holds everything about its kind: the maths (in its docstring),
the autograd Functions, the layer classes of its variants (shim, gns; fused ones
in layers/fused/), how convert() recognises and probes modules of that kind, and
its group in the analysis. Adding a kind is a new module and one line here.
"""

from nanogns.layers import (
    attention,  # noqa: F401,E402
    batchnorm,  # noqa: F401,E402
    conv,  # noqa: F401,E402
    conv1d,  # noqa: F401,E402
    embedding,  # noqa: F401,E402
    experts,  # noqa: F401,E402
    experts_dbrx,  # noqa: F401,E402
    fused,  # noqa: F401,E402  (adds the Triton variants)
    layernorm,  # noqa: F401,E402
    linear,  # noqa: F401,E402  (each import registers its kind)
    rmsnorm,  # noqa: F401,E402
    sogns,  # noqa: F401,E402  (adds the approximate Linear variants)
)
from nanogns.layers.registry import KINDS, LayerKind, Probe, get, group_of, register  # noqa: F401
