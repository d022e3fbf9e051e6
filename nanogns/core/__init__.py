"""
What every layer kind shares, one concept per file, in the order a norm flows through them (docs/architecture.md
lists the route as calls):

    registry.py      LayerKind: what the project knows about a kind (the list of kinds is nanogns/kinds/__init__.py)
    rowmaps.py       the values: Rows (which example each row of a layer's input is), Items, Tower, Layout
    inputs.py        a forward's Layout read from what the model was called with; example_dim
    ids.py           ExampleIds, the tag that follows the examples' ids through the model's ops; MadeIds, the one
                     on ids made from no example's data in a forward given no ids
    layout.py        install(model), whose hooks start a Pass at each forward; the Pass running now, and what layers
                     ask of it (rows_for, note_uses, note_refusal, ...)
    scopes.py        the scopes inside a forward: windows, sequence-first modules, vision towers, the windows in
                     which made ids are tagged
    mapper.py        RowMapper: a model's refusals and its last Pass, read by the monitor
    module_state.py  what the package keeps on a user's module (state_of), besides its buffers
    buffers.py       the `<param>_pe_sqnorm` buffers ([sum of per-example squared norms, count]) and the mixin
                     every per-example norm layer derives from
    table.py         BufferTable: one flat tensor behind every buffer of a model (one op to read, one to zero)
    uses.py          a tensor used several times in one forward: its uses' per-example gradients summed
    tied.py          a matrix tied between an Embedding and a Linear: the cross term of their uses
    shared.py        tables computed from parameters alone and shared by the examples (positions, relative bias)
    einsum.py        torch.einsum where a table or a parameter meets the examples: a copy per example
    pullback.py      a table's per-example gradients pulled back to its parameters (recomputed where need be)
    towers.py        which example each image of a vision tower is
    matmul.py        the Gram trick and materialised dW_i: the maths every matrix-product kind reuses
    strategy.py      the one context that forces an exact computation where there are several (tests, benchmarks)
    trees.py         pytree's map and leaves, fast for the plain containers
"""
