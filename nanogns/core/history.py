"""
Where a forward moved or folded its examples off the dim 0 its inputs hold them on, read from how the data was made
rather than from sizes: the ids' tag through transposes (core/ids.py's examples_dim: XLNet's (T, N) ids), the
autograd history of data transposed to (T, N, D) (Longformer's attention) or folded by a reshape of (N, ...) data
(heads, frames, tokens: core/inputs.py's folded_by_history) or gathered by an index from the examples' rows
(tokens regrouped by expert: rows_by_gather). Each answer is Rows or Items for the running forward
(core/layout.py's Pass), or None; where sizes could mean either layout and nothing tells which, the reason to refuse.
"""

import math

import torch

from nanogns.core.ids import ExampleIds
from nanogns.core.inputs import _FOLD_KEEPS, _output_shape, dim_by_history, folded_by_history, folded_by_node
from nanogns.core.layout import current_pass, rows_for
from nanogns.core.rowmaps import Items, Rows, Tower, ragged


def rows_by_history(x):
    """Rows 'seqfirst' for a (T, N, D) input whose autograd history moved the examples' dim 0 to dim 1 (Longformer's
    and LED's hidden states transposed before their projections, T padded to a length no input has), else None.
    Asked only where the input's sizes fit no mapping."""
    found = current_pass()
    if found is None or found.layout is None or found.layout.packed is not None or found.scopes:
        return None
    N = found.layout.examples
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != N or x.grad_fn is None or found.ids_moved:
        return None  # (ids moved to dim 1: the history's data did not arrive with its examples on dim 0)
    if dim_by_history(x) != 1:
        return None
    found.examples_moved = True
    return Rows("seqfirst", N, positions=x.shape[0])


def rows_by_fold(x):
    """Rows 'dim0' for an input whose dim 0 a view or reshape of (N, ...) data folded the examples into, example after
    example (N*k, ...), as its autograd history says (items_by_history), k no input's size; else None. Asked only
    where the input's sizes fit no mapping."""
    items = items_folded_on_dim0(x) if isinstance(x, torch.Tensor) else None
    return None if items is None else Rows("dim0", items.examples)


def rows_of_moved_ids(ids):
    """Rows of ids (..., 1) an Embedding looks up whose examples the forward moved off dim 0 (core/ids.py's
    examples_dim: XLNet transposes its ids to (T, N)): 'seqfirst' for (T, N, 1) ids, whatever T and N; why they
    cannot be mapped for other moves; None for ids holding their examples on dim 0 (rows_for decides)."""
    at = ids._examples_dim if isinstance(ids, ExampleIds) else 0
    found = current_pass()
    if at == 0 or found is None or found.layout is None:
        return None
    found.examples_moved = found.ids_moved = True
    N = found.layout.examples
    if at == 1 and ids.dim() == 3 and ids.shape[1] == N and found.layout.packed is None and not found.scopes:
        return Rows("seqfirst", N, positions=ids.shape[0])
    rows = sequence_first_groups(ids.shape) if at == 1 and ids.dim() == 3 else None
    if rows is not None:
        return rows
    where = f"to dim {at}" if at is not None else "off dim 0, then reshaped them (where they are is not known)"
    return (
        f"its ids have rows {tuple(ids.shape[:-1])}, the forward having moved their examples {where} (a transpose or "
        f"permute of the ids): only (T, {N}) ids, the forward's {N} examples on dim 1 (or their choices), can be mapped"
    )


