"""
Can a batch-size controller that knows neither the target nor the token budget match the best planned schedule where
batch growth pays? (issue 48; issue 38 asked it where it could not.)

    python bench/controller.py                       # the teacher task, in full (bench/RESULTS.md): ~20 CPU-minutes
    python bench/controller.py --task=shakespeare    # the progress-limited counterpoint (its certification fails)
    python bench/controller.py --quick               # CI: the controllers' pieces on a recorded GNS trace, resume,
                                                     # the couplings, and a tiny version of every step (~30 s)

Tasks. 'teacher' (bench/teacher_task.py): the project's 1-layer, 32-wide GPT learning an endless stream drawn from a
fixed random teacher, P(y | the last two inputs), vocabulary 16, 16-token windows, trained until its excess loss
over the teacher (exact KL on fixed validation windows) reaches the target: noise-dominated at the end, which the
certification checks before anything is scored. 'shakespeare': issue 38's task (2 layers, 64 wide, character-level
Shakespeare read once in a seeded order, validation loss 2.35), progress-limited.

1. The sweep (tuning seeds only): fixed batches 32 to 512; for each, the cosine (to `floor` x its peak over a horizon
   in tokens, after `warmup_steps`) tuned on a grid, the peak LR on a x sqrt(2) grid and the horizon on a x 1.5 grid,
   by coordinate search from the previous batch's best (`tune_cosine`): a candidate's score is its mean steps to the
   target over the tuning seeds; runs are stopped once they cannot win. The fit S = S_min + E_min / B
   (critical_batch.fit_tradeoff) gives B_crit = E_min / S_min; the reference is the tuned cosine at the sweep's batch
   nearest B_crit (in log B). A constant LR at that batch is tuned the same way.
2. The certification (printed before any score): the constant LR needs at least 2x the reference's steps or never
   reaches the target; the reference crosses the target in the last 30% of its decay; its GNS grows at least 10x
   from the end of the first plateau (the GNS's lowest point after its first peak) to the target.
3. Every method on the scored seeds (0-4), to the same target, with the same data order per seed: the reference, the
   constant LR, Seesaw and Merrill et al.'s doubling (planned: they follow the reference's cosine), the earlier rules
   (`gns`, `sqrt`, `grow`, `goodput`, on the reference's cosine), and the new controller ('temper', told neither the
   target nor the budget: a constant base LR), its settings fixed on the tuning seeds.
4. Steps and tokens at the interpolated crossing; per seed, x the reference's; the goal (stated in bench/RESULTS.md
   before the final measurement); the McCandlish bound from the reference's GNS path; time under this CPU's fitted
   step time t(B) = t0 + t1 B (CPU seconds, one thread) and a data-parallel model (a step of up to `width` examples
   costs one unit); the CPU recorded. Step times are process CPU times: the decisions and step counts are
   deterministic on one machine, not across CPUs (another CPU's float rounding gave 202.2 vs 205.2 steps once).
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Optional

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import critical_batch as cb  # noqa: E402
import teacher_task  # noqa: E402

from nanogns import schedules  # noqa: E402
from nanogns.estimator import RunningGNS  # noqa: E402
from nanogns.monitor.tracked import summed_squares  # noqa: E402


@dataclasses.dataclass
class Task:
    name: str = "teacher"
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 16
    vocab: int = 16  # the teacher's
    sharpness: float = 8.0  # the teacher's logits' scale (entropy 0.76 nats of a maximum 2.77)
    target: float = 0.025  # excess loss over the teacher (nats); shakespeare: validation loss
    near: float = 0.04  # evaluate every ~1.5% of steps once the metric is within this of the target
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_windows: int = 256
    batch_sizes: tuple = (32, 64, 128, 256, 512)
    lr0: float = 1e-3  # the LR grid: lr0 x sqrt(2)^i
    horizon0: float = 1e6  # the cosine's horizon grid, in tokens: horizon0 x 1.5^j
    start: tuple = (3, 0)  # (i, j) the first batch's search starts at
    floor: float = 0.0  # the cosine's last value, x its peak (0: a run that has not crossed at its end never will)
    tuning_seeds: tuple = (100, 101)
    seeds: tuple = (0, 1, 2, 3, 4)
    max_batch: int = 4096
    max_tokens: float = 6e6  # no run goes past this
    width: int = 512  # the data-parallel model: a step of up to `width` examples costs one unit
    ema_decay: float = 0.95
    one_epoch: bool = False  # shakespeare: a run that would read a window twice stops (not reached)
    lr_ref: float = 1e-3  # (critical_batch.build's optimizer default; every step sets its own LR)
    # (t0, t1): the step time the methods are told, t0 + t1 x B seconds, instead of the measured one (None): the
    # quick form's, so that goodput's decisions, and the test's verdicts, do not move with the machine's load
    told_step_time: Optional[tuple] = None


TEACHER = Task()
SHAKESPEARE = Task(
    name="shakespeare",
    n_layer=2,
    n_head=4,
    n_embd=64,
    block_size=32,
    target=2.35,
    near=0.15,
    batch_sizes=(16, 32, 64, 128),
    start=(3, 0),
    horizon0=4e5,
    seeds=(0, 1, 2),
    max_batch=1024,
    max_tokens=1e6,
    width=256,
    one_epoch=True,
)
QUICK = Task(
    target=0.8,
    near=0.3,
    eval_windows=32,
    batch_sizes=(32, 128),
    horizon0=1e5,
    start=(4, 0),
    tuning_seeds=(100,),
    seeds=(0,),
    max_tokens=3e5,
    width=128,
    told_step_time=(9e-3, 3.3e-5),  # (this machine's fit on the quick task, one thread)
)


# ---------------------------------------------------------------------------------------------------------------
# data: a stream per seed, and the metric the target is on


class TeacherData:
    """bench/teacher_task.py: the stream per seed and the excess loss on fixed validation windows."""

    metric_name = "excess loss (nats)"

    def __init__(self, task):
        self.teacher = teacher_task.Teacher(vocab=task.vocab, sharpness=task.sharpness)
        self.block, self.vocab = task.block_size, task.vocab
        self.metric = teacher_task.ExcessLoss(self.teacher, task.block_size, task.eval_windows)

    def stream(self, seed):
        return teacher_task.TeacherStream(self.teacher, self.block, seed)


class ShakespeareStream:
    """The training text as disjoint windows in a seeded order, read once: `take(n)` raises EOFError rather than
    start a second epoch."""

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


class ShakespeareData:
    metric_name = "validation loss"

    def __init__(self, task):
        self.train_ids, val_ids, self.vocab = cb.load_shakespeare()
        self.block = task.block_size
        starts = np.random.default_rng(999).integers(len(val_ids) - task.block_size, size=task.eval_windows)
        self.val = cb.windows(val_ids, starts, task.block_size)

    def stream(self, seed):
        return ShakespeareStream(self.train_ids, self.block, seed)

    @torch.no_grad()
    def metric(self, model):
        model.eval()
        loss = model(*self.val)[1].item()
        model.train()
        return loss


def cosine(tokens, horizon, floor):
    """The decay factor in [floor, 1] of a cosine over `horizon` tokens (constant beyond it)."""
    x = min(tokens / horizon, 1.0)
    return max(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x)), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# the methods: before each step decide(step, tokens) -> (B, lr before warmup); after it observe(...)


class Fixed:
    """A fixed batch; a constant LR, or a cosine to floor x lr over `horizon` tokens."""

    planned = False

    def __init__(self, B, lr, horizon=None, floor=0.1):
        self.B, self.lr, self.horizon, self.floor = B, lr, horizon, floor

    def decide(self, step, tokens):
        return self.B, self.lr * (cosine(tokens, self.horizon, self.floor) if self.horizon else 1.0)

    def observe(self, sq, pe, B, seconds, loss):
        pass

    def apply(self, optimizer, step):
        pass


class Seesaw(Fixed):
    """Seesaw (arXiv 2510.14717), planned on a cosine: wherever the cosine has halved k times, the batch is 2^k B0 and
    the LR lr0 a sqrt(2^k) (x 1/sqrt(2) per doubling instead of x 1/2), up to max_batch."""

    planned = True

    def __init__(self, B0, lr0, horizon, floor, max_batch):
        self.B0, self.lr0, self.horizon, self.floor, self.max_batch = B0, lr0, horizon, floor, max_batch

    def decide(self, step, tokens):
        a = cosine(tokens, self.horizon, self.floor)
        k = 2 ** min(math.floor(math.log2(1 / max(a, 1e-12)) + 1e-9), int(math.log2(self.max_batch / self.B0)))
        return self.B0 * k, self.lr0 * a * math.sqrt(k)


class Doubling(Fixed):
    """Merrill et al. 2025's batch-size warmup, planned on the reference's cosine: the batch doubles at fixed
    fractions of the cosine's horizon, from B_ref / 4 to 4 B_ref, the LR the reference's x sqrt(B / B_ref) (the
    same noise temperature as the reference at every token)."""

    planned = True

    def __init__(self, B_ref, lr, horizon, floor, fractions=(0.05, 0.15, 0.35, 0.6)):
        self.batches = [B_ref // 4, B_ref // 2, B_ref, 2 * B_ref, 4 * B_ref]
        self.B_ref, self.lr, self.horizon, self.floor = B_ref, lr, horizon, floor
        self.at = [f * horizon for f in fractions]

    def decide(self, step, tokens):
        B = self.batches[sum(tokens >= a for a in self.at)]
        return B, self.lr * cosine(tokens, self.horizon, self.floor) * math.sqrt(B / self.B_ref)


class GnsRule(Fixed):
    """The earlier `--bs_schedule=gns` (schedules.gns_steps: B -> GNS in micro-batches of `micro`, one per step), on
    the reference's cosine, the LR x sqrt(B / B_ref)."""

    def __init__(self, micro, max_batch, B_ref, lr, horizon, floor):
        self.micro, self.max_steps, self.B_ref = micro, max_batch // micro, B_ref
        self.lr, self.horizon, self.floor = lr, horizon, floor
        self.accum, self.gns, self.running = B_ref // micro, math.nan, RunningGNS(0.95)

    def decide(self, step, tokens):
        self.accum = schedules.gns_steps(self.accum, self.gns, self.micro, 1.0, 1, self.max_steps, max_delta=1)
        B = self.micro * self.accum
        return B, self.lr * cosine(tokens, self.horizon, self.floor) * math.sqrt(B / self.B_ref)

    def observe(self, sq, pe, B, seconds, loss):
        self.gns = self.running.update(sq, pe, B)


