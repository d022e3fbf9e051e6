"""
One command for whoever has a CUDA GPU (no network; written for the torch and Triton of the GPU images,
2.11 and 3.6, and runs with the ones installed, whose versions it prints at the top of its tables): check the
fused layers on the GPU, then measure what exact norms cost on GPT-2 124M in bf16, and print tables ready for
bench/RESULTS.md.

    python bench/gpu_report.py                        # checks, launch counts, step, kernel and per-Linear tables
    python bench/gpu_report.py --out gpu-report       # the same, each section also saved as gpu-report/<section>.md
    python bench/gpu_report.py --check-only           # the checks, launch counts and the fused test files
    TRITON_INTERPRET=1 python bench/gpu_report.py --check-only   # the checks on the CPU, kernels interpreted

On a GPU the sections run in this order whatever an earlier one found (a failed check is reported, and the
timings still come): the checks (the fused layers' test files under pytest running beside them, in their own
process), the launches, the test files' result, GPT-2's eager step, the kernel and per-Linear tables, then
GPT-2's compiled step; the exit code says whether all passed.

The checks: every Linear (shim; gns under each strategy; fused under
the timed choice, the kernel and each torch strategy), Embedding (shim, gns),
LayerNorm (shim, gns, fused; with and without bias) and RMSNorm (gns, fused)
class, in float32 and bfloat16, on 2-D and 3-D inputs with odd sizes, against
tests/oracle.py's one-example-at-a-time loop in float64 (buffers, parameter and
input gradients); every candidate tile of the Linear kernel, forced, against
per-example matmuls in float64, and on a GPU one case past 2**31 elements; the
fused layers under torch.compile (inductor, one graph) against eager. Then the
launches of one backward beside torch's (bench/launch_counts.py); (GPU only) the fused layers' test files
under pytest (FUSED_TEST_FILES). On the CPU
the shapes are small and the test files are left to CI; tests/test_bench_gpu_report.py
runs this mode, so the GPU command cannot rot.

The tables (GPU only): bench/step_overhead.py's whole training step of GPT-2 124M (12 layers, 768 wide,
T = 1024, vocabulary 50304, batch 12, bf16 autocast) for nn, LayerNorm-only fused, all-layer gns and all-layer
fused, interleaved, eager and compiled, each with its steps' peak memory above what was live before them;
bench/kernels.py's kernel timings at GPT-2 shapes against cuBLAS's plain weight gradient, and
bench/linear_strategies.py at GPT-2's Linear shapes, followed by the strategy the fused Linear timed fastest
for each of GPT-2's Linear shapes.
"""

