"""
Ids made from no example's data in a forward with no ids to tag (core/ids.py's MadeIds): a model whose inputs are
floating-point (audio features, latents) has nothing for ExampleIds to follow, and there an untagged int tensor
says nothing (it may be an argmax of the examples' data). What is known is how some ids were made: a constructor
given no tensor (torch.arange, torch.full, ...) and ops on such tensors alone. An Embedding looking those up looks
up a table the examples share (core/shared.py), whatever its sizes; ids computed from the examples' data are never
taken for one. Each model against the brute-force loop over examples (float64, micro-batches of one example and
the rest, the second one's batch size equal to the sequence length on purpose).

    python -m pytest -q tests/test_conversion_made_ids.py

Models are built from tiny configs with random weights (nothing is downloaded).
"""

import warnings

import pytest
import torch
import torch.nn as nn
import transformers
from test_conversion_models import brute_force, check_exact, measured

import nanogns as lc
from nanogns.core import ids
from nanogns.errors import StepNotMeasured


def assert_exact(model, loss_of, n):
    """Convert, one step over micro-batches of example 0 and the rest, exact against brute force; returns the
    monitor."""
    want = brute_force(model, loss_of, n)
    monitor = lc.convert(model)
    check_exact(model, monitor, want, measured(monitor, model, loss_of, [slice(0, 1), slice(1, n)], n))
    assert not monitor.unconverted and not monitor.untracked
    return monitor


