"""
Batch-size schedules for train.py (`--bs_schedule=none|linear|gns|sqrt|grow|goodput|temper`).

A schedule decides, before each optimizer step, the step's gradient accumulation
steps counted over the whole job (nanoGPT's `gradient_accumulation_steps`, an
integer >= 1). Each rank then runs `per_rank_steps(total, world_size)` =
ceil(total / world_size) micro-batches, so the step's batch is
B = batch_size x per_rank_steps x world_size examples.

- 'linear': a file `OUT_DIR/grad_accum_schedule.txt` of lines `tokens, steps`,
  re-read every step (edit it while the run goes) and interpolated with
  numpy.interp at the tokens processed so far, then clamped to
  [bs_min_accum_steps, bs_max_accum_steps] (with one warning per value the file
  asks for outside them). A malformed file keeps the last good schedule, with
  one warning per distinct bad content.
- 'gns': adaptive, steps -> bs_gns_factor x GNS / batch_size (that is B ~ factor x GNS),
  clamped to [min, max] and moved by at most `max_delta` per step.
- 'sqrt', 'grow', 'goodput', 'temper': BatchSizeController, a controller any loop asks each step for its
  accumulation steps, learning rate, Adam's beta2 and weight decay, from its own GNS estimate
  (RatioGNS); measured against fixed batches and published schedules in bench/controller.py.
  'temper' lowers the noise temperature (the LR over the square root of the batch, for Adam) as a decay
  schedule does, timed by the GNS, knowing neither the target nor the budget.
"""

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from nanogns.errors import SettingNotValid
from nanogns.estimator import gns_from_emas, unbiased_stats

SCHEDULE_FILE = "grad_accum_schedule.txt"


def per_rank_steps(total_steps, world_size):
    """Micro-batches each rank runs for `total_steps` accumulation steps over the job."""
    return max(1, math.ceil(int(total_steps) / world_size))


def linear_points(min_steps, max_steps, max_tokens, n=10):
    """n points (tokens, steps) rising linearly from min_steps at 0 tokens to max_steps at max_tokens."""
    tokens = np.linspace(0, max_tokens, n)
    steps = np.linspace(min_steps, max_steps, n)
    return [(int(round(t)), round(float(s), 3)) for t, s in zip(tokens, steps)]


def format_schedule(points):
    return "# tokens, gradient accumulation steps (over all ranks); edit while training, read every step\n" + "".join(
        f"{t}, {s:g}\n" for t, s in points
    )


def write_schedule_if_absent(path, points):
    """Write the schedule file unless one is already there (a resumed run keeps its file). True if written."""
    if os.path.exists(path):
        return False
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(format_schedule(points))
    os.replace(tmp, path)
    return True


def parse_schedule(text):
    """[(tokens, steps)] from the file's text; raises ValueError saying what is wrong.

    Blank lines and lines starting with '#' are ignored. Tokens must increase
    strictly, steps must be >= 1."""
    points = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        try:
            if len(parts) != 2:
                raise ValueError
            tokens, steps = float(parts[0]), float(parts[1])
        except ValueError:
            raise SettingNotValid(f"line {lineno} {line!r} is not 'tokens, steps'") from None
        if not (math.isfinite(tokens) and math.isfinite(steps)):
            raise SettingNotValid(f"line {lineno} {line!r} is not finite")
        if steps < 1:
            raise SettingNotValid(f"line {lineno}: steps {parts[1]} < 1")
        if points and tokens <= points[-1][0]:
            raise SettingNotValid(f"line {lineno}: tokens {parts[0]} do not increase")
        points.append((tokens, steps))
    if not points:
        raise SettingNotValid("no 'tokens, steps' lines")
    return points


def interpolate(points, tokens):
    """Accumulation steps at `tokens` (linear between points, constant beyond them), rounded, >= 1."""
    xs, ys = zip(*points)
    return max(1, int(round(float(np.interp(tokens, xs, ys)))))


