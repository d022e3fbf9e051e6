"""
Tests of gns-analysis.py against independent numpy/pandas re-computations: the
printed numbers, the parameter groups and blocks, tied weights (exact "+" columns
and reference-style ones), LayerNorm-only against all parameters, approximate
(SOGNS) against exact norms, non-finite and skipped steps, logs in the paper's
reference format, error messages and the files written.

    python -m pytest -q tests/test_analysis.py
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogns.analysis import analyze as ga
from nanogns.analysis import cli as analysis_cli
from nanogns.analysis import parameters as analysis_parameters
from nanogns.analysis import plots as analysis_plots
from nanogns.analysis import report as analysis_report
from nanogns.estimator import RunningGNS, unbiased_stats  # noqa: E402
from nanogns.runlog.record import write_parameter_record  # noqa: E402
from nanogns.runlog.writer import ANALYSIS_RESULTS, LogWrapper  # noqa: E402

PARAMS = [
    "transformer.wte.weight",
    "transformer.wpe.weight",
    "transformer.h.0.ln_1.weight",
    "transformer.h.0.ln_1.bias",
    "transformer.h.0.attn.c_attn.weight",
    "transformer.h.0.mlp.c_proj.bias",
    "transformer.ln_f.weight",
    "lm_head.weight",
]
NOT_TIED = [p for p in PARAMS if "wte" not in p and "lm_head" not in p]


def synthetic_norms(n_steps, seed=0):
    """{param: (norm, pegn)} arrays with pegn > norm, as real measurements have."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in PARAMS:
        norm = rng.uniform(0.5, 2.0, n_steps)
        pegn = np.sqrt(norm**2 + rng.uniform(1.0, 30.0, n_steps))
        out[p] = (norm, pegn)
    return out


def write_run(out_dir, norms, batch_size=64, eval_every=None, config=None, approx=None, prefix="train/gns"):
    """A log.csv as train.py writes it: `norms` under prefix, `approx` ({param: (norm, pegn)}) under train/sogns."""
    n_steps = len(next(iter(norms.values()))[0])
    t = LogWrapper(config=config, out_dir=str(out_dir))
    for s in range(n_steps):
        if eval_every and s % eval_every == 0:
            t.log({"val/loss": 3.0})
            t.step()  # an eval-only row
        row = {"train/lossf": 1.0, "tokens_processed": (s + 1) * batch_size * 256}
        for pre, logged in ((prefix, norms), ("train/sogns", approx or {})):
            for p, (norm, pegn) in logged.items():
                row[f"{pre}/{p}/norm"] = norm[s]
                row[f"{pre}/{p}/pegn"] = pegn[s]
                row[f"{pre}/{p}/batch_size"] = batch_size
        t.log(row)
        t.step()
    t.close()


def load_log(out_dir):
    return pd.read_csv(os.path.join(out_dir, "log.csv"))


def expected_gns(norms, params, batch_size, alpha):
    """Plain-loop reference: sums, eq. A.2, EMAs that skip non-finite steps."""
    n_steps = len(norms[params[0]][0])
    gtg_ema = tr_ema = math.nan
    out = []
    for s in range(n_steps):
        sgn = sum(norms[p][0][s] ** 2 for p in params)
        spegn = sum(norms[p][1][s] ** 2 for p in params)
        b = batch_size
        gtg = (b * sgn - spegn) / (b - 1)
        tr = (spegn - sgn) / (1 - 1 / b)
        if math.isfinite(gtg) and math.isfinite(tr):
            gtg_ema = gtg if math.isnan(gtg_ema) else alpha * gtg_ema + (1 - alpha) * gtg
            tr_ema = tr if math.isnan(tr_ema) else alpha * tr_ema + (1 - alpha) * tr
        out.append((gtg_ema, tr_ema, tr_ema / gtg_ema))
    return np.array(out)


def pandas_gns(df, names, alpha, prefix="train/gns"):
    """The GNS over `names` from the raw log columns: unbiased_stats and pandas EMAs that skip NaN
    (NaN where the |G|^2 EMA is not positive)."""
    sgn = sum(df[f"{prefix}/{n}/norm"] ** 2 for n in names)
    spegn = sum(df[f"{prefix}/{n}/pegn"] ** 2 for n in names)
    gtg, tr = unbiased_stats(sgn, spegn, df[f"{prefix}/{names[0]}/batch_size"])
    gtg_ema = gtg.ewm(alpha=1 - alpha, adjust=False, ignore_na=True).mean()
    tr_ema = tr.ewm(alpha=1 - alpha, adjust=False, ignore_na=True).mean()
    return (tr_ema / gtg_ema).where(gtg_ema > 0).to_numpy()


def printed(text, label):
    match = re.search(rf"^{re.escape(label)}: (\S+)$", text, re.MULTILINE)
    assert match, f"{label!r} not in output:\n{text}"
    return match.group(1)


def test_printed_numbers_match_independent_computation(tmp_path, capsys):
    norms = synthetic_norms(40)
    write_run(tmp_path, norms, batch_size=32, eval_every=10)
    assert analysis_cli.main([str(tmp_path), "--alpha", "0.9", "--no-plots"]) == 0
    out = capsys.readouterr().out
    exp = expected_gns(norms, NOT_TIED, 32, 0.9)
    assert printed(out, "Final GNS") == f"{exp[-1, 2]:.4f}"
    assert printed(out, "Final G^TG (EMA)") == f"{exp[-1, 0]:.4f}"
    assert printed(out, "Final tr(Σ) (EMA)") == f"{exp[-1, 1]:.4f}"
    assert printed(out, "Average batch size") == "32.0"
    assert printed(out, "Total tokens processed") == f"{40 * 32 * 256:,}"
    assert "Final DDP GNS" not in out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert len(results) == 40  # eval-only rows dropped
    np.testing.assert_allclose(results[["gtg_ema", "trsigma_ema", "gns"]].to_numpy(), exp, rtol=1e-12)


