"""
nanogns/analysis/figures.py and "Replicating Figures.ipynb", executed headless on small CPU runs of train.py.

    python -m pytest tests/test_analysis_figures.py -q
"""

import os
import shutil
import subprocess
import sys

import nbformat
import numpy as np
import pandas as pd
import pytest
from conftest import GNS_LAYERS, REPO, TINY, run_script
from nbclient import NotebookClient

from nanogns.analysis import figures

FIGURES = ["gns_by_layer_type.png", "per_layer_gns.png", "phase_plot.png", "schedule_comparison.png"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare_data):
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for label, flags in {
        "small": ["--batch_size=4", "--max_iters=12"],
        "large": ["--batch_size=8", "--max_iters=6"],
    }.items():
        out = run_script(
            "train.py",
            *TINY,
            *GNS_LAYERS,
            "--gradient_accumulation_steps=1",
            "--eval_interval=4",
            *flags,
            f"--out_dir={root / label}",
        )
        assert out.returncode == 0, out.stderr[-2000:]
        made[label] = str(root / label)
    return made


def test_per_layer_gns_has_every_parameter_and_block(runs):
    table = figures.per_layer_gns(runs["small"])
    assert {"block 0", "block 1", "transformer.h.1.ln_2.weight", "transformer.wpe.weight"} <= set(table.columns)
    assert len(table) == 12 and table["block 0"].notna().any()
    results = figures.gns_analysis.analyze_gns(runs["small"])  # the blocks are gns-analysis.py's, not a copy
    for index in (0, 1):
        np.testing.assert_array_equal(table[f"block {index}"], results[f"gns_block_{index}"])


def test_per_layer_gns_uses_the_analysis_rules_for_blocks_and_tied_weights(tmp_path):
    """A log in another naming scheme, with an exactly logged tied tensor and a reference-style tied column."""
    rng = np.random.default_rng(0)
    params = [
        "tok_emb.weight+head.weight",
        "layers.0.norm.weight",
        "layers.0.mlp.weight",
        "layers.3.mlp.weight",
        "lm_head.weight",
    ]
    cols = {"step": np.arange(10), "tokens_processed": (np.arange(10) + 1) * 512}
    for p in params:
        norm = rng.uniform(0.5, 2.0, 10)
        cols[f"train/gns/{p}/norm"] = norm
        cols[f"train/gns/{p}/pegn"] = np.sqrt(norm**2 + rng.uniform(1.0, 10.0, 10))
        cols[f"train/gns/{p}/batch_size"] = np.full(10, 32)
    pd.DataFrame(cols).to_csv(tmp_path / "log.csv", index=False)
    table = figures.per_layer_gns(str(tmp_path))
    assert list(table.columns) == [
        "tokens_processed",
        "layers.0.mlp.weight",
        "layers.0.norm.weight",
        "layers.3.mlp.weight",
        "tok_emb.weight+head.weight",
        "block 0",
        "block 3",
    ]
    results = figures.gns_analysis.analyze_gns(str(tmp_path))
    np.testing.assert_array_equal(table["block 0"], results["gns_block_0"])
    np.testing.assert_array_equal(table["block 3"], results["gns_block_3"])


def test_notebook_runs_headless_and_saves_every_figure(runs, tmp_path, monkeypatch):
    fig_dir = tmp_path / "figs"
    monkeypatch.setenv("GNS_RUN", runs["small"])
    monkeypatch.setenv("GNS_SCHEDULE_RUNS", f"batch 4={runs['small']},batch 8={runs['large']}")
    monkeypatch.setenv("GNS_FIG_DIR", str(fig_dir))
    monkeypatch.setenv("PYTHONPATH", REPO)
    nb = nbformat.read(os.path.join(REPO, "Replicating Figures.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": REPO}}).execute()
    assert sorted(os.listdir(fig_dir)) == sorted(FIGURES)
    assert all((fig_dir / name).stat().st_size > 10_000 for name in FIGURES)
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    assert len(images(nb)) == len(FIGURES)


def images(nb):
    """The PNG outputs of a notebook's cells."""
    return [
        o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if "image/png" in o.get("data", {})
    ]


def test_the_readmes_notebook_command_shows_the_figures_inline_and_writes_into_the_run(runs, tmp_path):
    """The README's command, as written, on a run copied into a scratch checkout's working directory: figures in
    the executed notebook and in <run>/figures, nothing written into the repository."""
    run = tmp_path / "out-shakespeare-char"
    shutil.copytree(runs["small"], run)
    env = dict(os.environ, GNS_RUN=str(run), PYTHONPATH=REPO)
    env.pop("GNS_FIG_DIR", None), env.pop("GNS_SCHEDULE_RUNS", None)
    before = set(os.listdir(REPO))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            "Replicating Figures.ipynb",
            "--output-dir",
            str(run),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # (.cache is the tokenizer cache tests/test_data_openwebtext.py may make meanwhile, on the other worker)
    assert set(os.listdir(REPO)) - {".cache"} == before - {".cache"}
    executed = nbformat.read(run / "Replicating Figures.ipynb", as_version=4)
    assert len(images(executed)) == 3  # the schedule comparison needs runs to compare: skipped, and says so
    assert "schedule comparison skipped" in str([c.outputs for c in executed.cells if c.cell_type == "code"])
    assert sorted(os.listdir(run / "figures")) == sorted(f for f in FIGURES if f != "schedule_comparison.png")


def overlapping_tick_labels(fig):
    """Pairs of visible tick labels, on any axis of the figure, whose drawn boxes overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            found += [
                (a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1 :] if box_a.overlaps(box_b)
            ]
    return found


@pytest.mark.parametrize("tokens, spread", [(614_400, 1.0), (3e9, 4.0), (2_000, 0.05)], ids=str)
def test_figures_have_readable_tick_labels(tmp_path, tokens, spread):
    """The quick start's 614,400 tokens once gave x labels '0100000200000...', and log axes overlapping labels."""
    rng = np.random.default_rng(0)
    steps = 300
    cols = {"step": np.arange(steps), "tokens_processed": np.linspace(tokens / steps, tokens, steps).round()}
    params = [f"transformer.h.{b}.{layer}.weight" for b in range(4) for layer in ("ln_1", "attn.c_attn", "mlp.c_fc")]
    for i, p in enumerate(params):  # at a large B, parameter i's GNS is about its noise ratio: spread decades apart
        norm = rng.uniform(0.5, 2.0, steps)
        ratio = rng.uniform(1.0, 2.0, steps) * np.linspace(1, 3, steps) * 10 ** (spread * i / len(params))
        cols[f"train/gns/{p}/norm"] = norm
        cols[f"train/gns/{p}/pegn"] = np.sqrt(norm**2 * (1 + ratio))
        cols[f"train/gns/{p}/batch_size"] = np.full(steps, 10**6)
    cols["train/lossf"], cols["dt"] = np.linspace(4, 2, steps), np.full(steps, 0.1)
    pd.DataFrame(cols).to_csv(tmp_path / "log.csv", index=False)
    for make in (
        figures.gns_by_layer_type,
        figures.phase_plot,
        figures.per_layer_figure,
        lambda d: figures.schedule_comparison({"a": d}),
    ):
        fig = make(str(tmp_path))
        assert not overlapping_tick_labels(fig), make
        figures.plt.close(fig)
