"""
The valid range of each train.py setting, checked at start-up before anything is created: a bad value is one
line naming the flag and its range, never a run that trains silently wrong or a traceback deep inside.

    problem = settings.check(config)     # None, or "--grad_clip=-1.0: ..." for train.py's fail()
    problem = settings.device_problem(device)                     # a device torch cannot use here
    problem = settings.model_size_problem(model_args, device)     # a model too large to allocate, sized first
    problem = settings.model_args_problem(model_args)             # a checkpoint's model_args that build no GPT
    problem, notes = settings.resume_check(config, checkpoint, has_log, vocab_size)  # a resume that would change the run
    problem = settings.continuation_problem(out_dir, checkpoint)   # a checkpoint that does not continue out_dir's log

configurator.py has checked each key's name and type already; this checks values and their relations. Each
function returns one line (or None) and raises nothing: the scripts print it and exit.

What a resume may change (resume_check), decided for a user who trusts the run's log:
- the model cannot change: every key of the checkpoint's model_args that makes the model (n_layer, n_head, n_embd,
  bias, block_size, cos_attn, spectral_c_attn, fp32_attention_layers; a key an older checkpoint lacks counts as
  its default) is compared with its flag, and a different one is refused naming it: the weights and optimizer
  state are that model's, and the same weights in another function would train another model under the same log
  (a block_size that changed would also change what one example is, in which the GNS counts). Its vocab_size is
  compared with the dataset's meta.json. dropout and device_name may change (nanoGPT's fine-tuning changes
  dropout; device_name is the MFU's denominator), each said in one line;
- the training data cannot change order: --data_seed must be the checkpoint's (another seed draws other batches
  from the checkpoint's step on);
- batch_size and gradient_accumulation_steps may change: the log's batch_size and tokens_processed columns record
  each step's, gns-analysis reports the change, and config.json (rewritten at every start) holds what trains now;
- what the log measures cannot change while the directory holds the log: a layer choice that would stop (or
  start, or swap exact for approximate) per-example norms is refused naming the flag; shim, gns and fused
  measure the same and may be swapped. Without a log (a new out_dir holding a copy of ckpt.pt) it may change;
- a checkpoint without a token count (nanoGPT's) continues at iter_num x the tokens of one of its steps
  (resumed_tokens), said in one line.

Whether the checkpoint continues the log in out_dir (continuation_problem, on the process that reads out_dir): a
checkpoint of another run copied into a run directory would append its steps to that run's log. Refused: a run id
(config["run_id"], kept by every resume) other than the one in out_dir's config.json, or another data_seed, or a
row of the log at the checkpoint's last step whose iter_num, tokens_processed or batch_size is not the
checkpoint's. A checkpoint copied into a new out_dir (no log) starts a new log, as before.
"""

import json
import math
import os

import torch

from nanogns.runlog.reader import last_row_of_step
from nanogns.runlog.writer import CONFIG_JSON

