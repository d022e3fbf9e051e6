"""
Mixture-of-experts banks through the grouped computation (kinds/grouped.py): one grouped GEMM per projection,
each (expert, example) segment's norms by the Gram trick, against the brute-force loop over examples (float64,
routed tokens with a dropped one, two uneven micro-batches), for banks stored either way round, with and without
biases and gates; in float32 through torch's grouped_mm itself; outputs and gradients equal to transformers' own.

    python -m pytest -q tests/test_layers_grouped.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import per_example_sqnorms_by_loop
from transformers import MixtralConfig
from transformers.integrations.moe import use_experts_implementation

import nanogns as lc

E, D, I, K_TOP = 4, 8, 12, 2  # experts, hidden, intermediate, experts per token (widths aligned for grouped_mm)
N, T = 5, 6  # examples of T tokens; micro-batches of 2 and 3


def experts_class(transposed, bias, gate):
    """A transformers-style experts bank (use_experts_implementation) stored (E, out, in) or (E, in, out)."""

    @use_experts_implementation(is_transposed=transposed, has_bias=bias, has_gate=gate)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            first = 2 * I if gate else I
            shapes = {
                "up": (E, D, first) if transposed else (E, first, D),
                "down": (E, I, D) if transposed else (E, D, I),
            }
            setattr(self, "gate_up_proj" if gate else "up_proj", nn.Parameter(torch.randn(*shapes["up"]) / D**0.5))
            self.down_proj = nn.Parameter(torch.randn(*shapes["down"]) / I**0.5)
            if bias:
                setattr(self, ("gate_up_proj" if gate else "up_proj") + "_bias", nn.Parameter(torch.randn(E, first)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, D))
            self.act_fn = F.silu

        def forward(self, hidden_states, top_k_index, top_k_weights):  # eager: transformers' loop, the reference
            out = torch.zeros_like(hidden_states)
            first = self.gate_up_proj if self.has_gate else self.up_proj
            first_bias = getattr(self, ("gate_up_proj" if self.has_gate else "up_proj") + "_bias", None)
            for expert in range(E):
                token, slot = torch.where(top_k_index == expert)
                w = first[expert].t() if self.is_transposed else first[expert]
                h = F.linear(hidden_states[token], w, first_bias[expert] if first_bias is not None else None)
                h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
                w = self.down_proj[expert].t() if self.is_transposed else self.down_proj[expert]
                y = F.linear(h, w, self.down_proj_bias[expert] if self.has_bias else None)
                out.index_add_(0, token, y * top_k_weights[token, slot, None])
            return out

    config = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E)
    config._experts_implementation = "eager"
    return Experts(config)


class Block(nn.Module):
    """(N, T, D) examples in, the bank on their (N*T, D) flattened rows (the layout maps them to the examples)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, top_k_index, top_k_weights):
        flat = self.experts(x.reshape(-1, D), top_k_index.reshape(-1, K_TOP), top_k_weights.reshape(-1, K_TOP))
        return flat.view(x.shape)


def routed_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, T, D, generator=gen, dtype=torch.float64).to(dtype)
    index = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(N * T)]).view(N, T, K_TOP)
    index[1, 2, 1] = E  # transformers' sentinel: this slot routes the token nowhere
    index[3, :, 0] = 1  # every token of example 3 on expert 1 (a long segment), never expert 0
    index[3, :, 1] = torch.tensor([2, 3, 2, 3, 2, 3])
    weights = torch.rand(N, T, K_TOP, generator=gen, dtype=torch.float64).to(dtype)
    grad = torch.randn(N, T, D, generator=gen, dtype=torch.float64).to(dtype)
    return x, index, weights, grad


def brute_force(block, x, index, weights, grad):
    """{experts' parameter name: sum over examples of ||that example's gradient||^2} by the oracle (float64)."""
    found = per_example_sqnorms_by_loop(block, (x, index, weights), grad)
    return {name[len("experts.") :]: v.sum().item() for name, v in found.items() if name.startswith("experts.")}


