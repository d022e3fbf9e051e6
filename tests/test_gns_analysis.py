"""
Tests of gns-analysis.py against independent numpy re-computations: the printed
numbers, the parameter groups, skipped non-finite steps, logs in the paper's
reference format, error messages and the files written.

    cd /work/main && python -m pytest -q tests/test_gns_analysis.py
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gnstracking import RunningGNS  # noqa: E402
from tracker import LogWrapper  # noqa: E402

_spec = importlib.util.spec_from_file_location("gns_analysis", os.path.join(ROOT, "gns-analysis.py"))
ga = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ga)

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


def write_run(out_dir, norms, batch_size=64, eval_every=None, config=None):
    n_steps = len(next(iter(norms.values()))[0])
    t = LogWrapper(config=config, out_dir=str(out_dir))
    for s in range(n_steps):
        if eval_every and s % eval_every == 0:
            t.log({"val/loss": 3.0})
            t.step()  # an eval-only row
        row = {"train/lossf": 1.0, "tokens_processed": (s + 1) * batch_size * 256}
        for p, (norm, pegn) in norms.items():
            row[f"train/gns/{p}/norm"] = norm[s]
            row[f"train/gns/{p}/pegn"] = pegn[s]
            row[f"train/gns/{p}/batch_size"] = batch_size
        t.log(row)
        t.step()
    t.close()


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


def printed(text, label):
    match = re.search(rf"^{re.escape(label)}: (\S+)$", text, re.MULTILINE)
    assert match, f"{label!r} not in output:\n{text}"
    return match.group(1)


def test_printed_numbers_match_independent_computation(tmp_path, capsys):
    norms = synthetic_norms(40)
    write_run(tmp_path, norms, batch_size=32, eval_every=10)
    assert ga.main([str(tmp_path), "--alpha", "0.9", "--no-plots"]) == 0
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
    with pytest.raises(SystemExit):
        ga.main(["--help"])
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
    ],
)
def test_param_group(name, group):
    assert ga.param_group(name) == group


def test_group_columns_and_table(tmp_path, capsys):
    norms = synthetic_norms(30, seed=2)
    write_run(tmp_path, norms)
    assert ga.main([str(tmp_path), "--no-plots"]) == 0
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
    assert ga.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    exp = expected_gns(norms, NOT_TIED, 16, 0.95)
    assert np.isfinite(exp[-1]).all()
    assert printed(out, "Final GNS") == f"{exp[-1, 2]:.4f}"
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    assert np.isnan(results["gtg"][7]) and np.isnan(results["trsigma"][12])
    np.testing.assert_allclose(results["gns"], exp[:, 2], rtol=1e-12)
    # the online estimator in gnstracking skips the same steps the same way
    running = RunningGNS(decay=0.95)
    for s in range(25):
        running.update(
            sum(norms[p][0][s] ** 2 for p in NOT_TIED), sum(norms[p][1][s] ** 2 for p in NOT_TIED), 16
        )
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
    assert ga.main([str(tmp_path), "--no-plots"]) == 0
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


def test_tied_columns_included_when_config_says_exact(tmp_path):
    _, norms = write_reference_log(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"gns_tied_exact": True}, f)
    results = ga.analyze_gns(str(tmp_path))
    used = [p for p in PARAMS if p != "lm_head.weight"]
    np.testing.assert_allclose(results["gns"], expected_gns(norms, used, 64, 0.95)[:, 2], rtol=1e-12)
    assert "transformer.wte.weight" in results.attrs["groups"]["Embedding"]


def test_files_written_and_terminal_plots(tmp_path, capsys):
    write_reference_log(tmp_path, n_steps=12)
    assert ga.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GNS over tokens" in out and "Legend" in out and "GNS (ddp)" in out
    for name in ("gns_emas.png", "gns_phase.png", "gns_over_tokens.png", "gns_groups.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    results = pd.read_csv(tmp_path / "gns_analysis.csv")
    expected_cols = ["step", "tokens_processed", "batch_size", "sgn", "spegn", "gtg", "trsigma",
                     "gtg_ema", "trsigma_ema", "gns", "gns_layernorm", "gns_linear", "gns_embedding"]
    assert list(results.columns[: len(expected_cols)]) == expected_cols
    assert len(results) == 12


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


@pytest.mark.parametrize(
    "make, message",
    [
        (None, r"no log in .*log\.csv"),
        (_empty_log, "header but no rows"),
        (_log_without_gns, r"no 'train/gns/<param>/norm' columns.*train/lossf, lr.*--linearclass=gns"),
    ],
    ids=["missing-dir", "empty-log", "no-gns-columns"],
)
def test_errors_exit_1_with_a_message_and_no_traceback(tmp_path, make, message):
    d = str(tmp_path / "run")
    if make is not None:
        make(d)
    proc = run_script(d, "--no-plots")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
