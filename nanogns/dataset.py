"""
A dataset's metadata (its vocabulary), read as data, never as code.

    meta = load_meta("data/shakespeare_char")   # None, or {"vocab_size": int, "stoi": {str: int}, "itos": {int: str},
                                                #   "path": the file read}

A prepare script writes `meta.json` beside train.bin and val.bin:

    {"vocab_size": 65, "itos": ["\\n", " ", "!", ...], "stoi": {"\\n": 0, " ": 1, ...}}

(itos: the character of each token id; stoi: the id of each character.) Datasets prepared by nanoGPT or by
earlier versions of this project have `meta.pkl` instead. A pickle can run code when it is loaded, so it is
read by an unpickler that refuses every class and function: plain dicts, lists, strings and numbers load, and
anything else is refused with a message (re-run the dataset's prepare.py to get a meta.json).
"""

import io
import json
import os
import pickle

import numpy as np

from nanogns.errors import DataNotUsable

META_JSON = "meta.json"
META_PKL = "meta.pkl"


class NotPlainData(DataNotUsable, pickle.UnpicklingError):
    """A pickle names a class or function: refused unloaded."""


class _PlainUnpickler(pickle.Unpickler):
    """Loads only what pickle builds without looking anything up: dict, list, tuple, str, bytes, numbers, bool,
    None. Every class or function a pickle names (the only way it can run code) is refused."""

    def find_class(self, module, name):
        raise NotPlainData(f"it names {module}.{name}, and only plain data is loaded")


def load_plain_pickle(data):
    """The object pickled in `data` (bytes), if it is plain data; raises NotPlainData otherwise."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def _checked(meta, path):
    """{"vocab_size", "stoi", "itos"} from a loaded meta, or ValueError naming what is wrong."""
    if not isinstance(meta, dict) or type(meta.get("vocab_size")) is not int or meta["vocab_size"] < 1:
        raise DataNotUsable(f"{path} holds no vocab_size (a positive integer)")
    out = {"vocab_size": meta["vocab_size"], "path": path}
    itos = meta.get("itos")
    if isinstance(itos, list):
        itos = dict(enumerate(itos))
    if itos is not None:
        if not isinstance(itos, dict) or not all(type(k) is int and isinstance(v, str) for k, v in itos.items()):
            raise DataNotUsable(f"{path}: itos must map token ids to strings")
        covered = sum(1 for k in itos if 0 <= k < meta["vocab_size"])
        if covered < meta["vocab_size"]:
            raise DataNotUsable(
                f"{path}: itos names the characters of {covered} of the vocab_size={meta['vocab_size']:,} token "
                "ids; every id needs one (sample.py writes each generated id as its character)"
            )
        out["itos"] = itos
        stoi = meta.get("stoi", {v: k for k, v in itos.items()})
        if not isinstance(stoi, dict) or not all(isinstance(k, str) and type(v) is int for k, v in stoi.items()):
            raise DataNotUsable(f"{path}: stoi must map strings to token ids")
        out["stoi"] = stoi
    return out


def load_meta(data_dir):
    """The dataset's metadata from data_dir/meta.json (or an older meta.pkl, read as plain data only), or None
    when it has neither (a GPT-2 BPE dataset such as openwebtext).

    Raises:
        ValueError: the file is damaged, or the pickle holds anything but plain data (the message names it).
    """
    json_path, pkl_path = os.path.join(data_dir, META_JSON), os.path.join(data_dir, META_PKL)
    if os.path.exists(json_path):
        try:
            with open(json_path, encoding="utf-8") as f:
                return _checked(json.load(f), json_path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataNotUsable(f"cannot read {json_path} ({type(e).__name__}: {e})") from None
        except RecursionError:  # json's parser recurses once per level
            raise DataNotUsable(f"cannot read {json_path} (it is nested too deeply to be a meta.json)") from None
    if os.path.exists(pkl_path):
        try:
            with open(pkl_path, "rb") as f:
                meta = load_plain_pickle(f.read())
        except NotPlainData as e:
            raise DataNotUsable(
                f"{pkl_path} is not plain data ({e}); it was not loaded, as loading it could run code"
            ) from None
        except RecursionError:
            raise DataNotUsable(f"cannot read {pkl_path} (it is nested too deeply to be a meta.pkl)") from None
        except Exception as e:  # truncated or damaged: EOFError, UnpicklingError, ...
            raise DataNotUsable(f"cannot read {pkl_path} ({type(e).__name__}: {e})") from None
        return _checked(meta, pkl_path)
    return None


def max_token_id(path, chunk=1 << 24):
    """The largest token id in a uint16 token file (nanoGPT's train.bin / val.bin), read in pieces; -1 if empty."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    return max((int(data[i : i + chunk].max()) for i in range(0, len(data), chunk)), default=-1)


def token_ids_problem(data_dir, vocab_size, source, fix):
    """Why the token ids of data_dir's train.bin and val.bin do not fit `vocab_size` (from `source`, named in the
    line with `fix`, how to make the data again), or None: an id at or above it would index past the embedding."""
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        top = max_token_id(path)
        if top >= vocab_size:
            return (
                f"{path} holds token id {top:,}, but vocab_size is {vocab_size:,} (from {source}): every id must be "
                f"below it; make the data and its meta.json again: {fix}"
            )
    return None
