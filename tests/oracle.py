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