import argparse
import io
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the shared oracle
sys.path.insert(0, os.path.join(REPO, "bench"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from oracle import per_example_sqnorms_by_loop  # noqa: E402

from nanogns import kinds as layer_kinds  # noqa: E402
from nanogns.core.strategy import forced as forced_strategy  # noqa: E402
from nanogns.kinds.layernorm import FusedLayerNorm
from nanogns.kinds.linear import FusedLinear
from nanogns.kinds.rmsnorm import FusedRMSNorm
from nanogns.variants import fused as fused_gns  # noqa: E402
from nanogns.variants.fused import linear as fused_linear
from nanogns.variants.fused import linear_plan as fused_linear_plan
from nanogns.variants.fused import runtime as fused_runtime

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest reference value
GPT2 = [
    "--n_layer=12",
    "--n_head=12",
    "--n_embd=768",
    "--block_size=1024",
    "--batch_size=12",
    "--vocab_size=50304",
    "--bias=True",
]


def layer_cases():
    """(label, kind, make(features), twin(module) -> float64 torch layer, strategy context or None)."""

    def linear_twin(m):
        return nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)

    def norm_twin(m):
        return nn.LayerNorm(m.normalized_shape, eps=m.eps, bias=m.bias is not None)

    def rms_twin(m):
        return nn.RMSNorm(m.normalized_shape, eps=m.eps)

    cases = [("Linear shim", "linear", lambda f: layer_kinds.linear.ShimLinear(f, f + 9), linear_twin, None)]
    for strategy in (None, "gram", "materialise"):
        cases.append(
            (
                f"Linear gns {strategy or 'rule'}",
                "linear",
                lambda f: layer_kinds.linear.PerExampleLinear(f, f + 9),
                linear_twin,
                {"linear": strategy},
            )
        )
    for strategy in (None, "kernel", "gram", "materialise"):
        cases.append(
            (
                f"Linear fused {strategy or 'choice'}",
                "linear",
                lambda f: FusedLinear(f, f + 9),
                linear_twin,
                {"fused_linear": strategy},
            )
        )
    cases += [
        (
            "Linear gns no bias",
            "linear",
            lambda f: layer_kinds.linear.PerExampleLinear(f, f + 9, bias=False),
            linear_twin,
            None,
        ),
        (
            "Linear fused no bias",
            "linear",
            lambda f: FusedLinear(f, f + 9, bias=False),
            linear_twin,
            None,
        ),
        (
            "Embedding shim",
            "embedding",
            lambda f: layer_kinds.embedding.ShimEmbedding(29, f),
            lambda m: nn.Embedding(m.num_embeddings, m.embedding_dim),
            None,
        ),
        (
            "Embedding gns",
            "embedding",
            lambda f: layer_kinds.embedding.PerExampleEmbedding(29, f),
            lambda m: nn.Embedding(m.num_embeddings, m.embedding_dim),
            None,
        ),
        ("LayerNorm shim", "norm", lambda f: layer_kinds.layernorm.SeparatedLayerNorm(f), norm_twin, None),
        ("LayerNorm gns", "norm", lambda f: layer_kinds.layernorm.PerExampleLayerNorm(f), norm_twin, None),
        ("LayerNorm fused", "norm", lambda f: FusedLayerNorm(f), norm_twin, None),
        (
            "LayerNorm fused no bias",
            "norm",
            lambda f: FusedLayerNorm(f, bias=False),
            norm_twin,
            None,
        ),
        ("RMSNorm gns", "norm", lambda f: layer_kinds.rmsnorm.PerExampleRMSNorm(f), rms_twin, None),
        ("RMSNorm fused", "norm", lambda f: FusedRMSNorm(f), rms_twin, None),
    ]
    return cases


def _rel_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def check_case(label, kind, make, twin_of, strategy, device, dtype, lead, features):
    """Worst relative error of one layer against the oracle (buffers, parameter and input gradients)."""
    import contextlib

    torch.manual_seed(0)
    layer = make(features)
    with torch.no_grad():
        for p in layer.parameters():  # away from the identity init, so every term matters
            p.copy_(torch.randn_like(p) / features**0.5 + (1 if p.dim() == 1 and kind == "norm" else 0))
    twin = twin_of(layer).double()
    twin.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    layer, twin = layer.to(device, dtype), twin.to(device)
    if kind == "embedding":
        inputs = torch.randint(0, layer.num_embeddings, lead, device=device)
        out_features = layer.embedding_dim
    else:
        inputs = torch.randn(*lead, features, device=device).to(dtype)
        out_features = getattr(layer, "out_features", features)
    grad_out = torch.randn(*lead, out_features, device=device).to(dtype)
    expected = per_example_sqnorms_by_loop(twin, inputs.double() if kind != "embedding" else inputs, grad_out.double())
    x = inputs.clone().requires_grad_(True) if kind != "embedding" else inputs
    x_twin = inputs.double().requires_grad_(True) if kind != "embedding" else inputs
    fused = isinstance(layer, (FusedLinear, FusedLayerNorm, FusedRMSNorm))
    if fused and (device.startswith("cuda") or fused_gns.kernels_interpreted()):
        reason = fused_gns.kernel_unavailable_reason(inputs)
        assert reason is None, f"{label}: the kernel would not run ({reason})"
    with forced_strategy(**strategy) if strategy else contextlib.nullcontext():
        layer(x).backward(grad_out)
    twin(x_twin).backward(grad_out.double())
    errors = []
    for name, p in layer.named_parameters():
        buffer = layer.pe_buffer(name)
        assert buffer[1].item() == lead[0], f"{label}: {name} counted {buffer[1].item()} examples, not {lead[0]}"
        errors.append(_rel_error(buffer[0], expected[name].sum()))
        errors.append(_rel_error(p.grad, getattr(twin, name).grad))
    if kind != "embedding":
        errors.append(_rel_error(x.grad, x_twin.grad))
    return max(errors)


def _check(case, measure, failed, out):
    """One ok/FAIL line for `case` from measure() -> (max relative error, tolerance); a crash is a failure,
    reported with its case. A failed case is added to `failed`."""
    try:
        error, tol = measure()
        ok, detail = error <= tol, f"max relative error {error:.1e} (tolerance {tol:.0e})"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {str(e)[:500]}"
    print(f"{'ok  ' if ok else 'FAIL'} {case}: {detail}", file=out)
    if not ok:
        failed.append(case)


def check_layers(device, dtypes=None, shapes=None, out=sys.stdout):
    """Run every case; print one line each; return the labels that failed."""
    on_gpu = device.startswith("cuda")
    dtypes = dtypes or [torch.float32, torch.bfloat16]
    shapes = shapes or ([((3,), 45), ((4, 77), 200), ((2, 300), 768)] if on_gpu else [((3,), 20), ((3, 7), 40)])
    if not on_gpu and not fused_gns.kernels_interpreted():
        print("(Triton's interpreter is off: the fused layers check their torch fallback here)", file=out)
    failed = []
    for label, kind, make, twin_of, strategy in layer_cases():
        for dtype in dtypes:
            for lead, features in shapes:
                case = f"{label}, {str(dtype).replace('torch.', '')}, input {(*lead, features)}"
                _check(
                    case,
                    lambda: (
                        check_case(label, kind, make, twin_of, strategy, device, dtype, lead, features),
                        TOL[dtype],
                    ),
                    failed,
                    out,
                )
    return failed


FUSED_TEST_FILES = [
    "tests/test_layers_fused.py",
    "tests/test_layers_fused_gpu_paths.py",
    "tests/test_bench_launch_counts.py",
    "tests/test_layers_fused_linear_plan.py",
    "tests/test_layers_fused_compile.py",
]


def start_test_files():
    """The fused layers' test files under pytest, started in a fresh process on the GPU (no TRITON_INTERPRET),
    on several workers where pytest-xdist is installed; returns the running process for finish_test_files."""
    import importlib.util
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *workers, *FUSED_TEST_FILES],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish_test_files(process, out=sys.stdout, timeout=None):
    """Waits for start_test_files's pytest (at most `timeout` seconds more, then stops it: a failure); one ok/FAIL
    line (the failures' last lines after it); returns the failed cases."""
    import subprocess

    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        output += f"\nstopped: still running {timeout} s after the checks"
    lines = output.strip().splitlines()
    print(
        f"{'ok  ' if process.returncode == 0 else 'FAIL'} pytest {' '.join(FUSED_TEST_FILES)}: "
        f"{lines[-1] if lines else '(no output)'}",
        file=out,
    )
    if process.returncode != 0:  # pytest's summary of each failure, then the end of its output
        print("\n".join([line for line in lines if line.startswith(("FAILED", "ERROR"))] + lines[-60:]), file=out)
    return [] if process.returncode == 0 else ["test files"]


