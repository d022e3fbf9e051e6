"""
Compile gate: every Triton kernel of this project at every launch configuration
nanogns/variants/fused/ can choose, compiled for NVIDIA sm_80 (A100) and sm_90 (H100) on a
machine without a GPU, each compiled kernel checked for register spills and for
shared memory over the target's per-block limit.

    python bench/compile_gate.py               # one summary line; exit status 1 on any failure
    python bench/compile_gate.py --verbose     # plus one line per compiled kernel
    python bench/compile_gate.py --targets 90 --jobs 4

"Every launch configuration" is what the glue's pure functions can return:
  _ln_fwd, _ln_bwd_dx_pe_sqnorm   fp32 / fp16 / bf16 x (LayerNorm, LayerNorm without
                             bias, RMSNorm) x every (BLOCK_D, num_warps) of
                             norm_launch_config(D) for D = 1 .. MAX_NORM_FEATURES,
                             each with the row stride a multiple of 16 and, up
                             to NORM_RAGGED_MAX, not: the glue masks a ragged D
                             (16 to 4096 features) in the kernel
  _pe_sqnorm_finish          fp32 / fp16 / bf16 gradients x every BLOCK_W of
                             finish_block_w, parameter a as vectors or squares
  _linear_bwd_dw_pe_sqnorm        fp32 with ieee and with tf32 dots, fp16, bf16 x
                             every autotune candidate linear_candidates returns
                             for the target's capability, each with L (the
                             output width) and K (the input width) multiples of
                             16 and not, as linear_ragged passes them: the glue
                             masks a ragged L (a 50257 vocabulary) or K in the
                             kernel
each compiled with the specialisation the glue launches: Triton's
divisible-by-16 hint on the pointers and on every integer argument a kernel
does not list in do_not_specialize (row strides and padded widths, which the
glue keeps multiples of 16 except the ragged L, K and D above, compiled without
the hint; tests/test_bench_compile_gate.py checks that it does).
Registers, spills and stack come from ptxas's own -v report for the cubin
Triton builds; shared memory from Triton's metadata, against the target's
per-block limit (fused_linear_plan.shared_memory_limit). Triton must not be in
interpreter mode here (TRITON_INTERPRET is dropped); compiles go to a fresh
cache directory, so each runs ptxas, spread over --jobs processes.
"""

import argparse
import contextlib
import io
import itertools
import os
import re
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # read when triton is imported: compiling needs the real compiler

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fused_gns  # noqa: E402
from nanogns import kernels as normgnorm  # noqa: E402
from nanogns.variants.fused import finish as fused_finish
from nanogns.variants.fused import linear_plan as fused_linear_plan
from nanogns.variants.fused import norms as fused_norms
from nanogns.variants.fused import runtime as fused_runtime

TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
NORM_FLAVOURS = ((False, True), (False, False), (True, False))  # (IS_RMS, HAS_BIAS): LayerNorm, no bias, RMSNorm
# argument types of each kernel: "*" pointers to the layer dtype ("*T") or fp32, scalars i32 / fp32
SIGNATURES = {
    "_ln_fwd": dict(X="*T", Y="*T", W="*T", B="*T", MEAN="*fp32", RSTD="*fp32", D="i32", STRIDE="i32", eps="fp32"),
    "_ln_bwd_dx_pe_sqnorm": dict(
        X="*T",
        G="*T",
        DX="*T",
        W="*T",
        MEAN="*fp32",
        RSTD="*fp32",
        DW_PART="*fp32",
        DB_PART="*fp32",
        T="i32",
        D="i32",
        STRIDE="i32",
        ROWS_PER_CHUNK="i32",
    ),
    "_linear_bwd_dw_pe_sqnorm": dict(
        X="*T",
        G="*T",
        DW="*T",
        DW_PART="*fp32",
        W_PE_SQNORM_PART="*fp32",
        N="i32",
        T="i32",
        L="i32",
        K="i32",
        EXAMPLES_PER_CHUNK="i32",
        FRONT_ROWS="i32",
        CHUNKS="i32",
    ),
    "_pe_sqnorm_finish": dict(
        A_PART="*fp32",
        B_PART="*fp32",
        A_GRAD="*T",
        B_GRAD="*T",
        SQ_PART="*fp32",
        PE_SQNORM="*fp32",
        A_BUF="*fp32",
        B_BUF="*fp32",
        COUNTER="*i32",
        N="i32",
        C="i32",
        W="i32",
        STRIDE="i32",
        S="i32",
        COUNT="i32",
        A_ON="i32",
        B_ON="i32",
        A_RECORD="i32",
        B_RECORD="i32",
        A_BUF_AT="i32",
        B_BUF_AT="i32",
        SUM_PART="*fp32",
        SUM_OUT="*T",
        SUM_N="i32",
        SUM_CHUNKS="i32",
    ),
}
FINISH_BLOCK_WS = (64, 128, 256, 512)  # every value of fused_finish.finish_block_w
FINISH_WARPS = 4


