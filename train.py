"""
This training script can be run both on a single gpu in debug mode,
and also in a larger training run with distributed data parallel (ddp).

It is nanoGPT's train.py plus exact per-example gradient norms for the
gradient noise scale (GNS); every addition is in a block labelled `# gns:`.

To run on a single GPU, example:
$ python train.py --batch_size=32 --compile=False

To run on the CPU with per-example norms on every layer (the quick start):
$ python train.py config/train_shakespeare_char_cpu.py

To run with DDP on 4 gpus on 1 node, example:
$ torchrun --standalone --nproc_per_node=4 train.py

To shard the model, gradients and optimizer state with FSDP2 instead of DDP:
$ torchrun --standalone --nproc_per_node=4 train.py --fsdp=True
"""

import dataclasses
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

# gns: the layer registry, the measurements and the CSV log
import layer_config as lc
import gnstracking
from tracker import LogWrapper
from nanogns import schedules
from nanogns.monitor import summed_squares # gns: a step's summed squared norms, for a batch-size controller
from nanogns import engines # gns: one process, DDP or FSDP2, and the checkpoint's contents, behind one interface
from nanogns import settings # gns: the valid range of every setting
from nanogns.dataset import load_meta, token_ids_problem # gns: the dataset's vocabulary, read as data (meta.json)
from nanogns.runlog.lock import RunLock, DirectoryInUse # gns: one run per out_dir
from nanogns.errors import NanoGNSError # gns: what the package raises when it refuses (one line each)
from model import PEAK_FLOPS

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False # if True, script exits right after the first eval
always_save_checkpoint = True # if True, always save a checkpoint after each eval
init_from = 'scratch' # 'scratch' or 'resume' or 'gpt2*'
# wandb logging
wandb_log = False # disabled by default
wandb_project = 'owt'
wandb_run_name = 'gpt2' # 'run' + str(time.time())
# data
dataset = 'openwebtext'
gradient_accumulation_steps = 5 * 8 # used to simulate larger batch sizes
batch_size = 12 # if gradient_accumulation_steps > 1, this is the micro-batch size
block_size = 1024
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0 # for pretraining 0 is good, for finetuning try 0.1+
bias = False # do we use bias inside LayerNorm and Linear layers?
linearclass = 'nn' # per-example norm layer classes: 'nn' (off), 'shim', 'gns', 'fused'; 'sogns' (approximate) or 'gns+sogns' (both)
embeddingclass = 'nn' # 'nn', 'shim', 'gns' or 'fused'
lnclass = 'nn' # 'nn', 'shim', 'gns' or 'fused'
cos_attn = [] # block indices that use cosine attention
spectral_c_attn = [] # block indices whose QKV projection is spectrally normalised
fp32_attention_layers = [] # block indices whose attention runs in float32
# adamw optimizer
learning_rate = 6e-4 # max learning rate
max_iters = 600000 # total number of training iterations
max_tokens = 15 * 10**12 # total number of tokens to process (whichever of the two comes first)
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0 # clip gradients at this value, or disable if == 0.0
# learning rate decay settings, in tokens (linear decay, as in the Cerebras-GPT recipe)
decay_lr = True # whether to decay the learning rate
warmup_tokens = 2000 * 40 * 12 * 1024 # 2000 steps of 40 x 12 sequences of 1024 tokens
lr_decay_tokens = 600000 * 40 * 12 * 1024 # should be ~= max_tokens per Chinchilla
min_lr = 6e-5 # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
# DDP settings
backend = 'nccl' # 'nccl', 'gloo', etc.
fsdp = False # under torchrun: shard parameters, gradients and optimizer state with FSDP2 (each block, then the root) instead of DDP
# system
device = 'cuda' # examples: 'cpu', 'cuda', 'cuda:0', 'cuda:1' etc., or try 'mps' on macbooks
device_name = 'A100' # peak FLOPS for MFU: 'A100', 'A10', 'H100', 'H200', 'cpu', ... (see model.py)
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16' # 'float32', 'bfloat16', or 'float16', the latter will auto implement a GradScaler
compile = True # use PyTorch 2.0 to compile the model to be faster
gns_ema_decay = 0.95 # decay of the running GNS estimate shown in the status line
# gns: batch-size schedule (schedules.py); steps count accumulation steps over all ranks
bs_schedule = 'none' # 'none', 'linear' (out_dir/grad_accum_schedule.txt, re-read every step; written when absent: a ramp
# from bs_min_accum_steps at 0 tokens to bs_max_accum_steps at max_tokens) or 'gns' (follows the running GNS); both end at max_tokens
bs_min_accum_steps = 1
bs_max_accum_steps = 0 # 0 = gradient_accumulation_steps
bs_gns_factor = 1.0 # 'gns': aim at a global batch of bs_gns_factor x GNS examples; 'sqrt': B = factor x sqrt(GNS x bs_anchor)
# controllers (schedules.BatchSizeController: 'sqrt', 'grow', 'goodput', 'temper'), from the configured batch and learning rate:
bs_cap = 0.0 # the batch within bs_cap x GNS ('grow' grows up to it in place of LR decay, 'temper' doubles within it); 0: 4
bs_anchor = 0.0 # 'sqrt': the batch where B = factor x GNS; 'temper': the GNS where its temperature starts to fall; 0: B0, B0/8
bs_ratio = 2.0 # 'temper' (it replaces the LR decay; the warmup stays): the temperature halves each time the GNS grows bs_ratio-fold
bs_lr_exponent = 0.5 # 'sqrt', 'goodput': LR x (B / B0)^bs_lr_exponent (B0: the configured batch)
bs_gns_horizon = 0 # their GNS's horizon in examples; 0 = 20 x the configured batch
data_seed = -1 # >= 0: training batches drawn from (data_seed, iter_num, global micro-batch index), the same for any number of ranks
# -----------------------------------------------------------------------------
config_keys = [k for k,v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, list))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read()) # overrides from command line or config file
config = {k: globals()[k] for k in config_keys} # will be useful for logging
config['run_id'] = os.urandom(6).hex() # gns: names the run in its checkpoints and config.json (a resume keeps it)
# -----------------------------------------------------------------------------