def run_test_files(out=sys.stdout):
    """The fused layers' test files under pytest on the GPU; returns the failed cases."""
    return finish_test_files(start_test_files(), out)


def _candidate_error(config, dtype, tf32, device, N, T, K, L):
    """Worst relative error of one forced kernel configuration against per-example matmuls in float64 (weight
    gradient, its per-example norms through the buffer, the bias's); returns (error, tolerance)."""
    torch.manual_seed(0)
    layer = FusedLinear(K, L).to(device, dtype)
    x = torch.randn(N, T, K, device=device).to(dtype)
    g = torch.randn(N, T, L, device=device).to(dtype)
    old_tf32 = fused_runtime.matmul_allows_tf32()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with forced_strategy(fused_linear=config):
            layer(x).backward(g)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    dw = torch.zeros(L, K, dtype=torch.float64, device=device)
    sq = 0.0
    for i in range(N):  # the oracle one example at a time (a Linear's dW_i = g_i^T x_i exactly)
        dw_i = g[i].double().t() @ x[i].double()
        dw += dw_i
        sq += dw_i.pow(2).sum().item()
    errors = [_rel_error(layer.weight.grad, dw), abs(layer.weight_pe_sqnorm[0].item() - sq) / sq]
    tol = {"16-bit": TOL[torch.bfloat16], "tf32": 5e-3, "ieee": TOL[torch.float32]}[
        fused_linear_plan.linear_dot_precision(dtype, tf32)
    ]
    return max(errors), tol


