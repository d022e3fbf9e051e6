"""
The README and docs/ say what the code does: the README stays a short guide (about 300 lines) whose links
resolve, its train.py diff is in train.py, its test command is what CI runs, and every command or code block in
the README and docs/ is run by a named test or marked with why CI does not run it.

A block's marker is the HTML comment on the line before it: `<!-- run by tests/test_x.py[, ...]: what -->`, or
`<!-- not run in CI: why -->`. Every script a marked block runs is named in one of its tests (or conftest.py).

    python -m pytest -q tests/test_readme.py
"""

import glob
import os
import re
import sys

import pytest
from conftest import REPO, run_script

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
RUN_LANGUAGES = ("bash", "sh", "python")
# what a command runs: a script, a notebook, CI's entry point
TARGET = re.compile(r"(?:^|(?<=[\s\"']))((?:[\w.-]+/)*[\w-]+\.(?:py|ipynb)|\.ci/run)")
FENCE = re.compile(r"^```(\w*)\s*$")


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def readme():
    return read("README.md")


def blocks(path):
    """[(the marker comment on the line before the block or None, its language, its body)] of every fenced block."""
    found, lines, at = [], read(path).splitlines(), 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if not opening:
            at += 1
            continue
        end = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```"))
        before = lines[at - 1].strip() if at else ""
        mark = before[4:-3] if before.startswith("<!--") and before.endswith("-->") else None
        found.append((mark, opening.group(1), "\n".join(lines[at + 1 : end]) + "\n"))
        at = end + 1
    return found


def without_code(text):
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    return {slug(h) for h in re.findall(r"^#+ (.+)$", without_code(read(path)), re.M)}


def test_the_readme_is_a_short_guide_with_contents():
    lines = readme().splitlines()
    assert 250 <= len(lines) <= 330, f"README.md has {len(lines)} lines; keep it about 300 and move the rest to docs/"
    assert "## Contents" in readme()
    assert not re.search(r"20\d\d-\d\d-\d\d", readme()), "dated measurements belong in bench/RESULTS.md"


def test_every_link_resolves():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(read(doc))):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(REPO, resolved)):
                missing.append(f"{doc}: {target} (no file {resolved})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                missing.append(f"{doc}: {target} (no heading #{anchor} in {resolved})")
    assert not missing, "\n".join(missing)


def test_every_command_block_is_run_by_a_test_or_marked():
    problems, checked = [], 0
    for doc in DOCS:
        for mark, lang, body in blocks(doc):
            if lang not in RUN_LANGUAGES:
                continue
            checked += 1
            first = body.strip().splitlines()[0] if body.strip() else ""
            mark = (mark or "").strip()
            if mark.startswith("not run in CI:"):
                if len(mark) < len("not run in CI: ") + 10:
                    problems.append(f"{doc}: {first!r}: say why it is not run")
                continue
            tests = re.findall(r"tests/[\w/]+\.py", mark)
            if not mark.startswith("run by ") or not tests:
                problems.append(f"{doc}: {first!r}: no marker naming the test that runs it (or why CI does not)")
                continue
            absent = [t for t in tests if not os.path.exists(os.path.join(REPO, t))]
            if absent:
                problems.append(f"{doc}: {first!r}: the marker names missing tests {absent}")
                continue
            sources = "".join(read(t) for t in tests) + read("tests/conftest.py")
            for line in body.splitlines():
                command = line.split("#")[0]
                for target in TARGET.findall(command):
                    if target.startswith("config/"):  # a config file is an argument: its run is the script's
                        continue
                    stem = os.path.splitext(os.path.basename(target))[0]  # a test may name a script without .py
                    if stem not in sources:
                        problems.append(f"{doc}: {first!r} runs {target}, which {', '.join(tests)} never names")
    assert not problems, "\n".join(problems)
    assert checked >= 25


def test_every_added_and_context_line_of_the_readme_diff_is_in_train_py():
    train_lines = read("train.py").splitlines()
    diff_blocks = [body for _, lang, body in blocks("README.md") if lang == "diff"]
    assert len(diff_blocks) >= 4
    checked = 0
    for block in diff_blocks:
        lines = [line for line in block.splitlines() if line[:1] in ("+", " ")]
        positions = [train_lines.index(line[1:]) if line[1:] in train_lines else None for line in lines]
        missing = [line for line, at in zip(lines, positions) if at is None]
        assert not missing, f"README diff lines not in train.py: {missing}"
        assert positions == sorted(positions), f"README diff block out of train.py's order: {lines}"
        checked += len(lines)
    assert checked >= 12


def test_ci_runs_the_readme_test_command():
    command = "python -m pytest -q -rs -n 2 tests/"
    assert command in readme() and command in read(".ci/run").splitlines()[-1]


def test_every_script_the_docs_run_exists():
    scripts = set()
    for doc in DOCS:
        scripts |= set(re.findall(r"python3? ((?:[\w-]+/)*[\w-]+\.py)", read(doc)))
    assert {"train.py", "gns-analysis.py", "data/shakespeare_char/prepare.py", "examples/hf_llama.py"} <= scripts
    missing = [s for s in scripts if not os.path.exists(os.path.join(REPO, s))]
    assert not missing


def test_quick_start_installs_torch_as_ci_does():
    """The quick start's torch install line is .ci/run's (same pin, index and retries), less --quiet."""
    ci_install = next(line for line in read(".ci/run").splitlines() if "torch==" in line and line.startswith("pip"))
    assert ci_install.replace("--quiet ", "").strip() in readme()


def requirement_names(path):
    """The distributions a requirements file names (comments, options and markers left out)."""
    names = set()
    for line in read(path).splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[\s;=<>!~\[]", line)[0].lower())
    return names


def test_the_quick_start_installs_what_it_runs_and_ci_installs_the_rest():
    """requirements.txt installed the tests' and tools' libraries too (Triton's wheel, jupyter, ruff, peft, ...): the
    quick start's pip took minutes. It now holds what the quick start runs (the package, with numpy and pandas,
    and the analysis's plots); every third-party module the quick start's scripts import is there or torch; CI
    installs requirements-dev.txt, which adds the rest."""
    assert requirement_names("requirements.txt") == {"plotille", "matplotlib"}
    assert "-e ." in read("requirements.txt") and "pip install -r requirements.txt" in readme()
    scripts = ["train.py", "model.py", "configurator.py", "gns-analysis.py", "data/shakespeare_char/prepare.py"]
    imported = set()
    for script in scripts:
        imported |= set(re.findall(r"^\s*(?:import|from) (\w+)", read(script), re.M))
    third_party = (
        imported - set(sys.stdlib_module_names) - {"nanogns", "model", "layer_config", "gnstracking", "tracker"}
    )
    # wandb only with --wandb_log, transformers only with --init_from=gpt2*: each one line naming it when absent
    assert third_party <= {"torch", "numpy", "wandb", "transformers"}, third_party
    dev = read("requirements-dev.txt")
    assert "-r requirements.txt" in dev.splitlines()
    assert {"pytest", "pytest-xdist", "ruff", "import-linter", "transformers", "triton"} <= requirement_names(
        "requirements-dev.txt"
    )
    assert "pip install --quiet -r requirements-dev.txt" in read(".ci/run")


@pytest.mark.slow
def test_the_quick_start_prints_what_the_readme_shows(tmp_path, shakespeare_data):
    """The quick start's training and analysis, as the README writes them (into a scratch out_dir): every line of
    the README's output excerpt is printed, digit for digit (an iteration's loss and running GNS; timings vary)."""
    command = next(body for mark, lang, body in blocks("README.md") if lang == "bash" and "train.py" in body)
    steps = [step.strip() for step in command.split("&&")]
    train = next(s for s in steps if s.startswith("python train.py")).split()[2:]
    analysis = next(s for s in steps if s.startswith("python gns-analysis.py")).split()[2:]
    assert train == ["config/train_shakespeare_char_cpu.py"] and analysis == ["out-shakespeare-char"]
    trained = run_script("train.py", *train, f"--out_dir={tmp_path}", timeout=1200)
    assert trained.returncode == 0, trained.stderr[-3000:]
    analysed = run_script("gns-analysis.py", str(tmp_path))
    assert analysed.returncode == 0, analysed.stderr[-3000:]
    printed = (trained.stdout + analysed.stdout).splitlines()
    excerpt = next(body for mark, lang, body in blocks("README.md") if lang == "" and "Final GNS" in body)
    missing = [line for line in excerpt.splitlines() if line.strip() not in ("", "...") and not shown(line, printed)]
    assert not missing, "README output lines not printed:\n" + "\n".join(missing)


NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def shown(line, printed):
    """Some printed line says `line`: the same words, and numbers within 2e-4 (relative or absolute: a busy machine's
    math library may split a product over fewer threads and move the last printed digit). An iteration's timings
    (dt, mfu, tokens_per_sec) are not compared."""
    if line.startswith("iter "):
        line = re.sub(r", dt=.*, tokens_per_sec=[\d,]+", "", line)
        printed = [re.sub(r", dt=.*, tokens_per_sec=[\d,]+", "", p) for p in printed]
    words, numbers = NUMBER.split(line), [float(n.replace(",", "")) for n in NUMBER.findall(line)]
    for candidate in printed:
        if NUMBER.split(candidate) != words:
            continue
        got = [float(n.replace(",", "")) for n in NUMBER.findall(candidate)]
        if all(abs(a - b) <= 2e-4 * max(1.0, abs(b)) for a, b in zip(got, numbers)):
            return True
    return False
