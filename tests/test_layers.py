"""
Per-example norm layers of the Linear, Embedding, LayerNorm and RMSNorm kinds (layers/) against a
brute-force per-example loop.

    python -m pytest tests/test_layers.py -q

Every class is compared with the plain torch layer (same weights) run one
example at a time (tests/oracle.py). Tolerances, relative to the oracle:
float64 1e-6 (the buffers are float32), float32 1e-5, bf16 / fp16 3e-2.
"""

import threading

import pytest
import torch
import torch.nn as nn
from oracle import per_example_sqnorms_by_loop

from nanogns.core import matmul
from nanogns.core.buffers import BUFFER_SUFFIX, zero_pe_sqnorm_buffers
from nanogns.core.rowmaps import Rows
from nanogns.kinds import embedding, layernorm, linear
from nanogns.kinds.embedding import PerExampleEmbedding, ShimEmbedding
from nanogns.kinds.layernorm import PerExampleLayerNorm, SeparatedLayerNorm
from nanogns.kinds.linear import PerExampleLinear, ShimLinear
from nanogns.kinds.rmsnorm import PerExampleRMSNorm

LINEARS = [ShimLinear, PerExampleLinear]
EMBEDDINGS = [ShimEmbedding, PerExampleEmbedding]
LAYERNORMS = [SeparatedLayerNorm, PerExampleLayerNorm]
RTOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}
# input shapes, (N, ..., features-last); odd sizes and N = 1 on purpose
SHAPES = [(3,), (1,), (3, 17), (1, 5), (2, 3, 4)]


def buffer_of(module, name):
    return getattr(module, name + BUFFER_SUFFIX)


def plain_twin(module):
    """The torch layer the per-example class replaces, with the same weights (float64)."""
    if isinstance(module, nn.Linear):
        twin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    elif isinstance(module, nn.Embedding):
        twin = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx)
    else:
        twin = nn.LayerNorm(module.normalized_shape, eps=module.eps, bias=module.bias is not None)
    twin.double().load_state_dict(module.state_dict())  # float64 first: no rounding through float32
    return twin


def check_against_oracle(module, inputs, grad_out, dtype, autocast=False):
    """Backward through `module`, then compare its buffers with the oracle (float64)."""
    zero_pe_sqnorm_buffers(module)
    twin = plain_twin(module)
    float_inputs = inputs.is_floating_point()
    expected = per_example_sqnorms_by_loop(twin, inputs.double() if float_inputs else inputs, grad_out.double())
    x = inputs.to(dtype).requires_grad_() if float_inputs else inputs
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        out = module(x)
    out.backward(grad_out.to(out.dtype))
    for name, _ in module.named_parameters():
        buffer = buffer_of(module, name)
        assert buffer.dtype == torch.float32
        assert buffer[1].item() == inputs.shape[0], "one count per example"
        torch.testing.assert_close(buffer[0].double(), expected[name].sum(), rtol=RTOL[dtype], atol=1e-6)
    return x, out


# the gns Linear under each of its strategies (both exact), and the shim
LINEAR_STRATEGIES = [(ShimLinear, None), (PerExampleLinear, "gram"), (PerExampleLinear, "materialise")]