def check_candidates(device, out=sys.stdout):
    """Every candidate tile configuration of the kernel, forced, against the oracle on ragged shapes (two
    tiles each way, a partial row block, ragged output and input widths); on a GPU also one case past 2**31 elements
    of the output gradient (int64 offsets). Returns the failed cases."""
    on_gpu = device.startswith("cuda")
    flavours = [("16-bit", torch.bfloat16, True), ("tf32", torch.float32, True), ("ieee", torch.float32, False)]
    failed = []
    cases = []
    for precision, dtype, tf32 in flavours:
        for c in fused_linear_plan.LINEAR_CANDIDATES[precision]:
            cases.append(
                (
                    f"kernel {precision} {c.block_l}x{c.block_k}x{c.block_t} w{c.num_warps} s{c.num_stages}",
                    c,
                    dtype,
                    tf32,
                    (3, c.block_t + 5, c.block_k + 24, c.block_l + 9),
                )
            )
    if on_gpu:  # 2 x 21504 x 50257 = 2.16e9 elements of the output gradient (4.3 GB in bf16), GPT-2's ragged vocabulary
        c = fused_linear_plan.linear_candidates(torch.bfloat16, torch.cuda.get_device_capability(), True, ("L",))[0]
        cases.append(("kernel past 2**31 elements, bf16", c, torch.bfloat16, True, (2, 21504, 64, 50257)))
    else:
        print("skip kernel past 2**31 elements: needs a GPU (too large for Triton's interpreter)", file=out)
    for label, config, dtype, tf32, shape in cases:
        _check(
            f"{label}, (N, T, K, L) = {shape}",
            lambda: _candidate_error(config, dtype, tf32, device, *shape),
            failed,
            out,
        )
        if on_gpu:
            torch.cuda.empty_cache()
    return failed


