"""
GPU benchmark of the fused Triton kernels against plain PyTorch at GPT-2 124M
shapes (B=12, T=1024, D=768, MLP 4*D, vocabulary 50304), measured in the same run.

    python bench/kernels.py                  # bfloat16
    python bench/kernels.py --dtype float16 --batch-size 8

Rows: fused LayerNorm forward+backward (+ per-example norms) vs F.layer_norm,
and, per Linear shape, the weight gradient + per-example norms by each exact
way (kinds/linear.py's gram and materialise, the kernel at each autotune
candidate) vs the plain weight gradient g^T x, then what the fused Linear's
timed choice picked.
Columns: median ms (triton.testing.do_bench), ratio to the plain row, GB/s of
the minimum traffic (each input read once, each output written once), and the
peak memory allocated above what was live before the call. Correctness is
tested in tests/test_layers_fused.py, not here.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import train_settings  # bench/train_settings.py, beside this script

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(fn, grad_to_none=()):
    """(median ms, peak MiB allocated above the live memory before one call)."""
    import triton.testing

    ms = triton.testing.do_bench(fn, grad_to_none=list(grad_to_none), return_mode="median")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def report(name, ms, plain_ms, nbytes, peak_mib):
    print(f"{name:<44} {ms:9.3f} {ms / plain_ms:7.2f}x {nbytes / ms / 1e6:9.1f} {peak_mib:10.1f}")


def bench_layernorm(B, T, D, dtype):
    import fused_gns

    x = torch.randn(B, T, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    w = torch.randn(D, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(D, device="cuda", dtype=dtype, requires_grad=True)
    w_buf, b_buf = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
    nbytes = 5 * x.numel() * x.element_size()  # forward: read x, write y; backward: read x and g, write dx

    def plain():
        F.layer_norm(x, (D,), w, b, 1e-5).backward(g)

    def fused():
        fused_gns.fused_layer_norm(x, w, b, 1e-5, w_buf, b_buf).backward(g)

    plain_ms, plain_mib = measure(plain, (x, w, b))
    fused_ms, fused_mib = measure(fused, (x, w, b))
    report(f"layernorm fwd+bwd F.layer_norm ({B}x{T}x{D})", plain_ms, plain_ms, nbytes, plain_mib)
    report("layernorm fwd+bwd fused + norms", fused_ms, plain_ms, nbytes, fused_mib)


def bench_linear_weight_grad(B, T, K, L, dtype):
    from nanogns import kinds as layer_kinds
    from nanogns.variants.fused import linear as fused_linear
    from nanogns.variants.fused import linear_plan as fused_linear_plan
    from nanogns.variants.fused import runtime as fused_runtime

    x = torch.randn(B, T, K, device="cuda", dtype=dtype)
    g = torch.randn(B, T, L, device="cuda", dtype=dtype)
    x2, g2 = x.view(-1, K), g.view(-1, L)
    nbytes = (x.numel() + g.numel() + K * L) * x.element_size()
    capability = torch.cuda.get_device_capability()
    tf32 = fused_runtime.matmul_allows_tf32()
    plain_ms, plain_mib = measure(lambda: g2.t() @ x2)
    report(f"linear dW g^T x ({B}x{T}, {K}->{L})", plain_ms, plain_ms, nbytes, plain_mib)
    for strategy in ("gram", "materialise"):
        ms, mib = measure(lambda: layer_kinds.linear.linear_weight_grad_and_pe_sqnorm(x, g, strategy))
        report(f"linear dW + norms, torch {strategy}", ms, plain_ms, nbytes, mib)
    for config in fused_linear_plan.linear_candidates(
        dtype, capability, tf32, fused_linear_plan.linear_ragged(L, K, dtype, tf32)
    ):
        # what the fused Linear's backward launches for dW and its norms: the kernel and the finishing kernel
        ms, mib = measure(lambda: fused_linear.linear_weight_grad_finished(x, g, config))
        report(
            f"  kernel {config.block_l}x{config.block_k}x{config.block_t} w{config.num_warps} s{config.num_stages}",
            ms,
            plain_ms,
            nbytes,
            mib,
        )
    choice = fused_linear._linear_choice(x, g)  # the fused Linear's own timed choice
    print(f"{'  fused Linear picks':<44} {choice if isinstance(choice, str) else 'the kernel, ' + str(choice)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="compute dtype (default: bfloat16)",
    )
    parser.add_argument("--batch_size", type=int, default=12, help="B, examples (default: 12)")
    parser.add_argument("--block_size", type=int, default=1024, help="T, tokens per example (default: 1024)")
    parser.add_argument("--n_embd", type=int, default=768, help="D, model width (default: 768)")
    parser.add_argument("--vocab_size", type=int, default=50304, help="V, vocabulary (default: 50304)")
    args = parser.parse_args(argv)
    train_settings.set_training_precision()  # TF32 as train.py: the torch strategies timed as they train
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernels.py times the Triton kernels on a CUDA GPU and none is available here; "
            "on a CPU the kernels only run (slowly) in Triton's interpreter, tested by tests/test_layers_fused.py"
        )
    import fused_gns

    dtype = getattr(torch, args.dtype)
    reason = fused_gns.kernel_unavailable_reason(torch.empty(1, device="cuda", dtype=dtype))
    if reason is not None:
        sys.exit(f"bench/kernels.py: the fused kernels cannot run here: {reason}")
    B, T, D, V = args.batch_size, args.block_size, args.n_embd, args.vocab_size
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, B={B} T={T} D={D} V={V}")
    print(f"{'':<44} {'ms':>9} {'ratio':>8} {'GB/s':>9} {'peak MiB':>10}")
    bench_layernorm(B, T, D, dtype)
    for K, L in [(D, 3 * D), (D, D), (D, 4 * D), (4 * D, D), (D, V)]:  # c_attn, attn c_proj, c_fc, mlp c_proj, lm_head
        bench_linear_weight_grad(B, T, K, L, dtype)


if __name__ == "__main__":
    main()