class FileSchedule:
    """The 'linear' schedule: `schedule(tokens)` re-reads `path`, interpolates and clamps to [min_steps, max_steps].

    A read or parse failure keeps the last good points (and warns once for each
    distinct bad content); with no good points yet it raises ValueError."""

    def __init__(self, path, min_steps=1, max_steps=None):
        self.path = path
        self.min_steps, self.max_steps = min_steps, max_steps
        self.points = None
        self._warned = set()

    def read(self):
        try:
            with open(self.path) as f:
                text = f.read()
            self.points = parse_schedule(text)
        except (OSError, ValueError) as e:
            if self.points is None:
                raise SettingNotValid(f"batch-size schedule {self.path}: {e}") from None
            key = text if not isinstance(e, OSError) else f"OSError {e}"
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(f"batch-size schedule {self.path}: {e}; keeping the last good schedule", stacklevel=2)
        return self.points

    def __call__(self, tokens):
        steps = interpolate(self.read(), tokens)
        clamped = max(self.min_steps, steps if self.max_steps is None else min(steps, self.max_steps))
        if clamped != steps and steps not in self._warned:
            self._warned.add(steps)
            warnings.warn(
                f"batch-size schedule {self.path}: {steps} accumulation steps at {tokens:,} tokens is outside "
                f"[bs_min_accum_steps, bs_max_accum_steps] = [{self.min_steps}, {self.max_steps}]; "
                f"using {clamped}",
                stacklevel=2,
            )
        return clamped


def gns_steps(current, gns, batch_size, factor=1.0, min_steps=1, max_steps=1, max_delta=1):
    """The 'gns' schedule's next accumulation steps (over all ranks).

    Target = clamp(round(factor x gns / batch_size), min_steps, max_steps), i.e. a
    global batch of about factor x GNS examples; the result moves from `current`
    towards it by at most `max_delta` (train.py passes the world size, so each
    rank changes by at most one micro-batch per step). A NaN/inf GNS (early
    steps) keeps `current` (clamped).
    """
    current = min(max(int(current), min_steps), max_steps)
    if gns is None or not math.isfinite(gns):
        return current
    target = min(max(int(round(factor * gns / batch_size)), min_steps), max_steps)
    return current + max(-max_delta, min(max_delta, target - current))


# ---------------------------------------------------------------------------------------------------------------
# The batch-size controller: each step, from the measured GNS, the batch (whole micro-batches) and what is coupled
# to it (learning rate, Adam's beta2 and its bias correction, weight decay, Adam's second moment at a switch).

CONTROLLER_RULES = ("sqrt", "grow", "goodput", "temper")
DEFAULT_CAP = {"grow": 4.0, "temper": 4.0}  # 'cap' x GNS: the largest batch 'grow' takes, and 'temper' doubles to


@dataclass(frozen=True)
class Decision:
    """What a step should run with (BatchSizeController.decide).

    accum_steps: micro-batches over the whole job (all ranks); batch_size = accum_steps x micro_batch_size.
    lr, beta2, weight_decay: the coupled values (beta2 / weight_decay None where the controller was given none).
    second_moment_scale: multiply Adam's exp_avg_sq by this before the step (1.0 unless the batch switched).
    gns: the controller's bias-corrected GNS estimate the decision used (NaN before the first measurement).
    temperature: the noise temperature, lr / sqrt(B) over the loop's lr / sqrt(base batch) (below 1 once 'temper'
        has lowered it; for the other rules, what their LR coupling makes of it).
    """

    accum_steps: int
    batch_size: int
    lr: float
    beta2: Optional[float]
    weight_decay: Optional[float]
    second_moment_scale: float
    switched: bool
    gns: float
    temperature: float = 1.0