class Controlled(Fixed):
    """A schedules.BatchSizeController on a base LR schedule (a cosine over `horizon` tokens, or constant)."""

    def __init__(self, controller, lr, horizon=None, floor=0.1):
        self.controller, self.lr, self.horizon, self.floor = controller, lr, horizon, floor
        self.decision = None

    def decide(self, step, tokens):
        a = cosine(tokens, self.horizon, self.floor) if self.horizon else 1.0
        self.decision = self.controller.decide(self.lr * a, a)
        return self.decision.batch_size, self.decision.lr

    def apply(self, optimizer, step):  # betas, weight decay and Adam's state (the loop sets the LR with its warmup)
        self.controller.apply(optimizer, dataclasses.replace(self.decision, lr=optimizer.param_groups[0]["lr"]))

    def observe(self, sq, pe, B, seconds, loss):
        self.controller.observe(sq, pe, B, step_seconds=seconds)


# ---------------------------------------------------------------------------------------------------------------
# one training run


def train(task, data, seed, method, label="", max_steps=None, max_tokens=None, quiet=False):
    """Train with `method` until the metric reaches task.target (or max_steps / max_tokens / the end of an epoch).

    Returns reached, steps and tokens at the crossing (linear between the evaluations either side), cpu seconds of
    the training steps, the per-step trace (B, lr, cpu seconds, running GNS, training loss) with its summed squared
    norms, and the evaluations (step, tokens, metric, B, lr)."""
    model, optimizer, monitor, _ = cb.build(task, data.vocab, seed)
    stream = data.stream(seed)
    max_tokens = min(max_tokens or math.inf, task.max_tokens)
    tokens, cpu, last, next_eval, step = 0, 0.0, None, 1, 0
    trace, curve, norms = [], [], []
    result = dict(reached=False, steps=math.nan, tokens=math.nan, seed=seed, why="max_steps", label=label)
    while max_steps is None or step < max_steps:
        if tokens >= max_tokens:
            result["why"] = "max_tokens"
            break
        if task.floor == 0 and getattr(method, "horizon", None) and tokens >= method.horizon:
            result["why"] = "decayed"  # its LR is 0 from here: it never will
            break
        t0 = time.process_time()
        B, lr = method.decide(step, tokens)
        lr *= min(1.0, (step + 1) / task.warmup_steps)
        for g in optimizer.param_groups:
            g["lr"] = lr
        method.apply(optimizer, step)
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
        lossf = loss.item()
        seconds = time.process_time() - t0
        told = task.told_step_time
        method.observe(sq, pe, B, seconds if told is None else told[0] + told[1] * B, lossf)
        cpu += seconds
        tokens += B * task.block_size
        step += 1
        trace.append((B, lr, seconds, monitor.gns, lossf))
        norms.append((B, sq, pe))
        near = last is not None and last[2] < task.target + task.near
        if step >= next_eval or (near and step >= last[0] * 1.015):
            v = data.metric(model)
            point = (step, tokens, v, B, lr)
            curve.append(point)
            next_eval = max(step + 1, math.ceil(step * 1.1))
            if v <= task.target:
                frac = 1.0 if last is None else (last[2] - task.target) / (last[2] - v)
                s = step if last is None else last[0] + frac * (step - last[0])
                e = tokens if last is None else last[1] + frac * (tokens - last[1])
                result.update(reached=True, steps=s, tokens=e, why="")
                break
            last = point
    result.update(cpu=cpu, trace=trace, curve=curve, norms=norms, gns=monitor.gns, planned=method.planned)
    if not quiet:
        said = (
            f"step {result['steps']:.1f}, {result['tokens']:,.0f} tokens"
            if result["reached"]
            else f"not reached ({result['why']}, {step} steps, {tokens:,} tokens, {task_metric(curve)})"
        )
        print(f"  {label} seed {seed}: {said}, {cpu:.1f} cpu s", flush=True)
    return result


