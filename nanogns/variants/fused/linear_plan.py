"""
The fused Linear's launch plans, pure functions of shapes, dtype and the GPU's capability and SM count (so that
bench/compile_gate.py compiles every one without a GPU): the candidate tiles and which spill, shared memory,
and `linear_split`, a cost model of the GPU's waves deciding which rows of dW tiles one program owns whole and
which are split into chunks of examples.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanogns.core.matmul import simultaneous_uses_gram
from nanogns.variants.fused import runtime
from nanogns.variants.fused.runtime import triton

# -----------------------------------------------------------------------------
# Linear


@dataclass(frozen=True)
class LinearConfig:
    """A launch configuration of _linear_bwd_dw_pe_sqnorm: tile of dW, rows per step, warps, pipeline stages."""

    block_l: int
    block_k: int
    block_t: int
    num_warps: int
    num_stages: int

    def shared_bytes(self, element_size):
        """Shared memory the pipeline's operand buffers take: num_stages x (g and x row blocks)."""
        return self.num_stages * self.block_t * (self.block_l + self.block_k) * element_size


# Autotune candidates by tl.dot flavour, largest tiles first: the tile/warp/stage range of fast Triton matmuls
# on A100/H100 (Triton's matmul tutorial). Each program holds two fp32 (BLOCK_L, BLOCK_K) accumulators, dW_i and
# dW, so a 128 x 128 tile needs 8 warps (64 + 64 registers per thread for them). fp32 "ieee" is a CUDA-core FMA
# dot whose operands also sit in registers: smaller row blocks. Every candidate compiles for sm_80 and sm_90
# with no spills (bench/compile_gate.py, run by tests/test_bench_compile_gate.py).
LINEAR_CANDIDATES = {
    "16-bit": (
        LinearConfig(128, 128, 64, 8, 3),
        LinearConfig(128, 128, 32, 8, 4),
        LinearConfig(128, 64, 64, 8, 4),
        LinearConfig(64, 128, 64, 8, 4),
        LinearConfig(64, 64, 64, 4, 4),
    ),
    "tf32": (
        LinearConfig(128, 128, 32, 8, 3),
        LinearConfig(128, 64, 32, 8, 3),
        LinearConfig(64, 128, 32, 8, 3),
        LinearConfig(64, 64, 32, 4, 3),
    ),
    "ieee": (LinearConfig(128, 128, 16, 8, 2), LinearConfig(64, 64, 32, 4, 3)),
}
# With a ragged width (not a multiple of 16) given unmasked, the rows of the output gradient (L) or of the input
# (K) are not 16-byte aligned, their loads are not vectorised and take more registers: these configurations then
# spill (bench/compile_gate.py, sm_80 or sm_90), so they are not candidates
_RAGGED_ONE_SPILLS = {("16-bit", LinearConfig(128, 128, 64, 8, 3)), ("ieee", LinearConfig(64, 64, 32, 4, 3))}
RAGGED_SPILLS = {
    ("L",): _RAGGED_ONE_SPILLS,
    ("K",): _RAGGED_ONE_SPILLS,
    ("L", "K"): _RAGGED_ONE_SPILLS
    | {
        ("16-bit", LinearConfig(128, 128, 32, 8, 4)),
        ("16-bit", LinearConfig(64, 64, 64, 4, 4)),
        ("tf32", LinearConfig(128, 128, 32, 8, 3)),
    },
}
# largest dynamic shared memory per block (bytes) by compute capability; unknown ones get the smallest listed
_SHARED_MEMORY_LIMIT = {
    (7, 0): 98304,
    (7, 5): 65536,
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
}


def shared_memory_limit(capability):
    return _SHARED_MEMORY_LIMIT.get(tuple(capability), min(_SHARED_MEMORY_LIMIT.values()))


def linear_dot_precision(dtype, allow_tf32):
    """The tl.dot flavour for operands of `dtype`: '16-bit' (tensor cores), 'tf32' or 'ieee' (fp32 FMA)."""
    if dtype != torch.float32:
        return "16-bit"
    return "tf32" if allow_tf32 else "ieee"


def _unspilled(precision, ragged):
    """LINEAR_CANDIDATES of a dot flavour that compile without spills with the widths `ragged` masked."""
    return [c for c in LINEAR_CANDIDATES[precision] if (precision, c) not in RAGGED_SPILLS.get(ragged, ())]


