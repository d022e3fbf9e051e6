# the paper's 111M-parameter Cerebras-GPT on OpenWebText (Gray et al., NeurIPS 2024)
# launch as e.g.: torchrun --standalone --nproc_per_node=3 train.py config/train_cgpt_111M_owt.py
# (nproc_per_node must divide gradient_accumulation_steps = 15: 1, 3, 5 or 15)
# needs data/openwebtext prepared (see nanoGPT's data/openwebtext/prepare.py)

out_dir = 'out-cgpt-openwebtext'
dataset = 'openwebtext'
wandb_project = 'owt'
wandb_run_name = 'cgpt_111M'

# MFU is reported against the A10's datasheet peak; set yours (see PEAK_FLOPS in model.py)
device_name = 'A10'

# 8 * 15 * 2048 = 245,760 tokens per optimizer step (summed over all DDP ranks,
# train.py divides gradient_accumulation_steps by the world size)
batch_size = 8
block_size = 2048
gradient_accumulation_steps = 15

# model: Cerebras-GPT 111M
n_layer = 10
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
cos_attn = [1]  # block 1 uses cosine attention (q, k unit-normalised; see CausalSelfAttention)

# AdamW and the schedule, in tokens (Chinchilla-style: about 20 tokens per parameter)
learning_rate = 1.17e-3
min_lr = 1.17e-4  # learning_rate / 10
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_tokens = 374_784_000  # 1525 steps * 245,760 tokens
lr_decay_tokens = 2_219_950_080  # 9033 steps * 245,760 tokens
max_tokens = lr_decay_tokens

# eval and logging
eval_interval = 1000
eval_iters = 200
log_interval = 10
