"""
Does following the GNS pay? The critical batch size measured against the GNS, and batch-size schedules.

    python bench/critical_batch.py                  # the full run (bench/RESULTS.md): 13-16 min on a shared 2-core machine
    python bench/critical_batch.py --quick          # a tiny version, ~20 s (CI: tests/test_bench_critical_batch.py)

1. Sweep: a small nanoGPT of the quick start's kind (char-level Shakespeare, all-layer `gns` norms) is trained
   at fixed batch sizes B (>= 2 orders of magnitude), each until a fixed validation loss, recording the
   optimizer steps S and examples E = B S it needed. The learning rate is tuned per B on a small grid:
   lr_grid x rule(B), rule(B) = lr_ref (B / B_ref)^lr_exp, run with the first seed (the middle candidate
   first; a candidate is stopped once it needs more steps than the best so far; while the best is at the
   grid's edge the grid is extended by a halving or doubling, up to lr_extend times); the fastest is kept for
   the other seeds. A linear warmup of `warmup_steps` steps, then constant (no decay, so "steps to the target"
   does not depend on a planned length).
   McCandlish et al. 2018 (arXiv 1812.06162): (S/S_min - 1)(E/E_min - 1) = 1, i.e.
   S = S_min + E_min / B, fitted by least squares in log S (`fit_tradeoff`); B_crit = E_min / S_min.
   Beside it: the running GNS (all parameters, and LayerNorm only; gnstracking.GNSMonitor with
   estimator.RunningGNS, EMA decay 0.95 per step) each run had when it passed the target.
2. Schedules, on the same task: the fixed batch nearest B_crit, the 'linear' schedule and the 'gns' one
   (schedules.linear_points/interpolate and schedules.gns_steps, train.py's --bs_schedule logic, with
   micro-batches of `micro` examples), each to the target: steps, examples, tokens, wall time.

The validation loss is the mean over a fixed set of validation windows (the same for every run), evaluated
when the training loss's EMA nears the target and then every ~2% of steps; the crossing step is
interpolated linearly between the last two evaluations. Wall time counts training steps only (not evals).
"""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import nanogns as lc  # noqa: E402
from nanogns import monitor as gnstracking  # noqa: E402
from nanogns import schedules  # noqa: E402
from nanogns.estimator import RunningGNS  # noqa: E402


@dataclasses.dataclass
class Task:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    target: float = 2.20  # validation loss every run trains to
    lr_ref: float = 4e-3  # rule(B) = lr_ref (B / b_ref)^lr_exp, the centre of each B's grid
    b_ref: int = 32
    lr_exp: float = 0.25
    lr_grid: tuple = (1.0, 0.5, 2.0)  # multipliers of rule(B) tried with seeds[0], in this order
    lr_extend: int = 2  # while the best is at the grid's edge, try up to this many halvings/doublings beyond it
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    val_windows: int = 256  # fixed validation windows of block_size tokens
    max_steps: int = 20000  # a run that has not reached the target by then is reported as not reaching it
    batch_sizes: tuple = (4, 8, 16, 32, 64, 128, 256, 512)
    seeds: tuple = (0, 1, 2)
    seeded_batch_sizes: tuple = ()  # batch sizes run with every seed; () = all, others with seeds[0]
    micro: int = 4  # the schedules' micro-batch (train.py's batch_size)
    schedule_seeds: tuple = (0, 1, 2)
    ema_decay: float = 0.95


FULL = Task()
QUICK = Task(
    n_layer=1,
    n_head=2,
    n_embd=32,
    block_size=16,
    target=2.75,
    lr_ref=4e-3,
    lr_grid=(1.0, 2.0),
    warmup_steps=5,
    val_windows=64,
    max_steps=1500,
    batch_sizes=(4, 16, 64, 256),
    seeds=(0,),
    schedule_seeds=(0,),
)


def rule_lr(task, batch_size):
    """The centre of the learning-rate grid at batch size B: lr_ref (B / b_ref)^lr_exp."""
    return task.lr_ref * (batch_size / task.b_ref) ** task.lr_exp