# gns: a bad setting ends every rank before any process group starts; rank 0 alone prints why (one line on
# stderr, above torchrun's report), the other ranks leave quietly so that the report names rank 0's failure
def fail(message):
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"train.py: {message}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0)

# gns: the package raises a NanoGNSError (a failed write, a checkpoint it cannot use, ...): one line, exit 1
def excepthook(kind, error, tb):
    if not issubclass(kind, NanoGNSError):
        return sys.__excepthook__(kind, error, tb)
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"train.py: {error}", file=sys.stderr, flush=True)
sys.excepthook = excepthook

# gns: every value in its range, and the device, before anything starts (one line naming the flag)
problem = settings.check(config, device_names=PEAK_FLOPS) or settings.device_problem(device)
if problem:
    fail(problem)
# gns: check the layer choice before anything starts, and say why B = 1 cannot work
layer_choice = dict(linearclass=linearclass, embeddingclass=embeddingclass, lnclass=lnclass)
try:
    layer_classes = lc.layer_classes(**layer_choice)
except ValueError as e:
    fail(str(e))
tracked = lc.tracks_per_example_norms(**layer_choice)
if spectral_c_attn and linearclass != 'nn':
    fail(f"spectral_c_attn={spectral_c_attn} with linearclass={linearclass!r}: the spectral norm "
         "makes c_attn compute with W / sigma(W), so its layer would record the per-example norms of that, "
         "not of the trainable W; use --linearclass=nn with spectral_c_attn (the LayerNorm and Embedding "
         "norms still give a GNS), or drop spectral_c_attn")
# gns: check the batch-size schedule
bs_max_accum_steps = bs_max_accum_steps or gradient_accumulation_steps
if bs_schedule not in ('none', 'linear', 'gns', *schedules.CONTROLLER_RULES):
    fail(f"unknown bs_schedule {bs_schedule!r}; choose 'none', 'linear', 'gns', 'sqrt', 'grow', 'goodput' or 'temper'")
if bs_schedule not in ('none', 'linear') and not tracked:
    fail(f"bs_schedule={bs_schedule!r} follows the measured GNS: set a layer class other than 'nn' "
         "(e.g. --linearclass=gns)")
if bs_schedule != 'none' and not 1 <= bs_min_accum_steps <= bs_max_accum_steps:
    fail(f"need 1 <= bs_min_accum_steps ({bs_min_accum_steps}) <= bs_max_accum_steps ({bs_max_accum_steps})")
# gns: wandb not installed, or without a login, would fail inside wandb.init, after out_dir is made; say so first
if wandb_log:
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True needs wandb, which is not installed (it is not in the quick start's requirements.txt): "
             "pip install wandb, or drop --wandb_log")
