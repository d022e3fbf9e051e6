"""
Sample from a model trained with train.py (nanoGPT's sample.py, reading this fork's checkpoints).

    python sample.py --out_dir=out-shakespeare-char --device=cpu --num_samples=2 --max_new_tokens=200

The checkpoint holds plain weights: the per-example norm buffers are not saved, so
the model is built with torch's layers. Besides nanoGPT's keys it carries
`tokens_processed` (a buffer of the run's token count, dropped here) and, for
character-level data, the vocabulary comes from the dataset's meta.json (an older
meta.pkl is read as plain data only). Both files are read as data, never run: see
"What is trusted" in docs/long-runs.md.
"""
import os
import sys
from contextlib import nullcontext

import torch

from model import GPTConfig, GPT
from nanogns import engines # gns: checkpoints are read as data (torch.load with weights_only=True)
from nanogns import settings # gns: a device, a dtype and a checkpoint's model_args checked before use
from nanogns.dataset import load_meta

# -----------------------------------------------------------------------------
out_dir = 'out' # the run's directory, holding ckpt.pt
start = "\n" # or "<|endoftext|>" or etc. Can also specify a file, use as: "FILE:prompt.txt"
num_samples = 10 # number of samples to draw
max_new_tokens = 500 # number of tokens generated in each sample
temperature = 0.8 # 1.0 = no change, < 1.0 = less random, > 1.0 = more random, in predictions
top_k = 200 # retain only the top_k most likely tokens, clamp others to have 0 probability
seed = 1337
device = 'cuda' if torch.cuda.is_available() else 'cpu' # examples: 'cpu', 'cuda', 'cuda:0', 'mps'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32' # 'float32', 'bfloat16', or 'float16'
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read()) # overrides from command line or config file
# -----------------------------------------------------------------------------

# gns: each mistake is one line naming it (a script exits; the package raises)
def fail(message):
    sys.exit(f"sample.py: {message}")

problem = settings.device_problem(device)
if problem:
    fail(problem)
if dtype not in settings.DTYPES:
    fail(f"unknown dtype {dtype!r}; choose from {list(settings.DTYPES)}")
torch.manual_seed(seed)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# model
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if not os.path.exists(ckpt_path):
    fail(f"no checkpoint {ckpt_path}; train first (python train.py ...) or pass the run's "
         f"--out_dir (a run writes ckpt.pt at every eval_interval)")
try:
    checkpoint = engines.read_checkpoint(ckpt_path)
except ValueError as e:
    fail(str(e))
if not isinstance(checkpoint.get('model_args'), dict):
    fail(f"{ckpt_path} is not a checkpoint of train.py (it has no model_args)")
problem = settings.model_args_problem(checkpoint['model_args'])
if problem or not isinstance(checkpoint.get('model'), dict):
    fail(f"{ckpt_path} is not a checkpoint of train.py's GPT (its model_args {problem or 'come without weights'})")
model_args = {k: v for k, v in checkpoint['model_args'].items() if k in GPTConfig.__dataclass_fields__}
problem = settings.model_size_problem(model_args, device, dtype=dtype, training=False)
if problem:
    fail(f"{ckpt_path}: {problem}")
model = GPT(GPTConfig(**model_args))
state_dict = checkpoint['model']
state_dict.pop('tokens_processed', None) # the run's token counter, not a weight
unwanted_prefix = '_orig_mod.' # torch.compile's wrapper
state_dict = {k.removeprefix(unwanted_prefix): v for k, v in state_dict.items()}
try:
    model.load_state_dict(state_dict)
except RuntimeError as e: # weights of another shape than model_args says
    fail(f"{ckpt_path}: its weights do not fit its model_args ({(str(e).splitlines()[1:2] or [str(e)])[0].strip()[:200]} ...)")
model.eval()
model.to(device)

# the encoding: the dataset's own vocabulary (meta.json) if it has one, else GPT-2's BPE
dataset = checkpoint.get('config', {}).get('dataset')
# data/<dataset> where train.py read it (the current directory), else beside this script
data_dirs = [os.path.join(d, 'data', dataset) for d in ('', os.path.dirname(os.path.abspath(__file__)))] if dataset else []
data_dir = next((d for d in data_dirs if os.path.isdir(d)), None)
try:
    meta = load_meta(data_dir) if data_dir else None
except ValueError as e:
    fail(f"{e}; re-run the dataset's prepare.py")
if meta is None and model_args.get('vocab_size', 50304) < 50257:
    fail(f"the model has a {model_args['vocab_size']}-token vocabulary, but no meta.json of "
         f"dataset {dataset!r} was found (looked in {', '.join(data_dirs) or 'no data dir'}); run from the "
         f"directory train.py ran in, or prepare the dataset there")
if meta is not None and 'stoi' in meta:
    print(f"Loading meta from {data_dir}...")
    stoi, itos = meta['stoi'], meta['itos']
    if model_args['vocab_size'] > meta['vocab_size']:
        fail(f"the model has a {model_args['vocab_size']}-token vocabulary, but {meta['path']} names characters for "
             f"{meta['vocab_size']}: its ids could not all be written as text; re-run the dataset's prepare.py")
    def encode(s):
        unknown = sorted(set(c for c in s if c not in stoi))
        if unknown:
            fail(f"--start holds {len(unknown)} character(s) not in the vocabulary of {meta['path']} "
                 f"({''.join(unknown)[:20]!r}); the model knows only its {len(stoi)} characters")
        return [stoi[c] for c in s]
    decode = lambda l: ''.join([itos[i] for i in l])
else:
    try: # gns: GPT-2's tokenizer is not in the quick start's requirements.txt
        import tiktoken
    except ImportError:
        fail("this model reads GPT-2 tokens (its dataset has no meta.json), which needs tiktoken: pip install tiktoken")
    print("No meta.json found, assuming GPT-2 encodings...")
    enc = tiktoken.get_encoding("gpt2")
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
    decode = lambda l: enc.decode(l)

# encode the beginning of the prompt
if start.startswith('FILE:'):
    try:
        with open(start[5:], 'r', encoding='utf-8') as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--start={start!r}: cannot read {start[5:]!r} ({getattr(e, 'strerror', None) or e})")
start_ids = encode(start)
if not start_ids:
    fail("--start is empty: give at least one character (the default is a newline) or FILE:prompt.txt")
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

# run generation
with torch.no_grad():
    with ctx:
        for k in range(num_samples):
            y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)
            print(decode(y[0].tolist()))
            print('---------------')
