"""
What exactness costs where it takes more than one layer's own norms, on one model each, as ratios to the plain
model measured in the same run, and peak memory:

    many uses   ALBERT: one layer group used by every layer, each example's gradient summed over its uses
                (core/uses.py); beside it the same model with one group per layer (no sharing), converted
    generic     Mamba: each mixer replayed per example in backward (conversion/replay.py), children included
    tables      GPT-2 called without position ids: positions looked up once for the batch, one copy per
                example (core/shared.py); beside it the same model given position ids expanded

    python bench/uses_cost.py                         # CPU, float32, B=8 x T=64
    python bench/uses_cost.py --models=albert --steps=15

A step is the forward and backward of a causal LM loss on B examples of T tokens, then (converted models) the
monitor's read and zeroing. The choices of one model are built in one process with the same weights and take
turns, one step each, for --steps rounds; reported: the median step time, and the median over rounds of each
step's time divided by the plain model's in the same round (quartiles). Peak memory: each choice runs alone in a
subprocess (the CPU process's peak RSS above its RSS after building the model, or the GPU allocator's peak).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import timing  # noqa: E402  (bench/timing.py)

CHOICES = {
    "albert": ("plain", "per-example (shared group, summed uses)", "per-example, one group per layer"),
    "mamba": ("plain", "per-example (mixers replayed)"),
    "gpt2": ("plain", "per-example (positions as called: a shared table)", "per-example, positions expanded"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="albert,mamba,gpt2", help="comma-separated: albert, mamba, gpt2")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--layers", type=int, default=4, help="layers (default: 4)")
    p.add_argument("--batch_size", type=int, default=8, help="examples B (default: 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per example T (default: 64)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per choice (default: 2)")
    p.add_argument("--steps", type=int, default=9, help="timed steps per choice, interleaved (default: 9)")
    p.add_argument("--memory", default="True", choices=["True", "False"], help="measure peak memory (default: True)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "model/choice", its peak memory
    return p.parse_args(argv)


def build(args, model_name, choice):
    """A step() closure running one choice."""
    import torch
    import torch.nn.functional as F
    import transformers

    import nanogns as lc
    from nanogns.core.buffers import zero_pe_sqnorm_buffers

    torch.manual_seed(0)
    V, H, L = 1000, args.hidden, args.layers
    if model_name == "albert":
        groups = L if choice.endswith("one group per layer") else 1
        config = transformers.AlbertConfig(
            vocab_size=V,
            embedding_size=128,
            hidden_size=H,
            num_hidden_layers=L,
            num_hidden_groups=groups,
            num_attention_heads=4,
            intermediate_size=4 * H,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        )
        model = transformers.AlbertForMaskedLM(config)
    elif model_name == "mamba":
        model = transformers.MambaForCausalLM(
            transformers.MambaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, state_size=16)
        )
    else:
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=V,
                n_embd=H,
                n_layer=L,
                n_head=4,
                n_positions=1024,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    model.to(args.device)
    monitor = None
    if choice != "plain":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monitor = lc.convert(model)
    ids = torch.randint(0, V, (args.batch_size, args.tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    extra = {}
    if choice.endswith("positions expanded"):
        extra = dict(position_ids=torch.arange(args.tokens, device=args.device).expand(args.batch_size, -1))
    synchronize = torch.cuda.synchronize if "cuda" in args.device else (lambda: None)

    def step():
        logits = model(input_ids=ids, **extra).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        if monitor is not None:
            monitor.measure(batch_size=args.batch_size)
            zero_pe_sqnorm_buffers(model)
        model.zero_grad(set_to_none=True)
        synchronize()

    return step


def peak_memory_mb(args):
    import resource

    import torch

    model_name, choice = args.one.split("/", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "cuda" in args.device:
            step = build(args, model_name, choice)
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.warmup + 1):
                step()
            return torch.cuda.max_memory_allocated() / 2**20
        step = build(args, model_name, choice)
        with open("/proc/self/status") as f:
            built_mb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        for _ in range(args.warmup + 1):
            step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - built_mb


def run(args, model_name, passthrough):
    choices = CHOICES[model_name]
    peaks = {name: float("nan") for name in choices}
    for name in choices if args.memory == "True" else []:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *passthrough, f"--one={model_name}/{name}"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if out.returncode != 0:
            raise SystemExit(f"uses_cost.py: {model_name}/{name} failed:\n{out.stderr[-3000:]}")
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = {name: build(args, model_name, name) for name in choices}
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        times = {name: [] for name in choices}
        for r in range(args.steps):
            for name in choices[r % len(choices) :] + choices[: r % len(choices)]:  # rotate who goes first
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    memory = "peak GPU MiB" if "cuda" in args.device else "peak RSS MiB above build"
    print(f"\n{model_name}: hidden {args.hidden}, {args.layers} layers, B={args.batch_size} x T={args.tokens}")
    print(f"| choice | step ms | ratio to plain | {memory} | memory ratio |")
    print("|---|---|---|---|---|")
    for name in choices:
        ratios = [t / b for t, b in zip(times[name], times["plain"])]
        q1, median, q3 = timing.quartiles(ratios)
        print(
            f"| {name} | {statistics.median(times[name]) * 1000:.0f} | {median:.2f} "
            f"[{q1:.2f}, {q3:.2f}] | {peaks[name]:.0f} | {peaks[name] / peaks['plain']:.2f} |",
            flush=True,
        )


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(json.dumps({"peak_mb": peak_memory_mb(args)}))
        return
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--models")]
    print(f"{args.device}, float32, {args.steps} interleaved rounds; ratio: median over rounds (quartiles)")
    for model_name in args.models.split(","):
        run(args, model_name, passthrough)


if __name__ == "__main__":
    main()
