"""
What convert() costs on library models, as users run them: one training step (forward, backward, the monitor's
read, AdamW) of a Hugging Face model built from a config (random weights, nothing downloaded) or of a GroupNorm
conv net, converted, beside the same model unconverted, in the same process, interleaved.

    python bench/hf_step.py                                   # every model below, wall clock at torch's threads
    python bench/hf_step.py --models=mamba --clock=cpu --threads=1   # one thread's CPU time (a loaded machine)
    python bench/hf_step.py --count                           # ops and Python calls per step, counted (no clock)

Models (B = 8, float32): `llama` (4 layers, 256 wide, T = 128: every layer a kind), `llama-small` (2 layers, 64
wide, T = 64), `mamba` (4 layers, 256 wide, T = 128: its mixers' own forward kept, their parameter uses
followed by conversion/intercept.py, with transformers' reference scan), `bamba` (a Mamba-2 + attention hybrid, 4 layers, 256
wide), `deltanet` (Qwen3.5's text model: 3 gated-DeltaNet layers and 1 attention layer, 256 wide, transformers'
reference chunked delta rule), `groupnorm` (a 3-block conv net with GroupNorm, 32x32 images, B = 16: GroupNorm a kind) and
`groupnorm-replayed` (the same net with the norm written as a module of one's own, which no kind matches:
convert() replays each, the path any module without a kind takes). The ratio is the median over rounds of the converted step's time over the plain
step's in the same round, with its quartiles; --count gives the ops (a TorchDispatchMode) and Python calls
(cProfile) of one step of each, the test's numbers (tests/test_bench_hf_step.py).
"""

import argparse
import contextlib
import io
import statistics
import sys
import warnings

import call_overhead  # bench/call_overhead.py: the counters (and the repository on sys.path)
import timing  # bench/timing.py
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogns  # noqa: E402

MODELS = ("llama", "llama-small", "mamba", "bamba", "deltanet", "groupnorm", "groupnorm-replayed")


def _config(name):
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=128,
        ), 128  # fmt: skip
    if name == "llama-small":
        return transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64,
        ), 64  # fmt: skip
    if name == "mamba":
        return transformers.MambaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, state_size=16), 128
    if name == "bamba":
        return transformers.BambaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16,
            mamba_n_groups=1, mamba_chunk_size=32, max_position_embeddings=128,
        ), 128  # fmt: skip
    if name == "deltanet":
        return transformers.Qwen3_5TextConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=128,
        ), 128  # fmt: skip
    raise ValueError(name)


class OwnGroupNorm(nn.Module):
    """GroupNorm written as a module of one's own: no kind matches it (GroupNorm's kind replaces nn.GroupNorm by
    class), so convert() measures it by the generic replay."""

    def __init__(self, groups, channels):
        super().__init__()
        self.groups = groups
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        return F.group_norm(x, self.groups, self.weight, self.bias)


class ConvNet(nn.Module):
    """Three conv blocks with a group norm and a linear head (32x32 RGB images, 10 classes)."""

    def __init__(self, norm=nn.GroupNorm, width=32):
        super().__init__()
        blocks, channels = [], 3
        for k in range(3):
            out = width * 2**k
            blocks += [nn.Conv2d(channels, out, 3, padding=1), norm(8, out), nn.ReLU(), nn.MaxPool2d(2)]
            channels = out
        self.features, self.head = nn.Sequential(*blocks), nn.Linear(channels * 16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def make_step(name, converted, batch=8):
    """A function running one training step of model `name` (converted or not); the same weights and data."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("groupnorm"):
            model, batch = ConvNet(OwnGroupNorm if name == "groupnorm-replayed" else nn.GroupNorm), 16
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

            def loss_of(m):
                return F.cross_entropy(m(x), y)
        else:
            import transformers

            config, T = _config(name)
            model = transformers.AutoModelForCausalLM.from_config(config)
            ids = torch.randint(0, config.vocab_size, (batch, T))

            def loss_of(m):
                return m(input_ids=ids, labels=ids).loss

        monitor = None
        if converted:
            with contextlib.redirect_stdout(io.StringIO()):
                monitor = nanogns.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss_of(model).backward()
        if monitor is not None:
            monitor.step(batch_size=batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, monitor


def timed(names, rounds, warmup, clock):
    """{name: [converted / plain per round]} and {name: (plain ms, converted ms) medians}, interleaved."""
    tick = timing.CLOCKS[clock]
    ratios, medians = {}, {}
    for name in names:
        plain, _ = make_step(name, False)
        conv, monitor = make_step(name, True)
        for _ in range(warmup):
            plain()
            conv()
        p_times, c_times = [], []
        for r in range(rounds):
            order = [(plain, p_times), (conv, c_times)][:: 1 if r % 2 else -1]  # who goes first alternates
            for step, times in order:
                t0 = tick()
                step()
                times.append(tick() - t0)
        ratios[name] = [c / p for c, p in zip(c_times, p_times)]
        medians[name] = (statistics.median(p_times) * 1e3, statistics.median(c_times) * 1e3)
        print(f"{name}: {len(monitor.tracked)} tensors measured", file=sys.stderr)
    return ratios, medians


def counted(names):
    """{name: (plain ops, plain calls, converted ops, converted calls)} of one step, after two warm-up steps."""
    found = {}
    for name in names:
        counts = []
        for converted in (False, True):
            step, _ = make_step(name, converted)
            step()
            step()
            counts += [call_overhead.ops(step), call_overhead.python_calls(step)]
        found[name] = tuple(counts)
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    timing.add_options(p)
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each (default: 2)")
    p.add_argument("--count", action="store_true", help="count ops and Python calls per step instead of timing")
    args = p.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {MODELS}")
    timing.apply(args)
    if args.count:
        print("| model | ops: plain | converted | added | Python calls: plain | converted | added |")
        print("|---|---|---|---|---|---|---|")
        for name, (po, pc, co, cc) in counted(names).items():
            print(f"| {name} | {po} | {co} | {co - po} | {pc} | {cc} | {cc - pc} |")
        return
    ratios, medians = timed(names, args.rounds, args.warmup, args.clock)
    print(
        f"\ncpu, float32, {torch.get_num_threads()} threads, {args.clock} clock, {args.rounds} interleaved rounds; "
        "ratio: median over rounds of the converted step's time / the plain step's in the same round (quartiles)"
    )
    print("| model | plain step ms | converted step ms | ratio |")
    print("|---|---|---|---|")
    for name in names:
        lo, mid, hi = timing.quartiles(ratios[name])
        print(f"| {name} | {medians[name][0]:.1f} | {medians[name][1]:.1f} | {mid:.2f} [{lo:.2f}, {hi:.2f}] |")


if __name__ == "__main__":
    main()
