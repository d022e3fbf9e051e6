"""
What every layer that records per-example squared gradient norms shares: the
buffers it records into, and the helpers its forward and backward use. The
layers themselves live in nanogns/kinds/, one module per layer kind (kinds/linear.py,
kinds/embedding.py, ...), each with its maths in its docstring.

Vocabulary (used everywhere in this project):
  example      one sequence (or image...) of the batch: the unit whose loss the
               step averages. Which example each row of a layer's input belongs
               to is decided by core/rowmaps.py (dim 0 of a (N, T, D) input, rows of a
               flattened (N*T, D) one, packed sequences, tokens routed to experts).
  pe_sqnorm    per-example squared gradient norm: ||dL/dp restricted to example i||^2.
  buffer       `<param>_pe_sqnorm` (BUFFER_SUFFIX), float32, shape (2,):
               [sum over examples of pe_sqnorm, count of examples]. Backward
               adds to it, so micro-batches of a gradient-accumulation step
               accumulate; `zero_pe_sqnorm_buffers` clears it after the step. A
               count of NaN means a forward's rows could not be mapped to its
               examples: the monitor refuses that step (core/mapper.py keeps why).

Why [sum, count]: the step's loss is the mean over its B examples, so backward
sees g_i / B where g_i is example i's own gradient. The buffer then holds
[sum_i ||g_i||^2 / B^2, B] and its product is sum_i ||g_i||^2 / B =
mean_i ||g_i||^2, the quantity the GNS estimator needs (nanogns/monitor/).

Three flavours per layer kind (its variants, named in its LayerKind: core/registry.py):
  shim   the plain layer, plus a backward pre-hook on the node that made its output,
         reading the output gradient to compute the norms (parameter gradients come
         from PyTorch as usual);
  gns    one autograd Function computes the parameter gradients and the norms
         together ("simultaneous"), sharing the per-example work;
  fused  Triton kernels (variants/fused/).
All keep the replaced class's constructor, parameter names, order and shapes, its
output dtype (under autocast too), and allow in-place ops on their output.
"""

import functools
import itertools
import math

import torch

from nanogns.core import history, layout, trees, uses
from nanogns.core.ids import ExampleIds
from nanogns.core.mapper import BUFFER_SUFFIX
from nanogns.core.module_state import state_of
from nanogns.core.rowmaps import Rows
from nanogns.core.table import TENSOR_PARALLEL, DTensor, is_dtensor  # noqa: F401

# -----------------------------------------------------------------------------
# buffers


def register_pe_sqnorm_buffers(module, param_names):
    """Give `module` one `<name>_pe_sqnorm` buffer per parameter name (those that exist)."""
    for name in param_names:
        if getattr(module, name, None) is not None:
            # non-persistent: checkpoints stay loadable by plain torch layers
            module.register_buffer(
                name + BUFFER_SUFFIX, torch.zeros(2, device=getattr(module, name).device), persistent=False
            )


def add_pe_sqnorm(buffer, pe_sqnorm, counted=True):
    """buffer += [sum of pe_sqnorm (N,), N]; the sum only when counted is False (a layer that counts its
    forward's examples once, itself, as a mixture of experts does for its experts). For a layer that asked
    uses.hand_over first (its tensor was used once); accumulate_pe_sqnorm for one that hands over no factors.

    The add is in place: once the monitor has built the model's BufferTable (core/table.py:BufferTable.build),
    `buffer` is a view of the table's flat tensor, and this add is what StepReader.read gathers from it."""
    if buffer is None:
        return
    total = pe_sqnorm.sum()
    if total.requires_grad:  # a backward that builds a graph (create_graph=True) ran through the layer: refused
        refuse_step(CREATE_GRAPH, (buffer,))
        return
    if total.dtype != buffer.dtype:
        total = total.to(buffer.dtype)
    buffer[0].add_(total)  # in place on the views: 2 ops each, no copy back
    if counted:
        buffer[1].add_(pe_sqnorm.numel())


def accumulate_pe_sqnorm(buffer, pe_sqnorm, counted=True):
    """add_pe_sqnorm for a layer that hands over no per-example factors (core/uses.py): when its tensor was used
    several times per forward, that is noted, and the tensor's uses are recorded each on its own (the monitor then
    stops measuring it, saying why)."""
    if buffer is not None and counted and uses.multiple(buffer):
        uses.add_direct(buffer)
    add_pe_sqnorm(buffer, pe_sqnorm, counted)


