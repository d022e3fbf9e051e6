"""
Every train.py setting in its range (nanogns/settings.py): each bad value is one line naming the flag and its
valid range, and train.py's own defaults and configs pass. The end-to-end check that such a line is all train.py
prints, and that it creates nothing, is in tests/test_train_hostile.py.

    python -m pytest -q tests/test_settings.py
"""

import os
import runpy

import pytest
import torch
from conftest import REPO

from model import PEAK_FLOPS
from nanogns import settings


def train_defaults():
    """train.py's config block (between its first two rulers), run on its own."""
    with open(os.path.join(REPO, "train.py")) as f:
        source = f.read()
    block = source.split("# -----------------------------------------------------------------------------\n")[1]
    scope = {}
    exec("import torch\n" + block, scope)
    return {k: v for k, v in scope.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, list))}


DEFAULTS = train_defaults()
PEAK = sorted(PEAK_FLOPS)


@pytest.mark.parametrize("config", ["defaults", *sorted(os.listdir(os.path.join(REPO, "config")))])
def test_the_defaults_and_every_config_pass(config):
    values = dict(DEFAULTS, device_name="cpu")
    if config != "defaults":
        values.update({k: v for k, v in runpy.run_path(os.path.join(REPO, "config", config)).items() if k in DEFAULTS})
    assert settings.check(values, device_names=PEAK) is None


CASES = [
    # the cases
    ({"grad_clip": -1.0}, "--grad_clip=-1.0 is out of range: it must be a number in [0, inf) (0 disables clipping"),
    ({"n_layer": 0}, "--n_layer=0 is out of range: it must be an integer >= 1"),
    ({"n_layer": -1}, "--n_layer=-1 is out of range: it must be an integer >= 1"),
    ({"gradient_accumulation_steps": 0}, "--gradient_accumulation_steps=0 is out of range: it must be an integer >= 1"),
    ({"gradient_accumulation_steps": -2}, "--gradient_accumulation_steps=-2 is out of range"),
    ({"max_iters": -5}, "--max_iters=-5 is out of range: it must be an integer >= 1"),
    ({"eval_iters": 0}, "--eval_iters=0 is out of range: it must be an integer in [1, 1,000,000]"),
    (
        {"eval_iters": 10**20},
        "--eval_iters=100000000000000000000 is out of range: it must be an integer in [1, 1,000,000]",
    ),
    ({"gns_ema_decay": 1.0}, "--gns_ema_decay=1.0 is out of range: it must be a number in (0, 1)"),
    ({"block_size": -1}, "--block_size=-1 is out of range: it must be an integer >= 1"),
    ({"n_embd": 0}, "--n_embd=0 is out of range: it must be an integer >= 1"),
    ({"n_head": 5}, "--n_embd=768 is not divisible by --n_head=5: each head gets n_embd / n_head channels"),
    ({"dtype": "float64"}, "unknown dtype 'float64'; choose from ['float32', 'bfloat16', 'float16']"),
    ({"eval_interval": 0}, "--eval_interval=0 is out of range: it must be an integer >= 1"),
    ({"learning_rate": -1.0}, "--learning_rate=-1.0 is out of range: it must be a number in (0, inf)"),
    ({"dropout": 2.0}, "--dropout=2.0 is out of range: it must be a number in [0, 1) (a probability)"),
    ({"init_from": "gpt3"}, "unknown init_from 'gpt3'; choose from ['scratch', 'resume', 'gpt2', 'gpt2-medium'"),
    # and beside them
    ({"batch_size": 0}, "--batch_size=0 is out of range: it must be an integer >= 1"),
    ({"n_head": 0}, "--n_head=0 is out of range: it must be an integer >= 1"),
    ({"max_tokens": 0}, "--max_tokens=0 is out of range"),
    ({"log_interval": 0}, "--log_interval=0 is out of range"),
    ({"dropout": 1.0}, "--dropout=1.0 is out of range: it must be a number in [0, 1)"),
    ({"gns_ema_decay": 0.0}, "--gns_ema_decay=0.0 is out of range: it must be a number in (0, 1)"),
    ({"beta1": 1.0}, "--beta1=1.0 is out of range: it must be a number in [0, 1)"),
    ({"beta2": -0.1}, "--beta2=-0.1 is out of range: it must be a number in [0, 1)"),
    ({"weight_decay": -0.1}, "--weight_decay=-0.1 is out of range: it must be a number in [0, inf)"),
    ({"learning_rate": float("inf")}, "--learning_rate=inf is out of range"),
    ({"min_lr": 1.0}, "--min_lr=1.0 is above --learning_rate=0.0006: the decay goes down to min_lr"),
    ({"warmup_tokens": -1}, "--warmup_tokens=-1 is out of range: it must be an integer >= 0"),
    ({"lr_decay_tokens": 10, "warmup_tokens": 10}, "--lr_decay_tokens=10 must be above --warmup_tokens=10"),
    (
        {"bs_schedule": "cosine"},
        "unknown bs_schedule 'cosine'; choose from ['none', 'linear', 'gns', 'sqrt', 'grow', 'goodput', 'temper']",
    ),
    ({"bs_gns_factor": 0.0}, "--bs_gns_factor=0.0 is out of range: it must be a number in (0, inf)"),
    ({"bs_min_accum_steps": 0}, "--bs_min_accum_steps=0 is out of range: it must be an integer >= 1"),
    ({"cos_attn": [12]}, "--cos_attn=[12]: block indices must be integers in [0, n_layer=12), got [12]"),
    ({"fp32_attention_layers": ["1"]}, "--fp32_attention_layers=['1']: block indices must be integers"),
    ({"device_name": "TPU"}, f"unknown device_name 'TPU' (the MFU's peak FLOPS); choose from {PEAK}"),
]