@pytest.mark.parametrize("cls, strategy", LINEAR_STRATEGIES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("features", [(5, 6), (3, 2), (24, 1)])
def test_linear_matches_oracle_and_plain_grads(cls, strategy, bias, lead, features, force_strategy):
    force_strategy(linear=strategy)
    torch.manual_seed(0)
    K, L = features
    module = cls(K, L, bias=bias).double()
    inputs, grad_out = torch.randn(*lead, K), torch.randn(*lead, L)
    x, _ = check_against_oracle(module, inputs, grad_out, torch.float64)
    twin = plain_twin(module)
    x_plain = inputs.double().requires_grad_()
    twin(x_plain).backward(grad_out.double())
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(module.weight.grad, twin.weight.grad)
    if bias:
        torch.testing.assert_close(module.bias.grad, twin.bias.grad)


@pytest.mark.parametrize("T, K, L", [(1, 7, 5), (17, 3, 2), (4, 40, 24), (9, 2, 30)])
def test_linear_pe_sqnorm_both_paths_per_example(T, K, L):
    """Gram trick and materialisation each give every example's norm."""
    torch.manual_seed(1)
    x, g = torch.randn(3, T, K, dtype=torch.float64), torch.randn(3, T, L, dtype=torch.float64)
    expected = torch.stack([(g[i].T @ x[i]).pow(2).sum() for i in range(3)])
    weight_pe_sqnorms, bias_pe_sqnorms = matmul.linear_pe_sqnorm(x, g), matmul.bias_pe_grads(g).pow(2).sum(1)
    torch.testing.assert_close(weight_pe_sqnorms, expected)
    torch.testing.assert_close(bias_pe_sqnorms, g.sum(1).pow(2).sum(1))
    torch.testing.assert_close(matmul.gram_pe_sqnorm(x, g), expected)
    grad_weight, weight_pe_sqnorms = matmul.materialised_pe_grads(x, g)
    torch.testing.assert_close(weight_pe_sqnorms, expected)
    torch.testing.assert_close(grad_weight, torch.einsum("ntl,ntk->lk", g, x))


@pytest.mark.parametrize("chunk_elements", [2**22, 2 * 6 * 5, 6 * 5, 1])
@pytest.mark.parametrize("N", [0, 1, 5])
def test_materialised_pe_grads_in_one_chunk_or_several(chunk_elements, N, monkeypatch):
    """The one-chunk path (every example's dW_i at once) and the loop over chunks of examples (the last one shorter:
    5 examples in chunks of 2) give the same sum and norms, also for no example and one; with and without the sum."""
    monkeypatch.setattr(matmul, "SIMULTANEOUS_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(2)
    x, g = torch.randn(N, 4, 5, dtype=torch.float64), torch.randn(N, 4, 6, dtype=torch.float64)
    expected = torch.stack([(g[i].T @ x[i]).pow(2).sum() for i in range(N)]) if N else torch.zeros(0).double()
    grad_weight, weight_pe_sqnorms = matmul.materialised_pe_grads(x, g)
    torch.testing.assert_close(weight_pe_sqnorms, expected)
    torch.testing.assert_close(grad_weight, torch.einsum("ntl,ntk->lk", g, x))
    assert matmul.materialised_pe_grads(x, g, with_sum=False)[0] is None
    torch.testing.assert_close(matmul.materialised_pe_grads(x, g, with_sum=False)[1], expected)
    x32, g32 = x.float(), g.float()  # float32: the norms in float32, the sum too
    grad_weight32, weight_pe_sqnorms32 = matmul.materialised_pe_grads(x32, g32)
    assert grad_weight32.dtype == weight_pe_sqnorms32.dtype == torch.float32
    torch.testing.assert_close(weight_pe_sqnorms32.double(), expected, rtol=1e-5, atol=1e-6)


def test_materialised_pe_grads_results_outlive_the_kept_workspace():
    """The CPU workspace the per-example gradients are formed in is kept between calls (core/matmul.py:
    _Workspaces): what a call returns must not be a view of it, and two threads computing at once must not share
    it (each thread's results are its own examples' norms)."""
    torch.manual_seed(3)
    pairs = [(torch.randn(4, 3, 5), torch.randn(4, 3, 6)) for _ in range(6)]
    expected = [
        (torch.einsum("ntl,ntk->lk", g, x), torch.einsum("ntl,ntk->nlk", g, x).pow(2).sum((1, 2))) for x, g in pairs
    ]
    first = matmul.materialised_pe_grads(*pairs[0])
    matmul.materialised_pe_grads(*pairs[1])  # writes the same workspace
    for got, want in zip(first, expected[0]):
        torch.testing.assert_close(got, want)
    results, barrier = {}, threading.Barrier(2)

    def run(thread):
        barrier.wait()
        for _ in range(200):
            for i in range(thread, len(pairs), 2):
                results.setdefault(i, []).append(matmul.materialised_pe_grads(*pairs[i]))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(len(pairs)))
    for i, outputs in results.items():
        for grad_weight, pe_sqnorms in outputs:
            torch.testing.assert_close(grad_weight, expected[i][0])
            torch.testing.assert_close(pe_sqnorms, expected[i][1])


def test_linear_cost_rules():
    assert matmul.linear_uses_gram(1, 8, 8)  # a single row: Gram is N*(K+L)
    assert matmul.linear_uses_gram(64, 768, 768)
    assert not matmul.linear_uses_gram(1024, 768, 768)  # long sequences: materialise
    assert not matmul.linear_uses_gram(17, 3, 2)
    # simultaneous: materialising costs only its memory traffic, which short sequences do not repay
    assert matmul.simultaneous_uses_gram(1, 8, 8)
    assert matmul.simultaneous_uses_gram(64, 768, 768)
    assert not matmul.simultaneous_uses_gram(256, 768, 768)
    assert not matmul.simultaneous_uses_gram(1024, 768, 768)
    # the five benchmark shapes (B, T, K, L) on the CPU: what bench/linear_strategies.py measured fastest
    picks = {
        (16, 256, 128, 512): "materialise",
        (16, 64, 384, 1536): "gram",
        (4, 512, 768, 3072): "materialise",
        (64, 32, 256, 256): "gram",
        (8, 256, 384, 1536): "materialise",
    }
    for (B, T, K, L), strategy in picks.items():
        assert matmul.linear_strategy(T, K, L, 4, "cpu") == strategy, (B, T, K, L)


@pytest.mark.parametrize("strategy", ["gram", "materialise"])
def test_linear_strategy_is_forced_and_exact(strategy, force_strategy):
    """strategy.forced(linear=...) overrides the rule; both strategies give the same gradient and norms."""
    force_strategy(linear=strategy)
    assert matmul.linear_strategy(64, 768, 768) == matmul.linear_strategy(1024, 8, 8) == strategy
    torch.manual_seed(2)
    x, g = torch.randn(4, 9, 7, dtype=torch.float64), torch.randn(4, 9, 5, dtype=torch.float64)
    grad_weight, weight_pe_sqnorms = matmul.linear_weight_grad_and_pe_sqnorm(x, g)
    torch.testing.assert_close(grad_weight, torch.einsum("ntl,ntk->lk", g, x))
    torch.testing.assert_close(weight_pe_sqnorms, torch.stack([(g[i].T @ x[i]).pow(2).sum() for i in range(4)]))


@pytest.mark.parametrize("strategy", ["gram", "materialise"])
@pytest.mark.parametrize(
    "check", ["test_float32", "test_bf16_autocast", "test_fp16_module", "test_gradient_accumulation_adds_micro_batches"]
)
def test_linear_strategies_every_dtype_and_accumulation(check, strategy, force_strategy):
    """fp32 (1e-5), bf16 autocast and fp16 (3e-2), and two accumulated micro-batches, under each strategy."""
    force_strategy(linear=strategy)
    globals()[check](PerExampleLinear)


@pytest.mark.parametrize("strategy", ["gram", "materialise"])
@pytest.mark.parametrize(
    "weight_trainable, bias_trainable, input_grad",
    [(False, True, True), (True, False, True), (False, False, True), (False, True, False)],
)
def test_linear_frozen_parameters(strategy, weight_trainable, bias_trainable, input_grad, force_strategy):
    """A frozen weight or bias (fine-tuning, LoRA) gets no gradient, no norms and no buffer update; the
    trainable ones and the input gradient are still exact; x is saved only if the weight trains."""
    force_strategy(linear=strategy)
    torch.manual_seed(3)
    module = PerExampleLinear(6, 5).double()
    module.weight.requires_grad_(weight_trainable)
    module.bias.requires_grad_(bias_trainable)
    twin = plain_twin(module)
    inputs, grad_out = torch.randn(3, 7, 6, dtype=torch.float64), torch.randn(3, 7, 5, dtype=torch.float64)
    expected = per_example_sqnorms_by_loop(twin, inputs, grad_out)
    x = inputs.clone().requires_grad_(input_grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = module(x)
    assert sum(t is not None and t.shape == x.shape for t in saved) == int(weight_trainable)
    out.backward(grad_out)
    x_plain = inputs.clone().requires_grad_(input_grad)
    twin(x_plain).backward(grad_out)
    if input_grad:
        torch.testing.assert_close(x.grad, x_plain.grad)
    for name, trainable in (("weight", weight_trainable), ("bias", bias_trainable)):
        buffer = buffer_of(module, name)
        if trainable:
            torch.testing.assert_close(getattr(module, name).grad, getattr(twin, name).grad)
            torch.testing.assert_close(buffer[0].double(), expected[name].sum(), rtol=1e-6, atol=1e-6)
            assert buffer[1].item() == 3
        else:
            assert getattr(module, name).grad is None
            assert buffer.abs().sum().item() == 0, f"frozen {name} recorded {buffer}"


def test_linear_shim_records_only_buffers_it_gets():
    """Without a weight buffer (a frozen weight) the shim adds the bias norms only, and skips the weight's."""
    torch.manual_seed(5)
    x, g = torch.randn(3, 7, 6, dtype=torch.float64), torch.randn(3, 7, 5, dtype=torch.float64)
    bias_buffer = torch.zeros(2)
    linear.record_linear_norms(x, Rows("dim0", 3), None, bias_buffer)(g)
    torch.testing.assert_close(bias_buffer[0].double(), g.sum(1).pow(2).sum(), rtol=1e-6, atol=0)
    assert bias_buffer[1].item() == 3


def test_functional_linear_frozen_transposed_weight():
    """functional.linear with a transposed view of a frozen parameter: input gradient only, no norms."""
    from nanogns.kinds import functional

    torch.manual_seed(4)
    weight = nn.Parameter(torch.randn(6, 5, dtype=torch.float64), requires_grad=False)  # stored (in, out)
    weight_buffer = torch.zeros(2)
    x = torch.randn(3, 7, 6, dtype=torch.float64, requires_grad=True)
    functional.linear(x, weight.t(), weight_buffer=weight_buffer).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 7, 5, dtype=torch.float64) @ weight.t())
    assert weight.grad is None and weight_buffer.abs().sum().item() == 0


