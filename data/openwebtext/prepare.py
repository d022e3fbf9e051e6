"""
Tokenize OpenWebText (or your own text) with GPT-2's BPE into nanoGPT's format:
uint16 token ids in train.bin and val.bin, every document followed by <|endoftext|>.

    python data/openwebtext/prepare.py                          # OpenWebText from the Hugging Face hub (~54 GB of cache)
    python data/openwebtext/prepare.py --num_proc=16
    python data/openwebtext/prepare.py --input 'my_corpus/*.parquet' --out_dir data/mycorpus
    python data/openwebtext/prepare.py --input 'notes/*.txt' --bpe_file gpt2.tiktoken   # fully offline

Documents are shuffled (seed 2357) and split: --val_fraction of them go to val.bin,
more if they hold fewer than --block_size + 1 tokens (one batch's read).

--input takes .txt files (one document per file), .jsonl/.json or .parquet files
(one document per row, in column --text_column). --bpe_file loads GPT-2's ranks
from a local .tiktoken file (for example whisper/assets/gpt2.tiktoken from the
openai-whisper source package) instead of tiktoken's download.
"""

import argparse
import math
import os

import numpy as np
import tiktoken
from datasets import load_dataset
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))


def gpt2_encoding(bpe_file=None):
    """tiktoken's GPT-2 encoding; from a local ranks file when given (same ranks, no download)."""
    if bpe_file is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # requests' ConnectionError, a proxy's error page, ...: the ranks could not be fetched
            raise SystemExit(f"prepare.py: cannot download GPT-2's BPE ranks ({type(e).__name__}); without a network "
                             "pass a local copy: --bpe_file gpt2.tiktoken (whisper/assets/gpt2.tiktoken in the "
                             "openai-whisper source package)") from None
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=load_tiktoken_bpe(bpe_file),
                             special_tokens={ENDOFTEXT: 50256})


def load_documents(inputs, text_column, num_proc):
    """A datasets.Dataset with one document per row in column 'text'."""
    if not inputs:
        # OpenWebText: 8,013,769 documents
        return load_dataset("openwebtext", num_proc=num_proc)["train"]
    extensions = {os.path.splitext(f)[1] for f in inputs}
    if len(extensions) != 1:
        raise SystemExit(f"prepare.py: --input files must share one type, got {sorted(extensions)}")
    ext = extensions.pop()
    if ext == ".txt":
        ds = load_dataset("text", data_files=inputs, sample_by="document")["train"]
    elif ext in (".json", ".jsonl"):
        ds = load_dataset("json", data_files=inputs)["train"]
    elif ext == ".parquet":
        ds = load_dataset("parquet", data_files=inputs)["train"]
    else:
        raise SystemExit(f"prepare.py: unsupported input type {ext!r}; use .txt, .json, .jsonl or .parquet")
    if text_column not in ds.column_names:
        raise SystemExit(f"prepare.py: no column {text_column!r} in {inputs[0]}; columns: {ds.column_names} (set --text_column)")
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def split_documents(lengths, val_fraction, min_tokens, seed=2357):
    """(train indices, val indices), each sorted: a seeded shuffle of the documents, val_fraction of them (at least
    one) for val, and more until val holds min_tokens tokens; SystemExit when train would then hold fewer."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths))
    covered = np.cumsum(lengths[order])
    n_val = max(1, math.ceil(val_fraction * len(lengths)), int(np.searchsorted(covered, min_tokens)) + 1)
    if n_val >= len(lengths) or covered[-1] - covered[n_val - 1] < min_tokens:
        raise SystemExit(f"prepare.py: {covered[-1]:,} tokens in {len(lengths)} documents are too few for a val split "
                         f"and a train split of at least {min_tokens:,} tokens each (--block_size + 1, what one "
                         "batch reads); add documents or lower --block_size")
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="*", default=None, help="local files instead of OpenWebText (default: OpenWebText)")
    parser.add_argument("--text_column", default="text", help="column holding the documents (default: text)")
    parser.add_argument("--out_dir", default=HERE, help="where train.bin and val.bin go (default: this folder)")
    parser.add_argument("--num_proc", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes for tokenizing (default: 8 or the number of CPUs, whichever is fewer)")
    parser.add_argument("--val_fraction", type=float, default=0.0005,
                        help="share of documents for val, more when they hold fewer than block_size + 1 tokens "
                             "(default: 0.0005)")
    parser.add_argument("--block_size", type=int, default=2048,
                        help="the longest block_size the data will train with: val.bin and train.bin get at least "
                             "block_size + 1 tokens (default: 2048, config/train_cgpt_111M_owt.py's)")
    parser.add_argument("--bpe_file", default=None, help="local GPT-2 .tiktoken ranks file (default: tiktoken's download)")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)

    import glob
    inputs = sorted(f for pattern in args.input for f in glob.glob(pattern)) if args.input else None
    if args.input and not inputs:
        raise SystemExit(f"prepare.py: no files match {args.input}")
    enc = gpt2_encoding(args.bpe_file)
    dataset = load_documents(inputs, args.text_column, args.num_proc)
    if len(dataset) < 2:
        raise SystemExit("prepare.py: need at least 2 documents (one for val)")

    def tokenize(example):
        ids = enc.encode_ordinary(example["text"])  # ignores special tokens written in the text
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    num_proc = max(1, min(args.num_proc, len(dataset)))
    tokenized = dataset.map(tokenize, remove_columns=dataset.column_names, desc="tokenizing", num_proc=num_proc)
    train_docs, val_docs = split_documents(tokenized["len"], args.val_fraction, args.block_size + 1)

    os.makedirs(args.out_dir, exist_ok=True)
    for name, docs in (("train", train_docs), ("val", val_docs)):
        dset = tokenized.select(docs)
        total = int(np.sum(dset["len"], dtype=np.uint64))
        path = os.path.join(args.out_dir, f"{name}.bin")
        tmp_path = path + ".tmp"  # renamed when complete: a killed run leaves no short train.bin
        arr = np.memmap(tmp_path, dtype=np.uint16, mode="w+", shape=(total,))  # GPT-2's 50257 ids fit in uint16
        shards = min(1024, len(dset))
        index = 0
        for shard in tqdm(range(shards), desc=f"writing {path}"):
            batch = dset.shard(num_shards=shards, index=shard, contiguous=True).with_format("numpy")
            ids = np.concatenate(batch["ids"]) if len(batch) else np.zeros(0, dtype=np.uint16)
            arr[index:index + len(ids)] = ids
            index += len(ids)
        arr.flush()
        del arr
        os.replace(tmp_path, path)
        print(f"{name}: {total:,} tokens in {path}")


if __name__ == "__main__":
    main()