CASES = [(False, False, True), (True, False, True), (False, True, True), (True, True, False)]


@pytest.mark.parametrize("transposed, bias, gate", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])  # buffers are float32
def test_grouped_experts_match_brute_force(transposed, bias, gate, dtype, rtol, monkeypatch):
    torch.manual_seed(0)
    block = Block(experts_class(transposed, bias, gate)).double()
    x, index, weights, grad = routed_batch(torch.float64)
    want = brute_force(block, x, index, weights, grad)
    block.zero_grad(set_to_none=True)
    block(x, index, weights).backward(grad)
    plain_grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)

    lc.convert(block.to(torch.float32))
    assert type(block.experts).__name__.startswith("PerExampleExperts")
    block.to(dtype)
    calls = []
    if dtype == torch.float32:  # torch's grouped_mm runs, not the per-expert fallback
        grouped_mm = F.grouped_mm
        monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    x, weights, grad = x.to(dtype), weights.to(dtype), grad.to(dtype)
    for part in (slice(0, 2), slice(2, N)):  # two uneven micro-batches accumulate
        out = block(x[part], index[part], weights[part])
        out.backward(grad[part])
    assert (dtype == torch.float32) == bool(calls)
    for name, p in block.experts.named_parameters():
        total, count = getattr(block.experts, name + "_pe_sqnorm").tolist()
        assert count == N, name
        assert total == pytest.approx(want[name], rel=rtol), name
        torch.testing.assert_close(p.grad.double(), plain_grads["experts." + name], rtol=rtol, atol=rtol)
    reference = Block(experts_class(transposed, bias, gate)).to(dtype)
    reference.load_state_dict(block.state_dict())
    torch.testing.assert_close(block(x, index, weights), reference(x, index, weights), rtol=rtol, atol=rtol)


def test_no_grad_computes_the_output_only():
    """Under no_grad the converted bank computes the module's output and records nothing."""
    torch.manual_seed(0)
    block = Block(experts_class(False, True, True)).double()
    x, index, weights, _ = routed_batch(torch.float64)
    want = block(x, index, weights)
    lc.convert(block)
    with torch.no_grad():
        torch.testing.assert_close(block(x, index, weights), want)
    assert all(b.abs().sum() == 0 for n, b in block.named_buffers() if n.endswith("_pe_sqnorm"))


# -----------------------------------------------------------------------------
# banks given their rows grouped by expert (kinds/experts_parallel.py)


class GroupedBank(nn.Module):
    """A bank of the ScatterMoE and JetMoE kind, of this test's own: bank(rows, expert_size), the rows grouped by
    expert, its matrices stored (E, out, in) or (E, in, out)."""

    def __init__(self, features, out, transposed):
        super().__init__()
        self.transposed = transposed
        shape = (E, features, out) if transposed else (E, out, features)
        self.bank = nn.Parameter(torch.randn(*shape) / features**0.5)

    def forward(self, rows, expert_size):
        parts = rows.split(expert_size, dim=0)
        return torch.cat(
            [p @ self.bank[e] if self.transposed else F.linear(p, self.bank[e]) for e, p in enumerate(parts)]
        )