def task_metric(curve):
    return f"last metric {curve[-1][2]:.4f}" if curve else "no evaluation"


# ---------------------------------------------------------------------------------------------------------------
# the sweep: the cosine tuned per batch size on the tuning seeds


def tune_cosine(task, data, B, start, seeds, lr_only_horizon=None, margin=0.02, max_steps=None, make=None, name=None):
    """Coordinate search on the grid lr = lr0 sqrt(2)^i, horizon = horizon0 1.5^j (or a constant LR when
    lr_only_horizon is 'const'), from `start` = (i, j): the LR walked up (then down) while the mean steps over `seeds`
    fall by more than `margin` (seeds differ by a few percent: a smaller gain is noise), then the horizon, then the LR
    again if the horizon moved. A candidate runs seed by seed, each run stopped once it passes 1.1 x the best's steps
    on that seed, and is dropped after a seed that is already slower than the best's by the margin. Returns (best:
    dict(i, j, lr, horizon, steps (mean), tokens (mean), runs), every candidate: [dict(i, j, lr, horizon, steps,
    reached, metric: the best metric its runs reached)]). max_steps: every run's bound until one reaches the target.
    make(lr, horizon) -> a method: another schedule's horizon tuned the same way (the LR stays at start's)."""
    const = lr_only_horizon == "const"
    tried, best = {}, None

    def score(i, j):
        if (i, j) in tried:
            return tried[(i, j)]["steps"]
        lr, horizon = task.lr0 * math.sqrt(2) ** i, None if const else task.horizon0 * 1.5**j
        runs = []
        for k, seed in enumerate(seeds):
            bound = math.ceil(best["runs"][k]["steps"] * 1.1) + 1 if best else max_steps
            label = f"{name or f'B={B}'} lr={lr:.2e} " + ("const" if const else f"cosine {horizon:,.0f}")
            method = make(lr, horizon) if make else Fixed(B, lr, horizon, task.floor)
            runs.append(train(task, data, seed, method, label, max_steps=bound))
            if not runs[-1]["reached"] or (best and runs[-1]["steps"] > best["runs"][k]["steps"] * (1 + margin)):
                break
        ok = len(runs) == len(seeds) and all(r["reached"] for r in runs)
        steps = float(np.mean([r["steps"] for r in runs])) if ok else math.inf
        metric = min((p[2] for r in runs for p in r["curve"]), default=math.nan)
        tried[(i, j)] = dict(i=i, j=j, lr=lr, horizon=horizon, steps=steps, reached=ok, runs=runs, metric=metric)
        return steps

    def walk(cur, axis):
        nonlocal best
        moved = False
        for direction in (1, -1):
            while True:
                nxt = (cur[0] + direction, cur[1]) if axis == 0 else (cur[0], cur[1] + direction)
                if nxt in tried and tried[nxt]["steps"] >= tried[cur]["steps"] * (1 - margin):
                    break
                if score(*nxt) < tried[cur]["steps"] * (1 - margin):
                    cur, moved, best = nxt, True, tried[nxt]
                else:
                    break
            if moved:
                break
        return cur, moved

    cur = tuple(start)
    score(*cur)
    best = tried[cur] if tried[cur]["reached"] else None
    if best is None:  # nothing reached at the start: a larger LR, a smaller one, a longer horizon, until one does
        lr_moves = [] if make else [(cur[0] + 1, cur[1]), (cur[0] - 1, cur[1])]
        for nxt in lr_moves + ([] if const else [(cur[0], cur[1] + 1), (cur[0], cur[1] + 2)]):
            if score(*nxt) < math.inf:
                cur, best = nxt, tried[nxt]
                break
    if best is not None:
        if make is None:
            cur, _ = walk(cur, 0)
        if not const:
            cur, moved = walk(cur, 1)
            if moved and make is None:
                cur, _ = walk(cur, 0)
    keep = ("i", "j", "lr", "horizon", "steps", "reached", "metric")
    trials = [{k: t[k] for k in keep} for t in tried.values()]
    if best is None:
        return None, trials
    best = dict(best)
    best["tokens"] = float(np.mean([r["tokens"] for r in best["runs"]]))
    return best, trials


def sweep(task, data):
    """Every fixed batch, its cosine tuned on the tuning seeds. Each batch's search starts where the previous ones
    point: one LR step up (Adam's square-root scaling), the horizon moved by as many x1.5 steps as the tokens grew
    from the batch before. Returns {B: best}, [every candidate]."""
    best, trials, start = {}, [], task.start
    for B in task.batch_sizes:
        b, t = tune_cosine(task, data, B, start, task.tuning_seeds)
        trials += [dict(B=B, **x) for x in t]
        if b is None:
            print(f"sweep B={B}: no grid point reached the target", flush=True)
            continue
        shift = 0
        if best:
            shift = max(0, round(math.log(b["tokens"] / best[max(best)]["tokens"]) / math.log(1.5)))
        best[B] = b
        start = (b["i"] + 1, b["j"] + shift)
        print(
            f"sweep B={B}: lr {b['lr']:.2e}, horizon {b['horizon']:,.0f} tokens, {b['steps']:.1f} steps, "
            f"{b['tokens']:,.0f} tokens (mean of the tuning seeds)",
            flush=True,
        )
    return best, trials


def tune_constant(task, data, B, start_i, seeds, bound_steps):
    """The constant LR at batch B on the x sqrt(2) grid (tuning seeds), each run stopped at bound_steps (2x the
    reference's): (the best that reached the target or None, every candidate with the best metric it reached)."""
    return tune_cosine(task, data, B, (start_i, 0), seeds, lr_only_horizon="const", max_steps=math.ceil(bound_steps))


