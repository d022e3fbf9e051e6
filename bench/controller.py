"""
Does following the GNS pay? Batch-size controllers (nanogns.schedules.BatchSizeController) against the fixed-batch
trade-off curve and the published schedules, on one task, one target loss, 3 seeds each (issue 38).

    python bench/controller.py                # the full run (bench/RESULTS.md): 14 min on one core of a shared machine
    python bench/controller.py --quick        # CI: the controller's pieces on a recorded GNS trace, resume, the LR and
                                              # beta2 couplings, and a tiny training of every method (~30 s)

The task: the small nanoGPT of bench/critical_batch.py (2 layers, 64 wide, character-level Shakespeare, 32-character
windows, all-layer `gns` norms, AdamW, one thread), trained until the loss on 256 fixed validation windows reaches
the target (2.35). No run repeats data: each seed reads the training text as disjoint windows in a seeded random
order, once (31,370 windows); a run that would need a second epoch is stopped and reported as not reaching the
target. (At issue 21's target, 2.20, batches of 256 and more need more than one epoch.)

1. The fixed-batch sweep (8 to 256), the learning rate tuned per batch size (critical_batch's grid: x0.5, 1, 2 of
   0.004 (B/32)^0.25, extended while the best is at an edge), constant LR after 10 warmup steps; the fit
   (S/S_min - 1)(E/E_min - 1) = 1 (critical_batch.fit_tradeoff), B_crit = E_min / S_min.
2. The reference: the sweep's batch nearest B_crit, its schedule tuned too (constant, or a cosine to 10% over 1, 2
   or 4 times the examples its constant-LR run needed, at 1 or 1.5 times its LR; seed 0), then every seed.
3. The methods, every seed, to the same target: the reference's linear ramp (Gray et al.'s code: 1 to 4 x B_ref / 4
   micro-batches over the reference's data, its LR unchanged), a Merrill-style doubling warmup (B_ref / 4 .. 4 B_ref,
   doubling at 5, 15, 35 and 60% of the reference's data, LR x sqrt(2) per doubling), Seesaw on the reference's
   cosine and on the cosine that decays within the run (batch x2 and LR x 1/sqrt(2) wherever the cosine halves, up
   to 512), the earlier `gns` rule (schedules.gns_steps, factor 1), and each controller rule ('sqrt' x1, x4, x8;
   'grow' capped at 4 and 16 x GNS on the reference's cosine; 'goodput' timing its own steps) with its couplings
   (LR, beta2 half-life in tokens, weight-decay timescale, Adam's second moment at a switch). The controllers'
   settings were chosen on calibration seeds (100, 101) before this run, never on its seeds.
4. Steps, tokens and modelled time under two throughput models: this CPU's step time vs batch (the median CPU time
   of every sweep step at each batch size, fitted t(B) = t0 + t1 B), and a data-parallel model (a step of up to
   `width` examples costs one unit); medians and ranges over seeds; issue 38's goal checked per seed; and the most
   any batch schedule can save under McCandlish et al.'s model for the GNS path the reference runs measured.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import critical_batch as cb  # noqa: E402

from nanogns import schedules  # noqa: E402
from nanogns.estimator import RunningGNS  # noqa: E402
from nanogns.monitor.tracked import summed_squares  # noqa: E402


@dataclasses.dataclass
class Task:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    target: float = 2.35
    lr_ref: float = 4e-3  # the sweep's grid: lr_grid x lr_ref (B / b_ref)^lr_exp (critical_batch.rule_lr)
    b_ref: int = 32
    lr_exp: float = 0.25
    lr_grid: tuple = (1.0, 0.5, 2.0)
    lr_extend: int = 1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    val_windows: int = 256
    max_steps: int = 6000
    batch_sizes: tuple = (8, 16, 32, 64, 128, 256)
    seeds: tuple = (0, 1, 2)
    micro: int = 4  # every variable batch is whole micro-batches of this many examples
    max_batch: int = 512
    ema_decay: float = 0.95
    horizons: tuple = (1.0, 2.0, 4.0)  # the reference's cosine horizons, x the examples its constant-LR run needed
    peak_mults: tuple = (1.0, 1.5)  # the reference's cosine peak LRs, x its tuned constant LR
    floor: float = 0.1  # the cosine's last value
    sqrt_factors: tuple = (1.0, 4.0, 8.0)  # the 'sqrt' rule's settings compared
    grow_caps: tuple = (4.0, 16.0)  # the 'grow' rule's caps (x GNS) compared
    width: int = 256  # the data-parallel model: a step of up to `width` examples costs one unit


FULL = Task()
QUICK = Task(
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    target=2.80,
    lr_grid=(1.0, 2.0),
    lr_extend=0,
    warmup_steps=5,
    val_windows=64,
    max_steps=400,
    batch_sizes=(8, 32, 128),
    seeds=(0,),
    max_batch=256,
    horizons=(1.0,),
    peak_mults=(1.0,),
    sqrt_factors=(1.0,),
    grow_caps=(4.0,),
    width=128,
)


# ---------------------------------------------------------------------------------------------------------------
# data read once per run: disjoint windows in a seeded order


class Stream:
    """The training text as disjoint windows of block_size (+1 for the targets), in a random order fixed by the
    seed, read in order; `take(n)` raises EOFError rather than start a second epoch."""

    def __init__(self, ids, block_size, seed):
        self.ids, self.block = ids, block_size
        starts = np.arange(0, len(ids) - block_size - 1, block_size)
        self.starts = np.random.default_rng([seed, 2024]).permutation(starts)
        self.pos = 0

    def take(self, n):
        if self.pos + n > len(self.starts):
            raise EOFError
        chosen = self.starts[self.pos : self.pos + n]
        self.pos += n
        return cb.windows(self.ids, chosen, self.block)


def cosine(examples, horizon, floor):
    """The decay factor a in [floor, 1] of a cosine over `horizon` examples (constant beyond it)."""
    x = min(examples / horizon, 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


# ---------------------------------------------------------------------------------------------------------------
# the methods: each step, decide() -> (B, lr before warmup, beta2, weight decay, Adam v scale); observe() the step


class Fixed:
    def __init__(self, B, lr, horizon=None, floor=0.1):
        self.B, self.lr, self.horizon, self.floor = B, lr, horizon, floor

    def decide(self, step, examples):
        a = cosine(examples, self.horizon, self.floor) if self.horizon else 1.0
        return self.B, self.lr * a, None, None, 1.0

    def observe(self, *args):
        pass


class LinearRamp(Fixed):
    """Gray et al.'s reference code: accumulation steps rising linearly from 1 to `top` micro-batches over
    `budget` examples (schedules.linear_points/interpolate as train.py's 'linear'), LR unchanged."""

    def __init__(self, micro, top, budget, lr, block_size):
        self.micro, self.top, self.lr, self.block = micro, top, lr, block_size
        self.points = schedules.linear_points(1, top, budget * block_size)

    def decide(self, step, examples):
        n = min(max(schedules.interpolate(self.points, examples * self.block), 1), self.top)
        return self.micro * n, self.lr, None, None, 1.0


class Doubling(Fixed):
    """Merrill et al. 2025 (OLMo-core's batch-size scheduler): the batch doubles at fixed points, LR x sqrt(2)."""

    def __init__(self, batches, at_examples, lr_of_first):
        self.batches, self.at, self.lr0 = batches, at_examples, lr_of_first

    def decide(self, step, examples):
        j = sum(examples >= a for a in self.at)
        B = self.batches[j]
        return B, self.lr0 * math.sqrt(B / self.batches[0]), None, None, 1.0


class Seesaw(Fixed):
    """Seesaw (arXiv 2510.14717) on a cosine: wherever the cosine has halved k times, the batch is 2^k B0 and the
    LR is lr0 a sqrt(2^k) (LR x 1/sqrt(2) per doubling instead of x 1/2), up to max_batch."""

    def __init__(self, B0, lr0, horizon, floor, max_batch):
        self.B0, self.lr0, self.horizon, self.floor, self.max_batch = B0, lr0, horizon, floor, max_batch

    def decide(self, step, examples):
        a = cosine(examples, self.horizon, self.floor)
        k = 2 ** min(math.floor(math.log2(1 / a) + 1e-9), int(math.log2(self.max_batch / self.B0)))
        return self.B0 * k, self.lr0 * a * math.sqrt(k), None, None, 1.0


class GnsRule(Fixed):
    """The earlier `--bs_schedule=gns` (schedules.gns_steps: B -> GNS, one micro-batch per step), the sweep's
    tuned LR interpolated in log B (as bench/critical_batch.py runs it)."""

    def __init__(self, micro, max_steps, lr_of):
        self.micro, self.max_steps, self.lr_of, self.accum, self.gns = micro, max_steps, lr_of, 1, math.nan

    def decide(self, step, examples):
        self.accum = schedules.gns_steps(self.accum, self.gns, self.micro, 1.0, 1, self.max_steps, max_delta=1)
        B = self.micro * self.accum
        return B, self.lr_of(B), None, None, 1.0

    def observe(self, sq, pe, B, seconds, monitor_gns):
        self.gns = monitor_gns


class Controlled(Fixed):
    """A BatchSizeController on a base schedule (lr, and a cosine over `horizon` examples, or constant)."""

    def __init__(self, controller, lr, horizon=None, floor=0.1):
        self.controller, self.lr, self.horizon, self.floor = controller, lr, horizon, floor

    def decide(self, step, examples):
        a = cosine(examples, self.horizon, self.floor) if self.horizon else 1.0
        d = self.controller.decide(self.lr * a, a)
        return d.batch_size, d.lr, d.beta2, d.weight_decay, d.second_moment_scale

    def observe(self, sq, pe, B, seconds, monitor_gns):
        self.controller.observe(sq, pe, B, step_seconds=seconds)


# ---------------------------------------------------------------------------------------------------------------
# one training run


def train(task, data, seed, method, label="", max_steps=None):
    """Train with `method` until the validation loss reaches task.target (or max_steps, or the end of the epoch).
    Returns reached, steps, examples, tokens (interpolated at the crossing), cpu seconds, the per-step trace
    [(B, lr, cpu seconds)] and the evaluations [(step, examples, val loss, B, lr)]."""
    train_ids, val_ids, vocab = data
    model, optimizer, monitor, _ = cb.build(task, vocab, seed)
    stream = Stream(train_ids, task.block_size, seed)
    val_x, val_y = cb.windows(
        val_ids,
        np.random.default_rng(999).integers(len(val_ids) - task.block_size, size=task.val_windows),
        task.block_size,
    )

    @torch.no_grad()
    def val_loss():
        model.eval()
        loss = model(val_x, val_y)[1].item()
        model.train()
        return loss

    examples, cpu, loss_ema, last, next_eval = 0, 0.0, None, None, 1
    trace, curve, gns_steps = [], [], []
    result = dict(reached=False, steps=math.nan, examples=math.nan, tokens=math.nan, seed=seed, why="max_steps")
    for step in range(max_steps or task.max_steps):
        t0 = time.process_time()
        B, lr, beta2, wd, v_scale = method.decide(step, examples)
        lr *= min(1.0, (step + 1) / task.warmup_steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
            if beta2 is not None:
                g["betas"] = (g["betas"][0], beta2)
            if wd is not None and g["weight_decay"] != 0:
                g["weight_decay"] = wd
        if v_scale != 1.0:
            for state in optimizer.state.values():
                state["exp_avg_sq"].mul_(v_scale)
        try:
            x, y = stream.take(B)
        except EOFError:
            result["why"] = "epoch"
            break
        loss = model(x, y)[1]
        loss.backward()
        monitor.step(batch_size=B)
        sq, pe, _ = summed_squares(monitor.measurements)
        torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.process_time() - t0
        method.observe(sq, pe, B, seconds, monitor.gns)
        cpu += seconds
        examples += B
        trace.append((B, lr, seconds))
        gns_steps.append(dict(B=B, sq_norm=sq, pe_sqnorm=pe))
        lossf = loss.item()
        loss_ema = lossf if loss_ema is None else 0.9 * loss_ema + 0.1 * lossf
        done = step + 1
        near = loss_ema < task.target + 0.12
        if done >= next_eval or (near and done >= (last[0] if last else 0) * 1.02):
            v = val_loss()
            point = (done, examples, v, B, lr)
            curve.append(point)
            next_eval = max(done + 1, math.ceil(done * 1.15))
            if v <= task.target:
                frac = 1.0 if last is None else (last[2] - task.target) / (last[2] - v)
                s = done if last is None else last[0] + frac * (done - last[0])
                e = examples if last is None else last[1] + frac * (examples - last[1])
                result.update(reached=True, steps=s, examples=e, tokens=e * task.block_size, why="")
                break
            last = point
    result.update(cpu=cpu, wall=cpu, gns=monitor.gns, gns_ln=math.nan, trace=trace, curve=curve, label=label)
    result["gns_steps"] = gns_steps
    said = (
        f"step {result['steps']:.1f}, {result['tokens']:,.0f} tokens"
        if result["reached"]
        else f"not reached ({result['why']}, {len(trace)} steps, {examples:,} examples)"
    )
    print(f"  {label} seed {seed}: {said}, {cpu:.1f} cpu s", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------------
# the benchmark


def sweep(task, data):
    """critical_batch.sweep's grid, on this training: every fixed B, LR tuned with seeds[0], then the other seeds."""
    runs, grid = [], []
    for B in task.batch_sizes:
        best, trials = cb.tune_lr(
            task, B, lambda lr, bound: train(task, data, task.seeds[0], Fixed(B, lr), f"B={B} lr={lr:.2e}", bound)
        )
        grid += trials
        best = best or trials[-1]
        runs.append(best)
        for seed in task.seeds[1:]:
            r = train(task, data, seed, Fixed(B, best["lr"]), f"B={B} lr={best['lr']:.2e}")
            r.update(B=B, lr=best["lr"], mult=best["mult"])
            runs.append(r)
    return runs, grid


def tune_reference(task, data, B, lr, e_const, s_const):
    """The reference batch's schedule: constant (its sweep run: s_const steps, e_const examples) or a cosine over
    a horizon (x e_const) at a peak (x lr), seed 0; returns (best (peak, horizon or None), trials)."""
    best, trials = ((lr, None), s_const), []
    for peak in task.peak_mults:
        for h in task.horizons:
            r = train(task, data, task.seeds[0], Fixed(B, lr * peak, h * e_const, task.floor), f"ref cos x{peak} h{h}")
            trials.append(dict(peak=lr * peak, horizon=h * e_const, steps=r["steps"], tokens=r["tokens"]))
            if r["reached"] and r["steps"] < best[1]:
                best = ((lr * peak, h * e_const), r["steps"])
    return best[0], trials


def controller(task, rule, b_ref, **kw):
    return schedules.BatchSizeController(
        rule,
        micro_batch_size=task.micro,
        base_batch_size=b_ref,
        min_accum_steps=1,
        max_accum_steps=task.max_batch // task.micro,
        start_accum_steps=b_ref // task.micro,
        beta2=task.beta2,
        weight_decay=task.weight_decay,
        **kw,
    )


def methods(task, b_ref, lr_ref, cos, e_ref, lr_of):
    """{name: a function making a fresh method}: the reference, the published schedules and the controllers."""
    peak, horizon = cos if cos[1] is not None else (lr_ref, e_ref)  # Seesaw needs a decay: the best cosine
    ref_cos = cos[1] is not None
    m = {
        f"fixed B={b_ref}, const": lambda: Fixed(b_ref, lr_ref),
        f"fixed B={b_ref}, cosine": lambda: Fixed(b_ref, peak, horizon, task.floor),
        f"linear {task.micro}->{4 * b_ref}": lambda: LinearRamp(
            task.micro, 4 * b_ref // task.micro, e_ref, lr_ref, task.block_size
        ),
        f"doubling {b_ref // 4}->{4 * b_ref}": lambda: Doubling(
            [b_ref // 4, b_ref // 2, b_ref, 2 * b_ref, 4 * b_ref],
            [f * e_ref for f in (0.05, 0.15, 0.35, 0.6)],
            lr_ref / 2,
        ),
        f"seesaw B0={b_ref}": lambda: Seesaw(b_ref, peak, horizon, task.floor, task.max_batch),
        f"seesaw B0={b_ref}, short cosine": lambda: Seesaw(b_ref, lr_ref, e_ref, task.floor, task.max_batch),
        "gns rule (factor 1)": lambda: GnsRule(task.micro, task.max_batch // task.micro, lr_of),
    }
    for f in task.sqrt_factors:
        m[f"ctl sqrt x{f:g}"] = lambda f=f: Controlled(controller(task, "sqrt", b_ref, factor=f), lr_ref)
    for c in task.grow_caps:
        m[f"ctl grow cap {c:g}"] = lambda c=c: Controlled(
            controller(task, "grow", b_ref, cap=c), peak, horizon, task.floor
        )
    m["ctl goodput"] = lambda: Controlled(controller(task, "goodput", b_ref), lr_ref)
    return m, ("cosine" if ref_cos else "const")


def mccandlish_bound(fit, run, B):
    """The most any batch schedule can save under McCandlish et al.'s model, for a GNS that moves as this run's did.

    `run` trained at the fixed batch B; its running GNS per step (estimator.RunningGNS, decay 0.95, from the
    recorded norms) gives the shape of B_noise along the way, scaled so that its mean over progress is the fit's
    B_crit (E_min = S_min mean(B_noise)); progress per step is 1 / (1 + B_noise / B). Steps and examples per unit
    of progress are S_min (1 + B_noise / B(p)) and S_min (B(p) + B_noise); at the fixed batch's examples the
    fewest steps come from B(p) = sqrt(B_noise / lambda), with S = S_min (1 + mean(sqrt B_noise)^2 / B). Returns
    (that S / the fixed batch's S, mean(sqrt B_noise)^2 / mean(B_noise)) (both 1 for a GNS that never moves).
    """
    gns, run_gns = [], RunningGNS(0.95)
    for s in run["gns_steps"]:
        g = run_gns.update(s["sq_norm"], s["pe_sqnorm"], s["B"])
        gns.append(g if math.isfinite(g) and g > 0 else math.nan)
    g = np.array(gns)
    g = np.where(np.isfinite(g), g, np.nanmin(g))  # the first steps (no estimate yet): the smallest seen
    scale = fit["B_crit"] / g.mean()
    for _ in range(50):  # progress-weighted mean of scale x GNS = B_crit
        w = 1 / (1 + scale * g / B)
        scale = fit["B_crit"] / (np.sum(w * g) / np.sum(w))
    bn, w = scale * g, 1 / (1 + scale * g / B)
    mean_sqrt = np.sum(w * np.sqrt(bn)) / np.sum(w)
    concentration = mean_sqrt**2 / fit["B_crit"]
    return float((1 + mean_sqrt**2 / B) / (1 + fit["B_crit"] / B)), float(concentration)


def throughput_models(task, runs):
    """This CPU: t(B) = t0 + t1 B fitted to the median per-step CPU time at each sweep batch size."""
    per_B = {}
    for r in runs:
        per_B.setdefault(r["B"], []).extend(s for _, _, s in r["trace"][task.warmup_steps :])
    Bs = sorted(per_B)
    med = [float(np.median(per_B[b])) for b in Bs]
    t1, t0 = np.polyfit(Bs, med, 1)
    return dict(t0=float(t0), t1=float(t1), per_B=dict(zip(Bs, med)))


def modelled(task, r, cpu_model):
    """(CPU seconds by the fitted model, data-parallel units) of a run's steps up to the target."""
    n = int(math.ceil(r["steps"])) if r["reached"] else len(r["trace"])
    Bs = np.array([b for b, _, _ in r["trace"][:n]], dtype=np.float64)
    return float(np.sum(cpu_model["t0"] + cpu_model["t1"] * Bs)), float(np.sum(np.ceil(Bs / task.width)))


def summarize(task, results, fit, cpu_model, ref_name):
    """One row per method (medians and ranges over seeds) and the goal per seed against the reference."""
    ref = {r["seed"]: r for r in results[ref_name]}
    rows = []
    for name, rs in results.items():
        ok = [r for r in rs if r["reached"]]
        for r in rs:
            r["cpu_model_s"], r["dp_units"] = modelled(task, r, cpu_model)
            S, E = r["steps"], r["examples"]
            r["inside"] = (S / fit["S_min"] - 1) * (E / fit["E_min"] - 1) if r["reached"] else math.nan
            base = ref.get(r["seed"])
            r["steps_ratio"] = S / base["steps"] if base and base["reached"] else math.nan
            r["tokens_ratio"] = E / base["examples"] if base and base["reached"] else math.nan
            r["goal"] = bool(
                r["reached"] and r["steps_ratio"] <= 0.7 and r["tokens_ratio"] <= 1.0 and r["inside"] <= 0.5
            )

        def stat(k):
            v = [r[k] for r in ok]
            return (float(np.median(v)), min(v), max(v)) if v else (math.nan,) * 3

        rows.append(
            dict(
                name=name,
                runs=len(rs),
                reached=len(ok),
                **{k: stat(k) for k in ("steps", "tokens", "cpu_model_s", "dp_units", "inside")},
                **{k: stat(k) for k in ("steps_ratio", "tokens_ratio")},
                goal=sum(r["goal"] for r in rs),
            )
        )
    return rows


def report(task, fit, cpu_model, rows, ref_name):
    f = lambda t, fmt: f"{t[0]:{fmt}} [{t[1]:{fmt}}, {t[2]:{fmt}}]"  # noqa: E731
    lines = [
        f"target validation loss {task.target}; fit S_min = {fit['S_min']:.1f} steps, E_min = {fit['E_min']:,.0f} "
        f"examples ({fit['E_min'] * task.block_size:,.0f} tokens), B_crit = {fit['B_crit']:.1f}, rms {fit['rms']:.3f}",
        f"CPU step time t(B) = {cpu_model['t0'] * 1e3:.2f} ms + {cpu_model['t1'] * 1e3:.3f} ms x B; data-parallel: "
        f"one unit per step of up to {task.width} examples",
        f"reference: {ref_name}; goal per seed: steps <= 0.7 x and tokens <= 1.0 x the reference's, "
        f"(S/S_min - 1)(E/E_min - 1) <= 0.5",
        f"{'method':28s} reached  {'steps':22s} {'tokens':30s} {'x ref steps':20s} {'x ref tokens':20s} "
        f"{'(S/Smin-1)(E/Emin-1)':22s} {'CPU model s':22s} {'DP units':20s} goal",
    ]
    for r in rows:
        lines.append(
            f"{r['name']:28s} {r['reached']}/{r['runs']}  {f(r['steps'], '6.0f'):22s} {f(r['tokens'], '9,.0f'):30s} "
            f"{f(r['steps_ratio'], '.2f'):20s} {f(r['tokens_ratio'], '.2f'):20s} {f(r['inside'], '.2f'):22s} "
            f"{f(r['cpu_model_s'], '6.1f'):22s} {f(r['dp_units'], '5.0f'):20s} {r['goal']}/{r['runs']}"
        )
    return "\n".join(lines)


def figures(task, sweep_runs, fit, results, out_dir, ref_name=None):
    """steps_vs_tokens.png (every method on the fixed-batch curve) and trajectories.png (batch and LR vs tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    T = task.block_size
    fig, ax = plt.subplots(figsize=(7, 5), dpi=90)
    ok = [r for r in sweep_runs if r["reached"]]
    ax.scatter([r["examples"] * T for r in ok], [r["steps"] for r in ok], c="lightgray", s=14, label="fixed B (sweep)")
    bb = np.geomspace(min(task.batch_sizes) / 4, max(task.batch_sizes) * 4, 200)
    s = fit["S_min"] + fit["E_min"] / bb
    ax.plot(bb * s * T, s, "k-", lw=1, label="fit: S = S_min + E_min/B")
    e = np.geomspace(fit["E_min"] * 1.05, fit["E_min"] * 20, 200)  # the goal's boundary: (S/Smin-1)(E/Emin-1) = 0.5
    ax.plot(e * T, fit["S_min"] * (1 + 0.5 / (e / fit["E_min"] - 1)), "k:", lw=1, label="(S/Smin-1)(E/Emin-1) = 0.5")
    if ref_name in results:  # the goal, against the reference's median: at most 70% of its steps, no more tokens
        ref = [r for r in results[ref_name] if r["reached"]]
        s_ref, e_ref = np.median([r["steps"] for r in ref]), np.median([r["examples"] for r in ref])
        ax.fill_between(
            [fit["E_min"] * T, e_ref * T], 1, 0.7 * s_ref, color="g", alpha=0.12, label="goal (median ref.)"
        )
    markers, colors = "osD^v<>phX*Pd", plt.get_cmap("tab20")
    for i, (name, rs) in enumerate(results.items()):
        pts = [(r["examples"] * T, r["steps"]) for r in rs if r["reached"]]
        if pts:
            ax.scatter(*zip(*pts), marker=markers[i % len(markers)], color=colors(i % 20), s=30, label=name, zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="tokens to target", ylabel="optimizer steps to target")
    ax.set_ylim(0.8 * fit["S_min"], None)
    ax.set_title(f"val loss {task.target}: every seed of every method", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "steps_vs_tokens.png"))
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=80)
    for i, (name, rs) in enumerate(results.items()):
        r = rs[0]
        tokens = np.cumsum([b for b, _, _ in r["trace"]]) * T
        color = plt.get_cmap("tab20")(i % 20)
        axes[0].plot(tokens, [b for b, _, _ in r["trace"]], lw=1, label=name, color=color)
        axes[1].plot(tokens, [lr for _, lr, _ in r["trace"]], lw=1, color=color)
    axes[0].axhline(fit["B_crit"], color="k", ls=":", lw=1, label=f"B_crit {fit['B_crit']:.0f}")
    axes[0].set(
        xscale="log", yscale="log", xlabel="tokens", ylabel="batch size (examples)", title=f"seed {task.seeds[0]}"
    )
    axes[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="learning rate (with warmup)")
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "trajectories.png"))
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------------------------
# the pieces, checked on a recorded GNS trace (CI: --quick)


def recorded_trace():
    """A recorded GNS trace: bench/figures/controller/gns_trace.json (the full run's seed-0 'sqrt x1' run: per step
    B and the summed squared norms), or, before any full run, a synthetic one with the same shape (GNS rising
    from ~2 to ~40 over 300 steps)."""
    path = os.path.join(REPO, "bench", "figures", "controller", "gns_trace.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["steps"]
    rng = np.random.default_rng(0)
    steps = []
    for i in range(300):
        gns = 2 + 38 * min(1.0, i / 200)
        gtg = 1.0 / (1 + i / 50)
        B = 16
        sq = gtg + gns * gtg / B * rng.chisquare(8) / 8  # |g_B|^2 = |G|^2 + tr(Sigma)/B, noisy
        pe = gtg + gns * gtg * rng.chisquare(8) / 8  # mean_i |g_i|^2 = |G|^2 + tr(Sigma)
        steps.append(dict(B=B, sq_norm=float(sq), pe_sqnorm=float(pe)))
    return steps


def check_pieces():
    """The controller's decisions on the recorded trace, its resume, and the couplings; raises AssertionError."""
    trace = recorded_trace()
    checks = []
    for rule, kw in (("sqrt", dict(factor=1.0)), ("grow", dict(cap=4.0)), ("goodput", {})):
        ctl = schedules.BatchSizeController(
            rule, micro_batch_size=4, base_batch_size=64, max_accum_steps=128, beta2=0.99, weight_decay=0.1, **kw
        )
        decisions, half = [], len(trace) // 2
        for i, s in enumerate(trace):
            if i == half:  # a resume: the state dict through JSON, as a checkpoint would carry it
                saved = json.loads(json.dumps(ctl.state_dict()))
            decay = cosine(i, len(trace), 0.1)
            d = ctl.decide(4e-3 * decay, decay)
            decisions.append(d)
            ctl.observe(s["sq_norm"], s["pe_sqnorm"], s["B"])  # the recorded step's norms
            ctl.observe_time(d.batch_size, 0.002 + 0.0003 * d.batch_size)  # the decided batch's time, t(B) known
        twin = schedules.BatchSizeController(
            rule, micro_batch_size=4, base_batch_size=64, max_accum_steps=128, beta2=0.99, weight_decay=0.1, **kw
        )
        twin.load_state_dict(saved)
        twin_decisions = []
        for i, s in enumerate(trace[half:], half):
            decay = cosine(i, len(trace), 0.1)
            d = twin.decide(4e-3 * decay, decay)
            twin_decisions.append(d)
            twin.observe(s["sq_norm"], s["pe_sqnorm"], s["B"])
            twin.observe_time(d.batch_size, 0.002 + 0.0003 * d.batch_size)
        assert twin_decisions == decisions[half:], f"{rule}: resumed decisions differ"
        batches = [d.batch_size for d in decisions]
        assert all(b % 4 == 0 and 4 <= b <= 512 for b in batches), rule
        switches = sum(d.switched for d in decisions)
        assert switches < len(trace) // 4, f"{rule}: {switches} switches in {len(trace)} steps: no hysteresis"
        for i, d in enumerate(decisions):  # the couplings
            assert d.beta2 == 0.99 ** (d.batch_size / 64)
            half_life_tokens = math.log(0.5) / math.log(d.beta2) * d.batch_size
            assert abs(half_life_tokens - math.log(0.5) / math.log(0.99) * 64) < 1e-6 * half_life_tokens
            mult = d.lr / (4e-3 * cosine(i, len(trace), 0.1))  # the LR's multiplier for this batch
            if rule == "grow":
                assert (
                    abs(mult - math.sqrt(d.batch_size / 64)) < 1e-9
                    and mult <= 1 / math.sqrt(cosine(i, len(trace), 0.1)) + 1e-9
                )
            assert abs(d.weight_decay * mult - 0.1 * d.batch_size / 64) < 1e-9  # B / (lr wd) constant
        if rule == "goodput":  # Pollux's optimum of t(B) = 0.002 + 0.0003 B is B* = sqrt(t0 GNS / t1), so each batch
            for d in decisions[20:]:  # is within the hysteresis band (and a micro-batch of rounding) of it
                best = math.sqrt(0.002 * d.gns / 0.0003)
                assert abs(d.batch_size - best) <= 0.1 * d.batch_size + 8, (d.batch_size, best)
        checks.append((rule, batches[0], batches[len(batches) // 2], batches[-1], switches))
    # the LR coupling: sqrt below the GNS, held above it
    ctl = schedules.BatchSizeController("sqrt", micro_batch_size=4, base_batch_size=16, max_accum_steps=64)
    for s in trace:
        ctl.observe(s["sq_norm"], s["pe_sqnorm"], s["B"])
    gns = ctl.gns
    below, above = 16 * 0.5, 16 * 100
    assert gns > 8 and ctl.lr_multiplier(int(below)) == math.sqrt(below / min(16, gns))  # sqrt below the GNS
    assert ctl.lr_multiplier(int(above)) == ctl.lr_multiplier(int(4 * above)), "LR not held above the GNS"
    assert ctl.lr_multiplier(int(above)) == math.sqrt(gns / min(16, gns))  # held at the GNS
    return checks


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the pieces on a recorded trace and a tiny run of each method")
    p.add_argument("--out_dir", default=None, help="default: bench/figures/controller (--quick: out-controller-quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1; step times are CPU times)")
    p.add_argument(
        "--clock", choices=["cpu"], default="cpu", help="step times: process CPU time (the machine is shared)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = QUICK if args.quick else FULL
    out_dir = args.out_dir or os.path.join(REPO, "out-controller-quick" if args.quick else "bench/figures/controller")
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    pieces = check_pieces()
    for rule, first, mid, last, switches in pieces:
        print(
            f"pieces: {rule}: batch {first} -> {mid} -> {last} on the recorded trace, {switches} switches; resume "
            "exact; beta2 half-life and weight-decay timescale held",
            flush=True,
        )
    data = cb.load_shakespeare()
    print(f"task: {task}", flush=True)
    runs, grid = sweep(task, data)
    with warnings.catch_warnings():  # (no LayerNorm-only GNS here: critical_batch's column stays NaN)
        warnings.simplefilter("ignore", RuntimeWarning)
        summary = cb.summarize_sweep(task, runs)
    fit = summary["fit"]
    b_ref = min(task.batch_sizes, key=lambda b: abs(math.log(b / fit["B_crit"])))
    row = next(t for t in summary["table"] if t["B"] == b_ref)
    ref0 = next(r for r in runs if r["B"] == b_ref and r["seed"] == task.seeds[0])
    print(f"fit: S_min {fit['S_min']:.1f}, E_min {fit['E_min']:,.0f}, B_crit {fit['B_crit']:.1f}; reference B={b_ref}")
    cos, trials = tune_reference(task, data, b_ref, row["lr"], ref0["examples"], ref0["steps"])
    lr_of = cb.interpolated_lr({t["B"]: t["lr"] for t in summary["table"]})
    made, kind = methods(task, b_ref, row["lr"], cos, ref0["examples"], lr_of)
    ref_name = f"fixed B={b_ref}, {kind}"
    results = {}
    for name, make in made.items():
        if name == f"fixed B={b_ref}, const":  # the sweep's own runs
            results[name] = [r for r in runs if r["B"] == b_ref]
            continue
        results[name] = [train(task, data, seed, make(), name) for seed in task.seeds]
    cpu_model = throughput_models(task, runs)
    rows = summarize(task, results, fit, cpu_model, ref_name)
    bounds = [mccandlish_bound(fit, r, b_ref) for r in runs if r["B"] == b_ref]
    text = report(task, fit, cpu_model, rows, ref_name)
    text += (
        f"\nMcCandlish's model with the GNS path of the fixed B={b_ref} runs: at their data, the best batch schedule "
        f"takes {', '.join(f'{b:.3f}' for b, _ in bounds)} x their steps (mean(sqrt B_noise)^2 / mean(B_noise) = "
        f"{', '.join(f'{c:.3f}' for _, c in bounds)})"
    )
    print(text)
    paths = figures(task, runs, fit, results, out_dir, ref_name)
    if not args.quick:  # the recorded trace the quick check replays
        r = results[f"ctl sqrt x{task.sqrt_factors[0]:g}"][0]
        with open(os.path.join(out_dir, "gns_trace.json"), "w") as f:
            json.dump(dict(source="seed 0 of 'ctl sqrt' in the full run", steps=r.get("gns_steps", [])), f)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(
            dict(
                task=dataclasses.asdict(task),
                fit=fit,
                sweep=summary["table"],
                sweep_runs=[{k: r[k] for k in ("B", "lr", "seed", "reached", "steps", "examples")} for r in runs],
                reference=dict(name=ref_name, lr=row["lr"], cosine=cos, trials=trials),
                cpu_model=cpu_model,
                mccandlish_bound=bounds,
                rows=rows,
                runs={
                    n: [{k: v for k, v in r.items() if k not in ("curve", "gns_steps")} for r in rs]
                    for n, rs in results.items()
                },
            ),
            f,
            default=float,
        )
    print(f"figures: {', '.join(os.path.relpath(q, REPO) for q in paths)}; total {time.time() - t_start:.0f}s")
    return dict(fit=fit, rows=rows, pieces=pieces, figures=paths, report=text, reference=ref_name, bounds=bounds)


if __name__ == "__main__":
    main()
