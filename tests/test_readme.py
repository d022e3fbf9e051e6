"""
The README says what the code does: its train.py diff is in train.py, its test command is what CI runs,
and every script it tells users to run exists.

    python -m pytest -q tests/test_readme.py
"""

import os
import re

from conftest import REPO


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def test_every_added_and_context_line_of_the_readme_diff_is_in_train_py():
    with open(os.path.join(REPO, "train.py")) as f:
        train_lines = f.read().splitlines()
    blocks = re.findall(r"```diff\n(.*?)```", readme(), re.DOTALL)
    assert len(blocks) >= 4
    checked = 0
    for block in blocks:
        lines = [line for line in block.splitlines() if line[:1] in ("+", " ")]
        positions = [train_lines.index(line[1:]) if line[1:] in train_lines else None for line in lines]
        missing = [line for line, at in zip(lines, positions) if at is None]
        assert not missing, f"README diff lines not in train.py: {missing}"
        assert positions == sorted(positions), f"README diff block out of train.py's order: {lines}"
        checked += len(lines)
    assert checked > 15


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    command = "python -m pytest -q -rs -n 2 tests/"
    assert command in readme() and command in ci.splitlines()[-1]


def test_every_script_the_readme_runs_exists():
    scripts = set(re.findall(r"python3? ((?:[\w-]+/)*[\w-]+\.py)", readme()))
    assert {"train.py", "gns-analysis.py", "data/shakespeare_char/prepare.py", "examples/hf_llama.py"} <= scripts
    missing = [s for s in scripts if not os.path.exists(os.path.join(REPO, s))]
    assert not missing


def test_quick_start_installs_torch_as_ci_does():
    """The quick start's torch install line is .ci/run's (same pin, index and retries), less --quiet."""
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci_install = next(line for line in f if "torch==" in line and line.startswith("pip install"))
    assert ci_install.replace("--quiet ", "").strip() in readme()