def test_default_alpha_is_095_and_help_says_so(tmp_path, capsys):
    assert analysis_cli.main(["--help"]) == 0  # returned, not argparse's SystemExit
    assert "(default: 0.95)" in capsys.readouterr().out
    norms = synthetic_norms(15, seed=1)
    write_run(tmp_path, norms)
    results = ga.analyze_gns(str(tmp_path))
    np.testing.assert_allclose(results["gns"], expected_gns(norms, NOT_TIED, 64, 0.95)[:, 2], rtol=1e-12)


@pytest.mark.parametrize(
    "name, group",
    [
        ("transformer.h.0.ln_1.weight", "LayerNorm"),
        ("transformer.h.11.ln_2.bias", "LayerNorm"),
        ("transformer.ln_f.weight", "LayerNorm"),
        ("blocks.3.norm1.weight", "LayerNorm"),
        ("transformer.wpe.weight", "Embedding"),
        ("transformer.wte.weight", "Embedding"),
        ("encoder.token_emb.weight", "Embedding"),
        ("transformer.h.0.attn.c_attn.weight", "Linear"),
        ("transformer.h.0.mlp.c_proj.bias", "Linear"),
        ("lm_head.weight", "Linear"),
        ("kiln.weight", "Linear"),  # 'ln' inside a word is not a LayerNorm
        ("transformer.wte.weight+lm_head.weight", "Embedding"),  # an exact tied tensor: its first name's group
        ("lm_head.weight+transformer.wte.weight", "Linear"),
    ],
)
def test_param_group(name, group):
    assert analysis_parameters.param_group(name) == group


@pytest.mark.parametrize(
    "name, block",
    [
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("transformer.h.11.ln_2.bias", 11),
        ("h.0.mlp.c_fc.weight", 0),
        ("model.0.h.5.attn.weight", 5),  # the index after `h` wins over an earlier integer
        ("layers.2.mlp.w1.weight", 2),  # other naming schemes: the first integer component
        ("model.layers.7.self_attn.q_proj.weight", 7),
        ("transformer.wpe.weight", None),
        ("transformer.ln_f.weight", None),
        ("transformer.wte.weight+lm_head.weight", None),
        ("transformer.hh.3x.weight", None),  # not a component `h`, not an integer component
        ("params.0", None),  # an integer attribute name is not a module index
    ],
)
def test_param_block(name, block):
    assert analysis_parameters.param_block(name) == block


def test_group_columns_and_table(tmp_path, capsys):
    norms = synthetic_norms(30, seed=2)
    write_run(tmp_path, norms)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    groups = {
        "layernorm": ["transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.ln_f.weight"],
        "linear": ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.bias"],
        "embedding": ["transformer.wpe.weight"],  # wte is tied: left out
    }
    for g, members in groups.items():
        exp = expected_gns(norms, members, 64, 0.95)[:, 2]
        np.testing.assert_allclose(results[f"gns_{g}"], exp, rtol=1e-12)
        corr = np.corrcoef(results["gns"], exp)[0, 1]
        label = {"layernorm": "LayerNorm", "linear": "Linear", "embedding": "Embedding"}[g]
        row = re.search(rf"^{label}\s+(\d+)\s+(\S+)\s+(\S+)$", out, re.MULTILINE)
        assert row and row.groups() == (str(len(members)), f"{exp[-1]:.4f}", f"{corr:.4f}")


def test_non_finite_steps_are_skipped_without_poisoning_the_ema(tmp_path, capsys):
    norms = synthetic_norms(25, seed=3)
    norms["transformer.h.0.attn.c_attn.weight"][0][7] = np.inf
    norms["transformer.wpe.weight"][1][12] = np.nan
    write_run(tmp_path, norms, batch_size=16)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    exp = expected_gns(norms, NOT_TIED, 16, 0.95)
    assert np.isfinite(exp[-1]).all()
    assert printed(out, "Final GNS") == f"{exp[-1, 2]:.4f}"
    assert "warning: 2 step(s) have non-finite norms (logged as nan/inf); skipped by the EMAs" in out
    assert "lack some parameter" not in out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert np.isnan(results["gtg"][7]) and np.isnan(results["trsigma"][12])
    np.testing.assert_allclose(results["gns"], exp[:, 2], rtol=1e-12)
    # the online estimator in the monitor skips the same steps the same way
    running = RunningGNS(decay=0.95)
    for s in range(25):
        running.update(sum(norms[p][0][s] ** 2 for p in NOT_TIED), sum(norms[p][1][s] ** 2 for p in NOT_TIED), 16)
    assert running.gns == pytest.approx(results["gns"].iloc[-1], rel=1e-12)


def reference_method(df, alpha):
    """The paper's reference analysis, re-stated: tied columns out, sums, eq. A.2,
    ewm(adjust=False), denominator clipped at 1e-6."""
    names = sorted({c.split("/")[-2] for c in df.columns if c.startswith("train/gns/")})
    names = [n for n in names if "wte" not in n and "lm_head" not in n]
    sgn = sum(df[f"train/gns/{n}/norm"] ** 2 for n in names)
    spegn = sum(df[f"train/gns/{n}/pegn"] ** 2 for n in names)
    b = df[f"train/gns/{names[0]}/batch_size"]
    gtg = (b * sgn - spegn) / (b - 1.0)
    tr = (spegn - sgn) / (1.0 - 1.0 / b)
    gtg_ema = gtg.ewm(alpha=1 - alpha, adjust=False).mean()
    tr_ema = tr.ewm(alpha=1 - alpha, adjust=False).mean()
    return gtg_ema, tr_ema, tr_ema / gtg_ema.clip(lower=1e-6)


