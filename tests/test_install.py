"""
The package installs into another project's environment: `pip install .` (not editable) of this checkout into a
fresh virtual environment, then, from a directory outside the checkout and with no PYTHONPATH, a convert() loop and a
transformers.Trainer run with only the README's import lines, and the installed analysis command on their logs.

The fresh environment borrows torch, transformers and the rest from the test's own environment through a .pth line
(so nothing large is downloaded); a path added that way is not a site directory, so the checkout's editable install
there is not seen, and the test checks that nanogns is imported from the fresh environment's own site-packages.

    python -m pytest -q tests/test_install.py
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORED = (".git", ".venv", "out*", "build", "*.egg-info", "__pycache__", "*.bin", "*.pt", "wandb", ".pytest_cache")

CONVERT_SCRIPT = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from nanogns import convert, GNSMonitor, LogWrapper

import nanogns
assert nanogns.__file__.startswith(VENV), nanogns.__file__

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 11)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))

torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
log = LogWrapper(out_dir="out-convert")
monitor = convert(model, log=log)
assert isinstance(monitor, GNSMonitor) and len(monitor.tracked) == 5, monitor.untracked
for step in range(3):
    for _ in range(2):  # gradient accumulation
        ids = torch.randint(0, 11, (4, 6))
        loss = F.cross_entropy(model(ids).transpose(1, 2), ids) / 2
        loss.backward()
    monitor.step(batch_size=8)
    optimizer.step()
    optimizer.zero_grad()
    log.log({"iter_num": step, "tokens_processed": (step + 1) * 48})
    log.step()
log.close()
print("convert: ok")
"""

TRAINER_SCRIPT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from nanogns.integrations import TrainerGNSCallback

import nanogns.integrations
assert nanogns.integrations.__file__.startswith(VENV), nanogns.integrations.__file__

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


@pytest.mark.slow
def test_pip_install_then_the_readme_imports_from_outside_the_checkout(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "zz_borrowed_packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers, pandas...: not a site dir
    source = tmp_path / "checkout"  # a copy: setuptools builds in the source tree, which stays clean
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*IGNORED))
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(source)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    with open(os.path.join(site, f"nanogns-{installed_version(python)}.dist-info", "top_level.txt")) as f:
        assert f.read().split() == ["nanogns"]  # one package: no loose or generic top-level module

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name, script in (("convert_loop.py", CONVERT_SCRIPT), ("trainer_run.py", TRAINER_SCRIPT)):
        (work / name).write_text(f"VENV = {str(venv)!r}\n" + textwrap.dedent(script))
        done = subprocess.run([python, name], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.strip().endswith("ok"), done.stdout
    for out_dir in ("out-convert", "out-trainer"):
        analysis = subprocess.run(
            [str(venv / "bin" / "nanogns-analysis"), out_dir, "--no-plots"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert analysis.returncode == 0, analysis.stdout + analysis.stderr
        assert "Final GNS" in analysis.stdout, analysis.stdout
    assert not (work / "nanogns").exists() and not os.path.exists(os.path.join(work, "gns_analysis.csv"))


def installed_version(python):
    return subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('nanogns'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