class RegroupedMoE(nn.Module):
    """JetMoE's MLP, reduced: a router's top-k over the (N*T, D) token rows; the rows gathered by the (token, k)
    slots sorted by expert, each expert's last slot first (its rows in no order of their examples, as an unstable
    sort leaves them); two banks (act(h1) * h2 between, cut by a slice); the rows scattered back, gated.
    `gathered` False: each expert's rows picked by a mask and joined by torch.cat, no gather in their history;
    `shuffled`: the token rows first gathered in a shuffled order (as many rows as tokens), then by expert."""

    def __init__(self, transposed, top_k=K_TOP, gathered=True, shuffled=False):
        super().__init__()
        self.top_k, self.gathered, self.shuffled = top_k, gathered, shuffled
        self.norm = nn.RMSNorm(D)  # (as in a model: the rows a gather takes have an autograd history)
        self.router = nn.Linear(D, E, bias=False)
        self.up = GroupedBank(D, 2 * I, transposed)
        self.down = GroupedBank(I, D, transposed)

    def forward(self, x):
        flat = self.norm(x).reshape(-1, D)
        gates, experts = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        slots = experts.flatten()
        order = (slots * slots.numel() - torch.arange(slots.numel())).argsort()
        token = order // self.top_k
        sizes = torch.bincount(slots, minlength=E).tolist()
        rows = flat[token] if self.gathered else torch.cat([flat[(experts == e).any(-1)] for e in range(E)])
        if self.shuffled:  # the bank's rows gathered from the tokens shuffled (row j of them: token place[j])
            place = torch.randperm(len(flat), generator=torch.Generator().manual_seed(len(flat)))
            rows = flat[place][place.argsort()[token]]
        h = self.up(rows, sizes)
        y = self.down(F.silu(h[:, :I]) * h[:, I:], sizes) * gates.flatten()[order, None]
        return torch.zeros_like(flat).index_add(0, token, y).view(x.shape)


@pytest.mark.parametrize("transposed, shuffled", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("examples", [N, T], ids=["N5", "N6"])  # (N == T: as many examples as tokens)
def test_a_bank_of_rows_grouped_by_expert_reads_their_examples_from_the_gather(transposed, shuffled, examples):
    """Each bank's per-example norms, the rows' examples read from the gather that grouped them (and from the one
    before it, for tokens shuffled first: as many rows as tokens, never mapped by their number), equal to the
    brute-force loop (float64, two uneven micro-batches accumulated), its gradient and output the module's own."""
    torch.manual_seed(0)
    block = RegroupedMoE(transposed, shuffled=shuffled).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(examples, T, D, generator=gen, dtype=torch.float64)
    grad = torch.randn(examples, T, D, generator=gen, dtype=torch.float64)
    want = per_example_sqnorms_by_loop(block, x, grad)
    block.zero_grad(set_to_none=True)
    out = block(x)
    out.backward(grad)
    plain = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    lc.convert(block)
    assert type(block.up).__name__ == "PerExampleParallelExperts(GroupedBank)"
    torch.testing.assert_close(block(x), out.detach())
    for part in (slice(0, 2), slice(2, examples)):
        block(x[part]).backward(grad[part])
    for name, p in block.named_parameters():
        module, _, attr = name.rpartition(".")
        total, count = block.get_buffer(f"{module}.{attr}_pe_sqnorm").tolist()
        assert count == examples, name
        assert total == pytest.approx(want[name].sum().item(), rel=1e-6), name
        torch.testing.assert_close(p.grad, plain[name])


def test_rows_grouped_by_expert_with_no_gather_behind_them_are_refused_whatever_their_number():
    """One expert per token gives as many rows as the (N*T, D) tokens; joined by torch.cat from masks, no gather
    says which example each row serves, so the step is refused naming that, never mapped by their number."""
    torch.manual_seed(0)
    block = RegroupedMoE(False, top_k=1, gathered=False).double()
    monitor = lc.convert(block)
    block(torch.randn(N, T, D, dtype=torch.float64)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"up.bank: this step is not measured.*shows no gather of the examples' rows"):
        monitor.step(batch_size=N)


class MaskedBank(nn.Module):
    """A 3-D parameter and a forward of two arguments that computes no grouped products (a mask over experts)."""

    def __init__(self):
        super().__init__()
        self.bank = nn.Parameter(torch.randn(E, D, D))

    def forward(self, x, mask):
        return torch.einsum("ntd,eod,e->nto", x, self.bank, mask)


def test_a_module_shaped_like_a_bank_that_computes_otherwise_is_no_bank():
    """The bank's probe decides, not its shape: a look-alike is left to the paths it took before (replayed per
    example), exact."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.bank = MaskedBank()
    model.forward = lambda x: model.bank(x, torch.ones(E, dtype=x.dtype))
    monitor = lc.convert(model.double())
    assert monitor.explain()["bank"].startswith("probed: replayed per example")
