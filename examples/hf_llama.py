"""
transformers' Llama (LlamaForCausalLM from a tiny config: random weights,
nothing downloaded) given exact per-example gradient norms by
nanogns.convert, trained a few steps on the bundled Shakespeare characters
with the GNS logged to a CSV that gns-analysis.py reads.

    python examples/hf_llama.py [--out_dir=out-hf-llama] [--steps=20]
    python gns-analysis.py out-hf-llama --no-plots

Llama's only normalisation parameters are the weights of its LlamaRMSNorm
layers, a class of transformers' own. convert() finds them by what they compute
(a probe shows that an RMSNorm with the module's `variance_epsilon` gives the
same output and gradients) and swaps them, so the paper's normalisation-layer
GNS exists for this model; the final line prints it beside the all-parameter GNS.
The head is not tied to the token embedding here (as in Llama 2 and 3 8B); the
run's record (gns_parameters.json) tells gns-analysis.py that `lm_head.weight` is
an ordinary Linear, so it sums the same parameters as the running GNS printed here.
"""

import torch
import torch.nn.functional as F
from common import EMA_DECAY, parse_args, shakespeare_batches
from transformers import LlamaConfig, LlamaForCausalLM

from nanogns import LogWrapper, convert, estimator
from nanogns.monitor import summed_squares

BLOCK_SIZE = 32


def build(vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=BLOCK_SIZE):
    """A tiny Llama: grouped-query attention, SwiGLU MLP, rotary positions, RMSNorm, untied head."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        intermediate_size=2 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        max_position_embeddings=block_size,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def logits(model, x):
    return model(input_ids=x).logits


def main(argv=None):
    args = parse_args(__doc__, argv, name="hf-llama")
    vocab_size, batches = shakespeare_batches(block_size=BLOCK_SIZE, batch_size=args.batch_size)
    torch.manual_seed(0)
    model = build(vocab_size)

    # gns: swap Linear, Embedding and (after the probe) LlamaRMSNorm for per-example norm layers
    log = LogWrapper(out_dir=args.out_dir)
    monitor = convert(model, log=log, ema_decay=EMA_DECAY)  # one object: the conversion report, the steps
    assert not monitor.unconverted and not monitor.untracked, (monitor.unconverted, monitor.untracked)
    norm_names = [name for name, facts in monitor.describe().items() if facts["kind"] == "RMSNorm"]
    norm_gns = estimator.RunningGNS(decay=EMA_DECAY)  # the paper's estimate: normalisation layers only

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = next(batches)
        loss = F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        monitor.step(batch_size=x.size(0))  # gns: measure, zero the buffers, log the row (before the optimizer step)
        norm_gns.update(*summed_squares([m for m in monitor.measurements if m.metadata["name"] in norm_names]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.log({"train/loss": loss.item(), "iter_num": step, "tokens_processed": (step + 1) * x.numel()})
        log.step()
    log.close()
    print(
        f"hf_llama: {args.steps} steps, loss {loss.item():.3f}, all {len(monitor.tracked)} parameters tracked: "
        f"final running GNS {monitor.gns:.4f}, RMSNorm-only ({len(norm_names)} weights) {norm_gns.gns:.4f}"
    )


if __name__ == "__main__":
    main()