# ---------------------------------------------------------------------------------------------------------------
# the certification: is this task one where lowering the noise temperature is what reaches the target?


def first_plateau_end(gns, losses=None, below=None):
    """The step (0-based) where the first plateau ends. With `below` (the teacher task: its entropy plus I(y; x[t-1] |
    x[t]), the excess loss of the best prediction from the last input alone, which is where the student sits until it
    learns to look at the one before), the first step whose training loss (its EMA, 0.9 a step) is under it: the
    student does better than any prediction that ignores x[t-1]. Without, it is read from the running GNS (one value
    per step): the GNS rises while the loss sits on a plateau (the gradient vanishes there) and falls as the loss
    drops off it; the end is its lowest point after its first peak (a maximum it later falls below 2/3 of), or, with
    no such peak, its lowest point in the first tenth of the run."""
    if below is not None and losses is not None:
        ema = None
        for i, loss in enumerate(losses):
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            if ema < below:
                return i
    g = np.asarray(gns, dtype=np.float64)
    g = np.where(np.isfinite(g), g, np.nan)
    peak = None
    running_max, at = -np.inf, 0
    for i, v in enumerate(g):
        if not np.isfinite(v):
            continue
        if v > running_max:
            running_max, at = v, i
        elif v < running_max * 2 / 3:
            peak = at
            break
    if peak is None:
        return int(np.nanargmin(g[: max(1, len(g) // 10)])) if np.isfinite(g).any() else 0
    return peak + int(np.nanargmin(g[peak:]))


def certify(task, reference_runs, horizon, const_best, const_trials, ref_steps, plateau_loss=None):
    """The three checks of issue 48, on the tuning seeds' runs (plateau_loss: the training loss below which the first
    plateau is over, where it is known: the teacher's entropy + I(y; x[t-1] | x[t])). Returns (passed, lines,
    numbers)."""
    lines, passed = [], True
    bound = 2 * ref_steps
    if const_best is None:
        ok = True
        said = f"no constant LR on the grid reached it within {bound:.0f} steps (2x the reference's): " + ", ".join(
            f"lr {t['lr']:.2e} got to {t['metric']:.4f}" for t in const_trials
        )
    else:
        ok = const_best["steps"] >= bound
        said = f"the best constant LR ({const_best['lr']:.2e}) took {const_best['steps']:.0f} steps ({const_best['steps'] / ref_steps:.2f}x)"
    lines.append(f"  [{'pass' if ok else 'FAIL'}] constant LR at the reference batch needs >= 2x its steps: {said}")
    passed &= ok
    fractions = [r["tokens"] / horizon for r in reference_runs]
    ok = all(0.7 <= f <= 1.0 for f in fractions)
    lines.append(
        f"  [{'pass' if ok else 'FAIL'}] the reference crosses the target in the last 30% of its decay: at "
        f"{', '.join(f'{f:.2f}' for f in fractions)} of its horizon ({horizon:,.0f} tokens)"
    )
    passed &= ok
    growth = []
    for r in reference_runs:
        gns = [t[3] for t in r["trace"]]
        end = first_plateau_end(gns, [t[4] for t in r["trace"]], plateau_loss)
        growth.append((end + 1, gns[end], r["gns"], r["gns"] / gns[end]))
    ok = all(x[3] >= 10 for x in growth)
    lines.append(
        f"  [{'pass' if ok else 'FAIL'}] the GNS grows >= 10x from the end of the first plateau to the target: "
        + "; ".join(f"{a:.0f} at step {e} -> {b:.0f} ({c:.1f}x)" for e, a, b, c in growth)
        + (
            " (the first plateau: its GNS's low after its first peak)"
            if plateau_loss is None
            else f" (the first plateau ends where the training loss first falls below {plateau_loss:.3f}, the best "
            "prediction from the last input alone)"
        )
    )
    passed &= ok
    numbers = dict(const_best=const_best, fractions=fractions, gns_growth=growth, passed=bool(passed))
    return passed, lines, numbers


# ---------------------------------------------------------------------------------------------------------------
# the methods on the scored seeds


def lr_exponent(best):
    """The slope of log(tuned peak LR) against log B over the sweep: the LR coupling the sweep supports."""
    Bs = sorted(best)
    if len(Bs) < 2:
        return 0.5
    return float(np.polyfit(np.log(Bs), np.log([best[b]["lr"] for b in Bs]), 1)[0])


def controller(task, rule, B0, start=None, couple=None, **kw):
    """A BatchSizeController for this task (micro-batches of 4 examples, 'temper' of half the smallest sweep batch).
    couple: which of beta2 ('b2'), weight decay ('wd') and Adam's second moment at a switch ('v') follow the batch
    (default: all three for the earlier rules, as issue 38 ran them; none for 'temper', as Seesaw)."""
    micro = 4 if rule != "temper" else min(task.batch_sizes) // 2
    couple = ("" if rule == "temper" else "b2,wd,v") if couple is None else couple
    kw["rescale_second_moment"] = "v" in couple
    return schedules.BatchSizeController(
        rule,
        micro_batch_size=micro,
        base_batch_size=B0,
        min_accum_steps=1,
        max_accum_steps=task.max_batch // micro,
        start_accum_steps=(start or B0) // micro,
        beta2=task.beta2 if "b2" in couple else None,
        weight_decay=task.weight_decay if "wd" in couple else None,
        **kw,
    )


TEMPER = dict(anchor=0.125, ratio=2.0, cap=4.0, start=0.5, couple="")  # 'temper''s settings (anchor, start: x B_ref)


def methods(task, b_ref, ref, const_lr, exponent, temper=None, seesaw_horizon=None):
    """{name: a function making a fresh method}: the reference, the constant LR, the planned schedules, the earlier
    rules and the new controller."""
    lr, horizon, floor = ref["lr"], ref["horizon"], task.floor
    temper = {**TEMPER, **(temper or {})}
    start = max(min(task.batch_sizes) // 2, int(b_ref * temper["start"]))
    m = {
        f"reference: B={b_ref}, cosine": lambda: Fixed(b_ref, lr, horizon, floor),
        f"B={b_ref}, constant LR": lambda: Fixed(b_ref, const_lr),
        f"Seesaw (planned) B0={b_ref}": lambda: Seesaw(b_ref, lr, seesaw_horizon or horizon, floor, task.max_batch),
        f"doubling {b_ref // 4}->{4 * b_ref} (planned)": lambda: Doubling(b_ref, lr, horizon, floor),
        "gns rule (issue 21), ref. cosine": lambda: GnsRule(4, task.max_batch, b_ref, lr, horizon, floor),
        "sqrt x4, ref. cosine": lambda: Controlled(
            controller(task, "sqrt", b_ref, factor=4.0, lr_exponent=exponent), lr, horizon, floor
        ),
        "grow cap 4, ref. cosine": lambda: Controlled(controller(task, "grow", b_ref, cap=4.0), lr, horizon, floor),
        "goodput, ref. cosine": lambda: Controlled(
            controller(task, "goodput", b_ref, lr_exponent=exponent), lr, horizon, floor
        ),
        "temper (no plan)": lambda: Controlled(
            controller(
                task,
                "temper",
                b_ref,
                start=start,
                anchor=temper["anchor"] * b_ref,
                ratio=temper["ratio"],
                cap=temper["cap"],
                couple=temper["couple"],
            ),
            lr,
        ),
    }
    return m


# ---------------------------------------------------------------------------------------------------------------
# the numbers: per seed against the reference, the time models, the bound


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
    for b, sq, pe in run["norms"]:
        g = run_gns.update(sq, pe, b)
        gns.append(g if math.isfinite(g) and g > 0 else math.nan)
    g = np.array(gns)
    g = np.where(np.isfinite(g), g, np.nanmin(g))  # the first steps (no estimate yet): the smallest seen
    scale = fit["B_crit"] / g.mean()
    for _ in range(50):  # progress-weighted mean of scale x GNS = B_crit
        w = 1 / (1 + scale * g / B)
        scale = fit["B_crit"] / (np.sum(w * g) / np.sum(w))
    w = 1 / (1 + scale * g / B)
    mean_sqrt = np.sum(w * np.sqrt(scale * g)) / np.sum(w)
    return float((1 + mean_sqrt**2 / B) / (1 + fit["B_crit"] / B)), float(mean_sqrt**2 / fit["B_crit"])


def throughput_model(runs):
    """This CPU: t(B) = t0 + t1 B fitted to the median per-step CPU time of each batch size's runs."""
    per_B = {}
    for r in runs:
        for b, _, s, _, _ in r["trace"][10:]:
            per_B.setdefault(b, []).append(s)
    Bs = sorted(per_B)
    med = [float(np.median(per_B[b])) for b in Bs]
    t1, t0 = np.polyfit(Bs, med, 1)
    return dict(t0=float(t0), t1=float(t1), per_B=dict(zip(Bs, med)))


def modelled(task, r, cpu_model):
    """(CPU seconds by the fitted model, data-parallel units) of a run's steps up to the target (all if not reached)."""
    n = int(math.ceil(r["steps"])) if r["reached"] else len(r["trace"])
    Bs = np.array([t[0] for t in r["trace"][:n]], dtype=np.float64)
    return float(np.sum(cpu_model["t0"] + cpu_model["t1"] * Bs)), float(np.sum(np.ceil(Bs / task.width)))


GOAL = dict(steps=0.75, tokens=1.10, seesaw_steps=1.05)  # issue 48's, stated in bench/RESULTS.md before measuring


def summarize(task, results, fit, cpu_model, ref_name, seesaw_name):
    """One row per method (medians and ranges over seeds); per seed x the reference's steps and tokens, and the goal:
    <= 0.75x the reference's steps at <= 1.10x its tokens, and within 5% of Seesaw's steps at no more tokens."""
    ref = {r["seed"]: r for r in results[ref_name]}
    seesaw = {r["seed"]: r for r in results.get(seesaw_name, [])}
    rows = []
    for name, rs in results.items():
        for r in rs:
            r["cpu_model_s"], r["dp_units"] = modelled(task, r, cpu_model)
            base, ss = ref.get(r["seed"]), seesaw.get(r["seed"])
            ok = r["reached"] and base is not None and base["reached"]
            r["steps_ratio"] = r["steps"] / base["steps"] if ok else math.nan
            r["tokens_ratio"] = r["tokens"] / base["tokens"] if ok else math.nan
            r["inside"] = (
                (r["steps"] / fit["S_min"] - 1) * (r["tokens"] / task.block_size / fit["E_min"] - 1)
                if r["reached"]
                else math.nan
            )
            near_seesaw = ss is not None and ss["reached"] and r["reached"]
            r["vs_seesaw"] = (r["steps"] / ss["steps"], r["tokens"] / ss["tokens"]) if near_seesaw else None
            r["goal"] = bool(
                ok
                and r["steps_ratio"] <= GOAL["steps"]
                and r["tokens_ratio"] <= GOAL["tokens"]
                and near_seesaw
                and r["vs_seesaw"][0] <= GOAL["seesaw_steps"]
                and r["vs_seesaw"][1] <= 1.0
            )
        ok = [r for r in rs if r["reached"]]

        def stat(k, ok=ok):
            v = [r[k] for r in ok if math.isfinite(r[k])]
            return (float(np.median(v)), float(min(v)), float(max(v))) if v else (math.nan,) * 3

        rows.append(
            dict(
                name=name,
                planned=bool(rs[0]["planned"]) if rs else False,
                runs=len(rs),
                reached=len(ok),
                **{k: stat(k) for k in ("steps", "tokens", "cpu_model_s", "dp_units", "inside")},
                **{k: stat(k) for k in ("steps_ratio", "tokens_ratio")},
                per_seed=[
                    (r["seed"], r["steps_ratio"], r["tokens_ratio"], *(r["vs_seesaw"] or (math.nan, math.nan)))
                    for r in rs
                ],
                goal=sum(r["goal"] for r in rs),
            )
        )
    return rows


def report(task, fit, cpu_model, rows, ref_name):
    f = lambda t, fmt: f"{t[0]:{fmt}} [{t[1]:{fmt}}, {t[2]:{fmt}}]"  # noqa: E731
    lines = [
        f"target {task.target} ({'excess loss over the teacher' if task.name == 'teacher' else 'validation loss'}); "
        f"fit S_min = {fit['S_min']:.1f} steps, E_min = {fit['E_min']:,.0f} examples "
        f"({fit['E_min'] * task.block_size:,.0f} tokens), B_crit = {fit['B_crit']:.1f}, rms {fit['rms']:.3f}",
        f"CPU step time t(B) = {cpu_model['t0'] * 1e3:.2f} ms + {cpu_model['t1'] * 1e3:.3f} ms x B (one thread); "
        f"data-parallel: one unit per step of up to {task.width} examples",
        f"{ref_name}; goal per seed: steps <= {GOAL['steps']}x and tokens <= {GOAL['tokens']}x the "
        f"reference's, steps <= {GOAL['seesaw_steps']}x and tokens <= 1x Seesaw's",
        f"{'method':36s} reached  {'steps':22s} {'tokens':32s} {'x ref steps':20s} {'x ref tokens':20s} "
        f"{'(S/Smin-1)(E/Emin-1)':22s} {'CPU model s':20s} {'DP units':20s} goal",
    ]
    for r in rows:
        lines.append(
            f"{r['name']:36s} {r['reached']}/{r['runs']}  {f(r['steps'], '6.0f'):22s} {f(r['tokens'], '10,.0f'):32s} "
            f"{f(r['steps_ratio'], '.2f'):20s} {f(r['tokens_ratio'], '.2f'):20s} {f(r['inside'], '.2f'):22s} "
            f"{f(r['cpu_model_s'], '6.1f'):20s} {f(r['dp_units'], '5.0f'):20s} {r['goal']}/{r['runs']}"
        )
    lines.append("per seed (x ref steps, x ref tokens; x Seesaw steps, x Seesaw tokens):")
    for r in rows:
        lines.append(
            f"  {r['name']:36s} "
            + "  ".join(f"s{s}: {a:.2f} {b:.2f}; {c:.2f} {d:.2f}" for s, a, b, c, d in r["per_seed"])
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# figures


def figures(task, data, best, fit, results, out_dir, ref_name):
    """steps_vs_tokens.png (every seed of every method on the fixed-batch curve) and trajectories.png (seed
    seeds[0]: batch, LR, noise temperature and the metric against tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    T = task.block_size
    fig, ax = plt.subplots(figsize=(7.5, 5.2), dpi=90)
    pts = [(b["tokens"], b["steps"]) for b in best.values()]
    ax.scatter(*zip(*pts), c="lightgray", s=40, marker="s", label="fixed B, cosine tuned (tuning seeds' mean)")
    for B, b in best.items():
        ax.annotate(f"B={B}", (b["tokens"], b["steps"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    bb = np.geomspace(min(best) / 4, max(best) * 4, 200)
    s = fit["S_min"] + fit["E_min"] / bb
    ax.plot(bb * s * T, s, "k-", lw=1, label="fit: S = S_min + E_min/B")
    ref = [r for r in results[ref_name] if r["reached"]]
    if ref:  # the goal, against the reference's median: at most 75% of its steps, at most 110% of its tokens
        s_ref, e_ref = np.median([r["steps"] for r in ref]), np.median([r["tokens"] for r in ref])
        lo = min(r["tokens"] for rs in results.values() for r in rs if r["reached"]) * 0.8
        ax.fill_between(
            [lo, GOAL["tokens"] * e_ref], 1, GOAL["steps"] * s_ref, color="g", alpha=0.12, label="goal (median ref.)"
        )
    markers, colors = "osD^v<>phX*Pd", plt.get_cmap("tab10")
    for i, (name, rs) in enumerate(results.items()):
        pts = [(r["tokens"], r["steps"]) for r in rs if r["reached"]]
        if pts:
            ax.scatter(*zip(*pts), marker=markers[i % len(markers)], color=colors(i % 10), s=30, label=name, zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="tokens to the target", ylabel="optimizer steps to the target")
    ax.set_ylim(0.8 * fit["S_min"], None)
    ax.set_title(f"{task.name}: {data.metric_name} {task.target}, every scored seed", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "steps_vs_tokens.png"))
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=80)
    (ax_b, ax_lr), (ax_t, ax_m) = axes
    for i, (name, rs) in enumerate(results.items()):
        r = rs[0]
        tokens = np.cumsum([t[0] for t in r["trace"]]) * T
        B = np.array([t[0] for t in r["trace"]], dtype=np.float64)
        lr = np.array([t[1] for t in r["trace"]])
        color = colors(i % 10)
        ax_b.plot(tokens, B, lw=1, label=name, color=color)
        ax_lr.plot(tokens, lr, lw=1, color=color)
        ax_t.plot(tokens, lr / np.sqrt(B), lw=1, color=color)
        c = np.array([(p[1], p[2]) for p in r["curve"]])
        if len(c):
            ax_m.plot(c[:, 0], c[:, 1], lw=1, color=color)
    ax_b.axhline(fit["B_crit"], color="k", ls=":", lw=1, label=f"B_crit {fit['B_crit']:.0f}")
    ax_b.set(xscale="log", yscale="log", xlabel="tokens", ylabel="batch (examples)", title=f"seed {task.seeds[0]}")
    ax_lr.set(xscale="log", yscale="log", xlabel="tokens", ylabel="learning rate (with warmup)")
    ax_t.set(xscale="log", yscale="log", xlabel="tokens", ylabel="noise temperature lr / sqrt(B)")
    ax_m.axhline(task.target, color="k", ls=":", lw=1)
    ax_m.set(xscale="log", yscale="log", xlabel="tokens", ylabel=data.metric_name)
    ax_b.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "trajectories.png"))
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------------------------
# the controllers' pieces, checked on a recorded GNS trace (CI: --quick)


def recorded_trace():
    """A recorded GNS trace: bench/figures/controller/gns_trace.json (the full run's seed-0 'temper' run: per step B
    and the summed squared norms), or, before any full run, a synthetic one with the same shape (a GNS rising from
    ~5 to ~500 over 600 steps at B = 64)."""
    path = os.path.join(REPO, "bench", "figures", "controller", "gns_trace.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["steps"]
    rng = np.random.default_rng(0)
    steps = []
    for i in range(600):
        gns = 5 * 100 ** min(1.0, i / 500)
        gtg = 1.0 / (1 + i / 50)
        B = 64
        sq = gtg + gns * gtg / B * rng.chisquare(8) / 8  # |g_B|^2 = |G|^2 + tr(Sigma)/B, noisy
        pe = gtg + gns * gtg * rng.chisquare(8) / 8  # mean_i |g_i|^2 = |G|^2 + tr(Sigma)
        steps.append(dict(B=B, sq_norm=float(sq), pe_sqnorm=float(pe)))
    return steps


def check_pieces():
    """The controllers' decisions on the recorded trace, their resume, and the couplings; raises AssertionError."""
    trace = recorded_trace()
    checks = []
    for rule, kw in (
        ("sqrt", dict(factor=4.0)),
        ("grow", dict(cap=4.0)),
        ("goodput", {}),
        ("temper", dict(anchor=32.0, ratio=2.0, cap=1.0)),
    ):
        make = lambda: schedules.BatchSizeController(  # noqa: E731
            rule, micro_batch_size=4, base_batch_size=64, max_accum_steps=1024, beta2=0.99, weight_decay=0.1, **kw
        )
        ctl, decisions, half = make(), [], len(trace) // 2
        for i, s in enumerate(trace):
            if i == half:  # a resume: the state dict through JSON, as a checkpoint would carry it
                saved = json.loads(json.dumps(ctl.state_dict()))
            decay = cosine(i, len(trace), 0.1) if rule != "temper" else 1.0
            d = ctl.decide(4e-3 * decay, decay)
            decisions.append(d)
            ctl.observe(s["sq_norm"], s["pe_sqnorm"], s["B"])  # the recorded step's norms
            ctl.observe_time(d.batch_size, 0.002 + 0.0003 * d.batch_size)  # the decided batch's time, t(B) known
        twin = make()
        twin.load_state_dict(saved)
        twin_decisions = []
        for i, s in enumerate(trace[half:], half):
            decay = cosine(i, len(trace), 0.1) if rule != "temper" else 1.0
            d = twin.decide(4e-3 * decay, decay)
            twin_decisions.append(d)
            twin.observe(s["sq_norm"], s["pe_sqnorm"], s["B"])
            twin.observe_time(d.batch_size, 0.002 + 0.0003 * d.batch_size)
        assert twin_decisions == decisions[half:], f"{rule}: resumed decisions differ"
        batches = [d.batch_size for d in decisions]
        assert all(b % 4 == 0 and 4 <= b <= 4096 for b in batches), rule
        switches = sum(d.switched for d in decisions)
        assert switches < len(trace) // 4, f"{rule}: {switches} switches in {len(trace)} steps: no hysteresis"
        for i, d in enumerate(decisions):  # the couplings
            assert d.beta2 == 0.99 ** (d.batch_size / 64)
            half_life_tokens = math.log(0.5) / math.log(d.beta2) * d.batch_size
            assert abs(half_life_tokens - math.log(0.5) / math.log(0.99) * 64) < 1e-6 * half_life_tokens
            decay = cosine(i, len(trace), 0.1) if rule != "temper" else 1.0
            mult = d.lr / (4e-3 * decay)  # the LR's multiplier for this batch (and temperature)
            if rule in ("grow", "temper"):  # the base's temperature, lowered only by temper's halvings
                assert abs(mult - math.sqrt(d.batch_size / 64) * d.temperature) < 1e-9
            if rule == "temper":
                assert abs(d.weight_decay * mult / d.temperature - 0.1 * d.batch_size / 64) < 1e-9
            else:
                assert abs(d.weight_decay * mult - 0.1 * d.batch_size / 64) < 1e-9  # B / (lr wd) constant
        if rule == "goodput":  # Pollux's optimum of t(B) = 0.002 + 0.0003 B is B* = sqrt(t0 GNS / t1)
            for d in decisions[100:]:
                best = math.sqrt(0.002 * d.gns / 0.0003)
                assert abs(d.batch_size - best) <= 0.1 * d.batch_size + 8 or not ctl.resolved, (d.batch_size, best)
        if rule == "temper":  # the temperature falls only once the GNS has passed the anchor, never rises; the batch
            seen = 0.0  # never shrinks and doubles only within cap x GNS
            for prev, d in zip(decisions, decisions[1:]):
                seen = max(seen, d.gns if math.isfinite(d.gns) else 0.0)
                assert d.temperature <= prev.temperature and (d.temperature == 1.0 or seen > 32)
                assert d.batch_size >= prev.batch_size and (
                    d.batch_size == prev.batch_size or d.batch_size <= 1.0 * d.gns
                )
        checks.append((rule, batches[0], batches[len(batches) // 2], batches[-1], switches))
    return checks


# ---------------------------------------------------------------------------------------------------------------


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slim(r):
    return {k: v for k, v in r.items() if k not in ("curve", "norms", "runs")}


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the pieces on a recorded trace and a tiny run of each step")
    p.add_argument("--task", choices=["teacher", "shakespeare"], default="teacher")
    p.add_argument(
        "--out_dir",
        default=None,
        help="default: bench/figures/controller[_shakespeare] (--quick: out-controller-quick)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1; step times are CPU times)")
    p.add_argument(
        "--clock", choices=["cpu"], default="cpu", help="step times: process CPU time (the machine is shared)"
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds to score instead of the task's (e.g. the "
        "tuning seeds, to choose settings without looking at the scored ones)",
    )
    p.add_argument("--only", default=None, help="comma-separated prefixes of the methods to run (the reference always)")
    p.add_argument("--certify_only", action="store_true", help="stop after the sweep and the certification")
    p.add_argument("--reuse_sweep", default=None, help="a previous run's sweep.json: score without tuning again")
    p.add_argument("--temper", default="", help="'temper''s settings for this run, e.g. anchor=0.5,ratio=2,cap=2")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = QUICK if args.quick else (TEACHER if args.task == "teacher" else SHAKESPEARE)
    if args.seeds:
        task = dataclasses.replace(task, seeds=tuple(int(s) for s in args.seeds.split(",")))
    temper = {k: v if k == "couple" else float(v) for k, v in (kv.split("=") for kv in args.temper.split(",") if kv)}
    default_dir = (
        "out-controller-quick"
        if args.quick
        else f"bench/figures/controller{'' if task.name == 'teacher' else '_' + task.name}"
    )
    out_dir = args.out_dir or os.path.join(REPO, default_dir)
    os.makedirs(out_dir, exist_ok=True)
    t_start, cpu_start = time.time(), time.process_time()
    pieces = check_pieces()
    for rule, first, mid, last, switches in pieces:
        print(
            f"pieces: {rule}: batch {first} -> {mid} -> {last} on the recorded trace, {switches} switches; resume "
            "exact; LR, beta2 and weight-decay couplings held",
            flush=True,
        )
    machine = dict(cpu=cpu_name(), torch=torch.__version__, threads=args.threads, python=platform.python_version())
    print(f"task: {task}\nmachine: {machine}", flush=True)
    data = TeacherData(task) if task.name == "teacher" else ShakespeareData(task)
    if task.name == "teacher":
        print(
            f"teacher: entropy {data.teacher.entropy:.4f} nats per target (of log {task.vocab} = "
            f"{math.log(task.vocab):.4f}); the metric is the excess over it; from the last input alone the best is "
            f"{data.teacher.plateau_excess:.4f} above it (the first plateau)",
            flush=True,
        )

    # 1. the sweep and the reference (tuning seeds)
    seesaw_best = seesaw_trials = None
    if args.reuse_sweep:  # a previous run's sweep (its tuning-seed runs), to score again without tuning again
        with open(args.reuse_sweep) as f:
            cached = json.load(f)
        best, trials = {int(B): b for B, b in cached["best"].items()}, cached["trials"]
        const_best, const_trials = cached["const_best"], cached["const_trials"]
        seesaw_best, seesaw_trials = cached.get("seesaw_best"), cached.get("seesaw_trials")
        print(f"sweep and constant LR: from {args.reuse_sweep}", flush=True)
    else:
        best, trials = sweep(task, data)
    fit = cb.fit_tradeoff(list(best), [b["steps"] for b in best.values()])
    b_ref = min(best, key=lambda b: abs(math.log(b / fit["B_crit"])))
    ref = best[b_ref]
    exponent = lr_exponent(best)
    print(
        f"fit: S_min {fit['S_min']:.1f}, E_min {fit['E_min']:,.0f} examples, B_crit {fit['B_crit']:.1f}; reference "
        f"B={b_ref}, lr {ref['lr']:.2e}, cosine over {ref['horizon']:,.0f} tokens; tuned LR ~ B^{exponent:.2f}",
        flush=True,
    )
    if not args.reuse_sweep:
        const_best, const_trials = tune_constant(task, data, b_ref, ref["i"], task.tuning_seeds, 2 * ref["steps"])
    if not args.reuse_sweep or seesaw_trials is None:
        seesaw_best, seesaw_trials = tune_cosine(  # the best planned Seesaw: its horizon tuned as the reference's was
            task,
            data,
            b_ref,
            (ref["i"], ref["j"]),
            task.tuning_seeds,
            max_steps=math.ceil(2 * ref["steps"]),
            make=lambda lr, horizon: Seesaw(b_ref, lr, horizon, task.floor, task.max_batch),
            name=f"Seesaw B0={b_ref}",
        )
        with open(os.path.join(out_dir, "sweep.json"), "w") as f:
            strip = lambda b: b and {**b, "runs": [{k: v for k, v in r.items() if k != "norms"} for r in b["runs"]]}  # noqa: E731
            json.dump(
                dict(
                    best={B: strip(b) for B, b in best.items()},
                    trials=trials,
                    const_best=strip(const_best),
                    const_trials=const_trials,
                    seesaw_best=strip(seesaw_best),
                    seesaw_trials=seesaw_trials,
                ),
                f,
                default=float,
            )

    # 2. the certification, before any score
    plateau = data.teacher.entropy + data.teacher.plateau_excess if task.name == "teacher" else None
    passed, lines, cert = certify(task, ref["runs"], ref["horizon"], const_best, const_trials, ref["steps"], plateau)
    print(f"certification ({task.name}, tuning seeds {task.tuning_seeds}): {'PASSED' if passed else 'NOT PASSED'}")
    print("\n".join(lines), flush=True)
    if args.certify_only:
        cpu_total = time.process_time() - cpu_start
        with open(os.path.join(out_dir, "certification.json"), "w") as f:
            json.dump(
                dict(
                    task=dataclasses.asdict(task),
                    machine=machine,
                    fit=fit,
                    reference=dict(B=b_ref, **slim(ref)),
                    lines=lines,
                    cpu_seconds=cpu_total,
                    **{k: v for k, v in cert.items() if k != "const_best"},
                ),
                f,
                default=float,
            )
        print(f"certification only: {cpu_total:.0f} s CPU")
        return dict(fit=fit, certified=passed, certification=lines, reference=b_ref)

    # 3. every method on the scored seeds
    const_lr = const_best["lr"] if const_best else min(const_trials, key=lambda t: t["lr"])["lr"]
    seesaw_horizon = seesaw_best["horizon"] if seesaw_best else None
    print(f"Seesaw's horizon (tuning seeds): {seesaw_horizon or ref['horizon']:,.0f} tokens", flush=True)
    made = methods(task, b_ref, ref, const_lr, exponent, temper, seesaw_horizon)
    ref_name, seesaw_name = next(iter(made)), next(n for n in made if n.startswith("Seesaw"))
    only = [s for s in (args.only or "").split(",") if s]
    results = {}
    for name, make in made.items():
        if only and name != ref_name and not any(name.startswith(o) for o in only):
            continue
        runs = []
        for seed in task.seeds:
            base = results[ref_name][len(runs)] if name != ref_name else None
            bound = dict(max_steps=math.ceil(2 * base["steps"]) + 1) if base and base["reached"] else {}
            runs.append(train(task, data, seed, make(), name, **bound))
        results[name] = runs
    cpu_model = throughput_model([r for b in best.values() for r in b["runs"]])
    rows = summarize(task, results, fit, cpu_model, ref_name, seesaw_name)
    bounds = [mccandlish_bound(fit, r, b_ref) for r in results[ref_name]]
    text = report(task, fit, cpu_model, rows, ref_name)
    text += (
        f"\nMcCandlish's model with the GNS path of the reference's runs: at their data, the best batch schedule takes "
        f"{', '.join(f'{b:.3f}' for b, _ in bounds)} x their steps (mean(sqrt B_noise)^2 / mean(B_noise) = "
        f"{', '.join(f'{c:.3f}' for _, c in bounds)})"
    )
    print(text)
    paths = figures(task, data, best, fit, results, out_dir, ref_name)
    temper_name = next((n for n in results if n.startswith("temper")), None)
    if not args.quick and task.name == "teacher" and temper_name:  # the recorded trace the quick check replays
        steps = [dict(B=b, sq_norm=sq, pe_sqnorm=pe) for b, sq, pe in results[temper_name][0]["norms"]]
        with open(os.path.join(out_dir, "gns_trace.json"), "w") as f:
            json.dump(dict(source=f"seed {task.seeds[0]} of '{temper_name}' in the full run", steps=steps), f)
    cpu_total = time.process_time() - cpu_start
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(
            dict(
                task=dataclasses.asdict(task),
                machine=machine,
                fit=fit,
                sweep={B: slim(b) for B, b in best.items()},
                sweep_trials=trials,
                reference=dict(B=b_ref, **slim(ref)),
                lr_exponent=exponent,
                constant=dict(best=slim(const_best) if const_best else None, trials=const_trials),
                seesaw=dict(best=slim(seesaw_best) if seesaw_best else None, trials=seesaw_trials),
                certification=dict(lines=lines, **{k: v for k, v in cert.items() if k != "const_best"}),
                cpu_model=cpu_model,
                mccandlish_bound=bounds,
                rows=rows,
                runs={
                    n: [{k: v for k, v in r.items() if k not in ("curve", "norms")} for r in rs]
                    for n, rs in results.items()
                },
                cpu_seconds=cpu_total,
            ),
            f,
            default=float,
        )
    print(
        f"figures: {', '.join(os.path.relpath(q, REPO) for q in paths)}; total {time.time() - t_start:.0f} s wall, "
        f"{cpu_total:.0f} s CPU ({cpu_total / 60:.1f} CPU-minutes, this process)"
    )
    return dict(
        fit=fit,
        rows=rows,
        pieces=pieces,
        figures=paths,
        report=text,
        reference=ref_name,
        bounds=bounds,
        certified=passed,
        certification=lines,
    )


if __name__ == "__main__":
    main()
