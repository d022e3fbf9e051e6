"""
The package installs into another project's environment, as the README says, in a fresh virtual environment that
borrows nothing from this one (no site-packages of ours, no PYTHONPATH): first with torch, numpy and pandas alone
(no Triton, no trainers, no plotting), then with the extras. Each time, from a directory outside the checkout, the
README's library example runs as written and `nanogns-analysis` reads its log.

Installs use this environment's pip (`pip --python`, so the new environment needs no pip of its own), torch's CPU
build of the version running here from PyTorch's index (as .ci/run), and `--no-compile` (bytecode is compiled on
first import instead: the install takes seconds, not minutes).

    python -m pytest -q tests/test_install.py
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO

IGNORED = (".git", ".venv", "out*", "build", "*.egg-info", "__pycache__", "*.bin", "*.pt", "wandb", ".pytest_cache")
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
EXAMPLE_MARK = "<!-- run by tests/test_install.py: the library example, in a clean environment -->"
INSTALL_MARK = "<!-- run by tests/test_install.py: the install lines -->"

FUSED_SCRIPT = """
import warnings
import torch
import torch.nn as nn
from nanogns import convert
from nanogns.variants.fused import HAS_TRITON
assert not HAS_TRITON
model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
convert(model, linearclass="fused", lnclass="fused")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model(torch.randn(2, 5, 4)).sum().backward()
messages = sorted({str(w.message) for w in caught})
assert len(messages) == 1 and "Triton is not installed" in messages[0], messages
print("fused:", messages[0].splitlines()[0])
"""

TRAINER_SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from nanogns.integrations import TrainerGNSCallback
from nanogns.variants.fused import HAS_TRITON
assert HAS_TRITON

config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 32, (16, 8))
data = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir="out-trainer", max_steps=2, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                         logging_steps=1, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.add_callback(TrainerGNSCallback(trainer))
trainer.train()
print("trainer: ok")
"""


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def block_after(text, mark, language):
    """The fenced block of `language` right after the marker comment."""
    found = re.search(re.escape(mark) + r"\s*```" + language + r"\n(.*?)```", text, re.DOTALL)
    assert found, f"README.md has no {language} block after {mark!r}"
    return found.group(1)


def install_lines():
    """The README's install commands, each with its comment stripped: [(command, what it installs)]."""
    lines = [line.split("#")[0].strip() for line in block_after(readme(), INSTALL_MARK, "bash").splitlines()]
    return [line for line in lines if line]


def run(args, cwd, env, timeout=900):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def pip_into(python, *args, cwd, env):
    return run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile", *args], cwd, env)


@pytest.mark.slow
def test_install_lines_then_the_readme_example_without_and_with_the_extras(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    isolated = run(
        [python, "-c", "import sys; print(sys.flags.no_site, [p for p in sys.path if 'site-packages' in p])"],
        tmp_path,
        env,
    )
    assert str(venv) in isolated and REPO not in isolated, isolated  # its own site-packages only

    # torch first (the README's step before the package), the build of the version running here
    version = torch.__version__.split("+")[0]
    pip_into(python, f"torch=={version}", "--index-url", TORCH_INDEX, "--retries", "0", cwd=tmp_path, env=env)
    # the checkout, by the README's first install line, from the directory above a copy of it
    parent = tmp_path / "src"
    shutil.copytree(REPO, parent / "nanoGNS-exact", ignore=shutil.ignore_patterns(*IGNORED))
    plain, with_extras = install_lines()[:2]
    assert plain.startswith("pip install ") and "[" not in plain, plain
    pip_into(python, *shlex.split(plain)[2:], cwd=parent, env=env)
    assert not (venv / "bin" / "pip").exists()  # every install went through this environment's pip --python
    for absent in ("triton", "plotille", "matplotlib", "transformers"):
        found = subprocess.run([python, "-c", f"import {absent}"], cwd=tmp_path, env=env, capture_output=True)
        assert found.returncode != 0, f"{absent} is in the clean environment"

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "library_example.py").write_text(block_after(readme(), EXAMPLE_MARK, "python"))
    assert "running GNS" in run([python, "library_example.py"], work, env)
    (work / "fused_without_triton.py").write_text(textwrap.dedent(FUSED_SCRIPT))
    assert "pip install triton" in run([python, "fused_without_triton.py"], work, env)
    analysis = run([str(venv / "bin" / "nanogns-analysis"), "out-tiny"], work, env)
    assert "Final GNS" in analysis and "Traceback" not in analysis, analysis
    assert 'for the plots, pip install "nanogns[plot]"' in analysis.splitlines()[-1], analysis
    assert (work / "out-tiny" / "gns_analysis.csv").exists()
    assert not list((work / "out-tiny").glob("*.png"))

    # the extras, by the README's second install line: trainers, plots and Triton on top
    assert with_extras.startswith("pip install ") and "[" in with_extras, with_extras
    pip_into(python, *shlex.split(with_extras)[2:], cwd=parent, env=env)
    (work / "trainer_run.py").write_text(textwrap.dedent(TRAINER_SCRIPT))
    assert run([python, "trainer_run.py"], work, env).strip().endswith("trainer: ok")
    for out_dir in ("out-tiny", "out-trainer"):
        analysis = run([str(venv / "bin" / "nanogns-analysis"), out_dir], work, env)
        assert "Final GNS" in analysis and "for the plots" not in analysis, analysis
        assert list((work / out_dir).glob("gns_over_tokens.png")), analysis
    assert not (work / "nanogns").exists()


def test_the_git_install_form_installs_the_committed_package(tmp_path):
    """The README's git line, copied as written from the directory above a clone (as its other install lines are),
    builds the package from git with an extra named (checked without installing its dependencies). It was
    `pip install "git+$REPO_URL"`, which named no URL and showed no extra."""
    line = next(line for line in install_lines() if "git+" in line)
    assert line == 'pip install "nanogns[plot] @ git+file://$PWD/nanoGNS-exact"', line
    if not os.path.exists(os.path.join(REPO, ".git")):  # a directory, or a file in a git worktree
        pytest.skip("the checkout is not a git clone")
    parent = tmp_path / "src"
    parent.mkdir()
    subprocess.run(["git", "clone", "-q", REPO, str(parent / "nanoGNS-exact")], check=True)
    wheel_dir = tmp_path / "wheels"
    command = line.replace("pip install", f"{shlex.quote(sys.executable)} -m pip wheel -q --no-deps -w {wheel_dir}", 1)
    done = subprocess.run(["sh", "-c", command], cwd=parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name.split("-")[0] for p in wheel_dir.iterdir()] == ["nanogns"]
