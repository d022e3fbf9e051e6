"""
Where a forward's examples are, read from what the model was called with: `layout_of_inputs(args, kwargs)` gives
the forward's Layout (core/rowmaps.py: N, the lengths of its (N, T) inputs, packed sequences, an inner batch of each
example's choices or channels), and `example_dim(t, N)` the dim of a tensor holding the examples where several
have that size (followed back through its autograd history).

  root input               the forward's examples
  (N, T) token ids         N examples of T positions
  (N, C, T) ids            N questions of C choices (multiple choice): an inner batch of N*C rows
  (N, L, C) past_values    N series of C channels, for a channel-independent model (CHANNEL_INDEPENDENT)
  (1, R) packed ids,       N sequences, position_ids restarting at 0 (or cu_seq_lens_q)
  (N, ...) any tensor      N examples

The argument holding the examples is the first of EXAMPLE_ARGUMENTS given (transformers' names), else the first
tensor. A user with a layout of their own passes `install(model, layout_of=fn)` (core/layout.py).
"""

import re

import torch

from nanogns.core.rowmaps import Layout, ragged

# keyword arguments that hold the examples, most specific first (transformers' names); else the first tensor
EXAMPLE_ARGUMENTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "idx")
# arguments that describe shapes (SigLIP2's spatial_shapes (N, 2), Qwen2-VL's image_grid_thw): no token grid
SHAPE_ARGUMENT = re.compile(r"(shapes|sizes|_thw|_hw)$")
# models that fold each series' channels into their batch (channel independence): (N, L, C) -> N*C rows
CHANNEL_INDEPENDENT = ("patchtst", "patchtsmixer")


def _tensors(args, kwargs):
    yield from ((None, a) for a in args if isinstance(a, torch.Tensor))
    yield from ((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))


def layout_of_inputs(args, kwargs, model=None):
    """The Layout of a forward called with (args, kwargs), or None when it has no tensor argument. model: the model
    called (its config says when its batch holds each example's channels: CHANNEL_INDEPENDENT)."""
    named = [kwargs[k] for k in EXAMPLE_ARGUMENTS if isinstance(kwargs.get(k), torch.Tensor)]
    tensors = [(k, t) for k, t in _tensors(args, kwargs) if not (k and SHAPE_ARGUMENT.search(k))]
    main = named[0] if named else (tensors[0][1] if tensors else None)
    if main is None or main.dim() == 0:
        return None
    N = main.shape[0]
    groups = ()
    choices = (main.dim() == 3 and not main.is_floating_point()) or (
        main is kwargs.get("inputs_embeds") and main.dim() == 4
    )
    if choices and main.shape[1] > 1:  # (N, C, T) ids: N questions of C choices, folded into N*C rows by the model
        groups = (main.shape[1],)
    config = getattr(model, "config", None)
    past = kwargs.get("past_values")
    if (
        getattr(config, "model_type", None) in CHANNEL_INDEPENDENT
        and isinstance(past, torch.Tensor)
        and past.dim() == 3
    ):
        groups = (past.shape[-1],)  # (N, L, C) series: each channel a row of the model's batch
    lengths = ()  # the distinct T of ids, masks, labels, (N, T, D) embeddings: compared, never hashed (a hash would
    for _, t in tensors:  # make torch.compile specialise on each T, and recompile this hook for every new length)
        grid = t.dim() >= 2 and (t.shape[0] == N and (not t.is_floating_point() or t.dim() == 3))
        if grid:
            T = t.shape[-1] if (choices and t.dim() == 3 and not t.is_floating_point()) else t.shape[1]
            for found in (T, *(k * T for k in groups)):
                if not any(found == known for known in lengths):
                    lengths += (found,)
    packed = packed_rows(N, kwargs)
    if packed is not None:
        return Layout(packed.examples, lengths, packed)
    return Layout(N, lengths, groups=groups)