class RatioGNS:
    """The GNS as a ratio of separate EMAs of the unbiased |G|^2 and tr(Sigma), with a horizon in examples.

    A step of B examples decays the EMAs by exp(-B / horizon_examples), so small batches (noisier estimates)
    average over more steps and a switch of batch does not change how much data the estimate spans (AdaptDL's
    rule: decay^(B/B0)). The EMAs are zero-initialised and debiased (as Adam's moments). The ratio of two
    averages is biased when the |G|^2 average is noisy, which it is at small batches (its per-step variance
    grows as (tr(Sigma)/B)^2): by the delta method E[A/G] ~ (A/G)(1 + Var(G)/G^2 - Cov(A, G)/(A G)), so the
    estimate is divided by that factor, with Var and Cov of the averages from EMAs of the products and the
    weights' sum of squares (exact for independent steps); the factor is clamped to [1/2, 2].
    `relative_error` is the standard error of the |G|^2 average over the average: where the batch is far below
    the GNS, one step's |G|^2 is mostly noise (often negative), and a controller decides nothing until enough
    steps have averaged it out.
    """

    def __init__(self, horizon_examples: float):
        if not horizon_examples > 0:
            raise SettingNotValid(f"horizon_examples must be > 0, got {horizon_examples!r}")
        self.horizon_examples = float(horizon_examples)
        self.sums = dict(w=0.0, w2=0.0, g=0.0, a=0.0, gg=0.0, aa=0.0, ag=0.0)

    def update(self, sq_norm: float, pe_sqnorm: float, batch_size: int) -> float:
        """Add one step: the summed squared norms of the batch gradient and of the per-example gradients, B."""
        gtg, trsigma = unbiased_stats(sq_norm, pe_sqnorm, batch_size)
        if not (math.isfinite(gtg) and math.isfinite(trsigma)):
            return self.gns
        d = math.exp(-batch_size / self.horizon_examples)
        s = self.sums
        for key, value in (("g", gtg), ("a", trsigma), ("gg", gtg * gtg), ("aa", trsigma * trsigma)):
            s[key] = d * s[key] + (1 - d) * value
        s["ag"] = d * s["ag"] + (1 - d) * trsigma * gtg
        s["w"] = d * s["w"] + (1 - d)
        s["w2"] = d * d * s["w2"] + (1 - d) ** 2
        return self.gns

    @property
    def raw_gns(self) -> float:
        """EMA(tr(Sigma)) / EMA(|G|^2), debiased, without the ratio's bias correction."""
        s = self.sums
        return gns_from_emas(s["g"], s["a"]) if s["w"] > 0 else math.nan

    @property
    def gns(self) -> float:
        s = self.sums
        raw = self.raw_gns
        if not math.isfinite(raw):
            return raw
        w, g, a = s["w"], s["g"] / s["w"], s["a"] / s["w"]
        shrink = s["w2"] / (w * w)  # the variance of the weighted mean, per unit variance of one step
        var_g = max(s["gg"] / w - g * g, 0.0) * shrink
        cov_ag = (s["ag"] / w - a * g) * shrink
        factor = 1 + var_g / (g * g) - (cov_ag / (a * g) if a > 0 else 0.0)
        return raw / min(max(factor, 0.5), 2.0)

    @property
    def effective_steps(self) -> float:
        """How many equally weighted steps the averages are worth: (sum of weights)^2 / sum of squared weights."""
        s = self.sums
        return s["w"] ** 2 / s["w2"] if s["w2"] > 0 else 0.0

    @property
    def relative_error(self) -> float:
        """The standard error of the |G|^2 average over the average (inf before two steps or while it is <= 0):
        the per-step spread from the EMAs (made unbiased: x n / (n - 1) for n effective steps), over sqrt(n)."""
        s, n = self.sums, self.effective_steps
        if n < 2 or s["g"] <= 0:
            return math.inf
        g = s["g"] / s["w"]
        var_step = max(s["gg"] / s["w"] - g * g, 0.0) * n / (n - 1)
        return math.sqrt(var_step / n) / g

    def state_dict(self) -> Dict[str, Any]:
        return {"horizon_examples": self.horizon_examples, **self.sums}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.horizon_examples = float(state["horizon_examples"])
        self.sums = {key: float(state[key]) for key in self.sums}


