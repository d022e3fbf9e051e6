"""
Prepare the Shakespeare dataset for character-level language modeling.
So instead of encoding with GPT-2 BPE tokens, we just map characters to ints.
Will save train.bin, val.bin containing the ids, and meta.json containing the
encoder and decoder and some other related info. All files go next to this script.
(meta.json, not nanoGPT's meta.pkl: metadata is data, and loading a pickle can run code.)

    python data/shakespeare_char/prepare.py
"""
import json
import os
import sys
import urllib.request

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))

# the text is committed as input.txt; download it only if it is missing
input_file_path = os.path.join(here, 'input.txt')
if not os.path.exists(input_file_path):
    data_url = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
    print(f"downloading {data_url}")
    try:
        with urllib.request.urlopen(data_url, timeout=60) as response:
            text = response.read().decode('utf-8')
    except OSError as e:  # URLError and timeouts are OSErrors
        sys.exit(f"prepare.py: {input_file_path} is missing and downloading it failed ({e}); "
                 f"copy tinyshakespeare's input.txt there by hand (from {data_url})")
    with open(input_file_path, 'w') as f:  # written only after a complete download
        f.write(text)

with open(input_file_path, 'r') as f:
    data = f.read()
print(f"length of dataset in characters: {len(data):,}")

# get all the unique characters that occur in this text
chars = sorted(list(set(data)))
vocab_size = len(chars)
print("all the unique characters:", ''.join(chars))
print(f"vocab size: {vocab_size:,}")

# create a mapping from characters to integers
stoi = { ch:i for i,ch in enumerate(chars) }
itos = { i:ch for i,ch in enumerate(chars) }
def encode(s):
    return [stoi[c] for c in s] # encoder: take a string, output a list of integers
def decode(l):
    return ''.join([itos[i] for i in l]) # decoder: take a list of integers, output a string

# create the train and test splits
n = len(data)
train_data = data[:int(n*0.9)]
val_data = data[int(n*0.9):]

# encode both to integers
train_ids = encode(train_data)
val_ids = encode(val_data)
print(f"train has {len(train_ids):,} tokens")
print(f"val has {len(val_ids):,} tokens")

# export to bin files
train_ids = np.array(train_ids, dtype=np.uint16)
val_ids = np.array(val_ids, dtype=np.uint16)
train_ids.tofile(os.path.join(here, 'train.bin'))
val_ids.tofile(os.path.join(here, 'val.bin'))

# save the meta information as well, to help us encode/decode later (itos as a list: JSON keys are strings)
meta = {
    'vocab_size': vocab_size,
    'itos': [itos[i] for i in range(vocab_size)],
    'stoi': stoi,
}
with open(os.path.join(here, 'meta.json'), 'w', encoding='utf-8') as f:
    json.dump(meta, f)

# length of dataset in characters:  1115394
# all the unique characters:
#  !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz
# vocab size: 65
# train has 1003854 tokens
# val has 111540 tokens
