"""
data/openwebtext/prepare.py on small local corpora (txt, jsonl, parquet), with GPT-2's
BPE loaded from the openai-whisper source package (tiktoken's download needs a network).

    python -m pytest tests/test_data_openwebtext.py -q
"""

import glob
import importlib.util
import os
import subprocess
import sys
import tarfile

import numpy as np
import pandas as pd
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
DOCS = [
    f"Document {i}: the quick brown fox jumps over the lazy dog. " * (i + 1) + "Ünïcödé ✓ <|endoftext|>"
    for i in range(7)
]


@pytest.fixture(scope="module")
def gpt2_bpe():
    """whisper/assets/gpt2.tiktoken, fetched once from PyPI's openai-whisper sdist into .cache/."""
    path = os.path.join(CACHE, "gpt2.tiktoken")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "openai-whisper",
                "-d",
                CACHE,
            ],
            check=True,
        )
        sdist = sorted(glob.glob(os.path.join(CACHE, "openai_whisper-*.tar.gz")))[-1]
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            with open(path, "wb") as f:
                f.write(tar.extractfile(member).read())
    return path


def load_prepare():
    spec = importlib.util.spec_from_file_location("owt_prepare", os.path.join(REPO, "data/openwebtext/prepare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_corpus(tmp_path, kind):
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "txt":
        for i, doc in enumerate(DOCS):
            (folder / f"doc{i}.txt").write_text(doc)
    elif kind == "jsonl":
        pd.DataFrame({"body": DOCS}).to_json(folder / "docs.jsonl", orient="records", lines=True)
    else:
        pd.DataFrame({"text": DOCS[:4]}).to_parquet(folder / "a.parquet")
        pd.DataFrame({"text": DOCS[4:]}).to_parquet(folder / "b.parquet")
    return str(folder / f"*.{kind}")


@pytest.mark.parametrize("kind, column", [("txt", "text"), ("jsonl", "body"), ("parquet", "text")])
def test_prepare_writes_every_document_once_in_nanogpt_format(tmp_path, gpt2_bpe, kind, column):
    pattern = write_corpus(tmp_path, kind)
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "data/openwebtext/prepare.py",
            "--input",
            pattern,
            "--text_column",
            column,
            "--out_dir",
            str(out),
            "--num_proc",
            "2",
            "--val_fraction",
            "0.2",
            "--bpe_file",
            gpt2_bpe,
            "--block_size",
            "16",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    enc = load_prepare().gpt2_encoding(gpt2_bpe)
    assert enc.n_vocab == 50257 and enc.encode_ordinary("hello world") == [31373, 995]  # GPT-2's ids
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(val) > 0 and len(train) > len(val)
    # split into documents at <|endoftext|> (50256); the literal text "<|endoftext|>" is not a special token
    decoded = []
    for ids in (train, val):
        cuts = np.flatnonzero(ids == enc.eot_token)
        assert cuts[-1] == len(ids) - 1
        decoded += [enc.decode(doc.tolist()) for doc in np.split(ids, cuts + 1)[:-1] for doc in [doc[:-1]]]
    assert sorted(decoded) == sorted(DOCS)
    assert not list(out.glob("*.tmp"))


def test_prepare_explains_bad_input(tmp_path, gpt2_bpe):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    for args, message in [
        (["--input", str(tmp_path / "*.csv")], "unsupported input type '.csv'"),
        (["--input", str(tmp_path / "*.nothing")], "no files match"),
    ]:
        result = subprocess.run(
            [
                sys.executable,
                "data/openwebtext/prepare.py",
                *args,
                "--bpe_file",
                gpt2_bpe,
                "--out_dir",
                str(tmp_path / "out"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr


def prepare(*args):
    return subprocess.run(
        [sys.executable, "data/openwebtext/prepare.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_the_val_split_holds_at_least_one_block(tmp_path, gpt2_bpe):
    """7 small documents and the default --val_fraction (0.0005): one document, too short for a batch of 64 + 1."""
    out = tmp_path / "out"
    result = prepare(
        "--input",
        write_corpus(tmp_path, "txt"),
        "--out_dir",
        str(out),
        "--num_proc",
        "1",
        "--bpe_file",
        gpt2_bpe,
        "--block_size",
        "64",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    train, val = (np.fromfile(out / f"{split}.bin", dtype=np.uint16) for split in ("train", "val"))
    assert len(val) >= 65 and len(train) >= 65
    tokens = sum(len(ids) + 1 for ids in load_prepare().gpt2_encoding(gpt2_bpe).encode_ordinary_batch(DOCS))
    assert len(train) + len(val) == tokens  # every document once


def test_split_documents_grows_val_to_a_block_and_refuses_a_corpus_too_small():
    split_documents = load_prepare().split_documents
    lengths = [10] * 100
    train, val = split_documents(lengths, 0.0005, 35)
    assert len(val) == 4 and len(train) == 96 and sorted(np.concatenate([train, val]).tolist()) == list(range(100))
    train, val = split_documents(lengths, 0.2, 35)
    assert len(val) == 20
    with pytest.raises(SystemExit, match="too few for a val split and a train split of at least 501 tokens each"):
        split_documents(lengths, 0.0005, 501)


def test_no_network_and_no_bpe_file_is_one_line_pointing_at_bpe_file(tmp_path):
    """tiktoken downloads GPT-2's ranks on first use: with no network (a proxy that refuses) and an empty cache."""
    env = dict(
        os.environ,
        TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
    )
    env.pop("NO_PROXY", None), env.pop("no_proxy", None)
    (tmp_path / "a.txt").write_text("hello")
    result = subprocess.run(
        [
            sys.executable,
            "data/openwebtext/prepare.py",
            "--input",
            str(tmp_path / "*.txt"),
            "--out_dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare.py: cannot download GPT-2's BPE ranks (")
    assert "--bpe_file gpt2.tiktoken" in lines[0] and not (tmp_path / "out").exists()


def test_num_proc_defaults_to_at_most_the_cpus():
    assert load_prepare().make_parser().parse_args([]).num_proc == min(8, os.cpu_count())