def sequence_first_groups(shape):
    """Rows of a (T, N*k, ...) input in a forward whose ids had their examples moved to dim 1, each example's k rows
    (its choices) one after the other there (XLNet's multiple choice: (N, C, T) ids flattened to (N*C, T), then
    transposed): ragged, row (t, j) example j // k; else None."""
    found = current_pass()
    if found is None or found.layout is None or not found.ids_moved or found.scopes or len(shape) < 3:
        return None
    N, M = found.layout.examples, shape[1]
    k = next((k for k in found.layout.groups if M == N * k), None)
    if k is None or shape[0] == M:
        return None
    return ragged((torch.arange(math.prod(shape[:-1])) % M) // k, N)


def undecided_rows(x):
    """Why rows 'dim0' of an input x (N, N, ...) cannot be trusted: its forward moved the examples off dim 0 (its ids
    transposed, or x's autograd history transposes its data), so dim 0 and dim 1 both have the N examples' sizes and
    nothing tells which holds them; None when x's examples can only be on dim 0. Asked only for (N, N, ...) inputs."""
    found = current_pass()
    if found is None or found.layout is None or found.scopes or found.layout.packed is not None:
        return None
    N = found.layout.examples
    if not isinstance(x, torch.Tensor) or x.shape[0] != N or N == 1:  # (one example: every row is its own)
        return None
    if not found.examples_moved:
        # (around a sequence-first module, the data transposed in and out: the history, which takes an op it does not
        # know (inside that module) to hold the examples on dim 0, would see only the last transpose; the module's
        # scope maps its own rows)
        if found.sequence_first_ran or x.grad_fn is None or dim_by_history(x) == 0:
            return None
        found.examples_moved = True
    return (
        f"its input has rows {tuple(x.shape[:-1])} for the forward's {N} examples, and this forward moves its "
        "examples off dim 0 (its ids, or its data, transposed): dim 0 and dim 1 both have the examples' size, and "
        f"nothing tells which holds them; use micro-batches of a size other than {N}"
    )


def items_held(shape):
    """(Items, dim) of a tensor of `shape` holding the examples' data in the running forward: its dim 0's items, or
    the examples on dim 1 in a forward whose ids had their examples moved there (XLNet's (T, N, ...) states: dim 1
    has the N examples, dim 0 another size); None where sizes cannot tell (N == T there) and outside a forward."""
    found = current_pass()
    if found is None or found.layout is None or not len(shape):
        return None
    items = found.layout.items_of(shape[0], found.scopes[-1] if found.scopes else None)
    if items is not None:
        return None if found.ids_moved and len(shape) > 1 and shape[1] == shape[0] != 1 else (items, 0)
    N = found.layout.examples
    if found.ids_moved and not found.scopes and found.layout.packed is None and len(shape) > 1:
        if shape[1] == N:
            return Items(N, N), 1
        if any(shape[1] == N * k for k in found.layout.groups) and shape[0] != shape[1]:  # (T, N*C, ...): choices
            return Items(shape[1], N), 1
    return None


def items_by_history(t):
    """(Items, dim) of data t whose dim `dim` a view or reshape of (N, ...) data folded the examples into, example
    after example (heads folded into the batch: (N*H, T, d); tokens: (H, N*T, d); core/inputs.py's
    folded_by_history), whatever the sizes; else None. Not asked in a forward that moved its examples off dim 0 (its
    history would not start at data holding them on dim 0)."""
    found = current_pass()
    if found is None or found.layout is None or found.examples_moved or found.layout.packed is not None:
        return None
    if not t.requires_grad or t.dim() == 0:
        return None
    N = found.layout.examples
    if found.scopes:  # in a vision tower: its images' (or patches') heads folded, (images*H, ...); GOT-OCR's
        return _items_folded_in_tower(t, found.scopes[-1], N)
    folded = folded_by_history(t, N)
    if folded is None or folded[1] == 1:
        return None
    return Items(t.shape[folded[0]], N), folded[0]


def _items_folded_in_tower(t, scope, N):
    """items_by_history in a Tower scope: t's rows folded from one of the counts of rows the tower maps to examples."""
    if not isinstance(scope, Tower) or scope.reason is not None:
        return None
    for count, example_of_item in scope.maps.items():
        folded = folded_by_history(t, count)
        if folded is not None and folded[1] > 1:
            dim, k = folded
            return Items(t.shape[dim], N, example_of_item.repeat_interleave(k)), dim
    return None


def items_folded_on_dim0(t):
    """The Items of data t whose dim 0 holds the examples folded by a reshape (items_by_history), else None."""
    held = items_by_history(t)
    return held[0] if held is not None and held[1] == 0 else None


def items_of_data(t):
    """(Items, dim) of the examples' data t: where sizes put them (items_held), else where a reshape folded them
    (items_by_history); None when neither says."""
    return items_held(t.shape) or items_by_history(t)


# autograd nodes whose output's row r is computed from their (first) input's row r alone, dim 0 kept: elementwise
# ops and activations, and the kinds' row-wise layers (a Linear's, an expert bank's: kinds/grouped.py); a split or
# slice keeps them too when it cuts a later dim (rows_by_gather)
_ROWWISE = _FOLD_KEEPS + ("GroupedLinearFunction", "Relu", "LeakyRelu", "Elu", "Mish", "Softplus", "Hardswish")
GATHERS = ("IndexBackward0", "IndexSelectBackward0", "GatherBackward0")
# views that only fold or unfold the leading dims of data (..., D), each row where it was in row-major order
REFOLDS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


def rows_by_gather(x):
    """Rows 'ragged' of x (R, D) whose rows its autograd history gathered by an index from the rows of the examples'
    data (x = source[index] or source.index_select(0, index), source (S, D) rows the layout maps: tokens regrouped by
    expert), followed back through ops that keep each row a row (_ROWWISE: an activation, act(h1) * h2, a split or
    slice of the features, an expert bank's own function): row s is the source's row index[s], of that row's
    example. None where the history shows no such gather (whatever x's sizes); a str saying why where it does but the
    source's rows cannot be mapped to examples."""
    found = current_pass()
    if found is None or found.layout is None or not isinstance(x, torch.Tensor) or x.dim() != 2:
        return None
    gather = _gather_behind(x.grad_fn, x.shape[0])
    return None if gather is None else _gathered_rows(gather, x.shape[0])


def rows_if_gathered(x):
    """Rows 'ragged' of a layer's input x (..., D) whose rows an index took, each once and in any order, from rows the
    forward computed and the layout maps (rows_by_gather's gather, behind ops that keep each row a row and views
    that only fold or unfold the leading dims: (N*T, D) rows gathered, then viewed as (N, T, D); or (N, T, D) data
    whose examples an index put in another order). None where x's history shows no such gather, where the gather
    takes a table's rows (_takes_computed_rows_once), or where its source cannot be mapped: sizes then decide, as
    for any input. Rows gathered in another order (tokens permuted across examples) are as many as the tokens:
    counted off example after example, by their number or their dims, they would give a wrong number."""
    found = current_pass()
    if found is None or found.layout is None or x.dim() < 2:
        return None
    R = math.prod(x.shape[:-1])
    gather = _gather_behind(x.grad_fn, R)
    rows = _gathered_rows(gather, R) if gather is not None and _takes_computed_rows_once(gather, R) else None
    return rows if isinstance(rows, Rows) else None


def _takes_computed_rows_once(node, R):
    """True when gather node `node` takes each row it takes once (a permutation or a selection of rows) from a tensor
    the forward computed. A parameter's or a constant's rows, or rows taken more than once (positions looked up for
    each example), are a table's: whatever its size, its rows are no examples' (a table of N rows is not N
    examples), and the layer's rows are mapped as any input's."""
    made = node.next_functions[0][0]
    if made is None or type(made).__name__ == "AccumulateGrad":
        return False
    index = _gather_index(node, R)[0]
    return torch.unique(index).numel() == index.numel()


def _gather_behind(node, R):
    """The gather node (of an index of R rows) that made the rows of autograd node `node`'s output, R of them (its
    leading dims' product), followed back through _ROWWISE ops and views that only fold or unfold the leading dims
    ((N, T, D) <-> (N*T, D): each row where it was, in row-major order); else None."""
    for _ in range(64):  # (as deep as folded_by_history looks)
        if node is None:
            return None
        name = type(node).__name__
        if name in GATHERS:
            return node if _gather_index(node, R) is not None else None
        if name in REFOLDS:
            source = node._saved_self_sym_sizes
            if not source or source[-1] != _last_dim(node) or math.prod(source[:-1]) != R:
                return None
        elif name in ("SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"):
            if _signed(node._saved_dim) % len(node._saved_self_sym_sizes) == 0:  # (a split of the rows themselves)
                return None
        elif name.rstrip("0123456789").removesuffix("Backward") not in _ROWWISE:
            return None
        # the input whose rows are the output's: the first with R rows (a row's weight (R, 1) or the features (R, D))
        node = next((f for f, _ in node.next_functions if f is not None and _rows_of_node(f) == R), None)
    return None


def _gather_index(node, R):
    """(index (n,), the source's shape (S, ..., D)) of a gather node taking R rows by an index on dim 0 of a source:
    of rows (S, D), n == R, or of slabs of rows (S, T, D), each index taking T of them (examples permuted whole:
    h[order] of (N, T, D) data), n * T == R; None for other gathers (of another dim, by a mask)."""
    if type(node).__name__ == "GatherBackward0":
        return _whole_rows_gathered(node, R)
    if type(node).__name__ == "IndexBackward0":
        indices = node._saved_indices
        index = indices[0] if indices and all(i is None for i in indices[1:]) else None
    else:
        index = node._saved_index if _signed(node._saved_dim) == 0 else None
    source = tuple(node._saved_self_sym_sizes)
    if index is None or index.dim() != 1 or len(source) < 2 or index.numel() * math.prod(source[1:-1]) != R:
        return None
    if index.is_floating_point() or index.dtype == torch.bool:  # (a mask: its rows' positions are not saved)
        return None
    return index, source


def _whole_rows_gathered(node, R):
    """_gather_index of torch.gather(source, 0, index) (GatherBackward0) on (S, D) rows whose index takes whole rows,
    each of its R rows one value (order[:, None].expand(-1, D), as a dispatch sorting tokens writes it): (that
    value per row, (S, D)); None for other gathers (along the features, or mixing rows within a row)."""
    source = tuple(node._saved_self.shape)
    index = node._saved_index
    if len(source) != 2 or _signed(node._saved_dim) % 2 != 0 or index.dim() != 2 or index.shape[0] != R:
        return None
    rows = index[:, 0]
    return (rows, source) if bool((index == rows[:, None]).all()) else None


def _gathered_rows(node, R, depth=0):
    """rows_by_gather's answer at gather node `node` of R rows: its source's rows, mapped as those of a gather behind
    them (rows regrouped twice), else as the layout maps rows of the source's shape, else as a reshape of (N, ...) data
    folded them; each row of the gather its source row's example."""
    index, source = _gather_index(node, R)
    S = math.prod(source[:-1])  # (the source's rows: index[j] took its rows index[j] * T ... index[j] * T + T - 1)
    behind = _gather_behind(node.next_functions[0][0], S) if depth < 8 else None
    rows = _gathered_rows(behind, S, depth + 1) if behind is not None else rows_for(source)
    if isinstance(rows, str) and behind is None:  # (N*k, D) rows a reshape of (N, ...) data folded (top-k slots)
        found = current_pass()
        N = found.layout.examples
        moved = found.examples_moved or found.layout.packed is not None or found.scopes
        folded = None if moved else folded_by_node(node.next_functions[0][0], source, N)
        rows = Rows("dim0", N) if folded is not None and folded[0] == 0 else rows
    if isinstance(rows, str) or rows.kind == "shared":
        why = rows if isinstance(rows, str) else "they are one row for every example, not the examples' own"
        return (
            f"its {R} input rows were gathered by an index from {S} rows of shape {source}, whose examples "
            f"cannot be told ({why})"
        )
    example_of_source = rows.example_ids(S, index.device).view(source[0], -1)
    return ragged(example_of_source.index_select(0, index.long()), rows.examples)


def _rows_of_node(node):
    """The rows of autograd node `node`'s output (its first): the product of its leading dims (all but the last), or
    None where torch does not say."""
    shape = _output_shape(node)
    return math.prod(shape[:-1]) if shape else None


def _last_dim(node):
    """The last dim of autograd node `node`'s output, or None where torch does not say."""
    shape = _output_shape(node)
    return shape[-1] if shape else None


def _signed(dim):
    """A dim autograd saved as an unsigned integer (-1 comes back as 2**64 - 1) as Python's signed int."""
    return dim - 2**64 if dim >= 2**63 else dim
