"""
A dataset's metadata is data, never code (nanogns/dataset.py): meta.json as prepare.py writes it, an older
meta.pkl of plain data, and a meta.pkl that would run code on loading refused unrun (a marker file never appears).

    python -m pytest -q tests/test_dataset.py
"""

import json
import os
import pickle

import pytest
from conftest import REPO

from nanogns.dataset import load_meta


class WritesAFile:
    """Unpickling this runs os.system: what a meta.pkl received from someone else could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_prepare_writes_a_meta_json_that_loads(shakespeare_data):
    data_dir = os.path.join(REPO, "data", "shakespeare_char")
    with open(os.path.join(data_dir, "meta.json")) as f:
        assert set(json.load(f)) == {"vocab_size", "itos", "stoi"}
    meta = load_meta(data_dir)
    assert meta["vocab_size"] == 65 == len(meta["itos"]) == len(meta["stoi"])
    assert all(meta["stoi"][meta["itos"][i]] == i for i in range(65)) and meta["itos"][0] == "\n"
    assert meta["path"] == os.path.join(data_dir, "meta.json")


def test_an_older_meta_pkl_of_plain_data_loads(tmp_path):
    chars = "\n !abc"
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 6, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, f)
    meta = load_meta(str(tmp_path))
    assert meta["vocab_size"] == 6 and meta["itos"][3] == "a" and meta["stoi"]["c"] == 5
    assert load_meta(str(tmp_path / "absent")) is None  # a GPT-2 BPE dataset has no metadata


@pytest.mark.parametrize("where", ["top", "inside"])
def test_a_meta_pkl_that_would_run_code_is_refused_unrun(tmp_path, where):
    marker = tmp_path / "marker"
    payload = WritesAFile(marker)
    meta = payload if where == "top" else {"vocab_size": 65, "itos": {0: payload}}
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(ValueError) as refused:
        load_meta(str(tmp_path))
    assert str(refused.value) == (
        f"{tmp_path / 'meta.pkl'} is not plain data (it names posix.system, and only plain data is loaded); "
        "it was not loaded, as loading it could run code"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("meta.pkl", pickle.dumps({"vocab_size": 65})[:-4], "cannot read {path} (UnpicklingError: "),
        ("meta.json", b'{"vocab_size": ', "cannot read {path} (JSONDecodeError: "),
        ("meta.json", b'{"itos": ["a"]}', "{path} holds no vocab_size (a positive integer)"),
        ("meta.json", b'{"vocab_size": 2, "itos": [1, 2]}', "{path}: itos must map token ids to strings"),
        ("meta.pkl", pickle.dumps([65]), "{path} holds no vocab_size (a positive integer)"),
    ],
    ids=["truncated-pkl", "truncated-json", "no-vocab-size", "itos-not-strings", "pkl-a-list"],
)
def test_damaged_metadata_is_one_message_naming_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as refused:
        load_meta(str(tmp_path))
    assert str(refused.value).startswith(message.format(path=tmp_path / name)), str(refused.value)