def interpolated_lr(tuned):
    """lr(B) from {B: tuned lr}: linear in log-log between the tuned batch sizes, constant beyond them."""
    Bs = sorted(tuned)
    return lambda B: float(np.exp(np.interp(math.log(B), np.log(Bs), np.log([tuned[b] for b in Bs]))))


def warmup(task, step):
    return min(1.0, (step + 1) / task.warmup_steps)


def load_shakespeare():
    """(train ids, val ids, vocab size): data/shakespeare_char/input.txt encoded as prepare.py does (90/10)."""
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(ids))
    return ids[:n], ids[n:], len(chars)


def windows(ids, starts, block_size):
    x = torch.stack([ids[s : s + block_size] for s in starts])
    y = torch.stack([ids[s + 1 : s + 1 + block_size] for s in starts])
    return x, y


def build(task, vocab_size, seed):
    """A GPT with per-example norms on every layer, its AdamW, and a GNSMonitor; seeded."""
    torch.manual_seed(seed)
    # (model.py prints its size: kept out of the tables)
    with lc.set_contextual_config(**lc.layer_classes("gns", "gns", "gns")), contextlib.redirect_stdout(io.StringIO()):
        from model import GPT, GPTConfig

        model = GPT(
            GPTConfig(
                n_layer=task.n_layer,
                n_head=task.n_head,
                n_embd=task.n_embd,
                block_size=task.block_size,
                vocab_size=vocab_size,
                dropout=0.0,
                bias=False,
                device_name="cpu",
            )
        )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": task.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=task.lr_ref,
        betas=(0.9, task.beta2),
    )
    monitor = gnstracking.GNSMonitor(model, ema_decay=task.ema_decay)
    ln_names = {name for name, what in monitor.describe().items() if what["kind"] in ("LayerNorm", "RMSNorm")}
    return model, optimizer, monitor, ln_names


