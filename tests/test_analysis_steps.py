"""
gns-analysis reads steps, not lines (nanogns/analysis/steps.py): shuffled, reversed and duplicated logs give the
sorted log's result; each damaged log (text in a cell, a batch size below 2, a negative norm, a last line cut
off mid-write, a malformed gns_parameters.json, a read-only run directory, the log file given for its directory)
gives one line or a named warning, never a traceback or a silently wrong number.

    python -m pytest -q tests/test_analysis_steps.py
"""

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO
from test_analysis import synthetic_norms, write_run

from nanogns.analysis import cli as analysis_cli
from nanogns.runlog.record import PARAMETERS_JSON, write_parameter_record

N_STEPS = 12
GAP = (
    "a log lost before a resume starts at the checkpoint's step, rows set aside at a resume are in "
    "log_after_step_<N>.csv; the EMAs skip them"
)
NORM = "train/gns/transformer.h.0.attn.c_attn.weight/norm"
BATCH = "train/gns/transformer.h.0.attn.c_attn.weight/batch_size"


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    """The PNG figures take seconds each and are tested elsewhere: written only where a test looks at them (it
    undoes this with monkeypatch.undo())."""
    monkeypatch.setattr(analysis_cli, "save_plots", lambda results, out_dir: [])


@pytest.fixture
def run(tmp_path):
    """A run's directory: a log of N_STEPS measured steps (and eval-only rows), and its log as a DataFrame."""
    write_run(tmp_path / "run", synthetic_norms(N_STEPS), batch_size=32, eval_every=5)
    return tmp_path / "run", pd.read_csv(tmp_path / "run" / "log.csv")


def with_log(directory, df):
    """A run directory holding `df` as its log.csv."""
    os.makedirs(directory, exist_ok=True)
    df.to_csv(os.path.join(directory, "log.csv"), index=False)
    return str(directory)


def analyse(directory, capsys):
    """(results, printed warnings) of gns-analysis on `directory`, through its command line (no plots)."""
    assert analysis_cli.main([str(directory), "--no-plots"]) == 0
    out = capsys.readouterr().out
    results = pd.read_csv(os.path.join(directory, "gns_analysis.csv"))
    return results, [line for line in out.splitlines() if line.startswith(("warning:", "note:"))]


def final_lines(directory, capsys):
    analysis_cli.main([str(directory), "--no-plots"])
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith(("Final", "Total", "Average"))]