def linear_ragged(L, K, dtype, allow_tf32):
    """The Linear kernel's widths given to it unpadded, masked in the kernel: ("L",), ("K",), ("L", "K") or ().
    A width is ragged when it is not a multiple of 16 (from 16 on: a 50257 vocabulary, no 1.2 GB padded copy per
    step); below 16 it is zero-padded, as is a ragged K should RAGGED_SPILLS leave no candidate with both
    masked."""
    ragged = tuple(name for name, width in (("L", L), ("K", K)) if width >= 16 and width % 16)
    if ragged == ("L", "K") and not _unspilled(linear_dot_precision(dtype, allow_tf32), ragged):
        return ("L",)
    return ragged


def linear_candidates(dtype, capability, allow_tf32, ragged=()):
    """The launch configurations the glue may time for `dtype` on a GPU of `capability` (major, minor):
    LINEAR_CANDIDATES of its dot flavour whose pipeline buffers fit the GPU's shared memory with a 10% margin,
    without those that spill with the widths `ragged` (linear_ragged) masked (RAGGED_SPILLS)."""
    limit = 0.9 * shared_memory_limit(capability)
    candidates = _unspilled(linear_dot_precision(dtype, allow_tf32), tuple(ragged))
    return [c for c in candidates if c.shared_bytes(dtype.itemsize) <= limit] or [candidates[-1]]


def linear_tile_grid(L, K, config):
    """(rows, columns) of dW tiles, L and K padded to multiples of 16 as the kernel sees them (a masked ragged
    width gives the same count)."""
    return triton.cdiv(triton.cdiv(L, 16) * 16, config.block_l), triton.cdiv(triton.cdiv(K, 16) * 16, config.block_k)


def linear_tiles(L, K, config):
    """dW tiles of a (L, K) weight (linear_tile_grid's rows x columns)."""
    tiles_l, tiles_k = linear_tile_grid(L, K, config)
    return tiles_l * tiles_k


def linear_default_config(N, T, K, L, dtype, capability, sm_count, allow_tf32, allow_gram=True):
    """The untimed choice (under torch.compile): 'gram' where the gns Linear's rule prefers it on a GPU, else the
    largest-tile candidate whose tiles alone give every SM a program (chunks of examples fill the rest)."""
    if allow_gram and simultaneous_uses_gram(T, K, L, 4, "cuda"):  # torch strategies work in float32
        return "gram"
    candidates = linear_candidates(dtype, capability, allow_tf32, linear_ragged(L, K, dtype, allow_tf32))
    return next((c for c in candidates if linear_tiles(L, K, c) >= sm_count), candidates[-1])


def _interpreter_linear_config(T, L, K):
    """Triton's interpreter (CPU): large blocks mean fewer (slow, Python-level) programs and steps (up to
    512 x 512 tiles: 8x faster than 128 x 128 on a 768 -> 1000 layer); tl.dot needs blocks >= 16."""
    return LinearConfig(
        min(512, max(16, triton.next_power_of_2(L))),
        min(512, max(16, triton.next_power_of_2(K))),
        min(64, max(16, triton.next_power_of_2(T))),
        4,
        1,
    )


# A cost model of the kernel on a GPU, for choosing how to split examples (H100 SXM spec sheet, per SM: dense
# tensor-core FLOP/s by dot flavour; HBM bytes/s); only the ratios matter, and A100's are alike
SM_FLOPS = {"16-bit": 989e12 / 132, "tf32": 494e12 / 132, "ieee": 67e12 / 132}
MEMORY_BYTES_PER_S = 3.35e12
_REGISTERS_PER_SM = 65536