def train_to_target(task, data, seed, batch_of, lr_of, label="", max_steps=None):
    """Train until the fixed validation loss reaches task.target (or max_steps).

    Args:
        data: load_shakespeare()'s (train, val, vocab).
        batch_of: callable(step, examples so far, running GNS) -> this step's batch size B.
        lr_of: callable(B) -> learning rate (times the warmup).
        max_steps: stop there (default task.max_steps).
    Returns a dict: reached, steps S and examples E at the target (interpolated), gns / gns_ln there,
    wall seconds of training, and the curve (step, examples, val loss, gns, gns_ln, B) of every evaluation.
    """
    train, val, vocab = data
    model, optimizer, monitor, ln_names = build(task, vocab, seed)
    ln_gns = RunningGNS(task.ema_decay)
    rng = np.random.default_rng([seed, 12345])
    val_x, val_y = windows(
        val, np.random.default_rng(999).integers(len(val) - task.block_size, size=task.val_windows), task.block_size
    )

    @torch.no_grad()
    def val_loss():
        model.eval()
        loss = model(val_x, val_y)[1].item()
        model.train()
        return loss

    examples, wall, loss_ema = 0, 0.0, None
    curve = []  # (step, examples, val loss, gns, gns_ln, B)
    next_eval = 1
    last = None
    max_steps = max_steps or task.max_steps
    for step in range(max_steps):
        t0 = time.perf_counter()
        B = int(batch_of(step, examples, monitor.gns))
        for g in optimizer.param_groups:
            g["lr"] = lr_of(B) * warmup(task, step)
        x, y = windows(train, rng.integers(len(train) - task.block_size, size=B), task.block_size)
        loss = model(x, y)[1]
        loss.backward()
        monitor.step(batch_size=B)
        ln_gns.update(*gnstracking.summed_squares([m for m in monitor.measurements if m.metadata["name"] in ln_names]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        examples += B
        wall += time.perf_counter() - t0
        lossf = loss.item()
        loss_ema = lossf if loss_ema is None else 0.9 * loss_ema + 0.1 * lossf
        done = step + 1
        # evaluate on a coarse geometric grid, and every ~2% of steps once the training loss nears the target
        near = loss_ema < task.target + 0.12
        if done >= next_eval or (near and done >= (last[0] if last else 0) * 1.02):
            v = val_loss()
            point = (done, examples, v, monitor.gns, ln_gns.gns, B)
            curve.append(point)
            next_eval = max(done + 1, math.ceil(done * 1.15))
            if v <= task.target:
                if last is None:
                    s, e, frac = done, examples, 1.0
                else:  # linear between the last evaluation above the target and this one
                    frac = (last[2] - task.target) / (last[2] - v)
                    s = last[0] + frac * (done - last[0])
                    e = last[1] + frac * (examples - last[1])
                print(
                    f"  {label} seed {seed}: target {task.target} at step {s:.1f}, {e:,.0f} examples, "
                    f"gns {monitor.gns:.1f} (LayerNorm {ln_gns.gns:.1f}), {wall:.1f}s",
                    flush=True,
                )
                return dict(
                    reached=True,
                    steps=s,
                    examples=e,
                    tokens=e * task.block_size,
                    gns=monitor.gns,
                    gns_ln=ln_gns.gns,
                    wall=wall,
                    curve=curve,
                    seed=seed,
                )
            last = point
    print(f"  {label} seed {seed}: target {task.target} not reached in {max_steps} steps", flush=True)
    return dict(
        reached=False,
        steps=math.nan,
        examples=math.nan,
        tokens=math.nan,
        gns=monitor.gns,
        gns_ln=ln_gns.gns,
        wall=wall,
        curve=curve,
        seed=seed,
    )


def fit_tradeoff(batch_sizes, steps):
    """Fit S = S_min + E_min / B, the same as (S/S_min - 1)(E/E_min - 1) = 1 with E = B S, to measured (B, S).

    Least squares in log S: for a given B_crit = E_min / S_min, log S_min = mean(log S - log(1 + B_crit / B))
    in closed form, and B_crit is found by a log-grid search refined by golden-section search (numpy only).
    Returns dict(S_min, E_min, B_crit, rms) (rms: residual in natural log).
    """
    B = np.asarray(batch_sizes, dtype=np.float64)
    logS = np.log(np.asarray(steps, dtype=np.float64))
    ok = np.isfinite(logS)
    B, logS = B[ok], logS[ok]
    assert len(set(B.tolist())) >= 2, "the fit needs at least two batch sizes"

    def cost(log_bcrit):
        shape = np.log1p(np.exp(log_bcrit) / B)
        log_smin = np.mean(logS - shape)
        return np.mean((logS - log_smin - shape) ** 2), log_smin

    lo, hi = math.log(B.min()) - 6, math.log(B.max()) + 6
    grid = np.linspace(lo, hi, 481)
    i = int(np.argmin([cost(g)[0] for g in grid]))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        c, d = b - phi * (b - a), a + phi * (b - a)
        if cost(c)[0] < cost(d)[0]:
            b = d
        else:
            a = c
    log_bcrit = (a + b) / 2
    mse, log_smin = cost(log_bcrit)
    s_min, b_crit = math.exp(log_smin), math.exp(log_bcrit)
    return dict(S_min=s_min, E_min=s_min * b_crit, B_crit=b_crit, rms=math.sqrt(mse))


def tune_lr(task, B, run):
    """The learning-rate grid at batch size B, seed 0: run(lr, bound) trains once (stopping after `bound` steps, the
    best so far plus one, where given) and returns its result dict; the grid grows while the fastest is at an edge
    (at most lr_extend more each way). Returns (the fastest run that reached the target or None, every trial), the
    trials carrying 'B', 'lr' and 'mult'."""
    best, tried, trials = None, list(task.lr_grid), []
    for mult in tried:
        lr = rule_lr(task, B) * mult
        r = run(lr, min(task.max_steps, math.ceil(best["steps"]) + 1) if best else None)
        r.update(B=B, lr=lr, mult=mult)
        trials.append(r)
        if r["reached"] and (best is None or r["steps"] < best["steps"]):
            best = r
        if mult == tried[-1] and best is not None:
            lo, hi = min(tried), max(tried)
            if best["mult"] == lo and lo > min(task.lr_grid) / 2**task.lr_extend:
                tried.append(lo / 2)
            elif best["mult"] == hi and hi < max(task.lr_grid) * 2**task.lr_extend:
                tried.append(hi * 2)
    return best, trials


def sweep(task, data):
    """Every fixed batch size: the learning-rate grid with seeds[0], then the other seeds (where asked) at the
    fastest lr. Returns (runs, grid): result dicts with 'B' and 'lr', the kept ones and every grid trial."""
    runs, grid = [], []
    seeded = set(task.seeded_batch_sizes or task.batch_sizes)
    for B in task.batch_sizes:
        fixed = lambda step, ex, gns, B=B: B  # noqa: E731
        best, trials = tune_lr(
            task,
            B,
            lambda lr, bound: train_to_target(
                task, data, task.seeds[0], fixed, lambda b, lr=lr: lr, f"B={B} lr={lr:.2e}", bound
            ),
        )
        grid += trials
        best = best or trials[0]
        runs.append(best)
        for seed in task.seeds[1:] if B in seeded else ():
            r = train_to_target(task, data, seed, fixed, lambda b, lr=best["lr"]: lr, f"B={B} lr={best['lr']:.2e}")
            r.update(B=B, lr=best["lr"], mult=best["mult"])
            runs.append(r)
    return runs, grid


def summarize_sweep(task, runs):
    """The fit over every run that reached the target, the fit per seed (where a seed has >= 3 batch sizes),
    and the GNS at the target (median over runs; per batch size)."""
    ok = [r for r in runs if r["reached"]]
    fit = fit_tradeoff([r["B"] for r in ok], [r["steps"] for r in ok])
    per_seed = {}
    for seed in task.seeds:
        mine = [r for r in ok if r["seed"] == seed]
        if len({r["B"] for r in mine}) >= 3:
            per_seed[seed] = fit_tradeoff([r["B"] for r in mine], [r["steps"] for r in mine])["B_crit"]
    gns = float(np.nanmedian([r["gns"] for r in ok])) if ok else math.nan
    gns_ln = float(np.nanmedian([r["gns_ln"] for r in ok])) if ok else math.nan
    table = []
    for B in task.batch_sizes:
        mine = [r for r in runs if r["B"] == B]
        reached = [r for r in mine if r["reached"]]
        col = lambda k: [r[k] for r in reached]  # noqa: E731
        table.append(
            dict(
                B=B,
                runs=len(mine),
                reached=len(reached),
                S=float(np.median(col("steps"))) if reached else math.nan,
                S_lo=min(col("steps"), default=math.nan),
                S_hi=max(col("steps"), default=math.nan),
                E=float(np.median(col("examples"))) if reached else math.nan,
                gns=float(np.median(col("gns"))) if reached else math.nan,
                gns_ln=float(np.median(col("gns_ln"))) if reached else math.nan,
                wall=float(np.median(col("wall"))) if reached else math.nan,
                lr=mine[0]["lr"] if mine else math.nan,
                lr_edge=bool(mine)
                and not (
                    min(task.lr_grid) / 2**task.lr_extend < mine[0]["mult"] < max(task.lr_grid) * 2**task.lr_extend
                ),
            )
        )
    return dict(fit=fit, per_seed_B_crit=per_seed, gns=gns, gns_ln=gns_ln, table=table)


def run_schedules(task, data, lr_of, b_fixed, b_linear, b_gns_max, tokens_budget):
    """The fixed batch b_fixed; the linear schedule (micro .. b_linear examples over tokens_budget tokens, then
    constant, as train.py's --bs_schedule=linear); the GNS-guided one (schedules.gns_steps as --bs_schedule=gns:
    B -> GNS, factor 1, clamped to micro .. b_gns_max, moving one micro-batch per step). Batches are whole
    micro-batches of task.micro examples; lr_of(B) is the sweep's tuned lr (interpolated_lr). Every schedule
    seed; {name: [result]}."""
    m = task.micro
    linear_max, gns_max = max(1, b_linear // m), max(1, b_gns_max // m)
    points = schedules.linear_points(1, linear_max, tokens_budget)

    def linear(step, examples, gns):
        return m * min(max(schedules.interpolate(points, examples * task.block_size), 1), linear_max)

    def gns_guided():
        state = {"accum": 1}

        def choose(step, examples, gns):
            state["accum"] = schedules.gns_steps(state["accum"], gns, m, 1.0, 1, gns_max, max_delta=1)
            return m * state["accum"]

        return choose

    out = {}
    for name, make in (
        (f"fixed B={b_fixed}", lambda: lambda s, e, g: b_fixed),
        (f"linear {m}->{m * linear_max}", lambda: linear),
        (f"gns (factor 1, {m}..{m * gns_max})", gns_guided),
    ):
        out[name] = [train_to_target(task, data, seed, make(), lr_of, label=name) for seed in task.schedule_seeds]
    return out


def fixed_batch_frontier(fit, steps=None, examples=None):
    """What fixed batches need by the fit: the steps at `examples` examples, S = S_min E / (E - E_min), or the
    examples at `steps` steps, E = E_min S / (S - S_min) (inf at or below the minimum)."""
    if examples is not None:
        return fit["S_min"] * examples / (examples - fit["E_min"]) if examples > fit["E_min"] else math.inf
    return fit["E_min"] * steps / (steps - fit["S_min"]) if steps > fit["S_min"] else math.inf


def summarize_schedules(results, fit=None):
    """One row per schedule: medians and ranges over seeds; with the sweep's fit, the steps a fixed batch
    needs for the schedule's examples and the examples it needs for the schedule's steps."""
    rows = []
    for name, runs in results.items():
        ok = [r for r in runs if r["reached"]]
        med = lambda k: float(np.median([r[k] for r in ok])) if ok else math.nan  # noqa: E731
        rng = lambda k: (min(r[k] for r in ok), max(r[k] for r in ok)) if ok else (math.nan, math.nan)  # noqa: E731
        row = dict(
            name=name,
            runs=len(runs),
            reached=len(ok),
            steps=med("steps"),
            steps_range=rng("steps"),
            examples=med("examples"),
            tokens=med("tokens"),
            tokens_range=rng("tokens"),
            wall=med("wall"),
            wall_range=rng("wall"),
            final_B=float(np.median([r["curve"][-1][5] for r in ok])) if ok else math.nan,
        )
        if fit is not None and ok:
            row["fixed_steps_same_examples"] = fixed_batch_frontier(fit, examples=row["examples"])
            row["fixed_examples_same_steps"] = fixed_batch_frontier(fit, steps=row["steps"])
        rows.append(row)
    return rows


def figures(task, runs, summary, sched, out_dir):
    """steps_vs_examples.png, bcrit_vs_gns.png and (with schedules) schedules.png in out_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(out_dir, exist_ok=True)
    fit = summary["fit"]
    paths = []
    ok = [r for r in runs if r["reached"]]
    fig, ax = plt.subplots(figsize=(5, 4), dpi=90)
    Bs = sorted({r["B"] for r in ok})
    cmap = plt.get_cmap("viridis")
    for i, B in enumerate(Bs):
        pts = [(r["examples"], r["steps"]) for r in ok if r["B"] == B]
        ax.scatter(*zip(*pts), color=cmap(i / max(1, len(Bs) - 1)), s=18, label=f"B={B}", zorder=3)
    bb = np.geomspace(min(Bs) / 4, max(Bs) * 4, 200)
    s = fit["S_min"] + fit["E_min"] / bb
    ax.plot(bb * s, s, "k-", lw=1, label="fit: S = S_min + E_min/B")
    ax.axhline(fit["S_min"], color="gray", ls=":", lw=1)
    ax.axvline(fit["E_min"], color="gray", ls=":", lw=1)
    ax.plot([2 * fit["E_min"]], [2 * fit["S_min"]], "r*", ms=10, label=f"B_crit = {fit['B_crit']:.0f}")
    for (name, rs), marker in zip(sched.items(), ("s", "^", "D")):
        pts = [(r["examples"], r["steps"]) for r in rs if r["reached"]]
        if pts and not name.startswith("fixed"):
            ax.scatter(*zip(*pts), marker=marker, facecolors="none", edgecolors="k", s=30, label=name, zorder=4)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="examples E to target",
        ylabel="optimizer steps S to target",
        title=f"val loss {task.target}: S_min {fit['S_min']:.0f}, E_min {fit['E_min']:,.0f}",
    )
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "steps_vs_examples.png"))
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4), dpi=90)
    ax.scatter([r["B"] for r in ok], [r["gns"] for r in ok], s=16, label="GNS at target, all parameters")
    ax.scatter([r["B"] for r in ok], [r["gns_ln"] for r in ok], s=16, marker="x", label="GNS at target, LayerNorm")
    ax.axhline(fit["B_crit"], color="r", lw=1.5, label=f"measured B_crit = {fit['B_crit']:.0f}")
    ax.axhline(summary["gns"], color="C0", ls="--", lw=1, label=f"median GNS, all = {summary['gns']:.0f}")
    ax.axhline(summary["gns_ln"], color="C1", ls="--", lw=1, label=f"median GNS, LayerNorm = {summary['gns_ln']:.0f}")
    seeds = list(summary["per_seed_B_crit"].values())
    if len(seeds) > 1:
        ax.axhspan(min(seeds), max(seeds), color="r", alpha=0.15, label="B_crit range over seeds")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="the run's batch size B",
        ylabel="examples",
        title="measured critical batch vs the runs' GNS",
    )
    lo, hi = ax.get_ylim()
    ax.set_yticks([t for t in (2, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000) if lo <= t <= hi])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bcrit_vs_gns.png"))
    fig.savefig(paths[-1])
    plt.close(fig)

    if sched:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=80)
        for (name, rs), color in zip(sched.items(), ("C0", "C1", "C2")):
            for j, r in enumerate(rs):
                c = np.array([p for p in r["curve"]], dtype=np.float64)
                if len(c):
                    axes[0].plot(c[:, 0], c[:, 2], color=color, lw=1, alpha=0.8, label=name if j == 0 else None)
                    axes[1].plot(c[:, 1] * task.block_size, c[:, 2], color=color, lw=1, alpha=0.8)
                    axes[2].plot(c[:, 1] * task.block_size, c[:, 5], color=color, lw=1, alpha=0.8)
        for ax, xl in zip(axes, ("optimizer steps", "tokens")):
            ax.axhline(task.target, color="k", ls=":", lw=1)
            ax.set(xscale="log", xlabel=xl, ylabel="validation loss", ylim=(task.target - 0.1, None))
        axes[2].axhline(fit["B_crit"], color="r", lw=1, label=f"measured B_crit = {fit['B_crit']:.0f}")
        axes[2].set(xscale="log", yscale="log", xlabel="tokens", ylabel="batch size B (at evaluations)")
        axes[2].legend(fontsize=7)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "schedules.png"))
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def report(task, summary, sched_rows):
    """The printed result: the sweep table, the fit, B_crit beside the GNS, the schedule table."""
    fit = summary["fit"]
    lines = [
        f"target validation loss {task.target}; lr tuned per B over {task.lr_grid} x {task.lr_ref:g} "
        f"(B/{task.b_ref})^{task.lr_exp:g} (seed {task.seeds[0]}), {task.warmup_steps} warmup steps; "
        f"* = best lr at the extended grid's edge",
        "     B  runs  reached   S (median [min, max])      E median    GNS all  GNS LN      lr   wall s",
    ]
    for t in summary["table"]:
        lines.append(
            f"{t['B']:6d} {t['runs']:5d} {t['reached']:8d}   {t['S']:8.1f} [{t['S_lo']:7.1f}, {t['S_hi']:7.1f}]"
            f"  {t['E']:11,.0f}  {t['gns']:9.1f} {t['gns_ln']:7.1f} {t['lr']:7.4f}{'*' if t['lr_edge'] else ' '}"
            f"{t['wall']:8.1f}"
        )
    seeds = summary["per_seed_B_crit"]
    spread = f" (per seed: {', '.join(f'{v:.0f}' for v in seeds.values())})" if seeds else ""
    lines += [
        f"fit (S/S_min - 1)(E/E_min - 1) = 1: S_min = {fit['S_min']:.1f} steps, E_min = {fit['E_min']:,.0f} "
        f"examples, rms log residual {fit['rms']:.3f}",
        f"measured B_crit = E_min / S_min = {fit['B_crit']:.1f} examples{spread}",
        f"GNS at the target (median over runs): all parameters {summary['gns']:.1f} "
        f"(B_crit / GNS = {fit['B_crit'] / summary['gns']:.2f}), LayerNorm only {summary['gns_ln']:.1f} "
        f"(B_crit / GNS = {fit['B_crit'] / summary['gns_ln']:.2f})",
    ]
    if sched_rows:
        lines.append(
            "schedule (medians over seeds)     runs  reached   steps [range]     tokens [range]"
            "                   wall s [range]      final B   fixed batch by the fit: steps at these "
            "examples, examples at these steps"
        )
        for r in sched_rows:
            lines.append(
                f"{r['name']:32s} {r['runs']:5d} {r['reached']:8d}   {r['steps']:6.1f} "
                f"[{r['steps_range'][0]:.0f}, {r['steps_range'][1]:.0f}]   {r['tokens']:9,.0f} "
                f"[{r['tokens_range'][0]:,.0f}, {r['tokens_range'][1]:,.0f}]   {r['wall']:6.1f} "
                f"[{r['wall_range'][0]:.1f}, {r['wall_range'][1]:.1f}]   {r['final_B']:6.0f}   "
                f"{r.get('fixed_steps_same_examples', math.nan):7.1f} steps "
                f"(x{r['steps'] / r.get('fixed_steps_same_examples', math.nan):.2f}), "
                f"{r.get('fixed_examples_same_steps', math.nan):8,.0f} examples "
                f"(x{r['examples'] / r.get('fixed_examples_same_steps', math.nan):.2f})"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the tiny CI version (about 20 s on 2 cores)")
    p.add_argument(
        "--out_dir",
        default=None,
        help="figures and results.json (default: bench/figures/critical_batch"
        " or, with --quick, out-critical-batch-quick)",
    )
    p.add_argument("--no_schedules", action="store_true", help="the sweep and fit only")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = QUICK if args.quick else FULL
    out_dir = args.out_dir or (
        os.path.join(REPO, "out-critical-batch-quick")
        if args.quick
        else os.path.join(REPO, "bench", "figures", "critical_batch")
    )
    data = load_shakespeare()
    print(f"task: {task}", flush=True)
    t0 = time.time()
    runs, grid = sweep(task, data)
    summary = summarize_sweep(task, runs)
    sched, sched_rows = {}, []
    if not args.no_schedules:
        fit = summary["fit"]
        b_fixed = min(task.batch_sizes, key=lambda b: abs(math.log(b / fit["B_crit"])))
        budget = next(t["E"] for t in summary["table"] if t["B"] == b_fixed) * task.block_size
        lr_of = interpolated_lr({t["B"]: t["lr"] for t in summary["table"]})
        sched = run_schedules(
            task, data, lr_of, b_fixed, min(4 * b_fixed, max(task.batch_sizes)), max(task.batch_sizes), int(budget)
        )
        sched_rows = summarize_schedules(sched, fit)
    text = report(task, summary, sched_rows)
    print(text)
    paths = figures(task, runs, summary, sched, out_dir)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(
            dict(
                task=dataclasses.asdict(task),
                summary=summary,
                schedules=sched_rows,
                runs=[{k: v for k, v in r.items() if k != "curve"} for r in runs],
                lr_grid=[{k: v for k, v in r.items() if k != "curve"} for r in grid],
            ),
            f,
            indent=1,
            default=float,
        )
    print(f"figures: {', '.join(os.path.relpath(q, REPO) for q in paths)}; total {time.time() - t0:.0f}s")
    return dict(summary=summary, schedules=sched_rows, figures=paths, report=text)


if __name__ == "__main__":
    main()