if wandb_log and os.environ.get('WANDB_MODE') not in ('offline', 'disabled', 'dryrun'):
    if not wandb.login(prompt=False, verify=False):
        fail("wandb_log=True but wandb has no login (no WANDB_API_KEY, no `wandb login`); log in with "
             "`wandb login`, or log offline with WANDB_MODE=offline (upload later with `wandb sync`), or drop --wandb_log")

# various inits, derived attributes, I/O setup
ddp = int(os.environ.get('RANK', -1)) != -1 # is this a ddp run?
if fsdp and not ddp:
    fail("fsdp=True shards the model over the processes of torchrun: "
         "torchrun --standalone --nproc_per_node=N train.py ... --fsdp=True")
if fsdp and (compile or dtype == 'float16'):
    fail("fsdp=True is supported with compile=False and dtype float32 or bfloat16 "
         "(fp16's GradScaler is not set up for sharded gradients)")
if ddp and bs_schedule == 'none':
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    if gradient_accumulation_steps % ddp_world_size != 0:
        divisors = [n for n in range(1, gradient_accumulation_steps + 1) if gradient_accumulation_steps % n == 0]
        lower = gradient_accumulation_steps // ddp_world_size * ddp_world_size
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} counts micro-batches over "
             f"all {ddp_world_size} ranks, so it must be a multiple of the number of ranks (each rank runs "
             f"an equal share); use --gradient_accumulation_steps={lower or ddp_world_size} or "
             f"{lower + ddp_world_size}, or a number of ranks in {divisors}")
engine = engines.start(device, backend, fsdp) # gns: torchrun's processes joined (DDP or FSDP2), or one process
device, ddp_rank, ddp_world_size = engine.device, engine.rank, engine.world_size
master_process = engine.master_process # this process will do logging, checkpointing etc.
if not master_process: # gns: the start-up lines (model size, optimizer, ...) once, from rank 0; errors still reach stderr
    sys.stdout = open(os.devnull, 'w')
seed_offset = engine.seed_offset # each process gets a different seed
# world_size number of processes will be training simultaneously, so we can scale
# down the desired gradient accumulation iterations per process proportionally
bs_base_batch = gradient_accumulation_steps * batch_size # gns: the configured batch (a controller's base)
gradient_accumulation_steps = schedules.per_rank_steps(gradient_accumulation_steps, ddp_world_size)
if bs_schedule != 'none': # gns: a schedule sets these before every step; 'gns' starts at the minimum
    gradient_accumulation_steps = schedules.per_rank_steps(bs_min_accum_steps, ddp_world_size)
examples_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size
tokens_per_iter = examples_per_iter * block_size
micro_tokens = ddp_world_size * batch_size * block_size # gns: tokens of one micro-batch on every rank
if master_process and bs_schedule == 'none':
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
elif master_process: # gns: a schedule moves the batch between its bounds (the last step cut to max_tokens)
    low, high = (schedules.per_rank_steps(n, ddp_world_size) * micro_tokens for n in (bs_min_accum_steps, bs_max_accum_steps))
    print(f"tokens per iteration will follow the {bs_schedule} batch-size schedule: {low:,} to {high:,} "
          f"({bs_min_accum_steps} to {bs_max_accum_steps} accumulation steps)")
if tracked and examples_per_iter < 2: # (a schedule starts at its smallest batch)
    fail("the GNS needs at least 2 examples per optimizer step (it compares per-example "
         "gradients with their mean; at B = 1 it is undefined): raise batch_size or "
         "gradient_accumulation_steps, or set all layer classes to 'nn'")

