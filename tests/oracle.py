"""
The brute-force oracle every per-example norm test compares against (as opacus does): example i's gradient is
taken from the one batched forward, by a backward of example i's part of the output (or of its loss) alone, in
plain autograd. A batch of one is not always the same computation as a row of a batch (torch's
MultiheadAttention differs by ~1%), so the forward is never rerun per example.

    per_example_sqnorms_by_loop(module, inputs, grad_out)    a layer or model, output dim 0 = example
    loss_sqnorms_from_batched_forward(model, losses)          a model, from its examples' losses
"""

import torch


def per_example_sqnorms_by_loop(module, inputs, grad_out):
    """Squared norm of each example's gradient for every parameter of `module`.

    Args:
        module: any module whose output's dim 0 indexes the examples of `inputs`.
        inputs: tensor (N, ...) whose dim 0 indexes examples (float input or token ids), or a tuple of the
            module's positional inputs (the first one's dim 0 indexing the examples).
        grad_out: tensor shaped like module(inputs): the upstream gradient. Example i's gradient is the
            vector-Jacobian product of output row i with grad_out[i], from the one batched forward.
    Returns:
        {parameter name: float64 tensor (N,)} of squared per-example gradient norms (0 for a frozen parameter).
    """
    named = list(module.named_parameters())
    trainable = [p for _, p in named if p.requires_grad]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    x = inputs[0].detach().requires_grad_(True) if inputs[0].is_floating_point() else inputs[0]
    out = module(x, *inputs[1:])
    pe_sqnorms = {name: [] for name, _ in named}
    for i in range(x.shape[0]):
        grads = iter(
            torch.autograd.grad(
                out[i], trainable, grad_outputs=grad_out[i].to(out.dtype), retain_graph=True, allow_unused=True
            )
        )
        for name, param in named:
            grad = next(grads) if param.requires_grad else None
            pe_sqnorms[name].append(
                grad.double().pow(2).sum() if grad is not None else torch.zeros((), dtype=torch.float64)
            )
    return {name: torch.stack(values) for name, values in pe_sqnorms.items()}


def loss_sqnorms_from_batched_forward(model, losses):
    """Per trainable parameter, (mean_i ||g_i||^2, ||mean_i g_i||^2), g_i the gradient of example i's loss:
    each example's gradient taken from the batched forward that made its loss, by a backward of that loss alone
    (retain_graph), in float64. The parameters' .grad are left untouched; a per-example norm layer in `model`
    records these backwards too, so zero its buffers afterwards (or use a copy of the model).

    Args:
        losses: (N,) per-example losses of one forward, or a list of them (the micro-batches of one step).
    Returns:
        ({name: mean_i ||g_i||^2}, {name: ||mean_i g_i||^2}) as Python floats over all the examples, under
        named_parameters() names (a tied tensor under its first name); a parameter no loss reaches has 0.0.
    """
    parts = [losses] if isinstance(losses, torch.Tensor) else list(losses)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    N = sum(part.shape[0] for part in parts)
    sq = {n: 0.0 for n, _ in params}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params}
    for part in parts:
        for i in range(part.shape[0]):
            grads = torch.autograd.grad(part[i], [p for _, p in params], retain_graph=True, allow_unused=True)
            for (n, _), g in zip(params, grads):
                if g is not None:
                    g = g.detach().double()
                    sq[n] += g.pow(2).sum().item() / N
                    total[n] += g / N
    return sq, {n: t.pow(2).sum().item() for n, t in total.items()}