def specialised_args(kernel):
    """Names of the arguments Triton may specialise at launch (divisibility by 16 of pointers and integers;
    floats never are): every argument that is neither a constexpr nor listed in the kernel's
    do_not_specialize. Works on jitted and interpreted kernels."""
    import inspect

    fn = kernel.fn
    dns = getattr(kernel, "kwargs", {}).get("do_not_specialize")  # the interpreter keeps the decorator's kwargs
    if dns is None:
        dns = [p.name for p in kernel.params if p.do_not_specialize]
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if "constexpr" not in str(p.annotation) and p.name not in dns]


@dataclass(frozen=True)
class Job:
    kernel: str
    dtype: str
    constexprs: tuple  # ((name, value), ...)
    num_warps: int
    num_stages: int  # 0: Triton's default, as the glue launches the norm kernels
    arch: int
    unaligned: tuple = ()  # integer arguments compiled without the divisible-by-16 hint

    def label(self):
        flags = " ".join(f"{k}={v}" for k, v in self.constexprs if k != "DOT_IN_FP32")
        stages = f" s{self.num_stages}" if self.num_stages else ""
        ragged = "".join(f" {a}%16!=0" for a in self.unaligned)
        return f"sm_{self.arch} {self.kernel} {self.dtype} {flags} w{self.num_warps}{stages}{ragged}"


def all_jobs(archs):
    """Every (kernel, dtype, constexprs, warps, stages) the glue can launch, per target."""
    block_ds = sorted(
        {
            fused_norms.norm_launch_config(D)
            for D in [2**i for i in range(fused_runtime.MAX_NORM_FEATURES.bit_length())]
            + [fused_runtime.MAX_NORM_FEATURES]
        }
    )
    for arch in archs:
        capability = divmod(arch, 10)
        for dtype, name in TYPE_NAMES.items():
            for allow_tf32 in (False, True) if dtype == torch.float32 else (True,):
                # L and K multiples of 16 or ragged, as fused_linear_plan.linear_ragged passes them for each (dtype, dots)
                unaligned_sets = sorted(
                    {
                        fused_linear_plan.linear_ragged(L, K, dtype, allow_tf32)
                        for L, K in itertools.product((32, 40), repeat=2)
                    }
                )
                for unaligned in unaligned_sets:
                    for c in fused_linear_plan.linear_candidates(dtype, capability, allow_tf32, unaligned):
                        flags = (
                            ("INPUT_PRECISION", "tf32" if allow_tf32 else "ieee"),
                            ("DOT_IN_FP32", False),
                            ("BLOCK_L", c.block_l),
                            ("BLOCK_K", c.block_k),
                            ("BLOCK_T", c.block_t),
                        )
                        yield Job("_linear_bwd_dw_pe_sqnorm", name, flags, c.num_warps, c.num_stages, arch, unaligned)
            for block_w, squares in itertools.product(FINISH_BLOCK_WS, (False, True)):
                flags = (("A_SQUARES", squares), ("BLOCK_W", block_w), ("SUM_BLOCK", fused_finish.FINISH_SUM_BLOCK))
                yield Job("_pe_sqnorm_finish", name, flags, FINISH_WARPS, 0, arch)
            for (block_d, num_warps), (is_rms, has_bias) in itertools.product(block_ds, NORM_FLAVOURS):
                flags = (("IS_RMS", is_rms), ("HAS_BIAS", has_bias), ("BLOCK_D", block_d))
                ragged = ((), ("STRIDE",)) if block_d <= fused_runtime.NORM_RAGGED_MAX else ((),)  # wider: padded
                for kernel, unaligned in itertools.product(("_ln_fwd", "_ln_bwd_dx_pe_sqnorm"), ragged):
                    yield Job(kernel, name, flags, num_warps, 0, arch, unaligned)  # D a multiple of 16, and ragged


