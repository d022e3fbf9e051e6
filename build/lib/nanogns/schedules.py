"""
Batch-size schedules for train.py (`--bs_schedule=none|linear|gns`).

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
"""

import math
import os
import warnings

import numpy as np

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
            raise ValueError(f"line {lineno} {line!r} is not 'tokens, steps'") from None
        if not (math.isfinite(tokens) and math.isfinite(steps)):
            raise ValueError(f"line {lineno} {line!r} is not finite")
        if steps < 1:
            raise ValueError(f"line {lineno}: steps {parts[1]} < 1")
        if points and tokens <= points[-1][0]:
            raise ValueError(f"line {lineno}: tokens {parts[0]} do not increase")
        points.append((tokens, steps))
    if not points:
        raise ValueError("no 'tokens, steps' lines")
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
                raise ValueError(f"batch-size schedule {self.path}: {e}") from None
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