def grouped(k):
    """A layout_of for forwards whose input holds each example as k rows, one after the other ((N * k, T) ids: a
    chosen and a rejected answer, k text queries for one image): `install(model, layout_of=grouped(k))` before
    convert(model). Each example's gradient is then its k rows' together, and a step counts N examples."""

    def layout_of(args, kwargs):
        found = layout_of_inputs(args, kwargs)
        if found is None or found.packed is not None or found.examples % k:
            return found
        lengths = found.lengths + tuple(k * T for T in found.lengths if k * T not in found.lengths)
        return Layout(found.examples // k, lengths, groups=(k,))

    return layout_of


def packed_rows(N, kwargs):
    """Rows of packed sequences: one row of R tokens whose position_ids restart at 0, or cu_seq_lens_q; else None."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if N == 1 and isinstance(cu_seq_lens, torch.Tensor) and cu_seq_lens.numel() > 2:
        lengths = torch.diff(cu_seq_lens.long())
        example_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        return ragged(example_of_row, lengths.numel())
    position_ids = kwargs.get("position_ids")
    if N == 1 and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[0] == 1:
        starts = position_ids[0] == 0
        sequences = int(starts.sum())
        if sequences > 1 and bool(starts[0]):
            return ragged(torch.cumsum(starts.long(), 0) - 1, sequences)
    return None


def example_dim(t, count):
    """The dim of t that holds `count` examples: the only dim of that size; where several have it (Gemma 3n stacks its
    (N, T, D) states into (K, N, T, D), and K may equal N), the one t's autograd history puts the examples on
    (torch.stack, unsqueeze, repeat, expand, permute, transpose, select followed back to data with the examples on
    dim 0). None when no dim has that size, or when t has no history and only other dims than 0 have it; a str
    saying why when the history does not tell."""
    dims = [d for d, n in enumerate(t.shape) if n == count]
    if dims and dims[0] != 0 and t.grad_fn is None and t._base is None:
        return None  # a tensor no op made from another (a root input, a constant the forward built, (1, T, D)
        # positions with T == N) holds examples on dim 0 if anywhere: data arrives with them there
    if len(dims) <= 1:
        return dims[0] if dims else None
    found = _traced_example_dim(t.grad_fn, t.dim(), 0)
    if found in dims:
        return found
    return (
        f"two of its dims (shape {tuple(t.shape)}) have the forward's {count} examples and its history does not "
        "say which holds them"
    )


def dim_by_history(t):
    """The dim of t on which its autograd history puts the examples (data arrives with them on dim 0; the ops that
    move dims are followed back), whatever t's sizes."""
    return _traced_example_dim(t.grad_fn, t.dim(), 0)


def flattened_by_history(t, count):
    """k where t's dim 0 holds `count` examples' k rows each, folded there by a view or reshape (folded_by_history);
    else None."""
    found = folded_by_history(t, count)
    return found[1] if found is not None and found[0] == 0 else None


def folded_by_history(t, count):
    """(dim, k) where t's dim `dim` holds `count` examples' k rows each, made by a view or reshape of a tensor holding
    the examples on its dim 0, one example after the other (Qwen3.5's gated norm takes its (N, T, H, d) heads as
    (N*T*H, d) rows; attention with its heads folded into the batch, (N*H, T, d), or its tokens, (H, N*T, d)), as
    t's autograd history says (followed back through transposes and ops that keep the dims: bmm, softmax,
    elementwise ops), whatever the sizes; else None. (A view keeps the elements' order: each example's elements stay
    together, and rows do not straddle two examples when the folded dim is a multiple of them.)"""
    if t.grad_fn is None or not count or t.dim() == 0:
        return None
    given = getattr(t, FOLDED_ROWS, None)  # a replayed module's output (replay.py: its history ends at its boundary)
    if given is not None:
        return (0, given[1]) if given[0] == count else None
    return folded_by_node(t.grad_fn, tuple(t.shape), count)


def folded_by_node(node, shape, count):
    """folded_by_history of the output of autograd node `node`, of `shape`: for a tensor known by the node that made
    it alone (the source a gather took its rows from: core/history.py's rows_by_gather)."""
    ndim = len(shape)
    if node is None or not count or ndim == 0:
        return None
    to_t = list(range(ndim))  # to_t[j]: the dim of t that dim j of the node's output becomes (None: none)
    for _ in range(64):  # (as deep as _traced_example_dim looks)
        name = type(node).__name__
        if name in _VIEWS:
            before, after = tuple(node._saved_self_sym_sizes), _output_shape(node)
            groups = _view_groups(before, after) if after is not None else None
            if groups is None:
                return None
            for j, (ins, first, _) in enumerate(groups):  # the view makes dim j (with others) from input dims ins
                if to_t[j] is not None and ins and first and before[ins[0]] == count and after[j] % count == 0:
                    found = _folded_at(node, ins[0], to_t[j], shape, count)  # (N, k, ...) folded into one dim
                    if found is not None:  # (else a dim of the examples' size, not theirs: further back)
                        return found
            inner = [None] * len(before)
            for j, (ins, first, alone) in enumerate(groups):
                if len(ins) == 1 and alone:
                    inner[ins[0]] = to_t[j]
            to_t, ndim = inner, len(before)
        elif name == "TransposeBackward0":
            d0, d1 = node._saved_dim0 % ndim, node._saved_dim1 % ndim
            to_t[d0], to_t[d1] = to_t[d1], to_t[d0]
        elif name == "PermuteBackward0":  # output dim j is input dim dims[j]
            dims = [d % ndim for d in node._saved_dims]
            to_t = [to_t[dims.index(j)] for j in range(ndim)]
        elif name in ("UnbindBackward0", "SelectBackward0"):  # (q, k, v = qkv.unbind(0): a dim taken away)
            d = node._saved_dim % (ndim + 1)
            to_t, ndim = to_t[:d] + [None] + to_t[d:], ndim + 1
        elif name in ("SplitBackward0", "SplitWithSizesBackward0"):
            to_t[node._saved_dim % ndim] = None  # (a split along a dim keeps the others)
        elif name == "ConstantPadNdBackward0" and len(node._saved_pad) < 2 * ndim:
            for k in range(len(node._saved_pad) // 2):  # (a pad of the last dims keeps the others)
                to_t[ndim - 1 - k] = None
        elif name == "BmmBackward0" and ndim == 3:  # (b, m, k) @ (b, k, l): its first operand's b and m are kept
            to_t[2] = None
        elif name in _KEEPS_DIMS or name.rstrip("0123456789").removesuffix("Backward") in _SAME_DIMS:
            pass
        elif name.rstrip("0123456789").removesuffix("Backward") in _FOLD_KEEPS:
            to_t = to_t[:1] + [None] * (ndim - 1)  # (a convolution, a norm, a kind's function: its leading dim)
        else:
            return None
        if all(d is None for d in to_t):
            return None
        node = node.next_functions[0][0] if node.next_functions else None
        if node is None:
            return None
    return None


def _folded_at(view, i, dim, shape, count):
    """folded_by_history's answer at `view`, whose input holds `count` on dim i, folded into dim `dim` of a tensor of
    `shape`: (dim, k) when its input's history holds the examples on that dim (or copies one row per example), else
    None."""
    if shape[dim] % count:
        return None
    source = view.next_functions[0][0]
    before = tuple(view._saved_self_sym_sizes)
    if not (i == 0 and _copies_per_example(source, count)) and _traced_example_dim(source, len(before), 0) != i:
        return None
    return dim, shape[dim] // count


def _output_shape(node):
    """The shape of autograd node `node`'s output (its first), or None where torch does not say."""
    metadata = getattr(node, "_input_metadata", None)
    return tuple(metadata[0].shape) if metadata else None


def _view_groups(before, after):
    """For each dim of a view's output `after` of input `before` (both shapes), the group of consecutive dims the
    view reshapes into each other: (the group's input dims, True for the group's first output dim, True when it is
    the group's only output dim); None when the sizes do not pair up (a zero size). A view keeps the elements' order,
    so the first output dim of a group whose first input dim holds N items holds them too, outermost."""
    if 0 in before or 0 in after:
        return None
    groups = [((), True, True)] * len(after)
    i = j = 0
    while i < len(before) and j < len(after):
        ins, outs, a, b = [i], [j], before[i], after[j]
        while a != b:
            if a < b and i + 1 < len(before):
                i += 1
                ins.append(i)
                a *= before[i]
            elif b < a and j + 1 < len(after):
                j += 1
                outs.append(j)
                b *= after[j]
            else:
                return None
        for o in outs:
            groups[o] = (tuple(ins), o == outs[0], len(outs) == 1)
        i, j = i + 1, j + 1
    return groups


def _copies_per_example(node, count):
    """True where autograd node `node` repeats or expands one row into `count` on dim 0 (WavLM's position bias,
    repeated over the batch before its heads are folded in): each example's copy is its own use of the row."""
    if type(node).__name__ not in ("RepeatBackward0", "ExpandBackward0"):
        return False
    sizes = tuple(node._saved_self_sym_sizes)
    return len(sizes) > 0 and sizes[0] == 1


FOLDED_ROWS = "_nanogns_folded_rows"  # (examples, rows each) a replayed module's output holds folded on dim 0
_KEEPS_DIMS = ("SoftmaxBackward0", "LogSoftmaxBackward0")
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
_SAME_DIMS = ("Clone", "ToCopy", "Alias", "Neg", "Tanh", "Sigmoid", "Add", "Sub", "Mul", "Div", "Gelu", "Silu")
# Ops keeping their first input's leading dims, followed back by folded_by_history only: it ends at a view whose
# input holds the examples on dim 0 (checked there), where _traced_example_dim ends at the first op it does not
# know and takes the examples to be on dim 0 there (followed further, through a module that had transposed its data
# (Longformer's attention), that guess would be wrong more often): the kinds' own functions, convolutions, norms,
# attention (each follows its first argument: the data, the query)
_FOLD_KEEPS = _SAME_DIMS + ("LinearFunction", "LayerNormFunction", "AffineFunction", "FusedLinearFunction")
_FOLD_KEEPS += ("FusedLayerNormFunction", "FusedRMSNormFunction", "NativeLayerNorm", "NativeDropout")
_FOLD_KEEPS += ("Convolution", "ConvFunction", "NativeGroupNorm")
_FOLD_KEEPS += ("ScaledDotProductFlashAttentionForCpu", "ScaledDotProductEfficientAttention")
_FOLD_KEEPS += ("ScaledDotProductFlashAttention", "ScaledDotProductCudnnAttention")


def _traced_example_dim(node, ndim, depth):
    """The dim holding the examples in the output (ndim dims) of autograd node `node`, followed back through ops that
    move dims; 0 where the history gives no such op (data arrives with its examples on dim 0)."""
    if node is None or depth > 64:
        return 0
    name = type(node).__name__
    inputs = [f for f, _ in node.next_functions if f is not None]
    first = inputs[0] if inputs else None
    if name in ("StackBackward0", "UnsqueezeBackward0"):  # a new dim d: dims from d on move one up
        d = node._saved_dim % ndim
        inner = _traced_example_dim(first, ndim - 1, depth + 1)
        return inner + 1 if d <= inner else inner
    if name in ("RepeatBackward0", "ExpandBackward0"):  # new leading dims
        before = len(node._saved_self_sym_sizes)
        return _traced_example_dim(first, before, depth + 1) + ndim - before
    if name == "PermuteBackward0":
        inner = _traced_example_dim(first, ndim, depth + 1)
        return [d % ndim for d in node._saved_dims].index(inner)
    if name == "TransposeBackward0":
        d0, d1 = node._saved_dim0 % ndim, node._saved_dim1 % ndim
        inner = _traced_example_dim(first, ndim, depth + 1)
        return d1 if inner == d0 else d0 if inner == d1 else inner
    if name == "SelectBackward0":
        before = len(node._saved_self_sym_sizes)
        d, inner = node._saved_dim % before, _traced_example_dim(first, before, depth + 1)
        return inner - 1 if d < inner else inner
    if name == "AsStridedBackward0":  # a view of a contiguous base written in place (x.permute(...) += y)
        strides = node._saved_stride
        outermost = sorted(range(len(strides)), key=lambda j: -strides[j])  # the base's dims, as the view's
        inner = _traced_example_dim(first, len(strides), depth + 1)
        return outermost[inner] if inner < len(outermost) else 0
    if name == "CopySlices" or name.rstrip("0123456789").removesuffix("Backward") in _SAME_DIMS:
        return _traced_example_dim(first, ndim, depth + 1)
    return 0