def write_reference_log(out_dir, n_steps=30, seed=4):
    """A log.csv laid out as the paper's reference implementation writes it."""
    rng = np.random.default_rng(seed)
    norms = synthetic_norms(n_steps, seed)
    cols = {"step": np.arange(n_steps), "iter_num": np.arange(n_steps)}
    cols["tokens_processed"] = (np.arange(n_steps) + 1) * 64 * 1024
    cols["train/lossf"] = rng.uniform(1, 3, n_steps)
    for p in sorted(set(PARAMS) - {"lm_head.weight"}):  # the tied matrix is logged once, as wte
        cols[f"train/gns/{p}/norm"] = norms[p][0]
        cols[f"train/gns/{p}/pegn"] = norms[p][1]
        cols[f"train/gns/{p}/batch_size"] = np.full(n_steps, 64)
    cols["ddp/gns"] = rng.uniform(5, 50, n_steps)
    df = pd.DataFrame(cols)
    os.makedirs(out_dir, exist_ok=True)
    df.to_csv(os.path.join(out_dir, "log.csv"), index=False)
    return df, norms


def test_reference_format_log_gives_the_reference_numbers(tmp_path, capsys):
    df, _ = write_reference_log(tmp_path)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    gtg_ema, tr_ema, gns = reference_method(df, 0.95)
    assert np.isfinite(gns).all() and (gtg_ema > 1e-6).all()  # where the clip would not act
    assert printed(out, "Final GNS") == f"{gns.iloc[-1]:.4f}"
    assert printed(out, "Final G^TG (EMA)") == f"{gtg_ema.iloc[-1]:.4f}"
    assert printed(out, "Final tr(Σ) (EMA)") == f"{tr_ema.iloc[-1]:.4f}"
    assert printed(out, "Final DDP GNS") == f"{df['ddp/gns'].iloc[-1]:.4f}"
    assert printed(out, "Total tokens processed") == f"{30 * 64 * 1024:,}"
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    np.testing.assert_allclose(results["gns"], gns, rtol=1e-12)
    np.testing.assert_allclose(results["ddp_gns"], df["ddp/gns"], rtol=1e-15)


TIED = "transformer.wte.weight+lm_head.weight"


def test_exact_tied_column_is_included_in_embedding_and_compared_without_it(tmp_path, capsys):
    norms = synthetic_norms(30, seed=5)
    norms[TIED] = norms.pop("transformer.wte.weight")
    del norms["lm_head.weight"]
    write_run(tmp_path, norms, batch_size=32)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    exp = expected_gns(norms, NOT_TIED + [TIED], 32, 0.95)[:, 2]
    without = expected_gns(norms, NOT_TIED, 32, 0.95)[:, 2]
    np.testing.assert_allclose(results["gns"], exp, rtol=1e-12)
    np.testing.assert_allclose(results["gns_without_tied"], without, rtol=1e-12)
    np.testing.assert_allclose(
        results["gns_embedding"], expected_gns(norms, ["transformer.wpe.weight", TIED], 32, 0.95)[:, 2], rtol=1e-12
    )
    assert f"tied weights logged exactly, included: {TIED}" in out
    change = (exp[-1] / without[-1] - 1) * 100
    line = (
        f"GNS without the tied matrix ({TIED}): {without[-1]:.4f} (tied matrix changes the final GNS by {change:+.1f}%)"
    )
    assert line in out.splitlines()
    assert re.search(r"^Embedding\s+2\s", out, re.MULTILINE)


def test_exact_tied_column_kept_and_reference_style_tied_column_left_out(tmp_path, capsys):
    norms = synthetic_norms(20, seed=6)
    norms[TIED] = norms["lm_head.weight"]  # the exact tensor, beside a reference-style wte column
    del norms["lm_head.weight"]
    write_run(tmp_path, norms)
    results = ga.analyze_gns(str(tmp_path))
    assert "tied weights left out (one use's norm, not exact): transformer.wte.weight" in capsys.readouterr().out
    assert results.attrs["tied"] == [TIED] and results.attrs["excluded"] == ["transformer.wte.weight"]
    assert TIED in results.attrs["groups"]["Embedding"]
    assert "transformer.wte.weight" not in sum(results.attrs["groups"].values(), [])
    np.testing.assert_allclose(results["gns"], expected_gns(norms, NOT_TIED + [TIED], 64, 0.95)[:, 2], rtol=1e-12)


BLOCK_PARAMS = [
    "transformer.wpe.weight",
    "transformer.h.0.ln_1.weight",
    "transformer.h.0.attn.c_attn.weight",
    "transformer.h.1.ln_1.weight",
    "transformer.h.1.mlp.c_fc.weight",
    "transformer.h.1.mlp.c_proj.bias",
    "transformer.h.10.attn.c_proj.weight",  # block 10, not block 1
    "transformer.ln_f.weight",
]


