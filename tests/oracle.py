"""
The brute-force oracle every per-example norm test compares against (as opacus
does): one forward and backward per example, batch size 1, plain autograd.
"""

import torch


def per_example_sqnorms_by_loop(module, inputs, grad_out):
    """Squared norm of each example's gradient for every parameter of `module`.

    Args:
        module: any module; it is run on one example at a time.
        inputs: tensor (N, ...) whose dim 0 indexes examples (float input or token ids).
        grad_out: tensor shaped like module(inputs): the upstream gradient. Example
            i's gradient is the vector-Jacobian product with grad_out[i:i+1].
    Returns:
        {parameter name: float64 tensor (N,)} of squared per-example gradient norms.
    """
    names = [name for name, _ in module.named_parameters()]
    sqnorms = {name: [] for name in names}
    for i in range(inputs.shape[0]):
        module.zero_grad(set_to_none=True)
        x = inputs[i : i + 1]
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        module(x).backward(grad_out[i : i + 1])
        for name, param in module.named_parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            sqnorms[name].append(grad.double().pow(2).sum())
    module.zero_grad(set_to_none=True)
    return {name: torch.stack(values) for name, values in sqnorms.items()}


def per_example_loss_sqnorms_by_loop(model, loss_of, batch):
    """Mean over examples of each trainable parameter's squared per-example gradient norm, and the
    squared norm of the batch gradient (the mean of the examples' gradients), by one backward per example.

    Args:
        model: the model; its parameters' .grad are cleared before and after.
        loss_of: callable(model, example batch) -> the loss of that batch, a mean over its examples
            (each example's loss being the mean over its tokens).
        batch: a tensor or a tuple of tensors whose dim 0 indexes the B examples.
    Returns:
        ({name: mean_i ||g_i||^2}, {name: ||mean_i g_i||^2}) as Python floats, for every parameter
        with requires_grad (named_parameters() names; a tied tensor under its first name).
    """
    batch = batch if isinstance(batch, tuple) else (batch,)
    B = batch[0].shape[0]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sq = {n: 0.0 for n, _ in params}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params}
    for i in range(B):
        model.zero_grad(set_to_none=True)
        loss_of(model, *[t[i : i + 1] for t in batch]).backward()
        for n, p in params:
            if p.grad is not None:
                g = p.grad.detach().double()
                sq[n] += g.pow(2).sum().item() / B
                total[n] += g / B
    model.zero_grad(set_to_none=True)
    return sq, {n: t.pow(2).sum().item() for n, t in total.items()}


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