def compile_job(job):
    """(job, result dict): registers, spill bytes, stack frame, shared memory, seconds; or an error."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's report to stdout
    kernel = getattr(normgnorm, job.kernel)
    signature = {k: v.replace("T", job.dtype) if v == "*T" else v for k, v in SIGNATURES[job.kernel].items()}
    constexprs = dict(job.constexprs)
    signature.update({k: "constexpr" for k in constexprs})
    names = list(signature)
    attrs = {
        (names.index(a),): [["tt.divisibility", 16]]
        for a in specialised_args(kernel)
        if signature[a][0] in "*i" and a not in job.unaligned
    }  # pointers and integers
    options = {"num_warps": job.num_warps, **({"num_stages": job.num_stages} if job.num_stages else {})}
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", job.arch, 32),
                options=options,
            )
    except Exception as e:  # a compile error is a gate failure, reported with the configuration
        return job, {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    text = log.getvalue()
    found = {
        key: re.search(pattern, text)
        for key, pattern in [
            ("registers", r"Used (\d+) registers"),
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
            ("stack", r"(\d+) bytes stack frame"),
        ]
    }
    if not all(found.values()):
        return job, {"error": f"no ptxas -v report found in:\n{text[-1500:]}"}
    result = {key: int(m.group(1)) for key, m in found.items()}
    result.update(shared=compiled.metadata.shared, seconds=time.perf_counter() - start)
    return job, result


def problems(job, result):
    """Why this compiled kernel fails the gate (empty if it passes)."""
    if "error" in result:
        return [result["error"]]
    found = []
    if result["spill_stores"] or result["spill_loads"] or result["stack"]:
        found.append(
            f"spills {result['spill_stores']} B stored / {result['spill_loads']} B loaded, "
            f"stack frame {result['stack']} B"
        )
    limit = fused_linear_plan.shared_memory_limit(divmod(job.arch, 10))
    if result["shared"] > limit:
        found.append(f"shared memory {result['shared']} B > {limit} B")
    return found


def run_gate(archs=(80, 90), jobs=None, verbose=False, out=sys.stdout):
    """Compile everything; print the summary line (and failures); return True when every kernel passes."""
    if fused_gns.kernels_interpreted():
        raise RuntimeError(
            "compile_gate: Triton's interpreter is active (TRITON_INTERPRET=1 when triton was "
            "imported); run `python bench/compile_gate.py`, which compiles for GPU targets"
        )
    # a fresh cache: every kernel really goes through ptxas (whose report we read), none comes from an old run
    # (removed afterwards: a few MB of cubins per run)
    cache = tempfile.TemporaryDirectory(prefix="compile_gate_")
    os.environ["TRITON_CACHE_DIR"] = triton.knobs.cache.dir = cache.name
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    todo = sorted(
        set(all_jobs(archs)), key=lambda j: (j.kernel != "_linear_bwd_dw_pe_sqnorm", -j.num_warps)
    )  # slow first
    start = time.perf_counter()
    with cache, ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as pool:
        results = list(pool.map(compile_job, todo, chunksize=1))
    failures = []
    for job, result in results:
        found = problems(job, result)
        failures += [f"FAIL {job.label()}: {p}" for p in found]
        if verbose and "error" not in result:
            print(
                f"{job.label()}: {result['registers']} registers, {result['spill_stores']} B spilled, "
                f"{result['shared']} B shared, {result['seconds']:.1f} s",
                file=out,
            )
    ok = [(job, r) for job, r in results if "error" not in r]
    per_target = ", ".join(f"sm_{a}: {sum(j.arch == a for j, _ in results)}" for a in archs)
    kernels = len({j.kernel for j, _ in results})
    spilled = sum(1 for _, r in ok if r["spill_stores"] or r["spill_loads"] or r["stack"])
    top_regs = max(ok, key=lambda jr: jr[1]["registers"], default=None)
    top_shared = max(ok, key=lambda jr: jr[1]["shared"], default=None)
    summary = (
        f"compile gate: {kernels} kernels x their launch configurations compiled per target ({per_target}); "
        f"spills: {spilled}; failures: {len(failures)}"
    )
    if top_regs:
        summary += (
            f"; most registers {top_regs[1]['registers']} ({top_regs[0].label()}); most shared memory "
            f"{top_shared[1]['shared']} B ({top_shared[0].label()})"
        )
    summary += f"; {time.perf_counter() - start:.0f} s"
    for line in failures:
        print(line, file=out)
    print(summary, file=out)
    return not failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated (default: 80,90)")
    parser.add_argument("--jobs", type=int, default=None, help="compiling processes (default: CPU count)")
    parser.add_argument("--verbose", action="store_true", help="one line per compiled kernel")
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.targets.split(","))
    sys.exit(0 if run_gate(archs, args.jobs, args.verbose) else 1)


if __name__ == "__main__":
    main()