def zero_pe_sqnorm_buffers(model):
    """Clear every per-example norm buffer of `model`, and what its layers noted about the step; call after
    each optimizer step's reading. A model a monitor reads (its BufferTable) is cleared in one op per device, as
    the monitor's own step clears it; any other module buffer by buffer."""
    table = state_of(model).buffer_table
    if table is not None:
        if not table.current():
            table.build()
        table.zero()
    else:
        for name, buffer in model.named_buffers():
            if name.endswith(BUFFER_SUFFIX):
                buffer.zero_()
    mapper = layout.mapper_of(model)
    if mapper is not None:
        mapper.clear()


class PerExampleNormLayer:
    """What every per-example norm layer shares: `pe_kind` (its layer kind, a name in nanogns/kinds/'s KINDS),
    buffers kept float32 when the module is cast (model.to(torch.bfloat16): a bf16 count stops being exact past
    256 examples), and the rows of its input mapped to examples."""

    pe_kind = None
    pe_roles = {}  # {role: parameter name} for parameters named otherwise than "weight"/"bias" (core/registry.py:adopt)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, buffer in self._buffers.items():
            if name.endswith(BUFFER_SUFFIX) and buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    def pe_adopt(self, options):
        """Finish turning a module of another class into this one in place (core/registry.py:adopt): set the
        attributes this class's forward reads from `options` and register the buffers."""
        for name, value in options.items():
            setattr(self, name, value)
        for role in ("weight", "bias"):  # a module without a bias has none to read
            if not hasattr(self, self.pe_roles.get(role, role)):
                setattr(self, role, None)
        self.register_pe_buffers()

    def register_pe_buffers(self, *roles):
        """One buffer per parameter (default: weight and bias, those that exist), named after the parameter."""
        register_pe_sqnorm_buffers(self, [self.pe_roles.get(role, role) for role in roles or ("weight", "bias")])

    def pe_buffer(self, role):
        """The buffer of the parameter playing `role` ("weight", "bias", or a parameter name), or None when it is
        absent or frozen (no gradient: nothing to record)."""
        name = self.pe_roles.get(role, role)
        param = getattr(self, name, None)
        if param is None or not param.requires_grad:
            return None
        return self._buffers.get(name + BUFFER_SUFFIX)

    def pe_rows_and_buffers(self, x, *param_names, lookup=False):
        """(Rows of x's examples, the parameters' buffers) for this forward; buffers are None for frozen
        parameters, and all None when x's rows cannot be mapped to examples (the step is then refused) or x is a
        table shared by the examples (see rows_or_refuse)."""
        params, buffers = [], []
        for role in param_names:  # pe_buffer's rule, inlined: this runs in every forward
            name = self.pe_roles.get(role, role) if self.pe_roles else role
            param = self._parameters[name] if name in self._parameters else getattr(self, name, None)
            params.append(param)
            buffers.append(
                self._buffers.get(name + BUFFER_SUFFIX) if param is not None and param.requires_grad else None
            )
        if all(b is None for b in buffers):
            return None, tuple(buffers)
        return rows_or_refuse(x, tuple(buffers), params, lookup, module=self)


# why a step whose backward built a graph (add_pe_sqnorm sees norms that require a gradient) is not measured
CREATE_GRAPH = (
    "a backward with create_graph=True ran through its layer (a gradient penalty such as R1, a Hessian-vector "
    "product, a meta-learning inner step): the part of the parameters' gradient that flows back through the graph it "
    "built passes no per-example layer, so no example's own gradient is known; measure the steps without it (a "
    "penalty applied every k steps: call zero_pe_sqnorm_buffers(model) instead of monitor.step on those steps)"
)
# why a forward under a torch.func transform is not measured (rows_or_refuse)
FUNCTORCH = (
    "it ran under a torch.func transform (grad, grad_and_value, vjp, jacrev, vmap): the gradients a transform returns "
    "pass no per-example layer and are not the parameters' .grad; measure a step whose gradients come from "
    "loss.backward() (a forward by torch.func.functional_call is fine), and call zero_pe_sqnorm_buffers(model) after "
    "a transform run beside the step"
)