@pytest.mark.parametrize("cls", EMBEDDINGS)
@pytest.mark.parametrize("lead", [(3,), (1,), (3, 17), (2, 3, 4)])
@pytest.mark.parametrize("padding_idx", [None, 3, -2])  # -2: row 9, counted from the end as torch does
def test_embedding_matches_oracle_and_plain_grads(cls, lead, padding_idx):
    torch.manual_seed(0)
    module = cls(11, 6, padding_idx=padding_idx).double()
    ids = torch.randint(0, 11, lead)  # 17 draws from 11 ids: repeats within an example
    if padding_idx is not None:
        ids.view(-1)[::2] = module.padding_idx  # padding in every example: it must add nothing
    grad_out = torch.randn(*lead, 6)
    check_against_oracle(module, ids, grad_out, torch.float64)
    twin = plain_twin(module)
    twin(ids).backward(grad_out.double())
    torch.testing.assert_close(module.weight.grad, twin.weight.grad)


def test_embedding_repeated_token_adds_before_squaring():
    ids = torch.tensor([[2, 2, 5]])
    g = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    # row 2 gets (2, 0), row 5 gets (0, 1): 4 + 1, not 1 + 1 + 1
    assert embedding.embedding_pe_sqnorm(ids, g, 7).item() == 5.0


