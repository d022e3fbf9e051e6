"""
The fused Triton layers (nanogns/variants/fused/, kernels in nanogns/kernels/) against brute force:
outputs, input and parameter gradients, and per-example squared gradient norms
compared to tests/oracle.py's one-example-at-a-time loop.

    TRITON_INTERPRET=1 python -m pytest tests/test_layers_fused.py

Without a GPU the kernels run on CPU tensors in Triton's interpreter, which
Triton switches on when it is imported. This module sets TRITON_INTERPRET=1
itself when no GPU is present, which is enough when it is the first to import
triton; in a whole-suite run export it (as .ci/run does), else collection fails
with that instruction. On a GPU machine without TRITON_INTERPRET the same tests
run the compiled kernels on CUDA tensors.
"""

import os
import sys

import torch

TRITON_WAS_IMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by Triton when it (and our kernels) are decorated

import math
import warnings

import pytest
import torch.nn as nn
from oracle import per_example_sqnorms_by_loop

from nanogns.core import buffers as buffered
from nanogns.kinds import linear as linear_kind
from nanogns.kinds.layernorm import FusedLayerNorm
from nanogns.kinds.linear import FusedLinear, PerExampleLinear
from nanogns.kinds.rmsnorm import FusedRMSNorm
from nanogns.variants import fused as fused_gns
from nanogns.variants.fused import finish as fused_finish
from nanogns.variants.fused import linear as fused_linear
from nanogns.variants.fused import linear_plan as fused_linear_plan
from nanogns.variants.fused import norms as fused_norms
from nanogns.variants.fused import runtime as fused_runtime

if fused_gns.kernels_interpreted():
    DEVICE = "cpu"
elif fused_gns.HAS_TRITON and torch.cuda.is_available():
    DEVICE = "cuda"
else:
    raise RuntimeError(
        "tests/test_layers_fused.py cannot run the Triton kernels: "
        + (
            "triton was imported (by an earlier test module or plugin) before this module could set "
            "TRITON_INTERPRET=1, and Triton reads it at import; export it for the whole run: "
            if TRITON_WAS_IMPORTED
            else "install triton and run "
        )
        + "`TRITON_INTERPRET=1 python -m pytest tests/` (or use a CUDA GPU); "
        + f"HAS_TRITON={fused_gns.HAS_TRITON}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
    )

# Tolerances, relative to the largest reference value of each compared tensor.
# float32: everything is computed in fp32, so only summation order differs.
# bfloat16 / float16: outputs, dx and parameter gradients are rounded to the
# dtype (8 / 11 significant bits); the norms are accumulated in fp32 from the
# rounded inputs, which the float64 oracle sees too, so they stay tight.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}

