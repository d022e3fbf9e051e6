"""Shared test setup.

- Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, which
  must be switched on before anything imports triton.
- Under pytest-xdist, each worker runs torch on its share of the cores.
- The bundled Shakespeare data, prepared once (`shakespeare_data`), and the tiny
  train.py configuration every end-to-end test starts from (`TINY`): tests that
  start train.py use both, via `run_script`, and are marked slow.
"""

import contextlib
import fcntl
import os
import subprocess
import sys

import pytest
import torch

from nanogns.core import strategy

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist's workers share the machine's cores: each gets its share of torch's threads, in this process and
    # in the scripts its tests start, instead of one per core in every worker (oversubscribed: the suite on 2 cores
    # ran a quarter slower)
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a 2-layer, 32-wide nanoGPT on 16-character windows on the CPU: a few steps take seconds
TINY = [
    os.path.join(REPO, "config/train_shakespeare_char.py"),
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--device_name=cpu",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--gradient_accumulation_steps=2",
    "--eval_iters=2",
    "--log_interval=1",
    "--dropout=0.0",
]
GNS_LAYERS = ["--linearclass=gns", "--embeddingclass=gns", "--lnclass=gns"]


@pytest.fixture
def force_strategy():
    """force_strategy(linear=..., fused_linear=..., cross_term=...): nanogns.core.strategy.forced for the rest of
    the test (None keeps the layer's own rule)."""
    with contextlib.ExitStack() as stack:
        yield lambda **choices: stack.enter_context(strategy.forced(**choices))


@pytest.fixture(scope="session")
def shakespeare_data():
    """data/shakespeare_char/{train,val}.bin from the bundled input.txt (no network). Under a lock: parallel
    test workers (pytest-xdist) each start a session, and one must not read the files while another writes them."""
    data_dir = os.path.join(REPO, "data", "shakespeare_char")
    with open(os.path.join(data_dir, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(data_dir, "meta.json")):  # prepare.py writes meta.json last
            subprocess.run(
                [sys.executable, "data/shakespeare_char/prepare.py"], cwd=REPO, check=True, capture_output=True
            )


def run_script(script, *args, cwd=REPO, env=None, nproc=None, timeout=300):
    """Run a script of the repository (under torchrun with `nproc` ranks) and return the CompletedProcess."""
    if nproc is None:
        launch = [sys.executable]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        env = {k: v for k, v in (env or os.environ).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["OMP_NUM_THREADS"] = "1"  # two ranks on a 2-core machine
    return subprocess.run(
        [*launch, os.path.join(REPO, script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