def linear_blocks_per_sm(config, element_size, capability):
    """Programs of `config` one SM holds at once, an estimate: its shared memory (pipeline buffers) and its
    registers (two fp32 accumulator tiles spread over the threads, plus about 64 per thread for the rest,
    at most 255; 128 x 128 tiles on 8 warps: 192 registers, one program per SM)."""
    threads = 32 * config.num_warps
    registers = min(255, 2 * config.block_l * config.block_k // threads + 64)
    by_registers = _REGISTERS_PER_SM // (registers * threads)
    by_shared = int(shared_memory_limit(capability) // max(1, config.shared_bytes(element_size)))
    return max(1, min(by_registers, by_shared))


def wave_efficiency(programs, slots):
    """Share of the GPU's program slots busy over the waves `programs` take (1.0: every wave full)."""
    return programs / (triton.cdiv(programs, slots) * slots) if programs else 1.0


class LinearSplit(NamedTuple):
    """How _linear_bwd_dw_pe_sqnorm's programs share dW: the first `front_rows` rows of tiles each owned by one program
    (all examples; dW written in its dtype), every tile after them split over `chunks` programs of `per_chunk`
    examples, each writing an fp32 partial that the finishing kernel sums."""

    front_rows: int
    chunks: int
    per_chunk: int


def makespan(programs, slots):
    """Time for `slots` program slots to run `programs`, [(count, duration), ...] in launch order, each slot
    taking the next program when it frees (the GPU's block scheduler as a list schedule)."""
    free = {0.0: slots}  # time -> slots free from then on
    for count, duration in programs:
        while count:
            t = min(free)
            taken = min(free[t], count)
            free[t] -= taken
            if not free[t]:
                del free[t]
            free[t + duration] = free.get(t + duration, 0) + taken
            count -= taken
    return max(free)


def plan_linear_split(N, tiles_l, tiles_k, slots, example_tile_s, row_partial_s):
    """The LinearSplit of N examples over tiles_l x tiles_k dW tiles on `slots` program slots minimising the
    modelled time: the makespan of the programs (an owned tile takes N x example_tile_s, one program's work on
    one example; a split one per_chunk x example_tile_s), plus, per chunk, the fp32 partials of the split rows
    written and read back (row_partial_s per row of tiles). Owned rows are tried up to each full wave
    (w x slots tiles); ties go to fewer chunks, then to more owned rows."""
    tiles = tiles_l * tiles_k
    fronts = {0} | {min(tiles_l, w * slots // tiles_k) for w in range(1, tiles // slots + 1)}
    best = None
    for per_chunk in sorted({triton.cdiv(N, c) for c in range(1, N + 1)}, reverse=True):
        chunks = triton.cdiv(N, per_chunk)
        for front in sorted(f for f in fronts if f < tiles_l) if chunks > 1 else [tiles_l]:
            split_tiles = (tiles_l - front) * tiles_k
            time = makespan(
                [(front * tiles_k, N * example_tile_s), (split_tiles * chunks, per_chunk * example_tile_s)], slots
            )
            time += chunks * (tiles_l - front) * row_partial_s if chunks > 1 else 0.0
            if (
                best is None
                or time < best[0] * (1 - 1e-9)
                or (time <= best[0] * (1 + 1e-9) and best[1].chunks == chunks and front > best[1].front_rows)
            ):
                best = (time, LinearSplit(front, chunks, per_chunk))
    return best[1]


def split_busy_share(N, tiles_l, tiles_k, slots, split):
    """Share of the slots' time busy with work under `split` (1.0: every wave full; partials not counted)."""
    front, chunks, per_chunk = split
    programs = [(front * tiles_k, N), ((tiles_l - front) * tiles_k * chunks, per_chunk)]
    return N * tiles_l * tiles_k / (makespan(programs, slots) * slots) if N and tiles_l * tiles_k else 1.0


@functools.lru_cache(maxsize=1024)
def linear_split(N, T, K, L, config, dtype, allow_tf32, capability, sm_count):
    """The LinearSplit of _linear_bwd_dw_pe_sqnorm on a GPU of sm_count SMs (plan_linear_split with the cost model
    above); every tile owned on the CPU (sm_count None)."""
    tiles_l, tiles_k = linear_tile_grid(L, K, config)
    if sm_count is None or N == 0:
        return LinearSplit(tiles_l, 1, N)
    slots = sm_count * linear_blocks_per_sm(config, dtype.itemsize, capability)
    example_tile_s = 2 * T * config.block_l * config.block_k / SM_FLOPS[linear_dot_precision(dtype, allow_tf32)]
    row_partial_s = 2 * 4 * config.block_l * K / MEMORY_BYTES_PER_S  # fp32 written by the kernel, read by the sum
    return plan_linear_split(N, tiles_l, tiles_k, slots, example_tile_s, row_partial_s)


def _linear_plan(N, T, K, L, config, dtype, tf32, device):
    """The LinearSplit for this GPU (linear_split, tf32 as the kernel's dots); every tile owned on the CPU."""
    sm_count = runtime._sm_count(device)
    capability = torch.cuda.get_device_capability(device) if sm_count is not None else None
    return linear_split(N, T, K, L, config, dtype, tf32, capability, sm_count)