# input shapes without the feature dim: 2-D (N, D) and 3-D (N, T, D), N in {1, 3}, T in {1, 17}
SHAPES = [(1,), (3,), (1, 17), (3, 1), (3, 17)]
BIG_SHAPES = [(1,), (3, 17)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_KINDS = ["layernorm", "layernorm_nobias", "rmsnorm"]


def assert_close(actual, expected, tol, what=""):
    actual, expected = actual.double(), expected.double()
    scale = max(expected.abs().max().item(), 1e-12)
    err = (actual - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} * {scale:.3g}"


@pytest.fixture
def captured(monkeypatch):
    """Record every per-example norm vector the fused layers add to a buffer, keyed by the buffer's id
    (the kernels report theirs through fused_finish._recorded; layers.linear's torch paths add through
    add_pe_sqnorm)."""
    record = {}
    original = buffered.add_pe_sqnorm

    def recording(buffer, pe_sqnorm, counted=True):
        if buffer is not None:
            record.setdefault(id(buffer), []).append(pe_sqnorm.detach().clone())
        original(buffer, pe_sqnorm, counted)

    def kernel_recorded(buffer, pe_sqnorm):  # the fused layers' kernels update the buffers themselves
        record.setdefault(id(buffer), []).append(pe_sqnorm.detach().clone())

    monkeypatch.setattr(fused_finish, "_recorded", kernel_recorded)
    monkeypatch.setattr(linear_kind, "add_pe_sqnorm", recording)
    return record


def make_norm(kind, D, dtype):
    """(fused layer, float64 torch reference with the same parameters)."""
    if kind == "rmsnorm":
        fused, ref = FusedRMSNorm(D), nn.RMSNorm(D, eps=1e-6)
    else:
        bias = kind == "layernorm"
        fused, ref = FusedLayerNorm(D, bias=bias), nn.LayerNorm(D, bias=bias)
    with torch.no_grad():  # non-trivial affine parameters
        for p in fused.parameters():
            p.copy_(torch.randn_like(p))
        for p_ref, p in zip(ref.parameters(), fused.parameters()):
            p_ref.copy_(p)
    return fused.to(DEVICE, dtype), ref.to(DEVICE, torch.float64)


def make_linear(K, L, bias, dtype):
    fused = FusedLinear(K, L, bias=bias)
    ref = nn.Linear(K, L, bias=bias)
    ref.load_state_dict(fused.state_dict())
    return fused.to(DEVICE, dtype), ref.to(DEVICE, torch.float64)


def check_against_oracle(fused, ref, x, g, dtype, captured, passes=1):
    """Run fused forward/backward `passes` times on (x, g) and compare everything to `ref` in float64."""
    assert fused_gns.kernel_unavailable_reason(x) is None, "the kernel path must be the one under test"
    for buf in fused.buffers():
        buf.zero_()
    for _ in range(passes):
        xk = x.detach().clone().requires_grad_(True)
        y = fused(xk)
        y.backward(g)
    assert y.dtype == x.dtype and xk.grad.dtype == x.dtype
    # the float64 reference on the same (rounded) values; the oracle loop first, as it clears .grad
    expected = per_example_sqnorms_by_loop(ref, x.detach().double(), g.double())
    xr = x.detach().double().requires_grad_(True)
    yr = ref(xr)
    yr.backward(g.double())
    tol = TOL[dtype]
    assert_close(y, yr, tol, "output")
    assert_close(xk.grad, xr.grad, tol, "input grad")
    for (name, p), (_, p_ref) in zip(fused.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, passes * p_ref.grad, tol, f"{name}.grad")
        buffer = fused.pe_buffer(name)
        records = captured[id(buffer)]
        assert len(records) == passes
        for pe in records:  # each backward's per-example vector, in example order
            assert pe.shape == (x.shape[0],) and pe.dtype == torch.float32
            assert_close(pe, expected[name], NORM_TOL[dtype], f"{name} per-example pe_sqnorms")
        assert buffer.dtype == torch.float32
        assert_close(buffer[0], passes * expected[name].sum(), NORM_TOL[dtype], f"{name} buffer sum")
        assert buffer[1].item() == passes * x.shape[0]


def inputs(shape, D, dtype, out_features=None):
    x = torch.randn(*shape, D, device=DEVICE).to(dtype)
    g = torch.randn(*shape, out_features or D, device=DEVICE).to(dtype)
    return x, g


# -----------------------------------------------------------------------------
# LayerNorm / RMSNorm kernels


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_norm_small(kind, dtype, shape, captured):
    torch.manual_seed(0)
    fused, ref = make_norm(kind, 40, dtype)
    x, g = inputs(shape, 40, dtype)
    check_against_oracle(fused, ref, x, g, dtype, captured)


@pytest.mark.parametrize("shape", BIG_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [768, 1000])
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_norm_wide(kind, D, dtype, shape, captured):
    torch.manual_seed(1)
    fused, ref = make_norm(kind, D, dtype)
    x, g = inputs(shape, D, dtype)
    check_against_oracle(fused, ref, x, g, dtype, captured)


@pytest.mark.parametrize("D", [7, 4100])
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_norm_widths_the_glue_pads(kind, D, captured):
    """Ragged widths the kernels get zero-padded (below 16, above NORM_RAGGED_MAX) beside the unpadded ones above."""
    torch.manual_seed(3)
    fused, ref = make_norm(kind, D, torch.float32)
    x, g = inputs((3, 5), D, torch.float32)
    check_against_oracle(fused, ref, x, g, torch.float32, captured)


@pytest.mark.parametrize("kind", NORM_KINDS)
def test_norm_split_rows_and_accumulation(kind, captured, monkeypatch):
    """Several programs per example (as on a GPU), and two backward passes adding up."""
    monkeypatch.setattr(fused_norms, "_norm_chunks", lambda N, T, sm_count: (3, math.ceil(T / 3)))
    torch.manual_seed(2)
    fused, ref = make_norm(kind, 40, torch.float32)
    x, g = inputs((3, 17), 40, torch.float32)
    check_against_oracle(fused, ref, x, g, torch.float32, captured, passes=2)


def test_norm_more_leading_dims(captured):
    torch.manual_seed(3)
    fused, ref = make_norm("layernorm", 40, torch.float32)
    x, g = inputs((3, 2, 5), 40, torch.float32)  # an example is all 2 * 5 rows
    check_against_oracle(fused, ref, x, g, torch.float32, captured)


def test_layernorm_autocast_bf16_input():
    """Under autocast a LayerNorm can get bf16 activations with fp32 parameters: output in the dtype torch's own
    LayerNorm gives under the same autocast (bf16 on the CPU; float32 on CUDA, where autocast runs layer_norm in
    float32), parameter gradients in fp32."""
    torch.manual_seed(4)
    fused, ref = make_norm("layernorm", 40, torch.float32)
    x, g = inputs((3, 17), 40, torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = fused(x)
        torch_dtype = nn.functional.layer_norm(x, (40,), fused.weight, fused.bias, fused.eps).dtype
    y.backward(g.to(y.dtype))
    assert y.dtype == torch_dtype and fused.weight.grad.dtype == torch.float32
    expected = per_example_sqnorms_by_loop(ref, x.double(), g.double())
    assert_close(fused.weight_pe_sqnorm[0], expected["weight"].sum(), 1e-4, "weight buffer")
    assert_close(fused.bias_pe_sqnorm[0], expected["bias"].sum(), 1e-4, "bias buffer")


# -----------------------------------------------------------------------------
# Linear weight-gradient kernel


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strategy", [None, "gram", "materialise"])  # None: the kernel, on CPU
def test_linear_small(strategy, bias, dtype, shape, captured, force_strategy):
    """Every exact way the fused Linear may pick, two backward passes accumulating."""
    force_strategy(fused_linear=strategy)
    torch.manual_seed(5)
    fused, ref = make_linear(40, 72, bias, dtype)
    x, g = inputs(shape, 40, dtype, out_features=72)
    check_against_oracle(fused, ref, x, g, dtype, captured, passes=2)


GPU_CANDIDATES = sorted(
    {c for configs in fused_linear_plan.LINEAR_CANDIDATES.values() for c in configs},
    key=lambda c: (c.block_l, c.block_k, c.block_t),
)


@pytest.mark.parametrize("config", GPU_CANDIDATES, ids=lambda c: f"{c.block_l}x{c.block_k}x{c.block_t}")
def test_linear_gpu_candidate_tiles(config, captured, force_strategy):
    """Each autotune candidate's tiles (run here by the interpreter), on ragged sizes: 2 x 2 tiles of dW
    at least, rows split across row blocks, a last example shorter than one block."""
    force_strategy(fused_linear=config)  # forced on a GPU too, not only timed
    torch.manual_seed(11)
    K, L = config.block_k + 24, config.block_l + 8
    fused, ref = make_linear(K, L, True, torch.float32)
    x, g = inputs((3, config.block_t + 5), K, torch.float32, out_features=L)
    check_against_oracle(fused, ref, x, g, torch.float32, captured)


@pytest.mark.parametrize("strategy", [None, "gram", "materialise"])
@pytest.mark.parametrize("weight_trainable, bias_trainable", [(False, True), (True, False), (False, False)])
def test_linear_frozen_parameters(strategy, weight_trainable, bias_trainable, force_strategy):
    """A frozen weight or bias gets no gradient and no norms; the input gradient and the trainable
    parameter are still exact."""
    force_strategy(fused_linear=strategy)
    torch.manual_seed(12)
    fused, ref = make_linear(40, 72, True, torch.float32)
    fused.weight.requires_grad_(weight_trainable)
    fused.bias.requires_grad_(bias_trainable)
    x, g = inputs((3, 17), 40, torch.float32, out_features=72)
    expected = per_example_sqnorms_by_loop(ref, x.double(), g.double())
    xk = x.clone().requires_grad_(True)
    fused(xk).backward(g)
    xr = x.double().requires_grad_(True)
    ref(xr).backward(g.double())
    assert_close(xk.grad, xr.grad, 1e-5, "input grad")
    for name, trainable in (("weight", weight_trainable), ("bias", bias_trainable)):
        buffer = getattr(fused, name + buffered.BUFFER_SUFFIX)  # by name: pe_buffer may hide a frozen one's
        if trainable:
            assert_close(getattr(fused, name).grad, getattr(ref, name).grad, 1e-5, f"{name}.grad")
            assert_close(buffer[0], expected[name].sum(), 1e-5, f"{name} buffer")
        else:
            assert getattr(fused, name).grad is None and buffer.abs().sum().item() == 0


def test_fastest_times_each_candidate_once(monkeypatch):
    """The timed choice (GPU): every candidate timed once per key, the fastest kept, nothing timed again."""
    timed = []
    fake_ms = {"gram": 3.0, "materialise": 5.0, fused_linear_plan.LINEAR_CANDIDATES["16-bit"][0]: 2.0}
    monkeypatch.setattr(fused_linear, "_linear_choices", {})
    monkeypatch.setattr(fused_linear, "_benchmark_ms", lambda fn: fn())

    def run(candidate):
        timed.append(candidate)
        return fake_ms[candidate]

    for _ in range(3):
        assert fused_linear._fastest("key", list(fake_ms), run) == fused_linear_plan.LINEAR_CANDIDATES["16-bit"][0]
    assert timed == list(fake_ms)
    assert fused_linear._fastest("other", ["gram", "materialise"], run) == "gram"


@pytest.mark.parametrize("shape", BIG_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K, L", [(768, 1000), (1000, 40)])
def test_linear_wide(K, L, bias, dtype, shape, captured):
    torch.manual_seed(6)
    fused, ref = make_linear(K, L, bias, dtype)
    x, g = inputs(shape, K, dtype, out_features=L)
    check_against_oracle(fused, ref, x, g, dtype, captured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, L", [(40, 48), (40, 72), (48, 72), (8, 20)])
def test_linear_ragged_widths_masked_or_padded(K, L, dtype, captured, monkeypatch, force_strategy):
    """Each way the glue passes the widths (fused_linear_plan.linear_ragged): a ragged input width alone, masked; ragged
    input and output widths, both masked; a ragged output alone; widths below 16 padded. The kernel sees each
    width unpadded exactly when linear_ragged says so, and the numbers agree."""
    force_strategy(fused_linear="kernel")  # on a GPU too, not the timed choice
    seen, launch = [], fused_runtime._launch

    def record(kernel, grid, device, *args, **kwargs):
        seen.append(
            (kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, dict(zip(kernel.arg_names, args)))
        )
        launch(kernel, grid, device, *args, **kwargs)

    monkeypatch.setattr(fused_runtime, "_launch", record)
    torch.manual_seed(13)
    fused, ref = make_linear(K, L, True, dtype)
    x, g = inputs((3, 17), K, dtype, out_features=L)
    check_against_oracle(fused, ref, x, g, dtype, captured, passes=2)
    linear = [args for name, args in seen if name == "_linear_bwd_dw_pe_sqnorm"]
    ieee = dtype == torch.float32 and not (DEVICE == "cuda" and fused_runtime.matmul_allows_tf32())
    ragged = fused_linear_plan.linear_ragged(L, K, dtype, not ieee)
    assert len(linear) == 2 and all(a["K"] == (K if "K" in ragged else -(-K // 16) * 16) for a in linear)
    assert all(a["L"] == (L if "L" in ragged else -(-L // 16) * 16) for a in linear)
    assert ragged == tuple(n for n, w in (("L", L), ("K", K)) if w >= 16 and w % 16)


@pytest.mark.parametrize("split", [(0, 2, 2), (2, 2, 2), (4, 3, 1), (1, 2, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_split_examples_small_tiles_and_accumulation(bias, split, captured, monkeypatch, force_strategy):
    """Examples split over programs as on a GPU (fused_linear_plan.LinearSplit: the first rows of tiles owned whole,
    the rest in chunks of examples: 2 chunks of 2 for N = 3, or 3 of 1), 16-wide tiles (5 x 3 of them,
    ragged), two T blocks per example, and two backward passes adding up. The tiles are forced (on a GPU the
    timed choice would pick others, which the split was not made for)."""
    monkeypatch.setattr(fused_linear_plan, "_linear_plan", lambda N, *shape: fused_linear_plan.LinearSplit(*split))
    force_strategy(fused_linear=fused_linear_plan.LinearConfig(16, 16, 16, 4, 1))
    torch.manual_seed(7)
    fused, ref = make_linear(40, 72, bias, torch.float32)
    x, g = inputs((3, 17), 40, torch.float32, out_features=72)
    check_against_oracle(fused, ref, x, g, torch.float32, captured, passes=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_autocast(dtype):
    """fp32 parameters and input under autocast: computed in autocast's dtype like F.linear, gradients
    in fp32, norms as buffered.PerExampleLinear computes them from the same cast tensors."""
    torch.manual_seed(8)
    fused = FusedLinear(40, 72).to(DEVICE)
    plain = PerExampleLinear(40, 72).to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    x, g = inputs((3, 17), 40, torch.float32, out_features=72)
    outs = []
    for layer in (fused, plain):
        xk = x.clone().requires_grad_(True)
        with torch.autocast(DEVICE, dtype=dtype):
            y = layer(xk)
        y.backward(g.to(dtype))
        outs.append((y, xk.grad))
    assert outs[0][0].dtype == dtype and fused.weight.grad.dtype == torch.float32
    assert_close(outs[0][0], outs[1][0], TOL[dtype], "output")
    assert_close(outs[0][1], outs[1][1], TOL[dtype], "input grad")
    for name in ("weight", "bias"):
        assert_close(getattr(fused, name).grad, getattr(plain, name).grad, TOL[dtype], f"{name}.grad")
        assert_close(fused.pe_buffer(name), plain.pe_buffer(name), 1e-4, f"{name} buffer")


# -----------------------------------------------------------------------------
# fallback, guards, availability


@pytest.mark.parametrize(
    "make",
    [
        lambda: FusedLayerNorm(40),
        lambda: FusedRMSNorm(40),
        lambda: FusedLinear(40, 40),
    ],
)
def test_fallback_same_numbers_and_warns_once(make, monkeypatch):
    torch.manual_seed(9)
    kernel_layer = make().to(DEVICE)
    torch_layer = make().to(DEVICE)
    torch_layer.load_state_dict(kernel_layer.state_dict())
    x, g = inputs((3, 17), 40, torch.float32)
    y = kernel_layer(x)
    y.backward(g)
    monkeypatch.setattr(fused_runtime, "_warned_reasons", set())
    monkeypatch.setattr(fused_runtime, "kernel_unavailable_reason", lambda x: "a test said so")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # second call: no new warning; buffers accumulate twice
            y_fallback = torch_layer(x)
            y_fallback.backward(g)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "a test said so" in messages[0] and "falling back" in messages[0]
    assert_close(y_fallback, y, 1e-5, "output")
    for name, p in kernel_layer.named_parameters():
        assert_close(getattr(torch_layer, name).grad, 2 * p.grad, 1e-5, f"{name}.grad")
        assert_close(torch_layer.pe_buffer(name), 2 * kernel_layer.pe_buffer(name), 1e-5, f"{name} buffer")


def test_float64_falls_back_with_reason(monkeypatch):
    monkeypatch.setattr(fused_runtime, "_warned_reasons", set())
    layer = FusedLayerNorm(40).to(DEVICE, torch.float64)
    x = torch.randn(3, 5, 40, dtype=torch.float64, device=DEVICE)
    assert "float64" in fused_gns.kernel_unavailable_reason(x)
    with pytest.warns(RuntimeWarning, match="float64"):
        layer(x).sum().backward()
    assert layer.weight_pe_sqnorm[1].item() == 3


def test_shape_guards():
    with pytest.raises(RuntimeError, match=r"\(40,\).*unsqueeze"):
        FusedLayerNorm(40).to(DEVICE)(torch.randn(40, device=DEVICE))
    with pytest.raises(RuntimeError, match=r"\(40,\).*unsqueeze"):
        FusedLinear(40, 8).to(DEVICE)(torch.randn(40, device=DEVICE))
    wide = 40000  # 80 kB of fp16 per row: more than one block holds
    with pytest.raises(RuntimeError, match=rf"{wide}.*lnclass='gns'"):
        FusedLayerNorm(wide).to(DEVICE, torch.float16)(torch.randn(2, wide, device=DEVICE, dtype=torch.float16))


def test_functions_without_buffers():
    """The exposed autograd functions take None for buffers."""
    x = torch.randn(3, 5, 40, device=DEVICE, requires_grad=True)
    w, b = torch.randn(40, device=DEVICE, requires_grad=True), torch.randn(40, device=DEVICE, requires_grad=True)
    fused_gns.fused_layer_norm(x, w, b, 1e-5, None, None).sum().backward()
    fused_gns.fused_rms_norm(x, w, 1e-6, None).sum().backward()
    fused_gns.fused_linear(x, torch.randn(8, 40, device=DEVICE), None, None, None).sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None


def test_registered_in_layer_config():
    import nanogns as layer_config

    classes = layer_config.layer_classes(linearclass="fused", lnclass="fused")
    assert classes["Linear"] is FusedLinear
    assert classes["LayerNorm"] is FusedLayerNorm


# -----------------------------------------------------------------------------
# GPU only: the grid heuristics as they are, at a GPT-2-like width


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_heuristics_gpt2_width(dtype, captured, monkeypatch):
    if DEVICE != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: kernels run on CPU tensors only; rerun without it on the GPU")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 tl.dot in ieee, like the reference
    torch.manual_seed(10)
    fused, ref = make_norm("layernorm", 768, dtype)
    check_against_oracle(fused, ref, *inputs((4, 256), 768, dtype), dtype, captured)
    fused, ref = make_linear(768, 3072, True, dtype)
    check_against_oracle(fused, ref, *inputs((4, 256), 768, dtype, out_features=3072), dtype, captured)
