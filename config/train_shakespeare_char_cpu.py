# quick start: a small character-level shakespeare model with per-example gradient
# norms on, sized for a 2-core CPU (1-3 minutes there)
#   python data/shakespeare_char/prepare.py
#   python train.py config/train_shakespeare_char_cpu.py
#   python gns-analysis.py out-shakespeare-char
#
# cost, from first principles: about 0.8M parameters, so 6N + 12*L*T*C = 5.2 MFLOP
# per token, and 32 * 64 = 2,048 tokens make 10.7 GFLOP per iteration. A 2-core
# AVX2/AVX-512 CPU sustains roughly 50-150 GFLOPS on these small matmuls: 0.07-0.2 s
# per iteration. Measured on a 2-core box: 73 ms (nn layers), 87 ms (gns layers);
# the whole run took 3 minutes there with other jobs competing, val loss 2.32.

out_dir = 'out-shakespeare-char'
eval_interval = 100
eval_iters = 20  # 20 * 32 sequences: a noisy but quick val loss
log_interval = 10
always_save_checkpoint = False

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 32  # examples per step: the B of the GNS estimator
block_size = 64

# a smaller baby GPT
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0  # a few hundred steps cannot overfit

# per-example gradient norms for every Linear, Embedding and LayerNorm
linearclass = 'gns'
embeddingclass = 'gns'
lnclass = 'gns'

learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99
max_iters = 300
_tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # 2,048
warmup_tokens = 20 * _tokens_per_iter
lr_decay_tokens = max_iters * _tokens_per_iter  # 614,400
max_tokens = lr_decay_tokens

# CPU, plain float32, no compile (torch.compile's start-up would dominate a run this short)
device = 'cpu'
device_name = 'cpu'
dtype = 'float32'
compile = False