def test_embedding_large_vocab_needs_no_vocab_sized_tensor():
    """A B*V*D one-hot here would be 3*17*2e6*8 floats (3 GB); the unique/index_add path is tiny."""
    module = PerExampleEmbedding(2_000_000, 8)
    ids = torch.randint(0, 2_000_000, (3, 17))
    ids[0, :5] = 7  # a repeated token
    module(ids).sum().backward()  # all-ones output gradient
    # each example's norm: sum over its distinct ids of (occurrences^2 * D)
    expected = torch.stack([torch.unique(row, return_counts=True)[1].double().pow(2).sum() * 8 for row in ids])
    assert buffer_of(module, "weight")[1].item() == 3
    torch.testing.assert_close(buffer_of(module, "weight")[0].double(), expected.sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("cls", LAYERNORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("D", [7, 40])
@pytest.mark.parametrize("kernel_per_example", [False, True], ids=["batched-sums", "kernel-per-example"])
def test_layernorm_matches_oracle_and_plain_grads(cls, bias, lead, D, kernel_per_example, monkeypatch):
    """Both ways of the gns backward (the batched per-example sums, torch's kernel run once per example)."""
    monkeypatch.setattr(layernorm, "PER_EXAMPLE_KERNEL_ELEMENTS", 1 if kernel_per_example else 2**62)
    monkeypatch.setattr(layernorm, "PER_EXAMPLE_KERNEL_THREADS", 2**20)  # whatever torch's threads
    torch.manual_seed(0)
    module = cls(D, bias=bias).double()
    with torch.no_grad():  # away from the identity init, so the affine part matters
        module.weight.normal_()
        if bias:
            module.bias.normal_()
    inputs, grad_out = torch.randn(*lead, D), torch.randn(*lead, D)
    x, _ = check_against_oracle(module, inputs, grad_out, torch.float64)
    twin = plain_twin(module)
    x_plain = inputs.double().requires_grad_()
    twin(x_plain).backward(grad_out.double())
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(module.weight.grad, twin.weight.grad)
    if bias:
        torch.testing.assert_close(module.bias.grad, twin.bias.grad)


@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("dtype, autocast", [(torch.float64, False), (torch.bfloat16, True)])
def test_rmsnorm_matches_oracle_and_plain_grads(lead, dtype, autocast):
    torch.manual_seed(0)
    module = PerExampleRMSNorm(40).double()
    with torch.no_grad():
        module.weight.normal_()
    twin = nn.RMSNorm(40, eps=module.eps).double()
    twin.load_state_dict(module.state_dict())
    inputs, grad_out = torch.randn(*lead, 40), torch.randn(*lead, 40)
    expected = per_example_sqnorms_by_loop(twin, inputs.double(), grad_out.double())
    module.float() if autocast else None
    x = inputs.to(torch.float32 if autocast else dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(grad_out.to(out.dtype))
    assert module.weight_pe_sqnorm[1].item() == inputs.shape[0]
    torch.testing.assert_close(
        module.weight_pe_sqnorm[0].double(), expected["weight"].sum(), rtol=RTOL[dtype], atol=1e-6
    )
    if not autocast:
        x_plain = inputs.double().requires_grad_()
        twin(x_plain).backward(grad_out.double())
        torch.testing.assert_close(x.grad, x_plain.grad)
        torch.testing.assert_close(module.weight.grad, twin.weight.grad)


def make(cls, bias=True):
    if cls in LINEARS:
        return cls(24, 10, bias=bias), (3, 17, 24), (3, 17, 10)
    if cls in EMBEDDINGS:
        return cls(13, 10), None, (3, 17, 10)
    return cls(24, bias=bias), (3, 17, 24), (3, 17, 24)


def inputs_for(cls, shape):
    return torch.randint(0, 13, (3, 17)) if cls in EMBEDDINGS else torch.randn(*shape)


@pytest.mark.parametrize("cls", LINEARS + EMBEDDINGS + LAYERNORMS)
def test_float32(cls):
    torch.manual_seed(0)
    module, in_shape, out_shape = make(cls)
    check_against_oracle(module, inputs_for(cls, in_shape), torch.randn(*out_shape), torch.float32)


@pytest.mark.parametrize("cls", LINEARS + EMBEDDINGS + LAYERNORMS)
def test_bf16_autocast(cls):
    """fp32 weights under bf16 autocast, as train.py runs: norms within 3e-2 of float64."""
    torch.manual_seed(0)
    module, in_shape, out_shape = make(cls)
    check_against_oracle(module, inputs_for(cls, in_shape), torch.randn(*out_shape), torch.bfloat16, autocast=True)


@pytest.mark.parametrize("cls", LINEARS + EMBEDDINGS + LAYERNORMS)
def test_fp16_module(cls):
    """A module cast to fp16 (pure half training): buffers stay float32, norms within 3e-2."""
    torch.manual_seed(0)
    module, in_shape, out_shape = make(cls)
    module.half()
    check_against_oracle(module, inputs_for(cls, in_shape), torch.randn(*out_shape), torch.float16)


@pytest.mark.parametrize("cls", LINEARS + EMBEDDINGS + LAYERNORMS)
def test_gradient_accumulation_adds_micro_batches(cls):
    torch.manual_seed(0)
    module, in_shape, out_shape = make(cls)
    module.double()
    first, second = inputs_for(cls, in_shape), inputs_for(cls, in_shape)
    g1, g2 = torch.randn(*out_shape), torch.randn(*out_shape)
    twin = plain_twin(module)
    cast = (lambda t: t.double()) if first.is_floating_point() else (lambda t: t)
    expected = {
        n: per_example_sqnorms_by_loop(twin, cast(first), g1.double())[n].sum()
        + per_example_sqnorms_by_loop(twin, cast(second), g2.double())[n].sum()
        for n, _ in twin.named_parameters()
    }
    zero_pe_sqnorm_buffers(module)
    module(cast(first)).backward(g1.double())
    module(cast(second)).backward(g2.double())
    for name, _ in module.named_parameters():
        assert buffer_of(module, name)[1].item() == 6
        torch.testing.assert_close(buffer_of(module, name)[0].double(), expected[name], rtol=1e-6, atol=0)
    zero_pe_sqnorm_buffers(module)
    assert all(buffer_of(module, name).abs().sum().item() == 0 for name, _ in module.named_parameters())


@pytest.mark.parametrize("cls", LINEARS + EMBEDDINGS + LAYERNORMS)
@pytest.mark.parametrize("bias", [True, False])
def test_drop_in_parameters_and_state_dict(cls, bias):
    """Same parameter names, order and shapes as the plain layer; buffers stay out of checkpoints."""
    module, _, _ = make(cls, bias=bias)
    twin = plain_twin(module)
    assert [(n, p.shape) for n, p in module.named_parameters()] == [(n, p.shape) for n, p in twin.named_parameters()]
    assert list(module.state_dict()) == list(twin.state_dict())
    twin.load_state_dict(module.state_dict())
    buffers = [n for n, _ in module.named_buffers()]
    assert buffers == [n + BUFFER_SUFFIX for n, _ in module.named_parameters()]


def test_buffers_stay_float32_when_cast():
    module = PerExampleLinear(4, 3).to(torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16
    assert buffer_of(module, "weight").dtype == torch.float32


def test_embedding_rejects_options_it_cannot_honour():
    with pytest.raises(ValueError, match="max_norm"):
        PerExampleEmbedding(10, 4, max_norm=1.0)
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        ShimEmbedding(10, 4, scale_grad_by_freq=True)
    ShimEmbedding(10, 4, max_norm=None)  # the default is fine
