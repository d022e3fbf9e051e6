"""
Per-example norm versions of linear, embedding, layer_norm and rms_norm, for
layers that are not torch.nn modules (or subclasses with their own forward).
Each takes the parameters it uses and the buffers to record into; a module
registers those buffers once and the monitor finds them by name:

    class CastedLinear(PerExampleNormLayer, nn.Module):   # stores W as (in, out)
        def __init__(self, d_in, d_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)
            register_buffers(self, "weight")              # -> weight_pe_sqnorm
        def forward(self, x):
            return functional.linear(x, self.weight.t().type_as(x), weight_buffer=self.weight_pe_sqnorm)

The weight may be any differentiable view or cast of the parameter (a
transpose or a dtype cast leaves each example's gradient norm unchanged).
PerExampleNormLayer keeps the buffers float32 under model.to(torch.bfloat16).
The numbers are those of the `gns` layers in nanogns/kinds/ (same autograd Functions),
and rows are mapped to examples as theirs are (layout.py).
`register_buffers(..., kind="Linear")` records the layer kind for the log's
parameter record (gns-analysis.py groups by it).

A parameter bank (modded-nanogpt keeps several layers' matrices in one
Parameter, e.g. mlp_bank (n_layer, 2, 4 * dim, dim), sliced per layer): its
per-example gradient is the sum of its slices', and disjoint slices have no
cross terms, so its squared norm is the sum of theirs. Register the buffer with
`bank_dims` = the number of leading dims that index slices; the buffer then has
one [sum, count] row per slice and is indexed like the bank:

    register_buffers(self, "mlp_bank", kind="Linear", bank_dims=2)       # buffer (n_layer, 2, 2)
    h = linear(x, self.mlp_bank[i, 0], weight_buffer=self.mlp_bank_pe_sqnorm[i, 0])

The monitor adds the rows and logs the bank once. A slice used twice in one
forward counts its examples twice, and the monitor then stops tracking the bank
with a warning (the norm of a sum of uses needs cross terms), as for any layer.
"""

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import nanogns.kinds
from nanogns.core import shared
from nanogns.core.buffers import BUFFER_SUFFIX, autocast_inputs, autocast_result_dtype, rows_or_refuse
from nanogns.core.ids import untagged
from nanogns.core.module_state import state_of
from nanogns.core.rowmaps import Rows
from nanogns.core.tied import note_embedding, note_head
from nanogns.errors import SettingNotValid
from nanogns.kinds import embedding as embedding_kind
from nanogns.kinds import layernorm as layernorm_kind
from nanogns.kinds import linear as linear_kind
from nanogns.kinds.affine import affine
from nanogns.kinds.layernorm import torch_layer_norm
from nanogns.kinds.rmsnorm import torch_rms_norm


def register_buffers(module: nn.Module, *param_names: str, kind: Optional[str] = None, bank_dims: int = 0) -> None:
    """Give `module` a `<name>_pe_sqnorm` buffer for each of its parameters `param_names`.

    Args:
        kind: the layer kind recorded for these parameters (a name in nanogns/kinds/'s KINDS), or None ('unknown').
        bank_dims: for a bank of disjoint slices, how many leading dims of the parameter index
            them; the buffer is then shaped param.shape[:bank_dims] + (2,) (see the module docstring).
    """
    missing = [n for n in param_names if not isinstance(getattr(module, n, None), torch.nn.Parameter)]
    if missing:
        raise SettingNotValid(f"{type(module).__name__} has no parameter(s) {missing}: register the parameters first")
    if kind is not None:
        nanogns.kinds.KINDS.kind(kind)  # an unknown kind raises, naming the kinds (read at the call: this module is
        # imported while nanogns/kinds/__init__.py makes KINDS)
    for name in param_names:
        param = getattr(module, name)
        if not 0 <= bank_dims < param.dim():
            raise SettingNotValid(
                f"bank_dims={bank_dims} for {name} of shape {tuple(param.shape)}: it must leave at least "
                "one dim to each slice (0 for a parameter that is not a bank)"
            )
        module.register_buffer(
            name + BUFFER_SUFFIX, torch.zeros(*param.shape[:bank_dims], 2, device=param.device), persistent=False
        )
        if kind is not None:
            state_of(module).kinds[name] = kind


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    weight_buffer: Optional[Tensor] = None,
    bias_buffer: Optional[Tensor] = None,
    rows: Optional[Rows] = None,
) -> Tensor:
    """F.linear(x, weight, bias), weight (out, in), recording per-example norms of weight and bias gradients.
    rows: which example each row of x belongs to (Rows), when the layer knows better than the layout
    (tokens routed to an expert); default: the layout's."""
    x, weight, bias = autocast_inputs(x, weight, bias)
    rows, buffers = (
        rows_or_refuse(x, (weight_buffer, bias_buffer), (weight, bias))
        if rows is None
        else (rows, (weight_buffer, bias_buffer))
    )
    with torch.autocast(x.device.type, enabled=False):  # inputs are already in the compute dtype
        out = linear_kind.linear(x, weight, bias, *buffers, rows)
    out = note_head(buffers[0], x, rows, out)
    return out


def embedding(
    ids: Tensor, weight: Tensor, weight_buffer: Optional[Tensor] = None, padding_idx: Optional[int] = None
) -> Tensor:
    """F.embedding(ids, weight, padding_idx) (no max_norm), recording per-example norms of the weight gradient."""
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]  # F.embedding's convention
    rows, (buffer,) = rows_or_refuse(ids.unsqueeze(-1), (weight_buffer,), (weight,), lookup=True)
    ids = untagged(ids)
    if rows is not None and rows.kind == "shared":  # one row of ids for every example: a table they share
        per_example = lambda ids, rows: embedding_kind.embedding(ids, weight, padding_idx, weight_buffer, rows)  # noqa: E731
        return shared.lookup(ids, weight, padding_idx, weight_buffer, per_example)
    out = embedding_kind.embedding(ids, weight, padding_idx, buffer, rows)
    out = note_embedding(buffer, ids, rows, out)
    return out


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    weight_buffer: Optional[Tensor] = None,
    bias_buffer: Optional[Tensor] = None,
) -> Tensor:
    """F.layer_norm over the last dim with an affine weight (and bias), recording their per-example norms."""
    out_dtype = autocast_result_dtype(torch_layer_norm, x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):
        x = x.float()  # computed in float32 under autocast
    rows, buffers = rows_or_refuse(x, (weight_buffer, bias_buffer))
    with torch.autocast(x.device.type, enabled=False):
        return layernorm_kind.layer_norm(x, weight, bias, eps, *buffers, rows, out_dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: Optional[float] = None, weight_buffer: Optional[Tensor] = None) -> Tensor:
    """F.rms_norm over the last dim times weight, recording per-example norms of the weight gradient."""
    out_dtype = autocast_result_dtype(torch_rms_norm, x, weight)
    xhat = F.rms_norm(x, (x.shape[-1],), None, eps)
    rows, (buffer,) = rows_or_refuse(x, (weight_buffer,))
    return affine(xhat, weight, None, buffer, None, rows).to(out_dtype)
