"""
Tests for model.py, configurator.py and data/shakespeare_char/prepare.py.

    python -m pytest -q tests/test_model.py

The per-example layer classes ('shim', 'gns') must leave the model's numbers
untouched: same loss, same parameter gradients, same parameter names as plain
torch layers with the same weights (float64, so the tolerance can be tight).
"""

import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nanogns as lc  # noqa: E402
from model import GPT, PEAK_FLOPS, GPTConfig  # noqa: E402

NAMES = ["nn", "shim", "gns"]
SIZES = {  # n_embd 24 with 2 heads: head size 12; vocab 67: nothing a power of two
    "small": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64),
    "odd": dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab_size=67),
}


def build(layer_names=("nn", "nn", "nn"), **config):
    """A float64 GPT built with the given (linearclass, embeddingclass, lnclass)."""
    try:
        classes = lc.layer_classes(*layer_names)
    except ModuleNotFoundError as e:  # the layers' modules not importable
        pytest.skip(f"layer classes {layer_names} unavailable: {e}")
    torch.manual_seed(0)
    with lc.set_contextual_config(**classes):
        model = GPT(GPTConfig(dropout=0.0, **config))
    return model.double()


def batch(config, B=3, T=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    T = T or config["block_size"]
    x = torch.randint(0, config["vocab_size"], (B, T), generator=gen)
    y = torch.randint(0, config["vocab_size"], (B, T), generator=gen)
    return x, y


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# -----------------------------------------------------------------------------
# per-example layer classes give the plain model's numbers


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("layer_names", list(itertools.product(NAMES, repeat=3)), ids="-".join)
def test_layer_classes_match_nn(layer_names, size):
    config = SIZES[size]
    reference = build(**config)
    model = build(layer_names, **config)
    ref_params = {n: p.shape for n, p in reference.named_parameters()}
    assert {n: p.shape for n, p in model.named_parameters()} == ref_params
    assert list(dict(model.named_parameters())) == list(ref_params)  # same order too
    model.load_state_dict(reference.state_dict())

    x, y = batch(config)
    ref_loss, ref_grads = loss_and_grads(reference, x, y)
    loss, grads = loss_and_grads(model, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


@pytest.mark.parametrize(
    "layer_names", [("nn", "nn", "nn"), ("gns", "gns", "gns"), ("shim", "shim", "shim")], ids="-".join
)
def test_init_reaches_every_layer(layer_names):
    # nanoGPT's init: N(0, 0.02) weights, N(0, 0.02/sqrt(2 n_layer)) residual projections,
    # zero biases, LayerNorm ones/zeros; torch's default init would give std ~0.1 here
    config = dict(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=64)
    model = build(layer_names, **config)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert abs(p.std().item() - 0.01) < 0.002, name
        elif p.dim() == 2:
            assert abs(p.std().item() - 0.02) < 0.004, name
        elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            assert torch.all(p == 1), name
        else:
            assert torch.all(p == 0), name
    assert model.transformer.wte.weight is model.lm_head.weight


def test_positions_have_a_batch_dim():
    # wpe must see ids (B, T), or its gradient arrives summed over examples
    model = build(**SIZES["small"])
    seen = []
    model.transformer.wpe.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    model(*batch(SIZES["small"], B=3, T=5))
    assert seen == [torch.Size([3, 5])]


# -----------------------------------------------------------------------------
# options


@pytest.mark.parametrize("option", ["cos_attn", "spectral_c_attn", "fp32_attention_layers"])
def test_attention_options_run_and_train(option):
    config = dict(SIZES["small"], **{option: [1]})
    model = build(**config)
    x, y = batch(config)
    loss, grads = loss_and_grads(model, x, y)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())
    plain = build(**SIZES["small"])
    if option != "fp32_attention_layers":  # fp32 attention changes no math in float64
        plain.load_state_dict(model.state_dict(), strict=False)
        # at init attention is near uniform either way, so the difference is small but real
        assert abs(loss_and_grads(plain, x, y)[0] - loss) > 1e-8


def test_cos_attn_normalises_q_and_k():
    # with unit q and k the logits are cos/sqrt(hs): scaling c_attn's q and k rows changes nothing
    config = dict(SIZES["small"], cos_attn=[0, 1])
    model = build(**config)
    x, y = batch(config)
    loss = model(x, y)[1]
    C = config["n_embd"]
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * C] *= 3.0
            block.attn.c_attn.bias[: 2 * C] *= 3.0
    torch.testing.assert_close(model(x, y)[1], loss)


