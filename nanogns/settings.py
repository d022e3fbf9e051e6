"""
The valid range of each train.py setting, checked at start-up before anything is created: a bad value is one
line naming the flag and its range, never a run that trains silently wrong or a traceback deep inside.

    problem = settings.check(config)     # None, or "--grad_clip=-1.0: ..." for train.py's fail()

configurator.py has checked each key's name and type already; this checks values and their relations.
"""

import math

DTYPES = ("float32", "bfloat16", "float16")
INIT_FROM = ("scratch", "resume", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
BS_SCHEDULES = ("none", "linear", "gns", "sqrt", "grow", "goodput")  # the last three: schedules.CONTROLLER_RULES


def _integer(low):
    return lambda v: v >= low, f"an integer >= {low}"


def _number(low, high, low_open=False):
    """In [low, high) (or (low, high) with low_open); high None: no upper bound."""

    def ok(v):
        return math.isfinite(v) and (v > low if low_open else v >= low) and (high is None or v < high)

    return ok, f"a number in {'(' if low_open else '['}{low:g}, {'inf' if high is None else f'{high:g}'})"


# key: (test, the valid range in words, why; shown when the test fails)
RANGES = {
    "n_layer": (*_integer(1), "a model needs a block"),
    "n_head": (*_integer(1), ""),
    "n_embd": (*_integer(1), ""),
    "block_size": (*_integer(1), ""),
    "batch_size": (*_integer(1), ""),
    "gradient_accumulation_steps": (*_integer(1), "micro-batches per optimizer step"),
    "max_iters": (*_integer(1), ""),
    "max_tokens": (*_integer(1), ""),
    "eval_interval": (*_integer(1), "evaluate (and save) every eval_interval steps"),
    "eval_iters": (*_integer(1), "batches per validation loss: 0 gives no loss to save on"),
    "log_interval": (*_integer(1), ""),
    "warmup_tokens": (*_integer(0), ""),
    "lr_decay_tokens": (*_integer(0), ""),
    "bs_min_accum_steps": (*_integer(1), ""),
    "bs_max_accum_steps": (*_integer(0), "0 means gradient_accumulation_steps"),
    "learning_rate": (*_number(0, None, low_open=True), ""),
    "min_lr": (*_number(0, None), ""),
    "weight_decay": (*_number(0, None), ""),
    "grad_clip": (*_number(0, None), "0 disables clipping; a negative norm would flip every gradient"),
    "dropout": (*_number(0, 1), "a probability"),
    "beta1": (*_number(0, 1), "AdamW's decays; 0 means no averaging"),
    "beta2": (*_number(0, 1), "AdamW's decays; 0 means no averaging"),
    "gns_ema_decay": (*_number(0, 1, low_open=True), "a decay: 1 would freeze the running GNS"),
    "bs_gns_factor": (*_number(0, None, low_open=True), ""),
    "bs_cap": (*_number(0, None, low_open=True), "the 'grow' controller's cap, a multiple of the GNS"),
    "bs_gns_horizon": (*_integer(0), "examples; 0 means 20 x the configured batch"),
}
CHOICES = {"dtype": DTYPES, "init_from": INIT_FROM, "bs_schedule": BS_SCHEDULES}


def _flag(key, value):
    return f"--{key}={value!r}" if isinstance(value, str) else f"--{key}={value}"


def check(config, device_names=None):
    """The first problem with train.py's `config` (a dict of its settings) as one line, or None.

    device_names: the valid device_name values (model.py's PEAK_FLOPS), checked when given."""
    for key, (ok, valid, why) in RANGES.items():
        if key in config and not ok(config[key]):
            return f"{_flag(key, config[key])} is out of range: it must be {valid}" + (f" ({why})" if why else "")
    for key, choices in CHOICES.items():
        if key in config and config[key] not in choices:
            return f"unknown {key} {config[key]!r}; choose from {list(choices)}"
    if device_names is not None and config.get("device_name") not in device_names:
        return (
            f"unknown device_name {config.get('device_name')!r} (the MFU's peak FLOPS); choose from "
            f"{sorted(device_names)} (or add its peak bf16 FLOPS to PEAK_FLOPS in model.py)"
        )
    c = config
    if c["n_embd"] % c["n_head"]:
        divisors = [n for n in range(1, c["n_embd"] + 1) if c["n_embd"] % n == 0]
        return (
            f"--n_embd={c['n_embd']} is not divisible by --n_head={c['n_head']}: each head gets n_embd / n_head "
            f"channels; choose n_head in {divisors[:12]}{' ...' if len(divisors) > 12 else ''}"
        )
    if c["min_lr"] > c["learning_rate"]:
        return f"--min_lr={c['min_lr']} is above --learning_rate={c['learning_rate']}: the decay goes down to min_lr"
    if c["decay_lr"] and c["lr_decay_tokens"] <= c["warmup_tokens"]:
        return (
            f"--lr_decay_tokens={c['lr_decay_tokens']} must be above --warmup_tokens={c['warmup_tokens']} "
            "(the decay runs from the end of the warmup to lr_decay_tokens), or set --decay_lr=False"
        )
    for key in ("cos_attn", "spectral_c_attn", "fp32_attention_layers"):
        bad = [i for i in c[key] if type(i) is not int or not 0 <= i < c["n_layer"]]
        if bad:
            return f"--{key}={c[key]}: block indices must be integers in [0, n_layer={c['n_layer']}), got {bad}"
    return None