def wav2vec2_bert(n, frames):
    """Wav2Vec2-BERT with relative_key positions: distances arange(T)[None] - arange(T)[:, None], clamped, looked up
    in distance_embedding and met by each example's queries in torch.einsum("bhld,lrd->bhlr")."""
    torch.manual_seed(0)
    model = transformers.Wav2Vec2BertForSequenceClassification(
        transformers.Wav2Vec2BertConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=24,
            feature_projection_input_dim=8,
            output_hidden_size=16,
            position_embeddings_type="relative_key",
            left_max_position_embeddings=3,
            right_max_position_embeddings=2,
            conv_depthwise_kernel_size=3,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            conformer_conv_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            num_labels=3,
            classifier_proj_size=8,
        )
    ).double()
    features = torch.randn(n, frames, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, lambda part: model(input_features=features[part]).logits.pow(2).sum(1)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("n, frames", [(4, 3), (3, 7)])
def test_wav2vec2_bert_relative_distances_made_by_arange_look_up_a_table_exact(n, frames, checkpointing):
    """Before, distance_embedding's (T, T) ids were refused (no tag says where they come from); now they are a table,
    each example's copy met by its queries in einsum: every parameter exact, also where the batch (3) is the number
    of frames (3), and under non-reentrant activation checkpointing (whose recompute makes the ids again, and meets
    the table again: no second use)."""
    model, loss_of = wav2vec2_bert(n, frames)
    if checkpointing:
        want = brute_force(model, loss_of, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers: gradient_checkpointing_enable is deprecated
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        monitor = lc.convert(model)
        check_exact(model, monitor, want, measured(monitor, model, loss_of, [slice(0, 1), slice(1, n)], n))
        assert not monitor.unconverted and not monitor.untracked
    else:
        assert_exact(model, loss_of, n)


class RootPositions(nn.Module):
    """MiniMax Music 3's depth decoder, reduced: positions torch.arange(T) made by the root's forward, looked up as a
    (T, D) table, unsqueezed and added to the float inputs (no ids among the model's arguments), then a head."""

    def __init__(self):
        super().__init__()
        self.pos, self.norm, self.head = nn.Embedding(8, 6), nn.LayerNorm(6), nn.Linear(6, 5)

    def forward(self, inputs_embeds):
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        return self.head(self.norm(inputs_embeds + self.pos(positions).unsqueeze(0)))


@pytest.mark.parametrize("n, length", [(4, 3), (3, 5)])
def test_positions_made_by_the_root_added_to_float_inputs_exact(n, length):
    """A (T,) row of positions met by the root's float inputs: the micro-batch of one example meets them as they are
    (the root's argument is the examples' data, though it carries no gradient), the other with B == T."""
    torch.manual_seed(0)
    model = RootPositions().double()
    x = torch.randn(n, length, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), n)


class Codes(nn.Module):
    """A quantizer's codes: ids computed from the examples' data (an argmax per frame), looked up per example; and,
    with `shared_by_data`, distances between example 0's codes, (T, T) ids that hold that example's data."""

    def __init__(self, shared_by_data=False):
        super().__init__()
        self.shared_by_data = shared_by_data
        self.codebook, self.head = nn.Embedding(6, 6), nn.Linear(6, 5)
        self.distance = nn.Embedding(11, 6) if shared_by_data else None

    def forward(self, x):
        codes = x.argmax(-1)  # (N, T), each example's own
        h = x + self.codebook(codes)
        if self.shared_by_data:
            first = codes[0]
            h = h + torch.einsum("ntd,trd->nrd", h, self.distance(first[None, :] - first[:, None] + 5))
        return self.head(h)


def test_ids_computed_from_the_examples_data_are_the_examples_rows_exact():
    """An argmax of the examples' data is no made id: the codes' (N, T) rows are each example's own, B == T."""
    torch.manual_seed(0)
    model = Codes().double()
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert_exact(model, lambda part: model(x[part]).pow(2).mean((1, 2)), 4)


def test_ids_computed_from_one_example_s_data_are_never_taken_for_a_table():
    """(T, T) distances between example 0's codes have the sizes of wav2vec2-BERT's distances but hold an example's
    data: refused, naming their rows, never measured as a table the examples share."""
    torch.manual_seed(0)
    model = Codes(shared_by_data=True).double()
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    monitor = lc.convert(model)
    with pytest.raises(StepNotMeasured, match=r"distance\.weight.*its input has rows \(4, 4\)"):
        measured(monitor, model, lambda part: model(x[part]).pow(2).mean((1, 2)), [slice(0, 3)], 3)


def test_what_is_made():
    """A constructor's result given no tensor (or only one whose shape it takes) and ops on made tensors alone are
    made; anything touching another tensor, or written into by one (through a view too), is not."""
    data = torch.randn(3, 4)
    mode = ids.open_window()
    try:
        made, made_like = torch.arange(4), torch.zeros_like(data, dtype=torch.long)
        filled_by_data = torch.full((4,), data.sum())
        written, view = torch.zeros(4, dtype=torch.long), None
        view = written[:2]
        written[1] = data.argmax()
        kept = torch.ones(2, dtype=torch.long)
        kept += made[:2]  # an in-place op on made tensors alone
    finally:
        ids.close_window(mode)
    assert torch._C._len_torch_function_stack() == 0
    assert ids.is_made(made) and ids.is_made(made_like) and ids.is_made(kept)
    distance = (made[None, :] - made[:, None]).clamp(-2, 2) + 2
    assert ids.is_made(distance) and ids.is_made(distance.float().softmax(-1).argmax(-1))
    assert not ids.is_made(made + data.argmax(0))  # the examples' data in it
    assert not ids.is_made(filled_by_data)  # filled with a tensor's value
    assert not ids.is_made(written) and not ids.is_made(view)  # written into by data, and its view with it
    assert not ids.is_made(torch.arange(4))  # made with no window open
    assert type(made + data.argmax(0)) is torch.Tensor


class MadeBeforeAndAfter(nn.Module):
    """Makes ids before its lookup and after it, keeping both; raises after the lookup when told to."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(8, 4), nn.Linear(4, 3)
        self.raises = False

    def forward(self, x):
        self.before = torch.arange(x.shape[1])
        h = x + self.pos(self.before)
        self.after = torch.arange(x.shape[1])
        if self.raises:
            raise ValueError("raised inside the forward")
        return self.head(h)


class Caller(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleList([MadeBeforeAndAfter()])

    def forward(self, x):
        return self.inner[0](x)


def test_the_window_is_open_from_the_caller_s_start_to_its_lookup_and_leaves_no_mode():
    """The mode sees the ops of the module calling the Embedding (not the root: a module under a ModuleList) until
    its lookup, and none after it; a forward raising inside the caller leaves no mode on torch's stack. A forward
    whose arguments hold ids tags those and opens no window."""
    model = Caller()
    lc.convert(model)
    model(torch.randn(2, 3, 4)).sum().backward()
    inner = model.inner[0]
    assert ids.is_made(inner.before) and not ids.is_made(inner.after)
    assert torch._C._len_torch_function_stack() == 0
    inner.raises = True
    with pytest.raises(ValueError, match="raised inside the forward"):
        model(torch.randn(2, 3, 4))
    assert torch._C._len_torch_function_stack() == 0

    class WithIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.inner = nn.Embedding(5, 4), MadeBeforeAndAfter()

        def forward(self, ids):
            return self.inner(self.wte(ids))

    tagged = WithIds()
    lc.convert(tagged)
    tagged(torch.randint(0, 5, (2, 3))).sum().backward()
    assert type(tagged.inner.before) is torch.Tensor