def block_norms(params, n_steps, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for p in params:
        norm = rng.uniform(0.5, 2.0, n_steps)
        out[p] = (norm, np.sqrt(norm**2 + rng.uniform(1.0, 30.0, n_steps)))
    return out


def test_block_columns_and_table(tmp_path, capsys):
    norms = block_norms(BLOCK_PARAMS, 25, seed=7)
    write_run(tmp_path, norms, batch_size=16)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    df = pd.read_csv(tmp_path / "log.csv")
    blocks = {
        0: ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.ln_1.weight"],
        1: ["transformer.h.1.ln_1.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.bias"],
        10: ["transformer.h.10.attn.c_proj.weight"],
    }
    block_columns = sorted(c for c in results.columns if c.startswith("gns_block_"))
    assert block_columns == ["gns_block_0", "gns_block_1", "gns_block_10"]
    assert "GNS by block:" in out
    for index, members in blocks.items():
        exp = pandas_gns(df, members, 0.95)
        np.testing.assert_allclose(results[f"gns_block_{index}"], exp, rtol=1e-12)
        corr = pd.Series(exp).corr(results["gns"])
        row = re.search(rf"^{index}\s+(\d+)\s+(\S+)\s+(\S+)$", out, re.MULTILINE)
        assert row and row.groups() == (str(len(members)), f"{exp[-1]:.4f}", f"{corr:.4f}")


def test_blocks_in_another_naming_scheme(tmp_path):
    params = [
        "tok_emb.weight",
        "layers.0.norm1.weight",
        "layers.0.mlp.w1.weight",
        "layers.2.mlp.w1.weight",
        "layers.2.attn.wq.weight",
        "norm.weight",
    ]
    norms = block_norms(params, 15, seed=8)
    write_run(tmp_path, norms)
    results = ga.analyze_gns(str(tmp_path))
    df = pd.read_csv(tmp_path / "log.csv")
    assert results.attrs["blocks"] == {
        0: ["layers.0.mlp.w1.weight", "layers.0.norm1.weight"],
        2: ["layers.2.attn.wq.weight", "layers.2.mlp.w1.weight"],
    }
    for index, members in results.attrs["blocks"].items():
        np.testing.assert_allclose(results[f"gns_block_{index}"], pandas_gns(df, members, 0.95), rtol=1e-12)


def test_no_block_index_is_said_in_one_line(tmp_path, capsys):
    write_run(tmp_path, block_norms(["transformer.wpe.weight", "transformer.ln_f.weight"], 6, seed=9))
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    assert "GNS by block: no parameter name has a block index" in capsys.readouterr().out
    assert not [c for c in pd.read_csv(tmp_path / "gns_analysis.csv").columns if c.startswith("gns_block_")]


def test_layernorm_vs_all_line_and_figure(tmp_path, capsys):
    norms = block_norms(BLOCK_PARAMS, 40, seed=10)
    write_run(tmp_path, norms, batch_size=16)
    assert analysis_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    df = pd.read_csv(tmp_path / "log.csv")
    ln = ["transformer.h.0.ln_1.weight", "transformer.h.1.ln_1.weight", "transformer.ln_f.weight"]
    ln_gns, all_gns = pd.Series(pandas_gns(df, ln, 0.95)), pd.Series(pandas_gns(df, BLOCK_PARAMS, 0.95))
    both = ln_gns.notna() & all_gns.notna()
    positive = (ln_gns > 0) & (all_gns > 0)
    assert 10 < positive.sum() and both.sum() < 40  # some steps have no GNS (|G|^2 EMA <= 0): left out
    line = (
        f"LayerNorm-only vs all parameters: corr {ln_gns.corr(all_gns):.3f} "
        f"(log10: {np.log10(ln_gns[positive]).corr(np.log10(all_gns[positive])):.3f}) over {both.sum()} steps, "
        f"final ratio LN/all {ln_gns.iloc[-1] / all_gns.iloc[-1]:.3f}"
    )
    assert line in out.splitlines()
    assert "GNS from LayerNorm only vs all parameters, over tokens:" in out
    with open(tmp_path / "gns_layernorm_vs_all.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_compare_counts_only_steps_where_both_are_finite():
    a = pd.Series([1.0, 2.0, np.nan, 4.0, -1.0, 8.0])
    b = pd.Series([1.0, 2.5, 3.0, np.inf, 2.0, 6.0])
    c = analysis_report.compare(a, b)
    both = [0, 1, 4, 5]
    assert c["steps"] == 4
    assert c["corr"] == pytest.approx(a[both].corr(b[both]), rel=1e-12)
    assert c["log10_corr"] == pytest.approx(np.log10(a[[0, 1, 5]]).corr(np.log10(b[[0, 1, 5]])), rel=1e-12)
    assert c["median_rel_diff"] == pytest.approx(np.median(np.abs(a[both] / b[both] - 1)), rel=1e-12)
    assert (c["final"], c["final_reference"]) == (8.0, 6.0)


def test_run_without_layernorm_says_so_and_skips_its_figure(tmp_path, capsys):
    write_run(tmp_path, block_norms(["transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"], 8, seed=11))
    assert analysis_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "LayerNorm-only vs all parameters: no LayerNorm columns in the log; comparison and plot skipped" in out
    assert not (tmp_path / "gns_layernorm_vs_all.png").exists()
    assert (tmp_path / "gns_groups.png").exists()


LINEAR = [
    "transformer.h.0.attn.c_attn.weight",
    "transformer.h.1.mlp.c_fc.weight",
    "transformer.h.1.mlp.c_proj.bias",
    "transformer.h.10.attn.c_proj.weight",
]


def approximate(norms, params, seed):
    """SOGNS-like columns: the same batch norm, the per-example norm off by a few percent."""
    rng = np.random.default_rng(seed)
    return {p: (norms[p][0], norms[p][1] * rng.uniform(0.95, 1.08, len(norms[p][1]))) for p in params}


def comparison_line(head, approx_gns, exact_gns):
    a, e = pd.Series(approx_gns), pd.Series(exact_gns)
    rel = (a / e - 1).abs().median()
    return (
        f"{head}: final {a.iloc[-1]:.4f} vs {e.iloc[-1]:.4f} ({(a.iloc[-1] / e.iloc[-1] - 1) * 100:+.1f}%), "
        f"median |relative difference| {rel * 100:.1f}% over {len(a)} steps, corr {a.corr(e):.3f}"
    )


def test_sogns_compared_with_exact_over_the_same_parameters(tmp_path, capsys):
    norms = block_norms(BLOCK_PARAMS, 30, seed=12)
    write_run(tmp_path, norms, batch_size=16, approx=approximate(norms, LINEAR, seed=13))
    assert analysis_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    df = pd.read_csv(tmp_path / "log.csv")
    sogns = pandas_gns(df, LINEAR, 0.95, prefix="train/sogns")
    exact = pandas_gns(df, LINEAR, 0.95)
    assert np.abs(sogns / exact - 1).max() > 1e-3  # the two really differ
    np.testing.assert_allclose(results["gns_sogns"], sogns, rtol=1e-12)
    np.testing.assert_allclose(results["gns_exact_same_params"], exact, rtol=1e-12)
    np.testing.assert_allclose(results["gns"], pandas_gns(df, BLOCK_PARAMS, 0.95), rtol=1e-12)  # sogns not mixed in
    head = "Approximate (SOGNS) vs exact GNS over the same 4 parameters"
    assert comparison_line(head, sogns, exact) in out.splitlines()
    assert "GNS from approximate (SOGNS) vs exact norms, over tokens:" in out
    with open(tmp_path / "gns_sogns_vs_exact.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sogns_without_exact_norms_for_its_parameters_is_compared_with_all_parameters(tmp_path, capsys):
    norms = block_norms(BLOCK_PARAMS, 30, seed=14)
    exact_ln = {p: norms[p] for p in BLOCK_PARAMS if p not in LINEAR}  # exact LayerNorm (+ wpe), approximate Linear
    write_run(tmp_path, exact_ln, batch_size=16, approx=approximate(norms, LINEAR, seed=15))
    assert analysis_cli.main([str(tmp_path)]) == 0  # with the figures
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    df = pd.read_csv(tmp_path / "log.csv")
    assert "gns_exact_same_params" not in results
    sogns = pandas_gns(df, LINEAR, 0.95, prefix="train/sogns")
    exact_all = pandas_gns(df, sorted(exact_ln), 0.95)
    np.testing.assert_allclose(results["gns_sogns"], sogns, rtol=1e-12)
    head = (
        "Approximate (SOGNS) GNS over 4 parameters vs exact GNS over all 4 parameters "
        "(not the same parameters: train/gns lacks 4 of the 4)"
    )
    assert comparison_line(head, sogns, exact_all) in out.splitlines()
    assert (tmp_path / "gns_sogns_vs_exact.png").exists()


def test_sogns_only_log_is_analysed_with_its_prefix(tmp_path, capsys):
    norms = block_norms(BLOCK_PARAMS, 12, seed=16)
    write_run(tmp_path, norms, prefix="train/sogns")
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 1
    assert re.search(
        r"no 'train/gns/<param>/norm' columns.*'train/sogns/<param>/norm'.*--prefix train/sogns",
        capsys.readouterr().err,
    )
    assert analysis_cli.main([str(tmp_path), "--no-plots", "--prefix", "train/sogns"]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    df = pd.read_csv(tmp_path / "log.csv")
    np.testing.assert_allclose(results["gns"], pandas_gns(df, BLOCK_PARAMS, 0.95, prefix="train/sogns"), rtol=1e-12)
    assert "Approximate (SOGNS)" not in out and "gns_sogns" not in results


def test_skipped_and_partial_steps_are_not_counted_as_non_finite(tmp_path, capsys):
    params = ["transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.weight"]
    norms = block_norms(params, 10, seed=17)
    t = LogWrapper(out_dir=str(tmp_path))
    for s in range(10):
        row = {"train/lossf": 1.0, "train/gns_skipped_steps": int(s >= 4)}
        for p in params:
            if s == 4 or (s == 7 and p == params[1]):
                continue  # step 4: skipped by a GradScaler (no GNS values); step 7: one parameter not logged
            row.update(
                {
                    f"train/gns/{p}/norm": norms[p][0][s],
                    f"train/gns/{p}/pegn": norms[p][1][s],
                    f"train/gns/{p}/batch_size": 8,
                }
            )
        if s == 8:
            row[f"train/gns/{params[0]}/pegn"] = math.nan
        t.log(row)
        t.step()
    t.close()
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "warning: 1 step(s) have non-finite norms (logged as nan/inf); skipped by the EMAs" in out
    assert "warning: 1 step(s) lack some parameter's columns (not logged at that step); skipped" in out
    assert "Processing 2 parameters\n" in out  # train/gns_skipped_steps is not a parameter
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert results["step"].tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert results.loc[results["step"].isin([7, 8]), "gtg"].isna().all()
    kept = [s for s in range(10) if s not in (4, 7, 8)]
    exp = expected_gns({p: (n[kept], pe[kept]) for p, (n, pe) in norms.items()}, params, 8, 0.95)
    np.testing.assert_allclose(results["gns"].iloc[-1], exp[-1, 2], rtol=1e-12)


@pytest.mark.parametrize("main", [analysis_cli.main, analysis_plots.main], ids=["gns-analysis", "plot"])
def test_a_bad_argument_is_a_return_code_not_an_exit_and_messages_name_the_program(main, tmp_path, capsys):
    """argparse's SystemExit(2) left main() on a bad argument, though no module of the package may exit its caller's
    process; and the installed nanogns-analysis printed its errors as `gns-analysis.py: error:`."""
    assert main([str(tmp_path), "train/lossf", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: " in err and "--no-such-flag" in err, err
    assert main([]) == 2  # the run directory missing
    assert "error: the following arguments are required: out_dir" in capsys.readouterr().err
    script = "import sys; sys.argv[0] = '/venv/bin/nanogns-analysis'; from nanogns.analysis.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "nothing")], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.startswith("nanogns-analysis: error: no log in "), done.stderr


def test_files_written_and_terminal_plots(tmp_path, capsys):
    write_reference_log(tmp_path, n_steps=12)
    assert analysis_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GNS over tokens" in out and "Legend" in out and "GNS (ddp)" in out
    for name in ("gns_emas.png", "gns_phase.png", "gns_over_tokens.png", "gns_groups.png", "gns_layernorm_vs_all.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    expected_cols = [
        "step",
        "tokens_processed",
        "batch_size",
        "sgn",
        "spegn",
        "gtg",
        "trsigma",
        "gtg_ema",
        "trsigma_ema",
        "gns",
        "gns_layernorm",
        "gns_linear",
        "gns_embedding",
    ]
    assert list(results.columns[: len(expected_cols)]) == expected_cols
    assert "gns_block_0" in results and "gns_sogns" not in results
    assert len(results) == 12
    assert not (tmp_path / "gns_sogns_vs_exact.png").exists()
    # what LogWrapper(..., replace=True) removes with the log it replaces: every result the analysis writes
    analysed = ga.analyze_gns(str(tmp_path))
    stems = {name for name, *_ in analysis_cli._figures(analysed.assign(gns_sogns=np.nan))}
    assert {f"{stem}.png" for stem in stems} | {"gns_analysis.csv"} == set(ANALYSIS_RESULTS)


def test_no_plots_writes_no_figure(tmp_path, capsys):
    """--no-plots skipped the terminal plots but still wrote the PNG figures (about 200 MiB of a 200 MB log's
    analysis): it now writes gns_analysis.csv alone."""
    write_reference_log(tmp_path, n_steps=12)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert sorted(f for f in os.listdir(tmp_path) if not f.startswith("log")) == ["gns_analysis.csv"]
    assert "Figures saved" not in out and "Legend" not in out and "for the plots" not in out


@pytest.mark.parametrize("scatter", [False, True])
def test_a_long_series_is_drawn_decimated_keeping_its_envelope(scatter, monkeypatch):
    """Plots drew every step (a list of Python floats per series for the terminal, a path of 400,000 vertices per
    PNG line): now at most MAX_POINTS per series, each run of points keeping its lowest and highest value."""
    import plotille

    from nanogns.analysis import plots

    n = 100_003
    x = np.arange(n, dtype=np.float64)
    y = np.sin(x / 997) + np.where(x % 5003 == 17, 3.0, 0.0)  # spikes a stride would miss
    y[[5, 70_001]] = [np.nan, np.inf]
    drawn = []
    monkeypatch.setattr(plotille.Figure, "scatter" if scatter else "plot", lambda fig, xs, ys, **kw: drawn.append(xs))
    plots.terminal_plot([("y", x, y)], scatter=scatter)
    assert 0 < len(drawn[0]) <= plots.MAX_POINTS
    dx, dy = plots.decimated(*plots._finite_pairs(x, y), scatter=scatter)
    assert len(dx) <= plots.MAX_POINTS and np.all(np.diff(dx) > 0)
    if not scatter:  # the line's envelope is the whole series': every spike and both extremes kept
        finite = np.isfinite(y)
        assert dy.max() == y[finite].max() and dy.min() == y[finite].min()
        assert set(np.flatnonzero(x % 5003 == 17)) <= set(dx.astype(np.int64))
    short = np.arange(10.0)
    assert [a.tolist() for a in plots.decimated(short, short)] == [short.tolist()] * 2


def test_a_non_finite_batch_size_is_a_bad_cell_warned_and_counted(tmp_path, capsys):
    """A step whose batch_size cells were nan (or empty) beside its logged norms was dropped without a word."""
    df, _ = write_reference_log(tmp_path, n_steps=12)
    batch = [c for c in df.columns if c.endswith("/batch_size")]
    df.loc[df["step"].isin([3, 7]), batch] = np.nan
    df.to_csv(tmp_path / "log.csv", index=False)
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == min(2 * len(batch), 20) + (2 * len(batch) > 20), warnings
    assert warnings[0] == (
        f"warning: {tmp_path / 'log.csv'}: step 3, column {batch[0]}: batch_size nan is not an integer >= 2 (the GNS "
        "compares 2 or more examples); step skipped"
    )
    assert pd.read_csv(tmp_path / "gns_analysis.csv")["step"].tolist() == [s for s in range(12) if s not in (3, 7)]


@pytest.mark.slow
def test_the_analysis_memory_follows_what_it_keeps_not_the_logs_length(tmp_path):
    """gns-analysis held each step's sums twice while joining the pieces it read, beside the results: 0.56 of every
    byte a long log adds (Python's traced memory, after a warm-up; 0.26 now). bench/analysis_memory.py measures
    the process's peak on a 200 MB log (bench/RESULTS.md)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import analysis_memory

    def peak(rows):
        run = tmp_path / f"rows-{rows}"
        run.mkdir()
        size = analysis_memory.write_log(str(run), rows, "narrow")
        tracemalloc.start()
        with contextlib.redirect_stdout(io.StringIO()):
            assert analysis_cli.main([str(run), "--no-plots"]) == 0
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return size, traced

    peak(100)  # the first analysis's one-time costs (pandas' CSV machinery) out of the comparison
    (small, small_peak), (large, large_peak) = peak(10_000), peak(30_000)
    assert (large_peak - small_peak) / (large - small) < 0.4, (small_peak, large_peak, small, large)


def test_uneven_batch_sizes_and_batch_size_one_are_errors(tmp_path):
    df, _ = write_reference_log(tmp_path / "uneven", n_steps=5)
    df.loc[3, "train/gns/transformer.wpe.weight/batch_size"] = 4
    df.to_csv(tmp_path / "uneven" / "log.csv", index=False)
    with pytest.raises(ValueError, match=r"batch sizes differ.*\[3\]"):
        ga.analyze_gns(str(tmp_path / "uneven"))
    write_run(tmp_path / "b1", synthetic_norms(5), batch_size=1)
    with pytest.raises(ValueError, match="undefined at B=1"):
        ga.analyze_gns(str(tmp_path / "b1"))


def run_script(*args):
    return subprocess.run(
        [sys.executable, "gns-analysis.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _empty_log(d):
    os.makedirs(d)
    with open(os.path.join(d, "log.csv"), "w") as f:
        f.write("step,train/lossf\n")


def _log_without_gns(d):
    t = LogWrapper(out_dir=d)
    for s in range(3):
        t.log({"train/lossf": 1.0 / (s + 1), "lr": 1e-3})
        t.step()
    t.close()


def _log_with_only_tied_columns(d):
    norms = synthetic_norms(3)
    write_run(d, {p: norms[p] for p in ("transformer.wte.weight", "lm_head.weight")})


@pytest.mark.parametrize(
    "make, message",
    [
        (None, r"no log in .*log\.csv"),
        (_empty_log, "header but no rows"),
        (_log_without_gns, r"no 'train/gns/<param>/norm' columns.*train/lossf, lr.*--linearclass=gns"),
        (_log_with_only_tied_columns, r"only tied-weight columns \(lm_head.weight, transformer.wte.weight\)"),
    ],
    ids=["missing-dir", "empty-log", "no-gns-columns", "only-reference-tied-columns"],
)
def test_errors_exit_1_with_a_message_and_no_traceback(tmp_path, make, message):
    d = str(tmp_path / "run")
    if make is not None:
        make(d)
    proc = run_script(d, "--no-plots")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr


# -----------------------------------------------------------------------------
# the run's record of what each parameter is; DDP; logs of other loops; what the GNS means for B


def record_entry(kind, block, name):
    return {"kind": kind, "layer": "x", "block": block, "names": [name], "numel": 1, "bank_slices": None}


def test_groups_and_blocks_come_from_the_record_not_the_names(tmp_path, capsys):
    """A norm named ln_attn (a name rule calls it Linear), a Linear named norm_proj, untied wte and lm_head
    (a name rule drops them as reference-style tied columns): the record says what they are."""
    names = [
        "h.0.ln_attn.weight",
        "h.0.norm_proj.weight",
        "h.1.ln_attn.weight",
        "transformer.wte.weight",
        "lm_head.weight",
    ]
    rng = np.random.default_rng(3)
    norms = {
        n: (rng.uniform(0.5, 2, 20), np.sqrt(rng.uniform(0.5, 2, 20) ** 2 + rng.uniform(1, 30, 20))) for n in names
    }
    write_run(tmp_path, norms)
    by_name = ga.analyze_gns(str(tmp_path))
    assert by_name.attrs["grouped_by"] == "name" and by_name.attrs["excluded"] == [
        "lm_head.weight",
        "transformer.wte.weight",
    ]
    assert by_name.attrs["groups"]["Linear"] == ["h.0.ln_attn.weight", "h.1.ln_attn.weight"]  # wrong, by name
    assert by_name.attrs["groups"]["LayerNorm"] == ["h.0.norm_proj.weight"]
    kinds = {
        "h.0.ln_attn.weight": ("LayerNorm", 0),
        "h.0.norm_proj.weight": ("Linear", 0),
        "h.1.ln_attn.weight": ("RMSNorm", 1),
        "transformer.wte.weight": ("Embedding", None),
        "lm_head.weight": ("Linear", None),
    }
    write_parameter_record(str(tmp_path), {n: record_entry(k, b, n) for n, (k, b) in kinds.items()})
    results = ga.analyze_gns(str(tmp_path))
    assert results.attrs["grouped_by"] == "record" and results.attrs["excluded"] == []
    assert results.attrs["groups"] == {
        "LayerNorm": ["h.0.ln_attn.weight", "h.1.ln_attn.weight"],
        "Linear": ["h.0.norm_proj.weight", "lm_head.weight"],
        "Embedding": ["transformer.wte.weight"],
        "Other": [],
    }
    assert results.attrs["blocks"] == {0: ["h.0.ln_attn.weight", "h.0.norm_proj.weight"], 1: ["h.1.ln_attn.weight"]}
    df = load_log(tmp_path)
    np.testing.assert_allclose(results["gns"], pandas_gns(df, names, 0.95), rtol=1e-12)
    np.testing.assert_allclose(
        results["gns_layernorm"], pandas_gns(df, ["h.0.ln_attn.weight", "h.1.ln_attn.weight"], 0.95), rtol=1e-12
    )
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    assert re.search(r"^all\s+5\s", capsys.readouterr().out, re.MULTILINE)


def test_ddp_gns_is_formed_from_the_raw_columns_with_the_given_alpha(tmp_path, capsys):
    n = 25
    rng = np.random.default_rng(4)
    small, large = rng.uniform(3, 3.5, n), rng.uniform(2, 2.5, n)  # |G|^2 = 2 large - small > 0
    write_run(tmp_path, synthetic_norms(n))
    df = load_log(tmp_path)
    df["ddp/sq_norm_small"], df["ddp/sq_norm_large"] = small, large
    df["ddp/small_batch_size"], df["ddp/big_batch_size"] = 32, 64
    os.remove(tmp_path / "log.csv")
    df.to_csv(tmp_path / "log.csv", index=False)
    for alpha in (0.95, 0.5):
        gtg = (64 * large - 32 * small) / 32
        trsigma = (small - large) / (1 / 32 - 1 / 64)
        ema = lambda x: pd.Series(x).ewm(alpha=1 - alpha, adjust=False).mean()  # noqa: E731
        expected = (ema(trsigma) / ema(gtg)).where(ema(gtg) > 0)
        results = ga.analyze_gns(str(tmp_path), alpha=alpha)
        np.testing.assert_allclose(results["ddp_gns"], expected, rtol=1e-12)
        assert analysis_cli.main([str(tmp_path), "--no-plots", "--alpha", str(alpha)]) == 0
        out = capsys.readouterr().out
        assert printed(out, "Final DDP GNS") == f"{expected.iloc[-1]:.4f}"
        groups = {g: len(m) for g, m in results.attrs["groups"].items() if m}
        covered = ", ".join(f"{g} {n}" for g, n in groups.items())
        assert (
            f"  (what each covers: Final GNS the {sum(groups.values())} tracked parameters ({covered}), from "
            "per-example norms; Final DDP GNS every trainable parameter"
        ) in out


def test_a_log_without_tokens_is_measured_in_examples(tmp_path, capsys):
    """A user's own loop may log no tokens_processed: the x-axis is then examples, and it says so."""
    log = LogWrapper(out_dir=str(tmp_path))
    norms = synthetic_norms(10)
    for step in range(10):
        log.log(
            {
                f"train/gns/{p}/{m}": v
                for p in NOT_TIED
                for m, v in (("norm", norms[p][0][step]), ("pegn", norms[p][1][step]), ("batch_size", 16))
            }
        )
        log.step()
    log.close()
    results = ga.analyze_gns(str(tmp_path))
    assert results.attrs["x"] == "examples_processed" and results["examples_processed"].tolist() == [
        16 * (i + 1) for i in range(10)
    ]
    assert analysis_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Total examples processed: 160 (the log has no tokens_processed column)" in out
    plots = out.split("no tokens_processed column)")[1].split("Figures saved")[0]
    assert "GNS over examples" in plots and "tokens" not in plots


def test_what_the_gns_means_for_the_batch_size(tmp_path, capsys):
    t = analysis_report.batch_size_tradeoff(100.0, 25)
    assert t == {"steps_overhead": 5.0, "examples_overhead": 1.25, "steps_within_b": 1000.0, "examples_within_b": 10.0}
    assert all(math.isnan(v) for v in analysis_report.batch_size_tradeoff(-3.0, 25).values())
    write_run(tmp_path, synthetic_norms(30), batch_size=64)
    results = ga.analyze_gns(str(tmp_path))
    gns = results["gns"].iloc[-1]
    assert analysis_cli.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"critical batch ~ GNS = {gns:.1f} examples" in out
    assert f"at this run's B = 64: {1 + gns / 64:.2f}x the minimum number of optimizer steps" in out
    assert f"and {1 + 64 / gns:.2f}x the minimum number of examples" in out
    assert (
        f"within 10% of the fewest steps: B >= {gns / 0.1:.0f}; within 10% of the fewest examples: B <= {gns * 0.1:.1f}"
        in out
    )


@pytest.mark.parametrize(
    "gns, steps, examples",
    [
        (0.0317, "every batch (B >= 1)", "no batch (it would take B <= 0.0032: the GNS is that small)"),
        (5.0, "B >= 50", "no batch (it would take B <= 0.5: the GNS is that small)"),
        (30.0, "B >= 300", "B <= 3.0"),
    ],
)
def test_the_batch_size_advice_says_something_for_a_small_gns(gns, steps, examples):
    """A GNS below 0.1 example made the steps bound read "B >= 0", and below 10 the examples bound "B <= 0.x"."""
    results = pd.DataFrame({"gns": [gns], "batch_size": [16]})
    line = analysis_report.tradeoff_lines(results)[-1]
    assert line == f"  within 10% of the fewest steps: {steps}; within 10% of the fewest examples: {examples}"


def test_terminal_plot_series_differ_without_colour():
    """In a log file or a black-and-white terminal only glyphs tell the lines apart."""
    from nanogns.analysis.plots import terminal_plot

    x = np.arange(20.0)
    text = terminal_plot([("a", x, x), ("b", x, 2 * x), ("c", x, 3 * x)])
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    legend = plain.split("Legend:")[1].strip().splitlines()[1:]
    glyphs = [line.split()[0] for line in legend]
    assert [line.split()[1] for line in legend] == ["a", "b", "c"] and len(set(glyphs)) == 3
    for glyph in glyphs:  # each series' glyph is drawn in the plot itself
        assert glyph[1] in plain.split("Legend:")[0]
