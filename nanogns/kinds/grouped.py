"""
Exact per-example norms of a mixture-of-experts bank from the grouped computation
transformers' default experts implementation runs: the routed (token, expert) rows
sorted by expert, one grouped GEMM per projection (torch's grouped_mm), not a loop
over the experts in Python.

The rows are sorted by (expert, example), so each expert's rows are one block (the
offsets of the grouped GEMM) and, inside it, each example's rows are one segment.
With x the rows' inputs and g their output gradients, the bank's weight gradient is
a stack of the experts' (one grouped GEMM: dW_e = g_e^T x_e), and

    ||dW_i||^2 = sum_e ||dW_{e,i}||^2,   ||dW_{e,i}||^2 = sum_{s,t in (e, i)} (x_s . x_t)(g_s . g_t),

the Gram trick (kinds/linear.py) over each segment's rows: segments are short (an
example's tokens routed to one expert, about T * top_k / E of them), so the Grams are
small. All segments at once: x and g gathered into (segments, longest, D), zero rows
padding the shorter ones, two batched products and one elementwise product. A bias
adds ||db_{e,i}||^2, db_{e,i} the sum of its segment's g. Only the sum over segments
goes to the bank's buffer (the bank counts its examples once, kinds/experts.py).

torch's grouped_mm takes float32 and 16-bit matrices whose rows are 16-byte aligned;
other dtypes (float64 in the tests) and widths run one torch.mm per expert instead,
the same numbers.
"""

import torch
import torch.nn.functional as F

from nanogns.core.buffers import accumulate_pe_sqnorm, norm_dtype

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_runs(a, b):
    """True when torch's grouped_mm takes these operands here (dtype, 16-byte aligned rows)."""
    return (
        hasattr(F, "grouped_mm")
        and a.shape[0] > 0
        and a.dtype in GROUPED_DTYPES
        and a.dtype == b.dtype
        and all((t.stride(-1) == 1 or t.stride(-2) == 1) for t in (a, b))
        and all(s * t.element_size() % 16 == 0 for t in (a, b) for s in t.stride() if s != 1)
        and all(t.data_ptr() % 16 == 0 for t in (a, b))
    )


def grouped_mm(a, b, offsets, ends):
    """a (S, K) @ b[e] (K, L) for each expert's rows (rows offsets[e-1]:offsets[e]): (S, L); b (E, K, L).
    `ends` are the offsets as Python ints (one host sync, by the caller) for the per-expert fallback."""
    if _grouped_mm_runs(a, b):
        return F.grouped_mm(a, b, offs=offsets)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for expert, end in enumerate(ends):
        torch.mm(a[start:end], b[expert], out=out[start:end])
        start = end
    return out


def grouped_weight_grads(g, x, offsets, ends, experts):
    """(E, L, K): each expert's g_e^T x_e over its rows; g (S, L), x (S, K)."""
    gt = g.t()
    if _grouped_mm_runs(gt, x) and x.shape[0] > 0:
        return F.grouped_mm(gt, x, offs=offsets)
    out = x.new_zeros(experts, g.shape[-1], x.shape[-1])
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            torch.mm(gt[:, start:end], x[start:end], out=out[expert])
        start = end
    return out


class Segments:
    """The (expert, example) segments of rows sorted by them, laid out for their Grams: `segment` (S,) each row's
    segment (long), and `buckets`, segments of similar lengths padded together: [(source (count * longest,),
    padding (P,), count, longest)], slot j of the bucket's rows holding row source[j], or zeros for the slots in
    `padding` (segments sorted by length, a bucket closed when the next is shorter than BUCKET_RATIO of its
    longest, so padding at most about doubles a Gram).

    keys: (S,) the rows' keys (expert * examples + example), sorted; order: (S,) the row each sorted key is, for rows
    not in that order (a bank given its rows grouped by expert but not by example inside each expert's: the row
    of sorted position j is order[j]), or None when the rows are in the keys' order."""

    def __init__(self, keys, order=None):
        rows = keys.numel()
        device = keys.device
        changes = torch.ones(rows, dtype=torch.bool, device=device)
        changes[1:] = keys[1:] != keys[:-1]
        self.segment = torch.cumsum(changes, 0) - 1
        if order is not None:  # each row's segment, in the rows' own order
            self.segment = torch.empty_like(self.segment).index_copy_(0, order, self.segment)
        starts = torch.nonzero(changes).squeeze(1).tolist()
        self.count = len(starts)
        sizes = [end - start for start, end in zip(starts, starts[1:] + [rows])]
        buckets = []  # [(longest, [segment, ...])], each bucket's segments longest first
        for seg in sorted(range(self.count), key=lambda seg: -sizes[seg]):
            if not buckets or sizes[seg] < BUCKET_RATIO * buckets[-1][0]:
                buckets.append((sizes[seg], []))
            buckets[-1][1].append(seg)
        self.buckets = []
        for longest, members in buckets:  # slot j of the bucket: row starts[seg] + j % longest of its j // longest-th
            first = torch.tensor([starts[seg] for seg in members], device=device).repeat_interleave(longest)
            length = torch.tensor([sizes[seg] for seg in members], device=device).repeat_interleave(longest)
            offset = torch.arange(longest, device=device).repeat(len(members))
            beyond = offset >= length  # the padding slots: any row (0) copied, then zeroed
            source = (first + offset).masked_fill_(beyond, 0)
            if order is not None:
                source = order.index_select(0, source)
            self.buckets.append((source, torch.nonzero(beyond).squeeze(1), len(members), longest))

    def padded(self, t, dtype):
        """t (S, D) as one (count, longest, D) tensor per bucket, in dtype, zero rows after each segment's own: one
        copy of the rows (index_select copies them whole) and zeros written over the padding slots only."""
        for source, padding, count, longest in self.buckets:
            out = t.index_select(0, source).to(dtype)
            if padding.numel():
                out.index_fill_(0, padding, 0)
            yield out.view(count, longest, t.shape[-1])