class BatchSizeController:
    """Each step's batch (whole micro-batches) from the measured GNS, and what is coupled to it.

        controller = BatchSizeController("temper", micro_batch_size=16, base_batch_size=128, max_accum_steps=256)
        for step ...:
            d = controller.decide(lr=base_lr_now, decay=base_lr_now / peak_lr)  # the loop's own LR schedule
            controller.apply(optimizer, d)          # lr, betas, weight decay; Adam's state at a switch
            ...d.accum_steps micro-batches of micro_batch_size examples...
            monitor.step(batch_size=d.batch_size)
            controller.observe(*summed_squares(monitor.measurements), step_seconds=dt)

    Rules (`rule`); B0 is base_batch_size, the batch the loop's LR is for:
      'temper': lowers the noise temperature lr / sqrt(B) (for Adam, what sets the loss's noise floor) as a decay
          schedule does, knowing neither a target nor a budget, and grows the batch where the GNS says it is cheap.
          Temperature: min(1, anchor / G)^(log 2 / log ratio) x the base's, G the largest GNS measured so far (its
          lower bound: the estimate / (1 + its relative error), counted only once resolved): it starts to fall when
          the GNS passes `anchor` examples and halves each time the GNS grows `ratio`-fold (2: the temperature
          inversely proportional to the GNS, which along a tuned cosine it is, bench/controller.py). Batch: it
          doubles, the LR x sqrt(2) (the same temperature), each time the doubled batch is within cap x GNS, and
          never shrinks. Run it on a constant LR after warmup: it is the decay. The defaults (anchor B0 / 8, cap 4)
          are bench/controller.py's, chosen on its tuning seeds (one task: set them for yours).
      'sqrt': B = factor x sqrt(GNS x anchor): the batch minimising steps + examples / anchor per unit of
          progress under McCandlish et al. 2018 (S/S_min - 1 = B_noise / B); anchor (default B0) is the batch at
          which B = factor x GNS.
      'grow': batch growth in place of learning-rate decay (Smith et al. 2018, Seesaw): where the loop's
          schedule multiplies the LR by `decay` = a, the batch is B0 / a and the LR lr x sqrt(B / B0) (so LR x
          sqrt(a) at B / a), capped at cap x GNS: beyond it growth stops paying (S/S_min - 1 = B_noise / B) and the
          rest of the decay stays in the LR. Early on, while the GNS is small, the cap makes it a warmup of the
          batch (Merrill et al. 2025).
      'goodput': Pollux's goodput, throughput(B) x efficiency(B) = B / t(B) x (GNS + B0) / (GNS + B), with
          t(B) = t0 + t1 B fitted to the step times given to `observe` (the last `time_window` steps; until two
          batch sizes have been timed, or while the fit finds no cost per example (noisy times), the batch grows
          one hysteresis band to measure another, rather than jump to the largest).
    Couplings: the LR is lr x (B / B0)^lr_exponent for 'sqrt' and 'goodput' (0.5, the square root for Adam, unless
    a sweep of tuned LRs says otherwise; bench/controller.py passes its sweep's), lr x sqrt(B / B0) for 'grow' and
    'temper' (the same noise temperature; 'temper' then lowers it). Given beta2, it becomes beta2^(B/B0) (the same
    half-life in tokens, Marek et al.), and `apply` keeps Adam's bias correction right as it changes; given
    weight_decay, it keeps AdamW's timescale B / (lr wd) (Power Lines; a lowered temperature counts as decay, not as
    coupling); with rescale_second_moment (default: on, off for 'temper', as Seesaw), Adam's second moment is
    rescaled at a switch by E|g_B'|^2 / E|g_B|^2 = (1 + GNS/B') / (1 + GNS/B). The GNS is RatioGNS (a horizon in
    examples, bias-corrected); nothing is decided while its |G|^2 average's relative standard error is above
    max_rel_error (a GNS measured far above the batch is mostly noise). 'sqrt', 'grow' and 'goodput' switch by
    whole micro-batches and only when the target leaves the band [n / (1 + hysteresis), n (1 + hysteresis)] around
    the current n micro-batches. `state_dict` holds all that a resume needs (the rule's settings are the caller's,
    given again).
    """

    def __init__(
        self,
        rule: str,
        micro_batch_size: int,
        base_batch_size: int,
        min_accum_steps: int = 1,
        max_accum_steps: int = 1,
        factor: float = 1.0,
        anchor: Optional[float] = None,
        cap: Optional[float] = None,
        ratio: float = 2.0,
        lr_exponent: float = 0.5,
        max_rel_error: float = 0.3,
        horizon_examples: Optional[float] = None,
        hysteresis: float = 0.1,
        beta2: Optional[float] = None,
        weight_decay: Optional[float] = None,
        rescale_second_moment: Optional[bool] = None,
        time_window: int = 50,
        start_accum_steps: Optional[int] = None,
    ):
        if rule not in CONTROLLER_RULES:
            raise SettingNotValid(f"unknown controller rule {rule!r}; choose from {list(CONTROLLER_RULES)}")
        if not 1 <= min_accum_steps <= max_accum_steps:
            raise SettingNotValid(
                f"need 1 <= min_accum_steps ({min_accum_steps}) <= max_accum_steps ({max_accum_steps})"
            )
        if micro_batch_size < 1 or base_batch_size < 1:
            raise SettingNotValid(
                f"micro_batch_size ({micro_batch_size}) and base_batch_size ({base_batch_size}) must be >= 1"
            )
        cap = DEFAULT_CAP.get(rule, 4.0) if cap is None else cap
        if hysteresis < 0 or factor <= 0 or cap <= 0 or not ratio > 1 or not max_rel_error > 0:
            raise SettingNotValid(
                f"need hysteresis >= 0, factor > 0, cap > 0, ratio > 1 and max_rel_error > 0 (got {hysteresis}, "
                f"{factor}, {cap}, {ratio}, {max_rel_error})"
            )
        if anchor is not None and not anchor > 0:
            raise SettingNotValid(f"anchor must be > 0 examples, got {anchor!r}")
        self.rule, self.micro, self.base = rule, int(micro_batch_size), int(base_batch_size)
        self.min_steps, self.max_steps = int(min_accum_steps), int(max_accum_steps)
        self.factor, self.cap, self.ratio, self.lr_exponent = factor, cap, ratio, lr_exponent
        default_anchor = base_batch_size / 8 if rule == "temper" else base_batch_size
        self.anchor = float(anchor) if anchor is not None else float(default_anchor)
        self.max_rel_error = max_rel_error
        self.hysteresis, self.beta2, self.weight_decay = hysteresis, beta2, weight_decay
        self.rescale = rule != "temper" if rescale_second_moment is None else bool(rescale_second_moment)
        self.time_window = time_window
        self.estimator = RatioGNS(horizon_examples or 20 * base_batch_size)
        self.accum = self._clamp(start_accum_steps if start_accum_steps is not None else min_accum_steps)
        self.clock = 0.0  # 'temper': the largest resolved GNS lower bound so far
        self.temp = 1.0  # 'temper': the temperature over the base's
        self.times: List[Tuple[int, float]] = []  # (B, seconds) of the last time_window steps
        self.steps = self.switches = 0

    # -- what the controller has measured --
    @property
    def gns(self) -> float:
        return self.estimator.gns

    @property
    def resolved(self) -> bool:
        """Whether the GNS is measured well enough to act on (its |G|^2 average's relative error <= max_rel_error)."""
        return self.estimator.relative_error <= self.max_rel_error and self.gns > 0

    def observe(self, sq_norm: float, pe_sqnorm: float, batch_size: int, step_seconds: Optional[float] = None) -> float:
        """Add one step's measurement (the summed squared norms, B) and, for 'goodput', its duration; the GNS."""
        gns = self.estimator.update(sq_norm, pe_sqnorm, batch_size)
        if step_seconds is not None:
            self.observe_time(batch_size, step_seconds)
        self.steps += 1
        return gns

    def observe_time(self, batch_size: int, step_seconds: float) -> None:
        """Add one step's duration at batch B to the step-time model ('goodput'); `observe` does with step_seconds."""
        if math.isfinite(step_seconds) and batch_size > 0:
            self.times = (self.times + [(int(batch_size), float(step_seconds))])[-self.time_window :]

    def step_time_model(self) -> Optional[Tuple[float, float]]:
        """(t0, t1) of t(B) = t0 + t1 B, least squares over the timed steps (both >= 0); None before two batch sizes."""
        if len({b for b, _ in self.times}) < 2:
            return None
        b = np.array([b for b, _ in self.times], dtype=np.float64)
        t = np.array([t for _, t in self.times], dtype=np.float64)
        t1, t0 = np.polyfit(b, t, 1)
        if t1 <= 0:
            return float(np.mean(t)), 0.0
        if t0 < 0:
            return 0.0, float(np.sum(b * t) / np.sum(b * b))
        return float(t0), float(t1)

    # -- the decision --
    def _clamp(self, n):
        return min(max(int(n), self.min_steps), self.max_steps)

    def target_batch(self, decay: float = 1.0) -> float:
        """The rule's wanted batch in examples (before whole micro-batches, bounds and hysteresis); NaN = keep.
        ('temper' moves by doublings in `decide`, not to a target: NaN.)"""
        gns = self.gns
        if self.rule == "temper" or not self.resolved:
            return math.nan
        if self.rule == "grow":
            return min(self.base / max(decay, 1e-12), self.cap * gns)
        if self.rule == "sqrt":
            return self.factor * math.sqrt(gns * self.anchor)
        model = self.step_time_model()  # goodput
        if model is None or model[1] <= 0:  # one batch size timed, or no sign yet that a bigger one costs more:
            return (math.ceil(self.accum * (1 + self.hysteresis)) + 1) * self.micro  # explore one band up, not max
        t0, t1 = model
        n = np.arange(self.min_steps, self.max_steps + 1, dtype=np.float64)
        b = n * self.micro
        goodput = b / np.maximum(t0 + t1 * b, 1e-12) * (gns + self.base) / (gns + b)
        return float(b[int(np.argmax(goodput))])

    def lr_multiplier(self, batch_size: int) -> float:
        """The LR's multiplier at batch B for the batch alone: (B / B0)^lr_exponent ('sqrt', 'goodput'), sqrt(B / B0)
        ('grow', 'temper': the base's noise temperature; 'temper' lowers it by temperature() on top)."""
        if self.rule in ("grow", "temper"):
            return math.sqrt(batch_size / self.base)
        return (batch_size / self.base) ** self.lr_exponent

    def temperature(self) -> float:
        """'temper''s noise temperature over the base's (1 until the GNS passes the anchor); 1 for the other rules."""
        return self.temp

    def _temper(self):
        """The temperature from the largest resolved GNS (lower bound) so far; the batch doubled while 2B <= cap x
        GNS (and max_accum_steps allows)."""
        if not self.resolved:
            return
        gns = self.gns
        self.clock = max(self.clock, gns / (1 + self.estimator.relative_error))
        self.temp = min(1.0, (self.anchor / self.clock) ** (math.log(2) / math.log(self.ratio)))
        while 2 * self.accum <= self.max_steps and 2 * self.accum * self.micro <= self.cap * gns:
            self.accum *= 2

    def decide(self, lr: float, decay: float = 1.0) -> Decision:
        """This step's Decision. lr: the loop's learning rate now (its schedule's, for base_batch_size);
        decay: the schedule's decay factor now (1 at the peak; 'grow' turns it into batch growth)."""
        old = self.accum
        if self.rule == "temper":
            self._temper()
        else:
            target = self.target_batch(decay)
            if math.isfinite(target):
                wanted = self._clamp(round(target / self.micro))
                if wanted >= old * (1 + self.hysteresis) or wanted <= old / (1 + self.hysteresis):
                    self.accum = wanted
        if self.rule == "grow":  # never past B0 / decay, hysteresis or not: the LR stays <= the schedule's peak
            self.accum = min(self.accum, max(self.min_steps, math.floor(self.base / max(decay, 1e-12) / self.micro)))
        switched = self.accum != old
        self.switches += switched
        batch = self.accum * self.micro
        gns = self.gns
        scale = 1.0
        if switched and self.rescale and math.isfinite(gns) and gns > 0:
            scale = (1 + gns / batch) / (1 + gns / (old * self.micro))
        mult = self.lr_multiplier(batch)
        wd = None
        if self.weight_decay is not None:  # B / (lr wd) constant, at the schedule's peak (decay = 1)
            wd = self.weight_decay * (batch / self.base) / mult
        beta2 = self.beta2 ** (batch / self.base) if self.beta2 is not None else None
        temperature = self.temp * mult / math.sqrt(batch / self.base)
        return Decision(self.accum, batch, lr * mult * self.temp, beta2, wd, scale, switched, gns, temperature)

    @staticmethod
    def apply(optimizer, decision: Decision, decay_groups: Optional[List[int]] = None) -> None:
        """Set the decision's lr, beta2 and weight decay (on `decay_groups`, default the groups whose weight decay
        is not 0) in every param group of a torch Adam/AdamW, and rescale its exp_avg_sq at a switch.

        Where beta2 changes, torch's bias correction would divide the second moment by 1 - beta2_new^t although it
        was averaged with the old beta2 (weight 1 - beta2_old^t): after a switch to a larger batch early in a run,
        that reads the second moment several times too small and steps too far. exp_avg_sq is multiplied by
        (1 - beta2_new^t) / (1 - beta2_old^t), so the corrected second moment is the same average before and after
        (t: the parameter's optimizer steps so far)."""
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = decision.lr
            if decision.beta2 is not None and "betas" in group and group["betas"][1] != decision.beta2:
                old_beta2 = group["betas"][1]
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    t = float(state["step"]) if "step" in state else 0.0
                    if t > 0 and "exp_avg_sq" in state:
                        state["exp_avg_sq"].mul_((1 - decision.beta2**t) / (1 - old_beta2**t))
                group["betas"] = (group["betas"][0], decision.beta2)
            decays = group.get("weight_decay", 0) != 0 if decay_groups is None else i in decay_groups
            if decision.weight_decay is not None and decays:
                group["weight_decay"] = decision.weight_decay
        if decision.second_moment_scale != 1.0:
            for state in optimizer.state.values():
                if "exp_avg_sq" in state:
                    state["exp_avg_sq"].mul_(decision.second_moment_scale)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "rule": self.rule,
            "accum": self.accum,
            "clock": self.clock,
            "temp": self.temp,
            "times": [list(t) for t in self.times],
            "steps": self.steps,
            "switches": self.switches,
            "estimator": self.estimator.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["rule"] != self.rule:
            raise SettingNotValid(
                f"the checkpoint's batch-size controller ran rule {state['rule']!r}, this one {self.rule!r}"
            )
        self.accum = int(state["accum"])
        self.clock, self.temp = float(state.get("clock", 0.0)), float(state.get("temp", 1.0))
        self.times = [(int(b), float(t)) for b, t in state["times"]]
        self.steps, self.switches = int(state["steps"]), int(state["switches"])
        self.estimator.load_state_dict(state["estimator"])
