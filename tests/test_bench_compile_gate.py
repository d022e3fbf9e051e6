"""
The GPU compile gate (bench/compile_gate.py) and what it relies on: every Triton
kernel at every launch configuration the glue can choose compiles for sm_80 and
sm_90 with no register spill and shared memory within the device's limit, and
the glue only ever launches the one specialisation the gate compiles.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_bench_compile_gate.py

The gate runs in a subprocess without TRITON_INTERPRET (Triton compiles for a GPU
target without one); the specialisation check runs the kernels in this process's
interpreter.
"""

import os
import subprocess
import sys

import pytest
import torch

from nanogns.kinds.layernorm import FusedLayerNorm, PerExampleLayerNorm
from nanogns.kinds.linear import FusedLinear, PerExampleLinear
from nanogns.variants import fused as fused_gns
from nanogns.variants.fused import finish as fused_finish
from nanogns.variants.fused import linear_plan as fused_linear_plan
from nanogns.variants.fused import norms as fused_norms
from nanogns.variants.fused import runtime as fused_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import compile_gate  # noqa: E402


def test_gpu_compile_gate(capsys):
    """Compiles everything (about 250 kernels on 2 cores, a minute or two) and prints the gate's summary line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "compile_gate.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    with capsys.disabled():  # the summary goes to the CI log
        print("\n" + (lines[-1] if lines else "compile gate printed nothing"))
    assert done.returncode == 0 and lines and lines[-1].startswith("compile gate:"), (
        "\n".join(lines[-30:]) + done.stderr[-3000:]
    )
    assert "spills: 0; failures: 0" in lines[-1]


def test_gate_covers_every_configuration_the_glue_returns():
    """The pure launch-configuration functions only return what the gate compiles."""
    jobs = set(compile_gate.all_jobs((80, 90)))
    for arch in (80, 90):
        capability = divmod(arch, 10)
        for D in range(1, fused_runtime.MAX_NORM_FEATURES + 1, 37):
            block_d, num_warps = fused_norms.norm_launch_config(D)
            unaligned = ("STRIDE",) if D % 16 and 16 <= D <= fused_runtime.NORM_RAGGED_MAX else ()  # as _masked_rows
            assert block_d >= D and any(
                j.kernel == "_ln_bwd_dx_pe_sqnorm"
                and j.arch == arch
                and j.num_warps == num_warps
                and dict(j.constexprs)["BLOCK_D"] == block_d
                and j.unaligned == unaligned
                for j in jobs
            )
        for W in [0, 1, 40, 768, 2304, 50257, 10**6]:
            assert fused_finish.finish_block_w(W) in compile_gate.FINISH_BLOCK_WS
        assert fused_finish.FINISH_WARPS == compile_gate.FINISH_WARPS
        for dtype in fused_runtime.KERNEL_DTYPES:
            for tf32 in (False, True):
                for N, T, K, L in [(16, 1024, 768, 3072), (4, 64, 40, 72), (1, 1, 8, 8), (64, 256, 768, 50257)]:
                    choice = fused_linear_plan.linear_default_config(N, T, K, L, dtype, capability, 132, tf32)
                    assert choice == "gram" or choice in fused_linear_plan.linear_candidates(
                        dtype, capability, tf32, fused_linear_plan.linear_ragged(L, K, dtype, tf32)
                    )
                precision = "tf32" if tf32 or dtype != torch.float32 else "ieee"
                for L, K in [(32, 32), (40, 32), (32, 40), (40, 40), (50257, 768), (8, 40), (40, 1)]:
                    ragged = fused_linear_plan.linear_ragged(L, K, dtype, tf32)
                    assert ragged == tuple(n for n, w in (("L", L), ("K", K)) if w >= 16 and w % 16)
                    compiled = set()
                    for j in jobs:
                        flags = dict(j.constexprs)
                        if (
                            j.kernel == "_linear_bwd_dw_pe_sqnorm"
                            and j.arch == arch
                            and flags["INPUT_PRECISION"] == precision
                            and j.dtype == compile_gate.TYPE_NAMES[dtype]
                            and j.unaligned == ragged
                        ):
                            compiled.add(
                                (flags["BLOCK_L"], flags["BLOCK_K"], flags["BLOCK_T"], j.num_warps, j.num_stages)
                            )
                    for c in fused_linear_plan.linear_candidates(dtype, capability, tf32, ragged):
                        assert (c.block_l, c.block_k, c.block_t, c.num_warps, c.num_stages) in compiled
                        assert c.shared_bytes(dtype.itemsize) <= fused_linear_plan.shared_memory_limit(capability)


# (kernel, argument) pairs the glue may pass ragged (not a multiple of 16): the Linear's output and input widths, the
# norms' row stride (a ragged feature count from 16 on, unpadded)
RAGGED = {
    ("_linear_bwd_dw_pe_sqnorm", "L"),
    ("_linear_bwd_dw_pe_sqnorm", "K"),
    ("_ln_fwd", "STRIDE"),
    ("_ln_bwd_dx_pe_sqnorm", "STRIDE"),
}


@pytest.mark.skipif(not fused_gns.kernels_interpreted(), reason="needs TRITON_INTERPRET=1 (runs the kernels on CPU)")
@pytest.mark.parametrize("features, outputs", [(40, 24), (48, 24), (1000, 32), (4100, 24), (40, 32)])
def test_glue_launches_only_the_compiled_specialisation(features, outputs, monkeypatch):
    """Odd widths and unaligned views: every argument Triton specialises is a 16-byte aligned tensor and a
    multiple of 16, or ragged widths the gate compiles unaligned too, so the kernel that runs is one the gate
    compiled; a ragged norm width's rows and ragged Linear widths go to the kernels unpadded (no copy)."""
    from nanogns import kernels as normgnorm

    launches = []
    kernels = (
        normgnorm.layernorm._ln_fwd,
        normgnorm.layernorm._ln_bwd_dx_pe_sqnorm,
        normgnorm.linear._linear_bwd_dw_pe_sqnorm,
        normgnorm.finish._pe_sqnorm_finish,
    )
    for kernel in kernels:

        def record(*args, kernel=kernel, **kwargs):  # the interpreter calls it with each launch's arguments
            launches.append((kernel, dict(zip(kernel.arg_names, args))))

        monkeypatch.setattr(kernel, "pre_run_hooks", [record])
    torch.manual_seed(0)
    base = torch.randn(3 * 5 * features + 1)
    x = base[1:].view(3, 5, features).requires_grad_(True)  # a view 4 bytes past an aligned address
    norm = FusedLayerNorm(features)
    linear = FusedLinear(features, outputs)
    linear(norm(x)).sum().backward()
    assert {kernel.__name__ for kernel, _ in launches} == {
        "_ln_fwd",
        "_ln_bwd_dx_pe_sqnorm",
        "_linear_bwd_dw_pe_sqnorm",
        "_pe_sqnorm_finish",
    }
    gate = compile_gate.all_jobs((90,))
    compiled = {(j.kernel, j.unaligned) for j in gate}
    unpadded = {}  # kernel -> the ragged widths it was given unpadded
    for kernel, args in launches:
        ragged = []
        for name in compile_gate.specialised_args(kernel):
            value = args[name]
            if isinstance(value, torch.Tensor):
                assert value.data_ptr() % 16 == 0, f"{kernel.__name__}: {name} not 16-byte aligned"
            elif isinstance(value, int) and (kernel.__name__, name) not in RAGGED:
                assert value % 16 == 0, f"{kernel.__name__}: {name} = {value} not a multiple of 16"
            elif isinstance(value, int) and value % 16:  # a ragged width is masked in the kernel
                assert value >= 16, f"{kernel.__name__}: {name} = {value} should have been padded"
                ragged.append(name)
        assert (kernel.__name__, tuple(ragged)) in compiled, (kernel.__name__, ragged)  # the gate compiled this one
        unpadded[kernel.__name__] = tuple(ragged)
    norms_unpadded = features % 16 and features <= fused_runtime.NORM_RAGGED_MAX
    assert bool(norms_unpadded) == (unpadded["_ln_fwd"] == unpadded["_ln_bwd_dx_pe_sqnorm"] == ("STRIDE",)), unpadded
    assert unpadded["_linear_bwd_dw_pe_sqnorm"] == fused_linear_plan.linear_ragged(
        outputs, features, torch.float32, False
    )
    if features % 16:  # a ragged input width, masked (and a ragged output width with it)
        assert unpadded["_linear_bwd_dw_pe_sqnorm"] == (("L", "K") if outputs % 16 else ("K",))
    # and the numbers are still right: the zero padding added nothing
    reference = PerExampleLinear(features, outputs)
    reference.load_state_dict(linear.state_dict())
    xr = x.detach().clone().requires_grad_(True)
    ln = PerExampleLayerNorm(features)
    reference(ln(xr)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(linear.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-5)
    for name in ("weight", "bias"):
        torch.testing.assert_close(linear.pe_buffer(name), reference.pe_buffer(name), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(norm.pe_buffer(name), ln.pe_buffer(name), rtol=1e-4, atol=1e-6)


def test_a_ragged_input_width_is_padded_where_no_candidate_is_left(monkeypatch):
    """Should the spill table (RAGGED_SPILLS) leave no candidate with both widths masked, K is zero-padded
    and L alone masked, so the glue never launches a specialisation the gate does not compile."""
    every_ieee = {("ieee", c) for c in fused_linear_plan.LINEAR_CANDIDATES["ieee"]}
    monkeypatch.setitem(fused_linear_plan.RAGGED_SPILLS, ("L", "K"), every_ieee)
    assert fused_linear_plan.linear_ragged(40, 40, torch.float32, False) == ("L",)
    assert fused_linear_plan.linear_ragged(40, 40, torch.bfloat16, False) == ("L", "K")
    assert fused_linear_plan.linear_ragged(32, 40, torch.float32, False) == ("K",)