torch.manual_seed(1337 + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True # allow tf32 on matmul
torch.backends.cudnn.allow_tf32 = True # allow tf32 on cudnn
device_type = 'cuda' if 'cuda' in device else 'cpu' # for later use in torch.autocast
# note: float16 data type will automatically use a GradScaler
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' and dtype == 'float32' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# poor man's data loader
data_dir = os.path.join('data', dataset)
# gns: how to make the data: its prepare.py where there is one, else what the files are
prepare = os.path.join(data_dir, 'prepare.py')
known = [d for d in sorted(os.listdir('data')) if os.path.isfile(os.path.join('data', d, 'prepare.py'))] if os.path.isdir('data') else []
prepare = (f"python {prepare}" if os.path.isfile(prepare) else f"{data_dir} has no prepare.py: put train.bin and val.bin "
           f"there (uint16 token ids, as nanoGPT's prepare scripts write them), with a meta.json for a character vocabulary, "
           f"or choose a --dataset with a prepare.py ({', '.join(known) or 'none in ./data'})")
for split in ('train', 'val'):
    if not os.path.exists(os.path.join(data_dir, f'{split}.bin')):
        raise SystemExit(f"train.py: missing {os.path.join(data_dir, f'{split}.bin')}; prepare the dataset first: {prepare}")
    n_tokens = os.path.getsize(os.path.join(data_dir, f'{split}.bin')) // 2 # uint16 tokens
    if n_tokens < batch_size * (block_size + 1): # gns: else every batch repeats text (its examples would not be distinct)
        raise SystemExit(f"train.py: {os.path.join(data_dir, f'{split}.bin')} holds {n_tokens} tokens, too few for "
                         f"block_size={block_size} with batch_size={batch_size}: a batch reads batch_size x (block_size + 1) = "
                         f"{batch_size * (block_size + 1):,} tokens; lower --block_size or --batch_size, or use more data")
def get_batch(split, index=None):
    # We recreate np.memmap every batch to avoid a memory leak, as per
    # https://stackoverflow.com/questions/45132940/numpy-memmap-memory-usage-want-to-iterate-once/61472122#61472122
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    if data_seed >= 0 and index is not None: # gns: index = (iter_num, micro_step); micro-batch g of the global batch
        it, micro = index
        rng = np.random.default_rng([data_seed, it, micro * ddp_world_size + seed_offset])
        ix = torch.from_numpy(rng.integers(len(data) - block_size, size=batch_size))
    else:
        ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y

# init these up here, can override if init_from='resume' (i.e. from a checkpoint)
iter_num = 0
best_val_loss = 1e9

# attempt to derive vocab_size from the dataset (gns: meta.json, or an older meta.pkl read as plain data only)
meta_vocab_size = None
try:
    meta = load_meta(data_dir)
except ValueError as e:
    raise SystemExit(f"train.py: {e}; make it again: {prepare}")
if meta is not None:
    meta_vocab_size = meta['vocab_size']
    print(f"found vocab_size = {meta_vocab_size} (inside {meta['path']})")
# gns: before anything is made: the data's token ids fit the vocabulary, and the model fits this machine's memory
problem = token_ids_problem(data_dir, meta_vocab_size, meta['path'], prepare) if meta is not None else None
if init_from == 'scratch' and not problem:
    problem = settings.model_size_problem(dict(n_layer=n_layer, n_embd=n_embd, block_size=block_size, bias=bias,
        vocab_size=meta_vocab_size or 50304), device, batch_size, dtype,
        vocab_source=f" from {meta['path']}" if meta is not None else "")
if problem:
    fail(problem)

# gns: only now (bad input above leaves no empty out_dir behind), rank 0 locks out_dir until its process ends: a
# second run or a resume while this one runs is refused; and a new run never mixes its log, checkpoint or schedule
# into another run's out_dir
refusal = None
if master_process:
    try:
        run_lock = RunLock(out_dir)
    except DirectoryInUse as e:
        refusal = str(e)
    except OSError as e:
        refusal = (f"--out_dir={out_dir!r} is a file, not a directory" if os.path.isfile(out_dir) else
                   f"cannot write --out_dir={out_dir!r} ({e.strerror}: {e.filename})") + "; choose another --out_dir"
    else:
        run_files = [f for f in ('log.csv', 'log_header.csv.tmp', 'ckpt.pt', schedules.SCHEDULE_FILE)
                     if os.path.exists(os.path.join(out_dir, f))]
        if init_from != 'resume' and run_files:
            refusal = (f"out_dir {out_dir!r} already holds another run ({', '.join(run_files)}); "
                       f"choose another --out_dir, delete the old one, or continue it with --init_from=resume")
refusal = engine.broadcast(refusal) # every rank leaves together, rank 0 saying why
if refusal:
    engine.close()
    fail(refusal)
# gns: the 'linear' schedule's file, written once (a resumed run keeps it, a user may edit it) and read by rank 0
accum_schedule = None
if bs_schedule == 'linear' and master_process:
    accum_schedule = schedules.FileSchedule(os.path.join(out_dir, schedules.SCHEDULE_FILE), bs_min_accum_steps, bs_max_accum_steps)
    schedules.write_schedule_if_absent(accum_schedule.path, schedules.linear_points(bs_min_accum_steps, bs_max_accum_steps, max_tokens))
    try:
        accum_schedule.read()
    except ValueError as e:
        raise SystemExit(f"train.py: {e}")

# model init
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                  bias=bias, vocab_size=None, dropout=dropout, device_name=device_name,
                  cos_attn=cos_attn, spectral_c_attn=spectral_c_attn,
                  fp32_attention_layers=fp32_attention_layers) # start with model_args from command line