@pytest.mark.parametrize("changes, message", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c, _ in CASES])
def test_each_bad_value_is_one_line_naming_the_flag_and_its_range(changes, message):
    problem = settings.check({**DEFAULTS, "device_name": "A100", **changes}, device_names=PEAK)
    assert problem is not None and problem.startswith(message), problem
    assert "\n" not in problem


def test_lr_decay_tokens_may_equal_the_warmup_without_decay():
    values = dict(DEFAULTS, device_name="A100", lr_decay_tokens=10, warmup_tokens=10, decay_lr=False)
    assert settings.check(values, device_names=PEAK) is None


@pytest.mark.parametrize("bias", [True, False])
def test_the_parameter_count_that_sizes_a_model_before_it_is_built_is_the_models(bias):
    from model import GPT, GPTConfig

    sizes = dict(n_layer=3, n_head=2, n_embd=24, block_size=16, vocab_size=65)
    model = GPT(GPTConfig(**sizes, bias=bias))
    count = settings.parameter_count(3, 24, 16, 65, bias)
    assert count == sum(p.numel() for p in model.parameters())
    fits = settings.model_size_problem({**sizes, "bias": bias}, "cpu", batch_size=4)
    assert fits is None
    huge = settings.model_size_problem({**sizes, "n_layer": 10**9, "bias": bias}, "cpu", batch_size=4)
    assert huge.startswith(f"the model would have {settings.parameter_count(10**9, 24, 16, 65, bias):,} parameters")


@pytest.mark.parametrize(
    "model_args, problem",
    [
        ({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 65, "bias": False}, None),
        ({"n_layer": 2, "n_head": 3, "n_embd": 32, "block_size": 16, "vocab_size": 65, "bias": False}, "have n_embd"),
        ({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 65}, "lack bias"),
        ({"n_layer": 2.0, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 65, "bias": False}, "have n_l"),
        ({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 65, "bias": "no"}, "have bias"),
        ([1, 2], "are a list, not a dict"),
    ],
)
def test_a_checkpoints_model_args_that_build_no_gpt_are_named(model_args, problem):
    found = settings.model_args_problem(model_args)
    assert found == problem if problem is None else found.startswith(problem), found


def test_a_device_torch_cannot_use_here_is_named():
    assert settings.device_problem("cpu") is None
    assert settings.device_problem("gpu").startswith("--device='gpu' is not a device")
    if not torch.cuda.is_available():
        assert "sees no CUDA GPU" in settings.device_problem("cuda:0")
    else:
        assert settings.device_problem(f"cuda:{torch.cuda.device_count()}").startswith("--device=")