def check_compiled(device, out=sys.stdout):
    """Fused LayerNorm + Linear + RMSNorm under torch.compile (inductor, one graph) against eager."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_layers_fused_compile import Block

    failed = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        eager = Block(64).to(device, dtype)
        model = Block(64).to(device, dtype)
        model.load_state_dict(eager.state_dict())
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        x, g = (torch.randn(3, 17, 64, device=device).to(dtype) for _ in range(2))

        def error():
            results = []
            for m in (eager, compiled):
                xk = x.clone().requires_grad_(True)
                m(xk).backward(g)
                results.append([xk.grad] + [p.grad for p in m.parameters()] + list(m.buffers()))
            return max(_rel_error(a, b) for a, b in zip(results[1], results[0])), TOL[dtype]

        _check(f"torch.compile fused layers vs eager, {str(dtype).replace('torch.', '')}", error, failed, out)
    return failed


def launch_table(device):
    import launch_counts

    launch_counts.main([f"--device={device}", "--dtype=bfloat16" if device == "cuda" else "--dtype=float32"])


def kernel_tables():
    import kernels
    import linear_strategies

    print(f"## {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {_triton_version()}\n")
    print("### Kernels at GPT-2 shapes against cuBLAS: `python bench/kernels.py`\n")
    kernels.main([])
    # peak memory per layer needs a subprocess per layer and shape (minutes): kernels.py's peak column stands in
    shapes = "--shapes=12,1024,768,2304;12,1024,768,768;12,1024,768,3072;12,1024,3072,768"
    print(
        f"\n### Per-Linear: `python bench/linear_strategies.py --device=cuda --dtype=bfloat16 --memory=False {shapes}`\n"
    )
    linear_strategies.main(["--device=cuda", "--dtype=bfloat16", "--memory=False", shapes])
    print(
        "\nfused Linear, strategy timed fastest per shape (N, T, K, L): "
        + "; ".join(
            f"{key[:4]} {choice if isinstance(choice, str) else 'kernel ' + str(choice)}"
            for key, choice in fused_linear._linear_choices.items()
        )
    )


def step_table(args, compiled):
    """GPT-2 124M's training step, bf16 autocast, every choice interleaved against nn, with each choice's step
    peak memory above what was live before it."""
    import step_overhead

    step_args = [
        "--device=cuda",
        "--dtype=bfloat16",
        f"--steps={args.steps}",
        f"--compile={compiled}",
        "--memory=False",  # each step's own peak, in this process (subprocesses per choice would take minutes)
        "--choices=nn,LayerNorm-only fused,all-layer gns,all-layer fused",
        *GPT2,
    ]
    print(f"## {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {_triton_version()}\n")
    print(f"### GPT-2 124M step: `python bench/step_overhead.py {' '.join(step_args)}`\n")
    step_overhead.main(step_args)


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def run_checks(device, out=sys.stdout, test_files=True):
    """Every check of this report for `device`; returns the failed cases. On a GPU the fused test files run
    under pytest first unless test_files=False (gpu_report's main runs them last, after the timings)."""
    on_gpu = device.startswith("cuda")
    print(
        f"# checks on {device}" + ("" if on_gpu else " (Triton's interpreter; the test files run in CI itself)"),
        file=out,
    )
    failed = run_test_files(out) if on_gpu and test_files else []
    print("## per-example norm layers against the brute-force oracle", file=out)
    failed += check_layers(device, out=out)
    print("## every candidate tile of the Linear kernel against the oracle", file=out)
    failed += check_candidates(device, out=out)
    print("## fused layers under torch.compile against eager", file=out)
    failed += check_compiled(device, out=out)
    return failed


class _Tee(io.TextIOBase):
    """Writes to the terminal and to one section's file, flushed per write (a run cut short keeps its lines)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)


def run_sections(sections, out_dir):
    """Run (name, fn) in order, each printing to stdout and to out_dir/name.md when out_dir is set; a section
    that raises is reported with its traceback's last lines and the next one runs. Returns the names that failed
    (a section fails by raising or by returning a non-empty list of failed cases)."""
    import contextlib
    import time
    import traceback

    failed = []
    for name, fn in sections:
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if out_dir:
                stream = stack.enter_context(open(os.path.join(out_dir, f"{name}.md"), "w"))
                stack.enter_context(contextlib.redirect_stdout(_Tee(sys.__stdout__, stream)))
            try:
                result = fn()
            except BaseException as e:  # a section's SystemExit (a bench script's refusal) included
                if isinstance(e, KeyboardInterrupt):
                    raise
                print("SECTION FAILED:\n" + "".join(traceback.format_exception(e)[-12:]))
                result = [name]
            print(f"\n({name}: {time.perf_counter() - t0:.0f} s)")
        if result:
            failed.append(name)
    return failed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-only", action="store_true", help="run the checks only")
    parser.add_argument("--steps", type=int, default=10, help="interleaved GPT-2 steps per choice (default: 10)")
    parser.add_argument(
        "--out", default=None, help="also write each section to OUT/<section>.md as it runs (default: none)"
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not fused_gns.kernels_interpreted() else "cpu"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if device != "cuda":
        failed = run_checks(device)
        print(f"{'all checks passed' if not failed else f'{len(failed)} checks FAILED'}")
        if failed:
            return 1
        print("\n## launches of one backward")
        launch_table(device)
        if not args.check_only:
            print("gpu_report.py: the timing tables need a CUDA GPU (and TRITON_INTERPRET unset); use --check-only")
            return 2
        return 0
    # On a GPU every section runs whatever an earlier one found, the checks first (a lease is short). The test
    # files run in their own process beside the checks (both check correctness; neither is timed), and the
    # timings start once both are done.
    test_files = start_test_files()
    sections = [
        ("checks", lambda: run_checks(device, out=sys.stdout, test_files=False)),
        ("launches", lambda: launch_table(device)),
        ("test_files", lambda: finish_test_files(test_files, sys.stdout, timeout=150)),
    ]
    if not args.check_only:
        sections += [
            ("step_eager", lambda: step_table(args, compiled=False)),
            ("kernels", lambda: kernel_tables()),
            ("step_compiled", lambda: step_table(args, compiled=True)),
        ]
    failed = run_sections(sections, args.out)
    print(f"\n{'every section passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