BUCKET_RATIO = 0.75


def segment_weight_pe_sqnorms(x, g, segments):
    """(segments,) ||sum over the segment's rows of g x^T||^2 by the Gram trick, float32 (float64 for float64),
    in the buckets' order."""
    dtype = norm_dtype(x)
    parts = [
        (torch.bmm(xs, xs.transpose(1, 2)) * torch.bmm(gs, gs.transpose(1, 2))).sum(dim=(1, 2))
        for xs, gs in zip(segments.padded(x, dtype), segments.padded(g, dtype))
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def segment_bias_pe_sqnorms(g, segments):
    """(segments,) ||sum over the segment's rows of g||^2."""
    sums = g.new_zeros(segments.count, g.shape[-1], dtype=norm_dtype(g))
    sums.index_add_(0, segments.segment, g.to(sums.dtype))
    return sums.pow(2).sum(dim=1)


class GroupedLinearFunction(torch.autograd.Function):
    """grouped_linear(x, weight, bias, offsets, ends, expert_of_row, segments, weight_buffer, bias_buffer): each
    row of x (S, K), sorted by expert, through its expert's weight (E, L, K) (+ bias (E, L)); backward gives the
    gradients autograd asks for and adds the bank's per-segment squared norms to the buffers (segments None: none)."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, ends, expert_of_row, segments, weight_buffer, bias_buffer):
        ctx.save_for_backward(x, weight, offsets, expert_of_row)
        ctx.ends, ctx.segments, ctx.buffers, ctx.has_bias = (
            ends,
            segments,
            (weight_buffer, bias_buffer),
            bias is not None,
        )
        out = grouped_mm(x, weight.transpose(1, 2), offsets, ends)
        if bias is not None:
            out += bias.index_select(0, expert_of_row)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets, expert_of_row = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        weight_buffer, bias_buffer = ctx.buffers
        segments = ctx.segments
        grad_out = grad_out.contiguous()
        grad_x = grouped_mm(grad_out, weight, offsets, ctx.ends) if needs_x else None
        grad_weight = grad_bias = None
        if needs_weight:
            grad_weight = grouped_weight_grads(grad_out, x, offsets, ctx.ends, weight.shape[0])
            if segments is not None:
                accumulate_pe_sqnorm(weight_buffer, segment_weight_pe_sqnorms(x, grad_out, segments), counted=False)
        if needs_bias and ctx.has_bias:
            grad_bias = grad_out.new_zeros(weight.shape[0], weight.shape[1])
            grad_bias.index_add_(0, expert_of_row, grad_out)
            if segments is not None:
                accumulate_pe_sqnorm(bias_buffer, segment_bias_pe_sqnorms(grad_out, segments), counted=False)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def routed_experts(module, hidden_states, top_k_index, top_k_weights, example_of_token, examples):
    """The experts module's output for (tokens, D) hidden states routed to top_k_index (tokens, k) with weights
    top_k_weights, computed grouped by expert; per-example norms recorded when example_of_token (tokens,) maps the
    tokens to `examples` examples (None: no norms). Reads the module's banks, has_gate, has_bias, is_transposed,
    _apply_gate / act_fn, and its buffers through pe_buffer."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    experts = getattr(module, first).shape[0]
    k = top_k_index.shape[-1]
    expert_of_slot = top_k_index.reshape(-1)
    token_of_slot = torch.arange(expert_of_slot.numel(), device=hidden_states.device) // k
    weight_of_slot = top_k_weights.reshape(-1)
    routed = expert_of_slot < experts  # transformers' sentinel index E routes a token nowhere
    if not bool(routed.all()):
        expert_of_slot, token_of_slot, weight_of_slot = (
            t[routed] for t in (expert_of_slot, token_of_slot, weight_of_slot)
        )
    with torch.no_grad():
        per_example = example_of_token is not None
        keys = expert_of_slot * examples + example_of_token[token_of_slot] if per_example else expert_of_slot
        keys, order = torch.sort(keys, stable=True)
        expert_of_row = keys // examples if per_example else keys
        offsets = torch.cumsum(torch.bincount(expert_of_row, minlength=experts), 0).to(torch.int32)
        ends = offsets.tolist()  # the one host sync (the fallback's per-expert slices, the segments' longest)
        segments = Segments(keys) if per_example else None
    token_of_row = token_of_slot[order]
    h = _projection(module, first, hidden_states.index_select(0, token_of_row), offsets, ends, expert_of_row, segments)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = _projection(module, "down_proj", h, offsets, ends, expert_of_row, segments)
    y = y * weight_of_slot[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token_of_row, y.to(out.dtype))


def _projection(module, name, x, offsets, ends, expert_of_row, segments):
    """One projection of the bank `name` (weights (E, out, in), or (E, in, out) when module.is_transposed)."""
    weight = getattr(module, name)
    weight = weight.transpose(1, 2) if module.is_transposed else weight
    bias = getattr(module, name + "_bias", None) if module.has_bias else None
    buffers = (module.pe_buffer(name), module.pe_buffer(name + "_bias") if bias is not None else None)
    if segments is None:
        buffers = (None, None)
    x = x.to(weight.dtype)  # as transformers' grouped experts: the bank's dtype (grouped_mm is not autocast)
    return GroupedLinearFunction.apply(x, weight, bias, offsets, ends, expert_of_row, segments, *buffers)
