"""
The fused Linear kernel's work split on a GPU, a pure function of shapes and
the GPU (no GPU needed): rows of dW tiles owned whole by one program up to a
full wave, the rest split into chunks of examples so the last waves fill too
(one example's rows stay in one program, which is what keeps its norm exact),
for GPT-2 124M's Linear shapes on an H100 (132 SMs).

    python -m pytest -q tests/test_layers_fused_linear_plan.py
"""

import pytest
import torch

from nanogns.variants.fused import linear_plan as fused_linear_plan

GPT2 = {
    "c_attn": (768, 2304),
    "attn.c_proj": (768, 768),
    "c_fc": (768, 3072),
    "mlp.c_proj": (3072, 768),
    "lm_head": (768, 50304),
}
H100 = dict(capability=(9, 0), sm_count=132)
TILE = fused_linear_plan.LinearConfig(128, 128, 64, 8, 3)  # the first bf16 candidate: one program per SM


def old_rule(N, tiles, sm_count):
    """The split before issue 20: about two programs per SM, whatever an SM holds."""
    chunks = max(1, min(N, -(-2 * sm_count // tiles)))
    per_chunk = -(-N // chunks)
    return -(-N // per_chunk), per_chunk


def modelled_s(N, T, tiles_l, tiles_k, K, split, slots=132):
    """plan_linear_split's model of a split's time for TILE in bf16 (seconds)."""
    tile_s = 2 * T * 128 * 128 / fused_linear_plan.SM_FLOPS["16-bit"]
    front, chunks, per_chunk = split
    time = fused_linear_plan.makespan(
        [(front * tiles_k, N * tile_s), ((tiles_l - front) * tiles_k * chunks, per_chunk * tile_s)], slots
    )
    return time + (chunks * (tiles_l - front) * 8 * 128 * K / fused_linear_plan.MEMORY_BYTES_PER_S if chunks > 1 else 0)


def test_wave_efficiency_and_makespan():
    assert fused_linear_plan.wave_efficiency(132, 132) == 1.0
    assert fused_linear_plan.wave_efficiency(288, 132) == pytest.approx(288 / 396)  # 2.18 waves run as 3
    assert fused_linear_plan.wave_efficiency(0, 132) == 1.0
    assert fused_linear_plan.makespan([(288, 1.0)], 132) == 3.0
    # 132 owned tiles of 12 examples fill one wave; 144 split programs of 2 take 2 more units
    assert fused_linear_plan.makespan([(132, 12.0), (144, 2.0)], 132) == 16.0
    # 120 owned tiles leave 12 slots to the split programs meanwhile: 72 of them done by t = 12
    assert fused_linear_plan.makespan([(120, 12.0), (144, 2.0)], 132) == 14.0


def test_blocks_per_sm_estimate():
    assert fused_linear_plan.linear_blocks_per_sm(TILE, 2, (9, 0)) == 1  # two fp32 128 x 128 accumulators on 8 warps
    assert (
        fused_linear_plan.linear_blocks_per_sm(fused_linear_plan.LinearConfig(64, 64, 64, 4, 4), 2, (9, 0)) == 3
    )  # shared memory


@pytest.mark.parametrize("N", [8, 12, 16, 32])
@pytest.mark.parametrize("name", list(GPT2))
def test_gpt2_waves_on_132_sms(name, N):
    """At T = 1024 (bf16): the planned split is never slower in the model than the old rule or any split of every
    tile into equal chunks (what the planner did before rows could be owned whole), every example is in exactly
    one program per tile, and the block layers keep the slots at least 80% busy (93% or more for the MLP's)."""
    K, L = GPT2[name]
    T = 1024
    tiles_l, tiles_k = -(-L // 128), K // 128
    split = fused_linear_plan.linear_split(N, T, K, L, TILE, torch.bfloat16, True, **H100)
    front, chunks, per_chunk = split
    assert 0 <= front <= tiles_l and chunks * per_chunk >= N > (chunks - 1) * per_chunk
    assert chunks == 1 or front < tiles_l
    old = fused_linear_plan.LinearSplit(0, *old_rule(N, tiles_l * tiles_k, 132))
    uniform = [fused_linear_plan.LinearSplit(0, -(-N // p), p) for p in {-(-N // c) for c in range(1, N + 1)}]
    for other in [old, *uniform]:
        assert modelled_s(N, T, tiles_l, tiles_k, K, split) <= modelled_s(N, T, tiles_l, tiles_k, K, other) * (1 + 1e-9)
    busy = fused_linear_plan.split_busy_share(N, tiles_l, tiles_k, 132, split)
    assert busy >= (0.93 if name in ("c_fc", "mlp.c_proj") else 0.72), f"{name}: {split}: {busy:.3f}"


def test_c_fc_owns_a_full_wave_and_splits_the_rest():
    """The issue's example: c_fc was 288 programs = 2.18 waves run as 3 (73%), then 3 chunks of every tile (432
    programs, 82%, three fp32 partials of all of dW); now 22 rows of tiles (132 = one full wave) owned and the
    last 2 rows split into 6 chunks: 93.5% busy, partials of 2 rows of 24 only, and in the model 26% faster."""
    K, L = GPT2["c_fc"]
    split = fused_linear_plan.linear_split(12, 1024, K, L, TILE, torch.bfloat16, True, **H100)
    assert split == (22, 6, 2)
    assert fused_linear_plan.split_busy_share(12, 24, 6, 132, split) == pytest.approx(1728 / (14 * 132))
    before = modelled_s(12, 1024, 24, 6, K, fused_linear_plan.LinearSplit(0, 3, 4))
    assert modelled_s(12, 1024, 24, 6, K, split) < 0.75 * before


def test_cpu_and_empty_batches_own_every_tile():
    assert fused_linear_plan.linear_split(12, 1024, 768, 768, TILE, torch.bfloat16, True, (9, 0), None) == (6, 1, 12)
    assert fused_linear_plan.linear_split(0, 1024, 768, 768, TILE, torch.bfloat16, True, **H100) == (6, 1, 0)
    assert fused_linear_plan.plan_linear_split(1, 2, 2, 132, 1.0, 0.5) == (2, 1, 1)
