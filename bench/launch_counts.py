"""
Launches of one backward of a fused layer beside torch's own layer: a count,
not a time (each launch costs a few microseconds of GPU time however small).

    TRITON_INTERPRET=1 python bench/launch_counts.py      # on the CPU, kernels interpreted
    python bench/launch_counts.py --device=cuda

Counted: the aten ops the backward dispatches (seen by a TorchDispatchMode)
that launch work on a GPU, those inside the fused layers' custom ops
(nanogns::*) included, plus each Triton kernel launch (fused_runtime._launch,
wrapped here; ops the interpreter issues inside a launch are not counted).
Views, detach and allocations (empty*) launch nothing and are not counted.
tests/test_bench_launch_counts.py holds the fused counts at torch's + 2 (LayerNorm) and
torch's + 3 (Linear).
"""

import argparse
import collections
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nanogns.kinds.layernorm import FusedLayerNorm
from nanogns.kinds.linear import FusedLinear
from nanogns.kinds.rmsnorm import FusedRMSNorm
from nanogns.variants import fused as fused_gns  # noqa: E402
from nanogns.variants.fused import runtime as fused_runtime

# ops that allocate or describe memory and launch no kernel
NO_LAUNCH = {
    "aten.detach.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.lift_fresh.default",
    "aten._unsafe_view.default",
}


class LaunchCounter(TorchDispatchMode):
    """Counts launching aten ops by name, and Triton launches as 'triton:<kernel>' (while installed)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self._inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "nanogns":  # the fused layers' custom ops: count what they run, not the op
            with self:
                return fused_runtime.CUSTOM_OPS[func.name()](*args, **(kwargs or {}))
        if not self._inside_kernel and not func.is_view and str(func) not in NO_LAUNCH:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def total(self):
        return sum(self.counts.values())


def count_backward(layer, x, grad=None):
    """LaunchCounter of layer(x).backward(grad) (grad random) into empty .grad; the forward is not counted."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = layer(x)
    grad = torch.randn_like(y) if grad is None else grad
    counter = LaunchCounter()
    launch = fused_runtime._launch

    def counted_launch(kernel, *args, **kwargs):
        counter.counts[f"triton:{kernel.__name__}"] += 1
        counter._inside_kernel += 1  # the interpreter's own tensor copies are the kernel, not extra launches
        try:
            return launch(kernel, *args, **kwargs)
        finally:
            counter._inside_kernel -= 1

    fused_runtime._launch = counted_launch
    try:
        with counter:
            y.backward(grad)
    finally:
        fused_runtime._launch = launch
    return counter


def layer_pairs(D, L, device, dtype):
    """(label, torch layer, fused layer) with the same parameters."""
    pairs = [
        ("LayerNorm", torch.nn.LayerNorm(D), FusedLayerNorm(D)),
        ("LayerNorm no bias", torch.nn.LayerNorm(D, bias=False), FusedLayerNorm(D, bias=False)),
        ("RMSNorm", torch.nn.RMSNorm(D, eps=1e-6), FusedRMSNorm(D)),
        ("Linear", torch.nn.Linear(D, L), FusedLinear(D, L)),
        ("Linear no bias", torch.nn.Linear(D, L, bias=False), FusedLinear(D, L, bias=False)),
    ]
    for _, plain, fused in pairs:
        fused.load_state_dict(plain.state_dict())
        plain.to(device, dtype)
        fused.to(device, dtype)
    return pairs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (with TRITON_INTERPRET=1) or cuda (default: cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="default: float32"
    )
    parser.add_argument("--shape", default="3,5,48,40", help="N,T,D,L (default: 3,5,48,40; GPT-2: 12,1024,768,3072)")
    args = parser.parse_args(argv)
    N, T, D, L = (int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(N, T, D, device=args.device, dtype=dtype)
    reason = fused_gns.kernel_unavailable_reason(x)
    if reason is not None:  # the fused layers would run their torch fallback: its launches are not the kernels'
        sys.exit(f"bench/launch_counts.py: the fused kernels cannot run here ({reason}), so there is nothing to count")
    print(f"launches of one backward, {args.device} {args.dtype}, x ({N}, {T}, {D}), Linear {D} -> {L}")
    print("| layer | torch | fused | fused ops |")
    print("|---|---|---|---|")
    for label, plain, fused in layer_pairs(D, L, args.device, dtype):
        count_backward(fused, x)  # first call: one-time set-up (the finishing kernel's counter)
        torch_count, fused_count = count_backward(plain, x), count_backward(fused, x)
        ops = ", ".join(f"{name.replace('aten.', '')} {n}" for name, n in sorted(fused_count.counts.items()))
        print(f"| {label} | {torch_count.total()} | {fused_count.total()} | {ops} |")


if __name__ == "__main__":
    main()