SHARED_INPUT = (
    "its input has one row for the forward's {} examples (shape {}), broadcast over the batch afterwards, and no "
    "table shared by the examples leads to it (core/shared.py follows those an Embedding looks up); if it is an "
    "input of yours, pass it expanded to one row per example"
)


def rows_or_refuse(x, buffers, params=(), lookup=False, module=None):
    """(Rows of the rows of input `x` (a tensor, or its shape), buffers), or (None, Nones) after refusing the step
    when they cannot be mapped to examples (layout.py), or when a parameter is sharded by tensor parallelism.
    A table shared by the examples (core/shared.py) gives (None, Nones) without refusing: the layer computes
    plainly, and the table follows its parameters; ids with one row for every example give Rows 'shared' when
    `lookup` (an Embedding then looks up a table), as do ids the forward did not compute from its example inputs
    (layout.looks_up_a_table). A layer `module` whose rows cannot be mapped refuses the step only when a gradient
    reaches its output (PEFT's DoRA runs its LoRA layers on an identity matrix for a norm it detaches)."""
    if DTensor is not None and any(map(isinstance, params, itertools.repeat(DTensor))):  # FSDP2 all-gathers its
        refuse_step(  # shards into plain tensors before a forward: a DTensor here is tensor parallelism
            f"its parameters are sharded by tensor parallelism (a DTensor in the forward): {TENSOR_PARALLEL}", buffers
        )
        return None, tuple(None for _ in buffers)
    if getattr(type(x), "pe_shared", False) or layout.replaying():  # a table, or a module's replay (replay.py)
        return None, tuple(None for _ in buffers)
    if torch._C._are_functorch_transforms_active():  # (autograd.Function.apply asks the same, then fails)
        with torch._C._DisableFuncTorch():  # the buffers are no tensors of the transform's: written as they are
            refuse_step(FUNCTORCH, buffers)
        return None, tuple(None for _ in buffers)
    shape = x.shape if isinstance(x, torch.Tensor) else x
    compiling = None
    if not lookup and shape is not x:  # rows an index took in another order (core/history.py's rows_if_gathered):
        compiling = torch.compiler.is_compiling()  # (asked once, for rows_for too; grad_fn breaks a traced graph)
        node = None if compiling else x.grad_fn
        # (asked of 2-D rows, of views of them and of gathers only: the other (N, T, D) inputs pay no call)
        name = type(node).__name__ if node is not None else None
        if name is not None and (
            not shape[2:] or name in history.GATHERS or name in history.REFOLDS and not node._saved_self_sym_sizes[2:]
        ):
            gathered = history.rows_if_gathered(x)
            if gathered is not None:
                layout.note_uses(buffers)
                return gathered, buffers
    if lookup and layout.looks_up_a_table(x):  # ids not computed from the examples' inputs: a table's
        return Rows("shared", layout.current().examples), tuple(None for _ in buffers)
    moved_ids = lookup and type(x) is ExampleIds and x._examples_dim != 0 and history.rows_of_moved_ids(x)
    rows = (lookup and (moved_ids or layout.untold_ids(shape))) or layout.rows_for(
        shape, module=module, compiling=compiling
    )
    undecided = None
    if not lookup and shape[2:] and shape[0] == shape[1]:
        if not isinstance(rows, str) and rows.kind == "dim0":  # (N, N, ...) rows: sizes cannot tell dim 0 from dim 1
            undecided = history.undecided_rows(x)  # where the forward moved its examples
            rows = undecided or rows
    if isinstance(rows, str) or rows.kind == "shared":  # (the common case asks one question)
        if not isinstance(rows, str) and lookup:  # ids, one row for every example: the Embedding looks up a table
            return rows, tuple(None for _ in buffers)
        moved = None
        if not lookup and not undecided and isinstance(rows, str):  # sizes fit no mapping: how the rows were made
            moved = history.rows_by_history(x) or history.rows_by_fold(x) or history.sequence_first_groups(shape)
        if moved is not None:  # sizes fit no mapping, and the autograd history moved or folded the examples
            layout.note_uses(buffers)
            return moved, buffers
        reason = rows if isinstance(rows, str) else SHARED_INPUT.format(rows.examples, tuple(shape[:-1]))
        # (a module called with hooks runs those registered during its forward; adopt() gives every converted one)
        hooked = module is not None and (module._forward_pre_hooks or module._forward_hooks)
        if hooked and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            refuse_when_gradient_arrives(module, reason, buffers)
        else:
            refuse_step(reason, buffers)
        return None, tuple(None for _ in buffers)
    layout.note_uses(buffers)
    return rows, buffers