tokens_processed = 0
# gns: build the model with the chosen layer classes
with lc.set_contextual_config(**layer_classes):
    from model import GPTConfig, GPT
    if init_from == 'scratch':
        # init a new model from scratch
        print("Initializing a new model from scratch")
        # determine the vocab size we'll use for from-scratch training
        if meta_vocab_size is None:
            print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
        model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
        gptconf = GPTConfig(**model_args)
        model = GPT(gptconf)
    elif init_from == 'resume':
        print(f"Resuming training from {out_dir}")
        # resume training from a checkpoint.
        ckpt_path = os.path.join(out_dir, 'ckpt.pt')
        checkpoint = engines.load_checkpoint(ckpt_path, fsdp, master_process) # gns: or raise saying what is wrong
        checkpoint_model_args = checkpoint['model_args']
        # gns: a resume continues the checkpoint's run: a flag that would change its model, or what its log
        # measures, is refused naming it; a change of batch size is said, and the log records it
        has_log = any(os.path.exists(os.path.join(out_dir, f)) for f in ('log.csv', 'log_header.csv.tmp'))
        problem, notes = settings.resume_check(config, checkpoint, engine.broadcast(has_log), meta_vocab_size)
        # and the checkpoint continues the log in out_dir (not another run's ckpt.pt copied in), read by rank 0
        problem = problem or engine.broadcast(settings.continuation_problem(out_dir, checkpoint) if master_process else None)
        if problem:
            engine.close()
            fail(problem)
        for note in notes:
            print(note)
        config['run_id'] = (checkpoint.get('config') or {}).get('run_id', config['run_id'])
        if master_process:
            engines.remove_unfinished(ckpt_path)
        # force these config attributes to be equal otherwise we can't even resume training
        # the rest of the attributes (e.g. dropout) can stay as desired from command line
        for k in ['n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size']:
            model_args[k] = checkpoint_model_args[k]
        # create the model
        gptconf = GPTConfig(**model_args)
        model = GPT(gptconf)
        state_dict = checkpoint['model']
        # fix the keys of the state dictionary :(
        # honestly no idea how checkpoints sometimes get this prefix, have to debug more
        unwanted_prefix = '_orig_mod.'
        for k,v in list(state_dict.items()):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
        tokens_processed = int(state_dict.pop('tokens_processed', -1))
        engines.load_weights(model, state_dict, ckpt_path) # gns: model.load_state_dict, a mismatch said in one line
        iter_num = checkpoint['iter_num']
        if tokens_processed < 0: # gns: a nanoGPT checkpoint counts no tokens: iter_num x the tokens of its steps
            tokens_processed, note = settings.resumed_tokens(checkpoint, tokens_per_iter)
            print(note)
        best_val_loss = checkpoint['best_val_loss']
        resume_log_step = checkpoint.get('log_step', iter_num) # gns: the log rows the weights have seen
        if not eval_only and (iter_num >= max_iters or tokens_processed >= max_tokens): # gns: a finished run stays as it is
            print(f"train.py: nothing left to do: the checkpoint in {out_dir} is at iteration {iter_num} and "
                  f"{tokens_processed:,} tokens; {settings.what_ends(iter_num, tokens_processed, max_iters, max_tokens)}")
            engine.close()
            sys.exit(0)
    elif init_from.startswith('gpt2'):
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
        # initialize from OpenAI GPT-2 weights
        override_args = dict(dropout=dropout)
        try: # gns: one line when the weights cannot be had (offline, no cache)
            model = GPT.from_pretrained(init_from, override_args)
        except Exception as e:
            fail(f"cannot load the {init_from} weights ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); "
                 f"transformers downloads them from the Hugging Face hub on first use: run once with a network, or "
                 f"copy them into its cache (HF_HOME)")
        # read off the created config params, so we can store them into checkpoint correctly
        for k in ['n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size']:
            model_args[k] = getattr(model.config, k)
    else:
        raise SystemExit(f"train.py: unknown init_from {init_from!r}; choose 'scratch', 'resume' or 'gpt2*'")
# gns: training is denominated in tokens; the counter lives in the model (and so in checkpoints)
model.register_buffer('tokens_processed', torch.tensor(tokens_processed, dtype=torch.int64))
# crop down the model block size if desired, using model surgery
if block_size < model.config.block_size:
    model.crop_block_size(block_size)
    model_args['block_size'] = block_size # so that the checkpoint will have the right value
