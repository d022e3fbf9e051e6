"""
The fused layers' GPU-only paths, checked on the CPU: the TF32 flag read through
either torch API, every kernel launched on its tensors' device, the timed choice
of the fused Linear surviving candidates that fail or run out of memory, a
ragged output width masked in the kernel (no padded copy), and the benchmarks'
TF32 matching train.py's.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_layers_fused_gpu_paths.py
"""

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from nanogns.kinds.layernorm import FusedLayerNorm
from nanogns.kinds.linear import FusedLinear
from nanogns.variants import fused as fused_gns
from nanogns.variants.fused import linear as fused_linear
from nanogns.variants.fused import linear_plan as fused_linear_plan
from nanogns.variants.fused import runtime as fused_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import train_settings  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not fused_gns.kernels_interpreted(), reason="needs TRITON_INTERPRET=1 (runs the kernels on CPU)"
)


def test_tf32_flag_read_through_either_api():
    """After torch.backends.fp32_precision (or the matmul's) is set, reading the legacy allow_tf32 raises
    (torch 2.13); the glue's reader gives the effective setting. A fresh process: these flags are sticky."""
    script = textwrap.dedent("""
        import torch
        from nanogns.variants.fused import runtime as fused_runtime
        m = torch.backends.cuda.matmul
        seen = [fused_runtime.matmul_allows_tf32()]
        torch.backends.fp32_precision = "tf32"  # the new API, global: the matmul inherits it
        seen.append(fused_runtime.matmul_allows_tf32())
        try:
            m.allow_tf32  # what the glue read before
            seen.append("legacy read")
        except RuntimeError:
            seen.append("legacy read raises")
        m.fp32_precision = "ieee"
        seen.append(fused_runtime.matmul_allows_tf32())
        m.fp32_precision = "tf32"
        seen.append(fused_runtime.matmul_allows_tf32())
        m.allow_tf32 = False  # the legacy API after the new one
        seen.append(fused_runtime.matmul_allows_tf32())
        m.allow_tf32 = True
        seen.append(fused_runtime.matmul_allows_tf32())
        print(seen)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str([False, True, "legacy read raises", False, True, False, True])


@needs_interpreter
def test_every_launch_is_on_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device; each launch must run under a guard for its tensors' device
    (mocked here: the guard is taken for CPU tensors too, torch.cuda.device replaced by a recorder)."""
    current = []

    @contextlib.contextmanager
    def fake_cuda_device(device):
        current.append(torch.device(device))
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)
    monkeypatch.setattr(fused_runtime, "_device_guard", lambda device: torch.cuda.device(device))
    seen = []
    from nanogns import kernels as normgnorm

    for kernel in [getattr(normgnorm, name) for name in normgnorm.__all__]:

        def check(*args, kernel=kernel, **kwargs):
            seen.append((kernel.__name__, current[-1] if current else None))

        monkeypatch.setattr(kernel, "pre_run_hooks", [check])
    x = torch.randn(3, 5, 40, requires_grad=True)
    norm, linear = FusedLayerNorm(40), FusedLinear(40, 24)
    linear(norm(x)).sum().backward()
    assert len(seen) >= 3 and all(device == x.device for _, device in seen), seen


def test_timed_choice_skips_candidates_that_fail(monkeypatch):
    """A candidate that runs out of memory or fails to compile is skipped with a warning, not the run's end."""
    from triton import CompilationError

    config = fused_linear_plan.LINEAR_CANDIDATES["16-bit"][0]
    errors = {
        "materialise": torch.OutOfMemoryError("CUDA out of memory"),
        config: CompilationError("kernel.py", None, "no compile"),
    }
    timed = []
    monkeypatch.setattr(fused_linear, "_linear_choices", {})
    monkeypatch.setattr(fused_linear, "_benchmark_ms", lambda fn: fn())

    def run(c):
        timed.append(c)
        if c in errors:
            raise errors[c]
        return {"gram": 3.0}.get(c, 2.0)

    candidates = ["gram", "materialise", *fused_linear_plan.LINEAR_CANDIDATES["16-bit"]]
    with pytest.warns(RuntimeWarning, match="skipped") as caught:
        choice = fused_linear._fastest(("k",), candidates, run)
    assert timed == candidates and choice == fused_linear_plan.LINEAR_CANDIDATES["16-bit"][1]
    assert sum("skipped" in str(w.message) for w in caught) == 2
    monkeypatch.setattr(fused_linear, "_linear_choices", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="every candidate failed"):
            fused_linear._fastest(("k",), ["materialise"], run)


