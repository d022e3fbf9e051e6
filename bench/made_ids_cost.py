"""
What the windows of made ids cost (core/ids.py's MadeHere, core/scopes.py): in a forward given no integer tensor,
the module calling an Embedding runs under a TorchFunctionMode from its start to its first lookup. Two models, each
converted, stepped with the windows on and with them off (the same process, the same weights, turns taken):

    wav2vec2-bert   relative_key positions: each attention makes its distances and looks them up (the windows' use)
    llama-embeds    Llama called with inputs_embeds: its decoder, which calls embed_tokens only for input_ids, runs
                    wholly under the mode (the windows' worst case: a caller that looks nothing up)

    python bench/made_ids_cost.py                       # wall clock at torch's default threads
    python bench/made_ids_cost.py --threads=1 --clock=cpu

A step is the forward and backward of a mean-square loss on B examples of T frames (or tokens), then the buffers
zeroed. Reported per model: the ops the mode saw per step, the median step time with the windows on and off, and
the median over rounds of on / off (quartiles). With the windows off wav2vec2-BERT's distance table is refused (the
step still runs every layer); Llama's steps compute the same with either.
"""

import argparse
import statistics

import timing  # bench/timing.py
import torch
import transformers

import nanogns as lc
from nanogns.core import ids, layout


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default: 128)")
    p.add_argument("--layers", type=int, default=4, help="layers (default: 4)")
    p.add_argument("--batch_size", type=int, default=8, help="examples B (default: 8)")
    p.add_argument("--length", type=int, default=64, help="frames or tokens per example T (default: 64)")
    p.add_argument("--steps", type=int, default=9, help="timed rounds (default: 9)")
    timing.add_options(p)
    return p.parse_args(argv)


def build(name, args):
    """(model, its input's keyword arguments)."""
    torch.manual_seed(0)
    H, L, B, T = args.hidden, args.layers, args.batch_size, args.length
    if name == "wav2vec2-bert":
        config = transformers.Wav2Vec2BertConfig(
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=4,
            intermediate_size=2 * H,
            feature_projection_input_dim=80,
            position_embeddings_type="relative_key",
            left_max_position_embeddings=16,
            right_max_position_embeddings=16,
            layerdrop=0.0,
            mask_time_prob=0.0,
            conformer_conv_dropout=0.0,
            num_labels=3,
        )
        return transformers.Wav2Vec2BertForSequenceClassification(config), {"input_features": torch.randn(B, T, 80)}
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L, num_attention_heads=4
    )
    return transformers.LlamaForCausalLM(config), {"inputs_embeds": torch.randn(B, T, H)}


def measure(name, args, clock):
    model, inputs = build(name, args)
    lc.convert(model)
    seen = [0]
    mode_call = ids.MadeHere.__torch_function__

    def counted(self, func, types, a=(), kw=None):
        seen[0] += 1
        return mode_call(self, func, types, a, kw)

    def step():
        out = model(**inputs)
        (out.logits if hasattr(out, "logits") else out).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        lc.zero_pe_sqnorm_buffers(model)

    opens = layout._opens_window
    times = {"on": [], "off": []}
    try:
        ids.MadeHere.__torch_function__ = counted
        step()
        seen[0] = 0
        step()
        ops = seen[0]
        ids.MadeHere.__torch_function__ = mode_call
        for _ in range(args.steps):
            for which in ("on", "off"):
                layout._opens_window = opens if which == "on" else (lambda found: False)
                step()  # (untimed: the turn's first step)
                start = clock()
                step()
                times[which].append(clock() - start)
    finally:
        ids.MadeHere.__torch_function__ = mode_call
        layout._opens_window = opens
    ratios = sorted(a / b for a, b in zip(times["on"], times["off"]))
    q1, median, q3 = timing.quartiles(ratios)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"{name:14s} ops under the mode per step {ops:5d}   on {on * 1e3:8.2f} ms   off {off * 1e3:8.2f} ms   "
        f"on/off {median:.3f} [{q1:.3f}, {q3:.3f}]"
    )


def main(argv=None):
    args = parse_args(argv)
    clock = timing.apply(args)
    print(
        f"B={args.batch_size} T={args.length} hidden={args.hidden} layers={args.layers} "
        f"threads={torch.get_num_threads()} clock={args.clock}"
    )
    for name in ("wav2vec2-bert", "llama-embeds"):
        measure(name, args, clock)


if __name__ == "__main__":
    main()