model.to(device)
model = engine.shard(model) # gns: FSDP2 shards each block, then the root; DDP and one process keep it whole

# initialize a GradScaler. If enabled=False scaler is a no-op
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))

# optimizer
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':
    engines.load_optimizer_state(engine, model, optimizer, checkpoint['optimizer'], ckpt_path) # gns: or one line
    if 'scaler' in checkpoint:
        scaler.load_state_dict(checkpoint['scaler'])

# logging: every optimizer step is a CSV row in out_dir/log.csv; wandb gets the same dict
logf = None
if wandb_log and master_process:
    import wandb
    wandb_run = wandb.init(project=wandb_project, name=wandb_run_name, config=config)
    logf = wandb_run.log
# gns: a resumed log continues from the checkpoint; rows written after it move to log_after_step_<N>.csv
tracker = LogWrapper(logf, config=config, out_dir=out_dir if master_process else None, resume=init_from == 'resume',
                     resume_step=resume_log_step if init_from == 'resume' else None)
# gns: one object reads every layer's per-example norms after a step's backward, zeroes them and logs them
# (on every rank: it all-reduces once); it also writes out_dir/gns_parameters.json, what each parameter is
monitor = gnstracking.GNSMonitor(model, log=tracker, scaler=scaler, ema_decay=gns_ema_decay) if tracked else None
# gns: a batch-size controller (micro-batches of batch_size x ranks examples, counted per rank)
controller = schedules.BatchSizeController(
    bs_schedule, batch_size * ddp_world_size, bs_base_batch, *(schedules.per_rank_steps(n, ddp_world_size) for n in (bs_min_accum_steps, bs_max_accum_steps)),
    factor=bs_gns_factor, cap=bs_cap or None, anchor=bs_anchor or None, ratio=bs_ratio, lr_exponent=bs_lr_exponent,
    horizon_examples=bs_gns_horizon or None, **({} if bs_schedule == 'temper' else dict(beta2=beta2, weight_decay=weight_decay)),
    start_accum_steps=schedules.per_rank_steps(bs_base_batch // batch_size, ddp_world_size) if bs_schedule == 'temper' else None,
) if bs_schedule in schedules.CONTROLLER_RULES else None # ('temper' starts at the configured batch, couples no beta2 or decay, as Seesaw)
decision = None

# compile the model
if compile:
    print("compiling the model... (takes a ~minute)")
    unoptimized_model = model
    model = torch.compile(model) # requires PyTorch 2.0

# wrap model into DDP container
model = engine.wrap(model)
# gns: under DDP, a second GNS (ddp/ columns): each rank's gradient (b examples) against the averaged one (B examples)
ddp_grad_stats = engine.gns_hook(model)

# gns: this step's accumulation steps per rank under a batch-size schedule, decided by rank 0
def scheduled_accum_steps():
    global decision
    if controller is not None: # a controller: rank 0's decision on every rank (its lr is a multiplier of get_lr's)
        decay = get_lr(max(tokens_processed, warmup_tokens), 0) / learning_rate if decay_lr else 1.0
        decision = engine.broadcast(controller.decide(1.0, decay))
        return decision.accum_steps
    if bs_schedule == 'linear':
        total = accum_schedule(tokens_processed) if master_process else 1
    else: # 'gns': the running GNS from the last step (NaN early on keeps the current value)
        total = schedules.gns_steps(gradient_accumulation_steps * ddp_world_size, monitor.gns, batch_size, bs_gns_factor,
                                    bs_min_accum_steps, bs_max_accum_steps, max_delta=ddp_world_size)
    return engine.broadcast(schedules.per_rank_steps(total, ddp_world_size)) # every rank runs the same number

# helps estimate an arbitrarily accurate loss over either split using many batches
@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = engine.mean(losses.mean().item()) # gns: under FSDP2 every rank evaluated
    model.train()
    return out

# learning rate decay scheduler (linear with warmup, in tokens)
def get_lr(tokens, step_tokens):
    # 1) linear warmup for warmup_tokens tokens, counting this step's tokens as nanoGPT counts it + 1: never 0
    if tokens < warmup_tokens:
        return learning_rate * (tokens + step_tokens) / (warmup_tokens + step_tokens)
    # 2) if tokens > lr_decay_tokens, return min learning rate
    if tokens > lr_decay_tokens:
        return min_lr
    # 3) in between, use linear decay down to min learning rate
    decay_ratio = (tokens - warmup_tokens) / (lr_decay_tokens - warmup_tokens)
    assert 0 <= decay_ratio <= 1
    return min_lr + (1.0 - decay_ratio) * (learning_rate - min_lr)
# gns: the schedule counts tokens, not nanoGPT's iterations: say when --max_iters ends the run before it decays
last_tokens = max_iters * tokens_per_iter
if decay_lr and bs_schedule == 'none' and init_from != 'resume' and last_tokens < min(max_tokens, lr_decay_tokens):
    print(f"note: max_iters={max_iters} ends the run at {last_tokens:,} tokens, before lr_decay_tokens={lr_decay_tokens:,}: "
          f"the learning rate ends at {get_lr(last_tokens - tokens_per_iter, tokens_per_iter):.3g}, not min_lr={min_lr:g}; "
          f"to decay over this run as nanoGPT's lr_decay_iters = max_iters does, add --lr_decay_tokens={last_tokens}")

def save_checkpoint():
    # gns: every rank takes part (FSDP2 gathers the full state; every rank gives its random state and batch)
    model_state, optimizer_state = engine.state_dicts(raw_model, optimizer)
    ranks = engine.gather(engines.rank_state(device, (X, Y)))
    if not master_process:
        return
    checkpoint = {
        'model': model_state,
        'optimizer': optimizer_state,
        'model_args': model_args,
        'iter_num': iter_num, # the next iteration to run
        'best_val_loss': best_val_loss,
        'config': config,
        'scaler': scaler.state_dict(),
        'log_step': tracker.step_count, # gns: rows of the log before this checkpoint
        'fsdp': fsdp,
        'gns': monitor.state_dict() if monitor is not None else None, # gns: the running GNS's EMAs
        'accum_steps': gradient_accumulation_steps, # gns: where a batch-size schedule stands
        'bs_controller': controller.state_dict() if controller is not None else None, # gns: and a controller
        'ranks': ranks, # gns: every rank's random state and prefetched batch, for an exact resume
    }
    print(f"saving checkpoint to {out_dir}")
    engines.save_checkpoint(os.path.join(out_dir, 'ckpt.pt'), checkpoint) # gns: through a temporary file

# training loop
X, Y = get_batch('train', (iter_num, 0)) # fetch the very first batch
raw_model = engine.unwrap(model) # unwrap DDP container if needed, and the compile wrapper
if init_from == 'resume': # gns: continue exactly where the checkpoint was written
    if checkpoint.get('gns') is not None and monitor is not None:
        monitor.load_state_dict(checkpoint['gns'])
    if bs_schedule != 'none' and 'accum_steps' in checkpoint:
        gradient_accumulation_steps = checkpoint['accum_steps']
    if controller is not None and checkpoint.get('bs_controller') is not None:
        controller.load_state_dict(checkpoint['bs_controller'])
    if len(checkpoint.get('ranks', [])) == ddp_world_size:
        X, Y = engines.restore_rank_state(checkpoint['ranks'][ddp_rank], device)
        if X.shape != (batch_size, block_size): # gns: the batch size changed: this run's first batch
            X, Y = get_batch('train', (iter_num, 0))
    elif 'ranks' in checkpoint:
        print(f"warning: the checkpoint holds the random state of {len(checkpoint['ranks'])} rank(s), this run has "
              f"{ddp_world_size}: dropout, evaluation batches (and training batches without --data_seed) will differ "
              "from an uninterrupted run")
checkpoint = None # free up memory
t0 = time.time()
local_iter_num = 0 # number of iterations in the lifetime of this process
running_mfu = -1.0
if iter_num == 0 or eval_only:
    # the weights before any step (or, eval_only, the checkpoint's): printed, not a log row (rows are optimizer steps)
    losses = estimate_loss() if master_process or engine.evaluates_on_every_rank else None
    if master_process:
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
while not eval_only and iter_num < max_iters and tokens_processed < max_tokens:

    if bs_schedule != 'none': # gns: the batch-size schedule picks this step's batch
        gradient_accumulation_steps = scheduled_accum_steps()
        # the last step runs only the micro-batches left in max_tokens (still >= 2 examples with GNS on)
        left = -(-(max_tokens - tokens_processed) // micro_tokens) # ceil
        if tracked:
            left = max(left, -(-2 // (ddp_world_size * batch_size)))
        gradient_accumulation_steps = min(gradient_accumulation_steps, left)
        examples_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size
        tokens_per_iter = examples_per_iter * block_size

    # determine and set the learning rate for this iteration
    lr = get_lr(tokens_processed, tokens_per_iter) if decay_lr else learning_rate
    if bs_schedule == 'temper' and tokens_processed >= warmup_tokens: # gns: 'temper' is the decay: after warmup, the peak
        lr = learning_rate
    if controller is not None: # gns: the controller's LR, beta2, weight decay, and Adam's state at a switch
        decision = dataclasses.replace(decision, lr=lr * decision.lr)
        controller.apply(optimizer, decision)
        lr = decision.lr
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    # and using the GradScaler if data type is float16
    for micro_step in range(gradient_accumulation_steps):
        # in DDP training we only need to sync gradients at the last micro step (FSDP2: reduce-scatter them)
        engine.sync_gradients(model, micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps # scale the loss to account for gradient accumulation
        # immediately async prefetch next batch while model is doing the forward pass on the GPU
        X, Y = get_batch('train', (iter_num, micro_step + 1) if micro_step + 1 < gradient_accumulation_steps else (iter_num + 1, 0))
        # backward pass, with gradient scaling if training in fp16
        scaler.scale(loss).backward()
    # gns: record + zero after the last backward (before clipping, which would change the batch gradient's norm)
    if monitor is not None:
        monitor.step(batch_size=examples_per_iter)
    if ddp_grad_stats is not None:
        tracker.log(ddp_grad_stats.get_msg(batch_size * gradient_accumulation_steps, examples_per_iter,
                                           scaler.get_scale() if scaler.is_enabled() else 1.0))
    tokens_processed += tokens_per_iter # a python mirror of the buffer: reading the buffer would sync the GPU
    raw_model.tokens_processed.add_(tokens_per_iter)
    # clip the gradient (the norm is logged before clipping)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip != 0.0 else float('inf'))
    grad_norm = engine.full(grad_norm).item()
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)

    # timing and logging
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if controller is not None: # gns: the step's GNS measurement and duration (for 'goodput')
        controller.observe(*summed_squares(monitor.measurements), step_seconds=dt)
    if iter_num % log_interval == 0 and master_process:
        # get loss as float. note: this is a CPU-GPU sync point
        # scale up to undo the division above, approximating the true total loss (exact would have been a sum)
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5: # let the training loop settle a bit
            mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9*running_mfu + 0.1*mfu
        tracker.log({
            "train/lossf": lossf, "lr": lr, "grad_norm": grad_norm, "dt": dt,
            "tokens_per_sec": tokens_per_iter / dt, "mfu": max(running_mfu, 0.0) * 100,
        })
        gns_status = ", {gns=:.2f}" if tracked else ""
        tracker.print(f"iter {iter_num}: " + "{train_lossf=:.4f}, {dt=:.3f}s, {mfu=:.2f}%, {tokens_per_sec=:,.0f}" + gns_status)
    tracker.log({"iter_num": iter_num, "tokens_processed": tokens_processed,
                 "gradient_accumulation_steps": gradient_accumulation_steps * ddp_world_size, "batch_size": examples_per_iter})
    iter_num += 1
    local_iter_num += 1

    # evaluate the weights this step made (and always after the last step), in this step's row
    final_iter = iter_num >= max_iters or tokens_processed >= max_tokens
    evaluate = iter_num % eval_interval == 0 or final_iter
    if evaluate and (master_process or engine.evaluates_on_every_rank):
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            tracker.log({"train/loss": losses['train'], "val/loss": losses['val']})
    # gns: one CSV row per optimizer step, indexed by iteration and tokens (tokens counted after the step)
    tracker.step()
    if evaluate:
        save = master_process and (losses['val'] < best_val_loss or always_save_checkpoint)
        if engine.broadcast(save): # rank 0 decides; every rank takes part in the save
            best_val_loss = losses['val'] if master_process else best_val_loss
            save_checkpoint()

tracker.close()
if monitor is not None and master_process and (monitor.scaler_skipped_steps or monitor.nonfinite_steps):
    print(f"GNS: {monitor.scaler_skipped_steps} step(s) skipped by the GradScaler (not measured), "
          f"{monitor.nonfinite_steps} step(s) with non-finite norms (logged as nan/inf)")
# gns: whatever holds the model is freed before its process group (gloo can abort at teardown otherwise)
model = raw_model = optimizer = monitor = ddp_grad_stats = logits = loss = None
engine.close()
