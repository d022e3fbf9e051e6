"""plot.py: terminal plots of logged columns, and its error for a column the run does not have."""

import pandas as pd

from nanogns.analysis import plots as plot


def write_run(tmp_path, n_params=30):
    columns = {
        "step": [0, 1, 2],
        "iter_num": [0, 1, 2],
        "tokens_processed": [8, 16, 24],
        "train/lossf": [3.0, 2.5, 2.2],
    }
    for i in range(n_params):
        for key in ("norm", "pegn", "batch_size"):
            columns[f"train/gns/h.{i}.weight/{key}"] = [1.0, 2.0, 3.0]
    pd.DataFrame(columns).to_csv(tmp_path / "log.csv", index=False)
    return str(tmp_path)


def test_plot_draws_the_asked_column(tmp_path, capsys):
    assert plot.main([write_run(tmp_path), "train/lossf", "--x", "iter_num"]) == 0
    out = capsys.readouterr().out
    assert "train/lossf vs iter_num" in out and "train/lossf" in out.splitlines()[-1] + out


def test_unknown_column_lists_the_main_columns_and_summarises_the_per_parameter_ones(tmp_path, capsys):
    assert plot.main([write_run(tmp_path), "train/los"]) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "plot.py: error: unknown column(s) ['train/los']; the run's columns:"
    assert "iter_num" in lines[1] and "train/lossf" in lines[1] and "train/gns/" not in lines[1]
    assert "for 30 parameters" in err and "did you mean train/lossf?" in err
    assert len(lines) <= 5  # 90 per-parameter columns are one line, not 90
