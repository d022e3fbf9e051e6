"""
What every layer kind shares, in the order a norm flows through it (docs/architecture.md draws the route):

    registry.py  LayerKind: what the project knows about each kind, registered once by the kind's module
    layout.py    row maps: which example each row of a layer's input belongs to (Rows), per model (RowMapper)
    buffers.py   the `<param>_pe_sqnorm` buffers ([sum of per-example squared norms, count]) and the mixin
                 every per-example norm layer derives from
    uses.py      a tensor used several times in one forward: its uses' per-example gradients summed
    tied.py      a matrix tied between an Embedding and a Linear: the cross term of their uses
    shared.py    tables computed from parameters alone and shared by the examples (positions, relative bias)
    matmul.py    the Gram trick and materialised dW_i: the maths every matrix-product kind reuses
    strategy.py  the one context that forces an exact computation where there are several (tests, benchmarks)
"""