DTYPES = ("float32", "bfloat16", "float16")
INIT_FROM = ("scratch", "resume", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
BS_SCHEDULES = ("none", "linear", "gns", "sqrt", "grow", "goodput", "temper")  # the last four: CONTROLLER_RULES


def _integer(low, high=None):
    if high is None:
        return lambda v: v >= low, f"an integer >= {low}"
    return lambda v: low <= v <= high, f"an integer in [{low}, {high:,}]"


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
    "eval_iters": (*_integer(1, 10**6), "batches per validation loss: 0 gives no loss to save on"),
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
    "bs_cap": (*_number(0, None), "a multiple of the GNS; 0 means the rule's default"),
    "bs_anchor": (*_number(0, None), "examples; 0 means the rule's default"),
    "bs_ratio": (*_number(1, None, low_open=True), "'temper': the GNS's growth per halving"),
    "bs_lr_exponent": (*_number(-1, 1), "the LR's power of the batch ratio (0.5: Adam's square root)"),
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


# -----------------------------------------------------------------------------
# the device, and a model's size before it is allocated


def device_problem(device):
    """Why `device` (train.py's or sample.py's --device) cannot run here, or None."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"--device={device!r} is not a device: use cpu, cuda, cuda:N (a GPU's index) or mps"
    if d.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"device={device!r} but this torch ({torch.__version__}) sees no CUDA GPU; run with "
                "--device=cpu --dtype=float32 --compile=False, or install a CUDA build of torch on a GPU machine"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            return f"--device={device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 and on"
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            return f"--device={device!r}: this machine or torch build has no MPS (Apple GPU) backend; use --device=cpu"
    elif d.type != "cpu":
        return f"--device={device!r}: the scripts run on cpu, cuda or mps"
    return None


TRAINING_BYTES_PER_PARAMETER = 16  # float32 weight, gradient and AdamW's two moments


def parameter_count(n_layer, n_embd, block_size, vocab_size, bias=True):
    """The parameters of model.py's GPT: token and position tables (the head is tied to the first), and per block
    the attention (4 n_embd^2) and the MLP (8 n_embd^2), biases and LayerNorms included."""
    per_block = 12 * n_embd**2 + (13 if bias else 2) * n_embd
    return n_layer * per_block + (vocab_size + block_size) * n_embd + (2 if bias else 1) * n_embd


def activation_bytes(n_layer, n_embd, block_size, batch_size, dtype="float32"):
    """A lower bound on what one micro-batch's forward keeps for its backward: per token and block at least 16
    vectors of n_embd (the inputs of the two LayerNorms, of the QKV, output and MLP projections, the attention's
    output, the MLP's 4 n_embd hidden layer before and after GELU), in the run's dtype."""
    return n_layer * batch_size * block_size * 16 * n_embd * (4 if dtype == "float32" else 2)


def memory_of(device):
    """(bytes of memory of `device`, its name in words): a GPU's own memory, else the machine's RAM."""
    d = torch.device(device)
    if d.type == "cuda":
        index = d.index if d.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"{device}'s memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def model_size_problem(model_args, device, batch_size=0, dtype="float32", training=True, vocab_source=""):
    """Why a GPT of `model_args` cannot run on `device`, sized before anything is allocated, or None: training
    needs its float32 weights, gradients and AdamW's two moments and one micro-batch's activations (of
    batch_size examples); sampling (training=False) its weights. vocab_source names where vocab_size came from."""
    m = model_args
    n = parameter_count(m["n_layer"], m["n_embd"], m["block_size"], m["vocab_size"], m.get("bias", True))
    if training:
        need = n * TRAINING_BYTES_PER_PARAMETER
        need += activation_bytes(m["n_layer"], m["n_embd"], m["block_size"], batch_size, dtype)
        what = "float32 weights, gradients and AdamW's two moments, and one micro-batch's activations"
    else:
        need, what = n * (2 if dtype in ("bfloat16", "float16") else 4), f"{dtype} weights"
    have, where = memory_of(device)
    if need <= have:
        return None
    shape = ", ".join(f"{k}={m[k]:,}" for k in ("n_layer", "n_embd", "block_size", "vocab_size"))
    return (
        f"the model would have {n:,} parameters ({shape}{vocab_source}): {'training' if training else 'running'} "
        f"it takes at least {need / 2**30:,.1f} GiB ({what}), more than the {have / 2**30:,.1f} GiB of {where}; "
        "lower --n_layer or --n_embd" + (" (or --batch_size)" if training else "")
    )


GPT_SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
MODEL_ARGS = (*GPT_SIZES, "bias")


def model_args_problem(model_args):
    """What in a checkpoint's model_args builds no GPT (a missing key, a string for a number, n_head not
    dividing n_embd), as words to follow "its model_args ..."; or None."""
    if not isinstance(model_args, dict):
        return f"are a {type(model_args).__name__}, not a dict"
    missing = [k for k in MODEL_ARGS if k not in model_args]
    if missing:
        return f"lack {', '.join(missing)}"
    for k in GPT_SIZES:
        if type(model_args[k]) is not int or model_args[k] < 1:
            return f"have {k}={model_args[k]!r}, not a positive integer"
    if type(model_args["bias"]) is not bool:
        return f"have bias={model_args['bias']!r}, not True or False"
    if model_args["n_embd"] % model_args["n_head"]:
        return f"have n_embd={model_args['n_embd']} not divisible by n_head={model_args['n_head']}"
    return None


# -----------------------------------------------------------------------------
# a resume continues the checkpoint's run (see the module docstring for what may change)

LAYER_CHOICES = ("linearclass", "embeddingclass", "lnclass")


def measures(layer_choice):
    """What a layer choice writes to the log: the registry's variants all record exact norms but 'nn' (nothing),
    'sogns' (approximate) and 'gns+sogns' (both)."""
    return {"nn": "nothing", "sogns": "approximate norms", "gns+sogns": "exact and approximate norms"}.get(
        layer_choice, "exact per-example norms"
    )


# the keys of model_args a resume may change, and why (the rest make the model: a change is refused)
MAY_CHANGE = {
    "dropout": "dropout is a training setting, not part of the weights (nanoGPT's fine-tuning changes it)",
    "device_name": "only the MFU's denominator",
}
MODEL_DEFAULTS = {
    "cos_attn": [],
    "spectral_c_attn": [],
    "fp32_attention_layers": [],
    "dropout": 0.0,
}  # older checkpoints


def resume_check(config, checkpoint, has_log, vocab_size=None):
    """(the first reason this resume would not continue the checkpoint's run, as one line naming the flag, or None;
    notes: lines saying what changes, to print).

    config: train.py's settings; checkpoint: the loaded checkpoint (model_args checked already); has_log: out_dir
    holds the run's log; vocab_size: the dataset's (its meta.json), or None."""
    old, model_args = checkpoint.get("config") or {}, checkpoint["model_args"]
    notes = []
    for k in model_args:
        if k == "vocab_size" or k not in config:
            continue
        was = model_args[k]
        if config[k] == was:
            continue
        if k in MAY_CHANGE:
            notes.append(f"note: --{k}={config[k]} differs from the checkpoint's {k}={was!r} ({MAY_CHANGE[k]})")
        elif k == "block_size":
            return (
                f"--block_size={config['block_size']} differs from the checkpoint's block_size={was}: its model "
                f"and optimizer state hold {was} positions, and the GNS counts examples, which would change length "
                f"mid-run; resume with --block_size={was}"
            ), []
        else:
            return (
                f"--{k}={config[k]} differs from the checkpoint's {k}={was}: a resume continues the checkpoint's "
                f"model; resume with --{k}={was} (or train a new model in a new out_dir)"
            ), []
    for k, default in MODEL_DEFAULTS.items():  # a checkpoint written before the key existed: its model had the default
        if k not in model_args and k in config and config[k] != default and k not in MAY_CHANGE:
            return (
                f"--{k}={config[k]}: the checkpoint's model has {k}={default} (its model_args predate {k}); a "
                f"resume continues that model; resume with --{k}={default} (or train a new model in a new out_dir)"
            ), []
    if vocab_size is not None and vocab_size != model_args["vocab_size"]:
        dataset, trained_on = config.get("dataset"), old.get("dataset", config.get("dataset"))
        fix = (
            f"resume with the run's --dataset={trained_on!r}"
            if trained_on != dataset
            else "prepare the dataset as the run had it (its meta.json changed), or train a new model in a new out_dir"
        )
        return (
            f"--dataset={dataset!r} has vocab_size={vocab_size} (its meta.json), where the checkpoint's model has "
            f"vocab_size={model_args['vocab_size']}: a resume continues the checkpoint's run on its data; {fix}"
        ), []
    if "data_seed" in old and "data_seed" in config and old["data_seed"] != config["data_seed"]:
        return (
            f"--data_seed={config['data_seed']} differs from the checkpoint's data_seed={old['data_seed']}: its "
            f"run's batches are drawn from that seed, and another would train on other batches from this step on; "
            f"resume with --data_seed={old['data_seed']}"
        ), []
    if has_log:
        for k in LAYER_CHOICES:
            if k in old and measures(old[k]) != measures(config[k]):
                return (
                    f"--{k}={config[k]} measures {measures(config[k])}, where the checkpoint's run measured "
                    f"{measures(old[k])} with {k}={old[k]!r}: its log would change what it records mid-run; resume "
                    f"with --{k}={old[k]}, or copy ckpt.pt into a new --out_dir and resume there to start a new log"
                ), []
    for k in ("batch_size", "gradient_accumulation_steps"):
        if k in old and old[k] != config[k]:
            notes.append(
                f"note: --{k}={config[k]} differs from the checkpoint's {old[k]}: from this step on the log's "
                "batch_size and tokens_processed columns count the new batch (gns-analysis reports the change)"
            )
    return None, notes


def checkpoint_tokens(checkpoint):
    """The tokens the checkpoint's model had trained on (its tokens_processed buffer), or None (nanoGPT's)."""
    weights = checkpoint.get("model") or {}
    for key in ("tokens_processed", "_orig_mod.tokens_processed"):
        if key in weights:
            return int(weights[key])
    return None


def _number(cell):
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None


def continuation_problem(out_dir, checkpoint):
    """Why the checkpoint in out_dir does not continue the log in out_dir, as one line, or None (see the module
    docstring): another run's id or data_seed in config.json, or the log's row at the checkpoint's last step with
    another iter_num, tokens_processed or batch_size. Reads out_dir: call it on the process that writes the log."""
    ckpt, old = os.path.join(out_dir, "ckpt.pt"), checkpoint.get("config") or {}
    fix = (
        "resume the run this checkpoint belongs to in its own out_dir, or copy ckpt.pt alone into a new --out_dir "
        "and resume there to start a new log from it"
    )
    try:
        with open(os.path.join(out_dir, CONFIG_JSON)) as f:
            run = json.load(f)
    except (OSError, ValueError):  # no config.json (a library log, an older run), or one that is not JSON
        run = {}
    run = run if isinstance(run, dict) else {}
    for key in ("run_id", "data_seed"):
        if key in run and key in old and run[key] != old[key]:
            return (
                f"cannot resume: {ckpt} was written by another run ({key}={old[key]!r}) than the log in {out_dir} "
                f"({key}={run[key]!r} in its {CONFIG_JSON}); its steps would be appended to that run's log: {fix}"
            )
    log_step = checkpoint.get("log_step")
    if not isinstance(log_step, int) or log_step < 1:
        return None
    try:
        row = last_row_of_step(out_dir, log_step - 1)
    except FileNotFoundError:
        return None
    except ValueError as e:  # a log in another encoding, say: one line
        return f"cannot continue the log: {e}"
    if row is None:  # the log lacks the step: the writer says which steps are missing
        return None
    expected = {"iter_num": checkpoint.get("iter_num"), "tokens_processed": checkpoint_tokens(checkpoint)}
    expected["iter_num"] = expected["iter_num"] - 1 if isinstance(expected["iter_num"], int) else None
    ranks, accum = checkpoint.get("ranks"), checkpoint.get("accum_steps")
    if isinstance(ranks, list) and type(accum) is int and type(old.get("batch_size")) is int:
        expected["batch_size"] = accum * len(ranks) * old["batch_size"]
    for key, value in expected.items():
        logged = _number(row.get(key))
        if value is not None and logged is not None and logged != value:
            return (
                f"cannot resume: {ckpt} does not continue the log in {out_dir}: the log's step {log_step - 1} (the "
                f"checkpoint's last) has {key}={logged:,.0f}, the checkpoint {key}={value:,}; its steps would be "
                f"appended to another run's log: {fix}"
            )
    return None


def resumed_tokens(checkpoint, tokens_per_iter):
    """(the tokens a checkpoint without a token count (nanoGPT's) had trained on, a note saying how they were
    counted): iter_num x the tokens of one of its steps, from its config where it has them, else this run's."""
    old, iter_num = checkpoint.get("config") or {}, checkpoint["iter_num"]
    keys = ("gradient_accumulation_steps", "batch_size", "block_size")
    if all(type(old.get(k)) is int for k in keys):
        per_iter = math.prod(old[k] for k in keys)
        source = "its config's gradient_accumulation_steps x batch_size x block_size"
    else:
        per_iter, source = tokens_per_iter, "this run's tokens per iteration"
    tokens = iter_num * per_iter
    return tokens, (
        f"note: the checkpoint holds no token count (nanoGPT's checkpoints do not): the run continues at "
        f"{iter_num} iterations x {per_iter:,} tokens ({source}) = {tokens:,} tokens, where the learning-rate "
        "schedule and max_tokens count from; the running GNS starts afresh"
    )


def what_ends(iter_num, tokens, max_iters, max_tokens):
    """The words after 'nothing left to do: ...': which limit ends the run and what to raise, for a resume."""
    reached = ([f"max_iters={max_iters}"] if iter_num >= max_iters else []) + (
        [f"max_tokens={max_tokens:,}"] if tokens >= max_tokens else []
    )
    flags = " and ".join(f"--{limit.split('=')[0]}" for limit in reached)
    return (
        f"{' and '.join(reached)} {'end' if len(reached) > 1 else 'ends'} the run; its files are left untouched "
        f"(raise {flags} to train further{', both' if len(reached) > 1 else ''})"
    )