def refuse_when_gradient_arrives(module, reason, buffers):
    """Refuse the step for `buffers` when a gradient reaches the output of this call of `module` (a call whose output
    is detached, or unused, leaves the step measured). A hook on the module, for this one call."""

    def refuse(grad):
        with torch.no_grad():
            for buffer in buffers:
                if buffer is not None:
                    buffer[..., 1] = math.nan
        layout.note_refusal(reason, buffers)

    def hook(module, args, output):
        handle.remove()
        found = next((t for t in trees.leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if found is not None:
            on_output_grad(found, refuse)

    handle = module.register_forward_hook(hook)


def refuse_step(reason, buffers):
    """Mark this step's buffers as not measured (count NaN) and keep the reason for the monitor's error; only
    for a forward that will have a backward."""
    if not torch.is_grad_enabled():
        return
    with torch.no_grad():
        for buffer in buffers:
            if buffer is not None:
                buffer[..., 1] = math.nan
    layout.note_refusal(reason, buffers)


def norm_dtype(t):
    # norms are summed in float32 (float64 kept for tests)
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def autocast_inputs(x, *params):
    """Cast x and params to autocast's dtype if it is on, as F.linear would; the
    casts are differentiable so parameter gradients come back in their own dtype."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *params)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None else None for t in (x, *params))


def autocast_result_dtype(op, x, *params):
    """The dtype torch's own `op(x, *params)` returns here, under autocast too (which differs by device: CPU
    autocast keeps a bf16 layer_norm in bf16, CUDA's runs it in float32), found once per setting by running
    op on empty tensors."""
    device_type = x.device.type
    enabled = torch.is_autocast_enabled(device_type)
    if not enabled and {p.dtype for p in params if p is not None} <= {x.dtype}:
        return x.dtype  # the norms' ops (layer_norm, rms_norm) keep the dtype they are all given
    autocast_dtype = torch.get_autocast_dtype(device_type) if enabled else None
    key = (op, x.device, enabled, autocast_dtype, x.dtype, tuple(p.dtype if p is not None else None for p in params))
    if torch.compiler.is_compiling():  # Dynamo traces through a cache (and warns): the empty op is traced, then dropped
        return _result_dtype.__wrapped__(key, x.shape[-1])
    return _result_dtype(key, x.shape[-1])


@functools.lru_cache(maxsize=None)
def _result_dtype(key, features):
    op, device, enabled, autocast_dtype, x_dtype, param_dtypes = key
    empty = torch.empty(0, features, dtype=x_dtype, device=device)
    params = [torch.ones(features, dtype=d, device=device) if d is not None else None for d in param_dtypes]
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=enabled):
        return op(empty, *params).dtype


def on_output_grad(out, hook):
    """Call hook(gradient of `out`) during backward, through a pre-hook on the node that made `out` (or, for a
    view, its base): no node is added, so in-place ops on `out` afterwards work as on the plain layer, and the
    node still receives the layer's own output gradient. Nothing happens when `out` needs no gradient or gets
    none."""
    if out._is_view():  # an in-place op on a view reroutes its gradient; the node of its base stays in the graph
        out = out._base  # (the base's gradient has the base's shape: the hooks read rows, not shapes)
    node = out.grad_fn
    if node is None:
        return
    index = out.output_nr

    def prehook(grad_outputs):
        if grad_outputs[index] is not None:
            hook(grad_outputs[index])

    node.register_prehook(prehook)


def count_examples_in_backward(out, examples, buffers):
    """Count a forward's `examples` once in each buffer, when `out`'s gradient arrives: for a layer whose parts
    add their norms' sums uncounted (experts, attention). In backward, not in forward, so that a recompute by
    activation checkpointing (a forward whose output no gradient reaches) is not counted as a second use."""

    def count(grad):
        with torch.no_grad():
            for buffer in buffers:
                if buffer is not None:
                    buffer[1] += examples

    on_output_grad(out, count)