def test_spectral_c_attn_reparametrises_only_chosen_blocks():
    model = build(**dict(SIZES["small"], spectral_c_attn=[1]))
    names = dict(model.named_parameters())
    assert "transformer.h.0.attn.c_attn.weight" in names
    assert "transformer.h.1.attn.c_attn.parametrizations.weight.original" in names
    sigma = torch.linalg.matrix_norm(model.transformer.h[1].attn.c_attn.weight, ord=2)
    assert abs(sigma.item() - 1.0) < 0.05


@pytest.mark.parametrize("layer_names", [("nn", "nn", "nn"), ("gns", "gns", "gns")], ids="-".join)
def test_fp32_attention_under_autocast(layer_names):
    # under bf16 autocast the chosen block's attention sees float32 q, k, v
    try:
        classes = lc.layer_classes(*layer_names)
    except ModuleNotFoundError as e:
        pytest.skip(f"layer classes {layer_names} unavailable: {e}")
    torch.manual_seed(0)
    with lc.set_contextual_config(**classes):
        model = GPT(GPTConfig(dropout=0.0, fp32_attention_layers=[1], **SIZES["small"]))
    dtypes = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        dtypes.append(q.dtype)
        return original(q, k, v, **kwargs)

    x, y = batch(SIZES["small"])
    torch.nn.functional.scaled_dot_product_attention = recording_sdpa
    try:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    loss.backward()
    assert dtypes == [torch.bfloat16, torch.float32]
    assert torch.isfinite(loss)


def test_bad_block_index_is_a_clear_error():
    with pytest.raises(ValueError, match="cos_attn"):
        GPT(GPTConfig(cos_attn=[2], **SIZES["small"]))


@pytest.mark.parametrize("device_name", sorted(PEAK_FLOPS))
def test_estimate_mfu(device_name):
    config = dict(SIZES["small"], device_name=device_name)
    model = build(**config)
    N = model.get_num_params()
    L, H, Q, T = 2, 2, 16, config["block_size"]
    flops_per_iter = (6 * N + 12 * L * H * Q * T) * T * 4
    assert model.estimate_mfu(fwdbwd_per_iter=4, dt=0.5) == pytest.approx(
        flops_per_iter / 0.5 / PEAK_FLOPS[device_name]
    )
    assert {"A100", "A10", "H100", "H200", "cpu", "M1_eflops"} <= set(PEAK_FLOPS)


def test_unknown_device_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown device_name 'B9000'; choose from .*A100"):
        GPT(GPTConfig(device_name="B9000", **SIZES["small"]))
    model = build(**SIZES["small"])
    model.config.device_name = "B9000"
    with pytest.raises(ValueError, match="choose from"):
        model.estimate_mfu(1, 1.0)


def test_generate_and_crop_block_size():
    model = build(**SIZES["small"]).eval()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=20, top_k=5)
    assert out.shape == (2, 23)
    model.crop_block_size(8)
    assert model.transformer.wpe.weight.shape[0] == 8
    assert model(torch.zeros(1, 8, dtype=torch.long))[0].shape == (1, 1, 64)


def test_configure_optimizers_decays_2d_params_only():
    model = build(**SIZES["small"])
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert not optimizer.defaults.get("fused")


def test_from_pretrained_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="pip install transformers"):
        GPT.from_pretrained("gpt2")


# -----------------------------------------------------------------------------
# configurator.py, run the way train.py runs it: exec'd in a script's globals

FAKE_TRAIN = """
import sys
batch_size = 12
learning_rate = 6e-4
dataset = 'openwebtext'
compile = True
cos_attn = []
wandb_run_name = 'gpt2'
exec(open(sys.argv.pop(1)).read())
print(repr(dict(batch_size=batch_size, learning_rate=learning_rate, dataset=dataset,
                compile=compile, cos_attn=cos_attn, wandb_run_name=wandb_run_name)))
"""