def test_gram_candidate_not_tried_when_too_large(monkeypatch):
    """GPT-2's lm_head at B = 12: the Gram trick's fp32 copies take ~2.5 GB; with 3 GB free it is not timed."""
    tried = []
    monkeypatch.setattr(
        fused_linear, "_fastest", lambda key, candidates, run: tried.append(candidates) or "materialise"
    )
    monkeypatch.setattr(fused_runtime, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    N, T, K, L = 12, 1024, 768, 50257
    assert 2.4e9 < fused_linear.gram_extra_bytes(N, T, K, L) < 2.7e9

    class FakeCuda(torch.Tensor):  # a meta tensor that says it is on a GPU: nothing is allocated
        @property
        def device(self):
            return torch.device("cuda", 0)

    x = torch.empty(N, T, K, dtype=torch.bfloat16, device="meta").as_subclass(FakeCuda)
    g = torch.empty(N, T, L, dtype=torch.bfloat16, device="meta").as_subclass(FakeCuda)
    for free, has_gram in ((3 * 2**30, False), (80 * 2**30, True)):
        monkeypatch.setattr(fused_linear, "_free_bytes", lambda device, free=free: free)
        fused_linear._linear_choice(x, g)
        assert ("gram" in tried[-1]) == has_gram and "materialise" in tried[-1]


def test_remembered_choice_queries_nothing(monkeypatch):
    """After the first call for a shape, the choice comes from the cache before anything else: no free-memory query
    (a driver call that cost about 1 ms of host time per Linear backward on an H200) and no candidate list."""
    monkeypatch.setattr(fused_linear, "_linear_choices", {})
    monkeypatch.setattr(fused_runtime, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    queries = []
    monkeypatch.setattr(fused_linear, "_free_bytes", lambda device: queries.append(device) or 80 * 2**30)

    def fastest(key, candidates, run):
        fused_linear._linear_choices[key] = "materialise"
        return "materialise"

    monkeypatch.setattr(fused_linear, "_fastest", fastest)

    class FakeCuda(torch.Tensor):  # a meta tensor that says it is on a GPU: nothing is allocated
        @property
        def device(self):
            return torch.device("cuda", 0)

    x = torch.empty(12, 64, 96, dtype=torch.bfloat16, device="meta").as_subclass(FakeCuda)
    g = torch.empty(12, 64, 80, dtype=torch.bfloat16, device="meta").as_subclass(FakeCuda)
    assert [fused_linear._linear_choice(x, g) for _ in range(3)] == ["materialise"] * 3
    assert len(queries) == 1


@needs_interpreter
def test_ragged_output_width_masked_not_copied(monkeypatch):
    """L = 40 (not a multiple of 16): the kernel reads the output gradient itself, not a padded copy."""
    from nanogns import kernels as normgnorm

    pointers = []
    monkeypatch.setattr(
        normgnorm.linear._linear_bwd_dw_pe_sqnorm,
        "pre_run_hooks",
        [lambda *args, **kw: pointers.append(args[1].data_ptr())],
    )
    linear = FusedLinear(32, 40)
    x = torch.randn(3, 5, 32)
    g = torch.randn(3, 5, 40)
    linear(x).backward(g)
    assert pointers == [g.data_ptr()]
    reference = torch.nn.Linear(32, 40)
    reference.load_state_dict(linear.state_dict())
    reference(x).backward(g)
    torch.testing.assert_close(linear.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    expected = sum((g[i].t() @ x[i]).pow(2).sum() for i in range(3))
    torch.testing.assert_close(linear.weight_pe_sqnorm[0], expected, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_buffers_viewed_in_one_flat_tensor(monkeypatch):
    """GNSMonitor re-homes the buffers as views of one flat tensor, 8 bytes apart from 16-byte alignment every
    other one: the finishing kernel still gets only aligned pointers (the compiled specialisation) and updates
    the right elements."""
    import compile_gate

    from nanogns import kernels as normgnorm

    kernel = normgnorm.finish._pe_sqnorm_finish
    launches = []
    monkeypatch.setattr(
        kernel, "pre_run_hooks", [lambda *args, **kw: launches.append(dict(zip(kernel.arg_names, args)))]
    )
    torch.manual_seed(0)
    layers = [FusedLayerNorm(32), FusedLinear(32, 24)]
    reference = [FusedLayerNorm(32), FusedLinear(32, 24)]
    flat = torch.zeros(2 + 4 * 2)
    for i, (layer, twin) in enumerate(zip(layers, reference)):
        twin.load_state_dict(layer.state_dict())
        for j, name in enumerate(("weight_pe_sqnorm", "bias_pe_sqnorm")):
            start = 2 + 4 * i + 2 * j  # odd pairs: 8 bytes past an aligned address
            layer._buffers[name] = flat[start : start + 2]
    x = torch.randn(3, 5, 32)
    for model in (layers, reference):
        model[1](model[0](x)).sum().backward()
    assert flat[:2].tolist() == [0.0, 0.0]
    for layer, twin in zip(layers, reference):
        for name in ("weight", "bias"):
            torch.testing.assert_close(layer.pe_buffer(name), twin.pe_buffer(name))
    for args in launches:
        for name in compile_gate.specialised_args(kernel):
            if isinstance(args[name], torch.Tensor):
                assert args[name].data_ptr() % 16 == 0, name


def test_benchmarks_set_tf32_as_train_py():
    """bench/train_settings.py sets exactly the TF32 flags train.py sets, and every timing benchmark calls it."""
    with open(os.path.join(ROOT, "train.py")) as f:
        train_flags = set(re.findall(r"^(torch\.backends\.[\w.]+) = (\w+)", f.read(), re.M))
    with open(os.path.join(ROOT, "bench", "train_settings.py")) as f:
        bench_flags = set(re.findall(r"^\s+(torch\.backends\.[\w.]+) = (\w+)", f.read(), re.M))
    assert train_flags and bench_flags == train_flags
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        train_settings.set_training_precision()
        assert fused_runtime.matmul_allows_tf32() and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    for script in ("kernels.py", "linear_strategies.py", "step_overhead.py", "moe_block.py"):
        with open(os.path.join(ROOT, "bench", script)) as f:
            assert "train_settings.set_training_precision()" in f.read(), script


@needs_interpreter
def test_fused_gpt_under_the_monitor_equals_gns():
    """A GPT with fused Linear and LayerNorm read by GNSMonitor (its buffers re-homed in one flat tensor, which
    the finishing kernel updates) measures what the gns layers measure, over two accumulated steps."""
    import nanogns as lc
    from nanogns import monitor as gnstracking
    from nanogns.core.buffers import zero_pe_sqnorm_buffers

    measured = {}
    for kind in ("gns", "fused"):
        torch.manual_seed(0)
        with lc.set_contextual_config(**lc.layer_classes(kind, "gns", kind)):
            from model import GPT, GPTConfig

            model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=67, dropout=0.0))
        monitor = gnstracking.GNSMonitor(model)
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                x, y = torch.randint(0, 67, (2, 3, 8), generator=generator)
                (model(x, y)[1] / 2).backward()
            measured[kind] = monitor.measure(batch_size=6)
            zero_pe_sqnorm_buffers(model)
            model.zero_grad(set_to_none=True)
    assert [m.metadata["name"] for m in measured["fused"]] == [m.metadata["name"] for m in measured["gns"]]
    for fused, gns in zip(measured["fused"], measured["gns"]):
        assert fused.rms_pe_norm == pytest.approx(gns.rms_pe_norm, rel=1e-5), fused.metadata["name"]
        assert fused.norm == pytest.approx(gns.norm, rel=1e-5), fused.metadata["name"]