def refusal(directory, capsys):
    """The one line gns-analysis prints when it refuses `directory` (exit status 1)."""
    assert analysis_cli.main([str(directory), "--no-plots"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gns-analysis.py: error: "), err
    return err


@pytest.mark.parametrize("order", ["shuffled", "reversed", "duplicated", "duplicated-and-shuffled"])
def test_row_order_and_repeated_rows_give_the_sorted_logs_result(run, tmp_path, order, capsys):
    directory, df = run
    expected, _ = analyse(directory, capsys)
    if order == "reversed":
        damaged = df.iloc[::-1]
    elif order == "shuffled":
        damaged = df.sample(frac=1, random_state=3)
    else:
        damaged = pd.concat([df, df])  # every row written twice, as a log concatenated with itself
        if order == "duplicated-and-shuffled":
            damaged = damaged.sample(frac=1, random_state=5)
    results, notes = analyse(with_log(tmp_path / order, damaged), capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert final_lines(tmp_path / order, capsys) == final_lines(directory, capsys)
    if order != "duplicated":
        assert f"note: {tmp_path / order / 'log.csv'}: the rows are not in step order; analysed in step order" in notes
    if order.startswith("duplicated"):
        assert len(notes) == 1 + (order != "duplicated")
        assert notes[0].startswith(
            f"warning: {tmp_path / order / 'log.csv'}: step(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ..."
        )
        assert notes[0].endswith(
            "logged more than once; the last row of each is used (a later write replaces an earlier one, as a resume does)"
        )


def test_a_later_write_of_a_step_replaces_the_earlier_one(run, tmp_path, capsys):
    """A step written again further down (as a resumed run rewrites it) counts with its last values."""
    directory, df = run
    rewritten = df.copy()
    row = rewritten.index[rewritten["step"] == 7][0]
    rewritten.loc[row, NORM] *= 3
    expected, _ = analyse(with_log(tmp_path / "expected", rewritten), capsys)
    damaged = pd.concat([df.iloc[: row + 3], rewritten.loc[[row]], df.iloc[row + 3 :]])
    results, notes = analyse(with_log(tmp_path / "damaged", damaged), capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert notes[0].startswith(f"warning: {tmp_path / 'damaged' / 'log.csv'}: step(s) 7 logged more than once")


def without_step(df, step):
    return df[df["step"] != step]


@pytest.mark.parametrize(
    "case",
    [
        "text-in-a-norm",
        "text-in-the-last-tokens",
        "batch-size-0-in-the-last-row",
        "batch-size-1",
        "negative-norm",
        "text-in-one-batch-size",
    ],
)
def test_each_bad_cell_is_one_warning_naming_step_column_and_file_and_its_step_is_skipped(run, tmp_path, case, capsys):
    directory, df = run
    measured = df[df[NORM].notna()]
    step = int(measured["step"].iloc[-1] if "last" in case else measured["step"].iloc[4])
    row = df.index[df["step"] == step][0]
    damaged = df.astype({NORM: object, BATCH: object, "tokens_processed": object})
    column, value, why = {
        "text-in-a-norm": (NORM, "0.7x", "'0.7x' is not a number"),
        "text-in-the-last-tokens": ("tokens_processed", "12k", "'12k' is not a number"),
        "batch-size-0-in-the-last-row": (BATCH, 0, "batch_size 0 is not an integer >= 2"),
        "batch-size-1": (BATCH, 1, "batch_size 1 is not an integer >= 2"),
        "negative-norm": (NORM, -0.5, "-0.5 is negative"),
        "text-in-one-batch-size": (BATCH, "thirty-two", "'thirty-two' is not a number"),
    }[case]
    damaged.loc[row, column] = value
    expected, _ = analyse(with_log(tmp_path / "expected", without_step(df, step)), capsys)
    results, notes = analyse(with_log(tmp_path / "damaged", damaged), capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"warning: {tmp_path / 'damaged' / 'log.csv'}: step {step}, column {column}: {why}")
    assert notes[0].endswith("; step skipped")
    assert final_lines(tmp_path / "damaged", capsys) == final_lines(tmp_path / "expected", capsys)


def test_a_log_whose_every_step_has_batch_size_one_is_refused(run, tmp_path, capsys):
    _, df = run
    df.loc[df[BATCH].notna(), [c for c in df.columns if c.endswith("/batch_size")]] = 1
    err = refusal(with_log(tmp_path / "b1", df), capsys)
    assert "every step has batch size 1: the GNS is undefined at B=1" in err


def test_a_row_without_a_step_number_is_dropped_naming_its_line(run, tmp_path, capsys):
    directory, df = run
    damaged = df.astype({"step": object})
    damaged.loc[3, "step"] = "three"
    expected, _ = analyse(with_log(tmp_path / "expected", df.drop(index=3)), capsys)
    results, notes = analyse(with_log(tmp_path / "damaged", damaged), capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert notes[0] == (
        f"warning: {tmp_path / 'damaged' / 'log.csv'}, line 5: step 'three' is not a step number; row skipped"
    )
    assert notes[1:] == [f"note: {tmp_path / 'damaged' / 'log.csv'}: no row for 1 step(s) (3): " + GAP]


@pytest.mark.parametrize("tmp_files", [False, True], ids=["log.csv", "tmp-files-of-a-killed-run"])
def test_a_last_line_cut_off_mid_write_is_dropped_with_a_warning(run, tmp_path, tmp_files, capsys):
    directory, df = run
    expected, _ = analyse(with_log(tmp_path / "expected", df.iloc[:-1]), capsys)
    text = (directory / "log.csv").read_text()
    cut = text[: text.rstrip("\n").rfind("\n") + 40]  # the last row's first 39 characters
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    if tmp_files:
        header, _, rows = cut.partition("\n")
        (damaged / "log_header.csv.tmp").write_text(header + "\n")
        (damaged / "log_data.csv.tmp").write_text(rows)
        path = damaged / "log_data.csv.tmp"
    else:
        (damaged / "log.csv").write_text(cut)
        path = damaged / "log.csv"
    results, notes = analyse(damaged, capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert notes == [f"warning: {path}: its last line was cut off mid-write (it ends {cut[-39:]!r}); dropped"]
    assert final_lines(damaged, capsys) == final_lines(tmp_path / "expected", capsys)


RECORD = {"transformer.h.0.attn.c_attn.weight": {"kind": "Linear", "group": "Linear", "block": 0, "numel": 12}}


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"format": 2, "parameters": {', "is not valid JSON (Expecting property name enclosed in double quotes"),
        ("[1, 2]", "is not a record of the tracked parameters: it holds a list (expected"),
        ('{"format": 2}', "it holds a dict without a 'parameters' object"),
        (json.dumps({"parameters": {"a.weight": [1]}}), "entry 'a.weight' is a list, not an object"),
        (json.dumps({"parameters": {"a.weight": {"kind": "Linear"}}}), "entry 'a.weight' has no 'block'"),
        (json.dumps({"parameters": {"a.weight": {"group": "Conv", "block": 0}}}), "entry 'a.weight' has group 'Conv'"),
        (json.dumps({"parameters": {"a.weight": {"block": 0}}}), "has neither a 'kind' nor a 'group' string"),
    ],
    ids=["malformed", "a-list", "no-parameters", "entry-a-list", "no-block", "unknown-group", "no-kind"],
)
def test_a_malformed_parameter_record_is_one_line_naming_the_file(run, text, problem, capsys):
    directory, _ = run
    write_parameter_record(str(directory), RECORD)
    analyse(directory, capsys)  # a good record is read
    (directory / PARAMETERS_JSON).write_text(text)
    err = refusal(directory, capsys)
    assert f"error: {directory / PARAMETERS_JSON} " in err and problem in err, err
    assert err.endswith("repair it, or move it away to group the parameters by their names")


@pytest.fixture
def read_only(tmp_path):
    """Make a directory read-only for this process, root included (as root: the immutable attribute)."""
    made = []

    def make(directory):
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", directory]).returncode:
                pytest.skip("running as root, where only `chattr +i` makes a directory read-only, and it failed here")
        else:
            os.chmod(directory, 0o555)
        made.append(directory)

    yield make
    for directory in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", directory], check=True)
        else:
            os.chmod(directory, 0o755)


def test_a_read_only_run_directory_gets_its_results_elsewhere_with_a_note(run, read_only, monkeypatch, capsys):
    monkeypatch.undo()  # the figures too
    directory, _ = run
    before = sorted(os.listdir(directory))
    read_only(directory)
    assert analysis_cli.main([str(directory)]) == 0  # with the plots
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(f"note: {directory} is read-only: the results go to "), notes
    elsewhere = notes[0].split("the results go to ")[1].split(" instead")[0]
    assert f"Detailed results saved to: {os.path.join(elsewhere, 'gns_analysis.csv')}" in out
    assert os.path.exists(os.path.join(elsewhere, "gns_emas.png"))
    assert sorted(os.listdir(directory)) == before
    shutil.rmtree(elsewhere)


def test_output_dir_takes_the_results(run, tmp_path, capsys):
    directory, _ = run
    assert analysis_cli.main([str(directory), "--no-plots", "--output-dir", str(tmp_path / "results")]) == 0
    assert (tmp_path / "results" / "gns_analysis.csv").exists() and not (directory / "gns_analysis.csv").exists()


def test_the_path_of_the_log_file_reads_its_run_directory_and_another_file_is_one_clear_line(run, capsys):
    directory, _ = run
    proc = subprocess.run(
        [sys.executable, "gns-analysis.py", str(directory / "log.csv"), "--no-plots"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"Loading data from {directory}\n" in proc.stdout and (directory / "gns_analysis.csv").exists()
    err = refusal(directory / "gns_analysis.csv", capsys)
    assert f"{directory / 'gns_analysis.csv'} is a file: gns-analysis.py reads a run directory" in err


# -----------------------------------------------------------------------------
# issue 37: duplicates resolved before cells are judged; steps without norms reported; every mistake one line


def test_a_bad_later_write_of_a_step_skips_the_step_and_never_uses_the_earlier_row(run, tmp_path, capsys):
    """Step 7 written again further down with a bad cell: the later write replaces the earlier one, so the step is
    skipped (as if it were not logged), and the warning names both rows."""
    directory, df = run
    row = df.index[df["step"] == 7][0]
    rewritten = df.loc[[row]].astype({NORM: object})
    rewritten.loc[row, NORM] = "0.7x"
    expected, _ = analyse(with_log(tmp_path / "expected", without_step(df, 7)), capsys)
    damaged = pd.concat([df.iloc[: row + 3], rewritten, df.iloc[row + 3 :]])
    results, notes = analyse(with_log(tmp_path / "damaged", damaged), capsys)
    pd.testing.assert_frame_equal(results, expected)
    path = tmp_path / "damaged" / "log.csv"
    assert notes[0].startswith(f"warning: {path}: step(s) 7 logged more than once; the last row of each is used")
    first, later = row + 2, row + 3 + 2  # file lines: the header is line 1
    assert notes[1] == (
        f"warning: {path}: step 7, column {NORM}: '0.7x' is not a number (its last row, line {later}; the earlier "
        f"row at line {first} is not used); step skipped"
    )


def test_steps_without_norms_are_reported_and_the_totals_cover_the_whole_log(run, tmp_path, capsys):
    """A run resumed with layers that record no norms (steps 12-19: training columns only): one warning names the
    steps, the GNS is the last measured step's, the total tokens the whole log's."""
    directory, df = run
    measured = df[df[NORM].notna()]
    later = pd.DataFrame(
        {"step": range(int(df["step"].max()) + 1, int(df["step"].max()) + 9), "train/lossf": 1.0}
    ).assign(tokens_processed=lambda d: (d["step"] + 1) * 32 * 256)
    expected, _ = analyse(directory, capsys)
    results, notes = analyse(with_log(tmp_path / "resumed", pd.concat([df, later])), capsys)
    pd.testing.assert_frame_equal(results, expected)
    first, last = later["step"].iloc[0], later["step"].iloc[-1]
    assert notes == [
        f"warning: {tmp_path / 'resumed' / 'log.csv'}: 8 of the log's {len(measured) + 8} training steps have no "
        f"per-example norms (steps {first}-{last}): the GNS leaves them out, the totals count them (a step a "
        "GradScaler skipped has none; so have steps trained with layer classes 'nn')"
    ]
    lines = final_lines(tmp_path / "resumed", capsys)
    assert f"Total tokens processed: {(last + 1) * 32 * 256:,}" in lines
    out = analysis_cli.main([str(tmp_path / "resumed"), "--no-plots"]) or capsys.readouterr().out
    assert (
        f"  (the GNS above is at step {int(measured['step'].iloc[-1])} ({int(measured['tokens_processed'].iloc[-1]):,} "
        f"tokens), the last step with per-example norms; the log goes on to step {last} without them, and the "
        "total counts those steps too)"
    ) in out


def test_a_log_without_batch_size_columns_is_one_line_saying_so(run, tmp_path, capsys):
    _, df = run
    damaged = df[[c for c in df.columns if not c.endswith("/batch_size")]]
    err = refusal(with_log(tmp_path / "no-batch-size", damaged), capsys)
    n = sum(c.endswith("/norm") for c in df.columns)
    assert err.startswith(
        f"gns-analysis.py: error: no parameter under 'train/gns' has all three columns norm, pegn and batch_size: "
        f"{n} of {n} lack batch_size (e.g. "
    ), err


def test_a_binary_file_as_the_log_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.csv").write_bytes(bytes(range(256)) * 64)
    err = refusal(tmp_path / "run" / "log.csv", capsys)
    assert err.startswith(f"gns-analysis.py: error: {tmp_path / 'run' / 'log.csv'} is not a text CSV log ("), err
    header = b"step,train/gns/a.weight/norm,train/gns/a.weight/pegn,train/gns/a.weight/batch_size\n"
    (tmp_path / "run" / "log.csv").write_bytes(header + b"0,1.0,2.0,8\n\xff\xfe\x00\x01\n")  # text, then not
    err = refusal(tmp_path / "run", capsys)
    assert err.startswith(f"gns-analysis.py: error: {tmp_path / 'run' / 'log.csv'} is not a text CSV log ("), err


@pytest.mark.parametrize("saved_as", ["utf-8-bom", "crlf", "utf-8-bom-crlf"])
def test_a_log_saved_again_by_a_spreadsheet_reads_as_written(run, tmp_path, saved_as, capsys):
    """A spreadsheet's "CSV UTF-8" puts a byte order mark before the header (it was read as part of the column
    `step`, so the rows were analysed in file order without a word), Windows ends lines with CR LF: every column
    is read, and the shuffled log gives the sorted log's numbers."""
    directory, df = run
    expected, _ = analyse(directory, capsys)
    shuffled = with_log(tmp_path / saved_as, df.sample(frac=1, random_state=3))
    path = os.path.join(shuffled, "log.csv")
    text = open(path, "rb").read()
    if "crlf" in saved_as:
        text = text.replace(b"\n", b"\r\n")
    if "bom" in saved_as:
        text = b"\xef\xbb\xbf" + text
    with open(path, "wb") as f:
        f.write(text)
    results, notes = analyse(shuffled, capsys)
    pd.testing.assert_frame_equal(results, expected)
    assert notes == [f"note: {path}: the rows are not in step order; analysed in step order"]


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_log_saved_again_as_utf16_is_one_line_giving_the_command_that_converts_it(run, tmp_path, codec, capsys):
    directory, df = run
    path = tmp_path / codec / "log.csv"
    with_log(tmp_path / codec, df)
    path.write_bytes(path.read_text().encode(codec))
    err = refusal(tmp_path / codec, capsys)
    name = {"utf-16": "UTF-16LE", "utf-16-le": "UTF-16LE", "utf-16-be": "UTF-16BE", "utf-32": "UTF-32LE"}[codec]
    assert err == (
        f"gns-analysis.py: error: {path} holds {name} text (as a spreadsheet's \"Unicode text\" or an editor's "
        f"UTF-16 saves it), not the UTF-8 lines a log is written in: convert it with `iconv -f {name} -t UTF-8 "
        f'{path} > {path}.utf8 && mv {path}.utf8 {path}` (or save it from the spreadsheet as "CSV UTF-8")'
    )
    # the command it gives works: the converted log is read as written
    converted = subprocess.run(["sh", "-c", err.split("`")[1]], capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    expected, _ = analyse(directory, capsys)
    results, _ = analyse(tmp_path / codec, capsys)
    pd.testing.assert_frame_equal(results, expected)


def test_a_log_whose_lines_end_in_a_carriage_return_alone_is_one_line(run, tmp_path, capsys):
    directory, df = run
    path = tmp_path / "cr" / "log.csv"
    with_log(tmp_path / "cr", df)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))
    err = refusal(tmp_path / "cr", capsys)
    assert err.startswith(f"gns-analysis.py: error: {path} holds lines ended by a carriage return alone"), err


FULL_DISK = """
import resource, sys
sys.argv = ["gns-analysis.py", sys.argv[1], "--no-plots"]
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # files stop growing at 1 kB, as on a full disk
from nanogns.analysis.cli import main
sys.exit(main())
"""


def test_a_full_disk_while_writing_the_results_is_one_line(run):
    directory, _ = run
    before = sorted(os.listdir(directory))
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(directory)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("gns-analysis.py: error: cannot write "), proc.stderr
    assert "(File too large); free some space, or write the results elsewhere with --output-dir" in proc.stderr
    assert not (directory / "gns_analysis.csv").exists() and not (directory / "gns_analysis.csv.tmp").exists()
    assert set(before) <= set(os.listdir(directory))
