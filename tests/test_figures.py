"""
figures.py and "Replicating Figures.ipynb", executed headless on small CPU runs of train.py.

    python -m pytest tests/test_figures.py -q
"""

import os

import nbformat
import numpy as np
import pandas as pd
import pytest
from nbclient import NotebookClient

import figures
from conftest import GNS_LAYERS, REPO, TINY, run_script

FIGURES = ["gns_by_layer_type.png", "per_layer_gns.png", "phase_plot.png", "schedule_comparison.png"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare_data):
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for label, flags in {"small": ["--batch_size=4", "--max_iters=12"], "large": ["--batch_size=8", "--max_iters=6"]}.items():
        out = run_script("train.py", *TINY, *GNS_LAYERS, "--gradient_accumulation_steps=1", "--eval_interval=4", *flags,
                         f"--out_dir={root / label}")
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
    params = ["tok_emb.weight+head.weight", "layers.0.norm.weight", "layers.0.mlp.weight", "layers.3.mlp.weight",
              "lm_head.weight"]
    cols = {"step": np.arange(10), "tokens_processed": (np.arange(10) + 1) * 512}
    for p in params:
        norm = rng.uniform(0.5, 2.0, 10)
        cols[f"train/gns/{p}/norm"] = norm
        cols[f"train/gns/{p}/pegn"] = np.sqrt(norm**2 + rng.uniform(1.0, 10.0, 10))
        cols[f"train/gns/{p}/batch_size"] = np.full(10, 32)
    pd.DataFrame(cols).to_csv(tmp_path / "log.csv", index=False)
    table = figures.per_layer_gns(str(tmp_path))
    assert list(table.columns) == ["tokens_processed", "layers.0.mlp.weight", "layers.0.norm.weight",
                                   "layers.3.mlp.weight", "tok_emb.weight+head.weight", "block 0", "block 3"]
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