def run_configurator(tmp_path, *args):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    return subprocess.run(
        [sys.executable, str(script), os.path.join(ROOT, "configurator.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


def final_config(result):
    assert result.returncode == 0, result.stderr
    return eval(result.stdout.strip().splitlines()[-1])


def test_configurator_overrides(tmp_path):
    (tmp_path / "my_config.py").write_text("batch_size = 4\n_scratch = 3\nlearning_rate = batch_size * 1e-4\n")
    result = run_configurator(
        tmp_path,
        "my_config.py",
        "--cos_attn=[1]",
        "--learning_rate=1",
        "--compile=False",
        "--dataset=shakespeare_char",
        "--wandb_run_name=2024",
    )
    assert final_config(result) == dict(
        batch_size=4, learning_rate=1.0, dataset="shakespeare_char", compile=False, cos_attn=[1], wandb_run_name="2024"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--batch_sise=4"],
            "configurator: unknown config key 'batch_sise' (from --batch_sise=4); did you mean batch_size?",
        ),
        (
            ["--batch_size=4.5"],
            "configurator: config key 'batch_size' (from --batch_size=4.5) expects int like its default 12, got float 4.5",
        ),
        (["--compile=1"], "expects bool"),
        (["--cos_attn=1"], "expects list"),
        (["--batch_size", "4"], "'--batch_size' has no value; write --batch_size=VALUE"),
        (["batch_size=4"], "overrides are written --batch_size=4"),
        (["config/nope.py"], "configurator: config file 'config/nope.py' not found"),
    ],
)
def test_configurator_errors_are_one_line(tmp_path, args, message):
    result = run_configurator(tmp_path, *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_configurator_checks_config_files(tmp_path):
    (tmp_path / "old_nanogpt.py").write_text("warmup_iters = 100\n")
    result = run_configurator(tmp_path, "old_nanogpt.py")
    assert result.returncode != 0
    assert "unknown config key 'warmup_iters' (from old_nanogpt.py)" in result.stderr
    assert "valid keys: batch_size, compile, cos_attn, dataset, learning_rate, wandb_run_name" in result.stderr


# -----------------------------------------------------------------------------
# the repository's config files and data preparation


@pytest.mark.parametrize(
    "name", ["train_shakespeare_char.py", "train_shakespeare_char_cpu.py", "train_cgpt_111M_owt.py"]
)
def test_config_files_use_only_train_keys(name):
    train_keys = set(
        """out_dir eval_interval log_interval eval_iters eval_only always_save_checkpoint init_from
        wandb_log wandb_project wandb_run_name dataset gradient_accumulation_steps batch_size block_size n_layer
        n_head n_embd dropout bias linearclass embeddingclass lnclass cos_attn spectral_c_attn fp32_attention_layers
        learning_rate max_iters max_tokens weight_decay beta1 beta2 grad_clip decay_lr warmup_tokens lr_decay_tokens
        min_lr backend device device_name dtype compile gns_ema_decay""".split()
    )
    scope = {}
    with open(os.path.join(ROOT, "config", name)) as f:
        exec(f.read(), scope)
    keys = {k for k in scope if not k.startswith("_")}
    assert keys <= train_keys, keys - train_keys
    if "device_name" in scope:
        assert scope["device_name"] in PEAK_FLOPS
    tokens_per_iter = scope["batch_size"] * scope["block_size"] * scope.get("gradient_accumulation_steps", 1)
    assert scope["max_tokens"] % tokens_per_iter == 0 and scope["warmup_tokens"] % tokens_per_iter == 0


def test_prepare_shakespeare_char_offline(tmp_path):
    source = os.path.join(ROOT, "data", "shakespeare_char")
    data_dir = tmp_path / "shakespeare_char"
    data_dir.mkdir()
    for name in ["prepare.py", "input.txt"]:
        shutil.copy(os.path.join(source, name), data_dir / name)
    result = subprocess.run(
        [sys.executable, str(data_dir / "prepare.py")], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert not (data_dir / "meta.pkl").exists()
    with open(data_dir / "meta.json") as f:
        meta = json.load(f)
    assert meta["vocab_size"] == 65 and len(meta["itos"]) == len(meta["stoi"]) == 65
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    text = (data_dir / "input.txt").read_text()
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    assert "".join(meta["itos"][int(i)] for i in val[:50]) == text[len(train) : len(train) + 50]
