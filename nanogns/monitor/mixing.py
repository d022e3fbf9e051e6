"""
The mixing check: an op of the forward that combines the examples of the batch (its output for one example depends
on another example's inputs) leaves no example a gradient of its own for the layers before it, and no layer can see
it. A BatchNorm is caught by its class (kinds/batchnorm.py); an op without parameters in a model's own code (a
reshape that folds the batch into the heads, a mean over dim 0) is caught here.

At the first step of a monitor in each training mode (model.train(), model.eval()), `examples_mixed` runs the step's
first forward again on its inputs, the layers computing plainly (recording nothing: layout.replay()), and asks
autograd whether the outputs of one example reach the inputs of another: a backward from example j's output rows (a
random cotangent on them, zero elsewhere) to the examples' first rows (the main floating-point input, or the outputs
of the Embeddings looking up the examples' ids) gives exactly zero on every row of every other example unless an op
mixes them; it is run for the first and the last example. Where they mix, the outputs of every module are asked too,
to say where: the op lies after the last module (in the order their forwards end) whose rows of other examples reach
example j's outputs, and before the next one. The steps in that training mode are then refused, as a BatchNorm's.

What it cannot see: a mixing that happens before any parameter (it mixes data, and leaves every example's gradient
its own), one that only some batches trigger (it checks the first), the loss (nanogns.verify checks that), models
run under torch.compile (the root's hooks are compiled) or sharded by FSDP2 (a forward outside the step would run the
engine's collectives), and a forward of one example.

Cost: once per training mode, one forward and two backward passes to the first rows (where the examples mix, one more
to every module's output); at every other step, a dict lookup. bench/mixing_check.py measures it against a step. The
model's state is left as it was: its buffers (a BatchNorm's running statistics), the random number generators
(dropout), the per-example norm buffers and the RowMapper's record of the step.
"""

import warnings

import torch

from nanogns.core import layout, trees
from nanogns.core.ids import ExampleIds
from nanogns.core.inputs import EXAMPLE_ARGUMENTS, SHAPE_ARGUMENT
from nanogns.core.registry import own_class_name
from nanogns.core.rowmaps import Rows
from nanogns.core.table import is_dtensor

PROBED = "the first and the last"  # the examples whose outputs are followed back (EXAMPLES_PROBED)
RELATIVE_ZERO = 1e-6  # a gradient on another example's rows below this fraction of the largest is rounding, not mixing


class MixingCheck:
    """The monitor's mixing check: the inputs of the first forward of a step in a training mode not yet checked
    (`note_inputs`, at the step's first forward), checked when the step is read (`run`), and the finding of each mode
    noted in the RowMapper at every read (`note`), so that the monitor refuses those steps."""

    def __init__(self):
        self.found = {}  # {training mode: None (no mixing seen), or (where, why)}
        self.pending = None  # (module, args, kwargs) of this step's first forward, to be checked at the read
        self.module = None  # the module whose forward was checked (the model; a LightningModule's child)

    def note_inputs(self, module, args, kwargs):
        if self.pending is None and module.training not in self.found and torch.is_grad_enabled():
            self.pending = (module, args, kwargs)

    def run(self, mapper, table):
        """Check the forward noted this step, if any (after the step's backward: its own state is then complete)."""
        if self.pending is None:
            return
        module, args, kwargs = self.pending
        self.pending = None
        if module.training in self.found:
            return
        self.module = module
        try:
            found = examples_mixed(module, args, kwargs, mapper, table)
        except Exception as e:  # the check is the monitor's own: a failure of it refuses nothing, and is said
            warnings.warn(f"GNS: the check that the forward does not mix the examples could not run ({e!r})")
            found = None
        if found != "one example":  # (a forward of one example: checked at a later step)
            self.found[module.training] = found

    def note(self, mapper):
        found = self.found.get(self.module.training) if self.module is not None else None
        if found is not None:
            mapper.note_mixing(*found)


class _Saved:
    """What the check's forward may change, put back afterwards: the module's buffers (running statistics, the
    per-example norm buffers), the flat table, and the RowMapper's and the Passes' record of the step."""

    def __init__(self, module, mapper, table):
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.flats = [(f, f.clone()) for f in table.flats.values()]
        self.mapper = mapper
        self.kept = (dict(mapper.refusals), dict(mapper.mixing), mapper.forwards, mapper.last_pass)
        self.last = layout.PASSES.last

    def restore(self):
        with torch.no_grad():
            for buffer, value in self.buffers + self.flats:
                buffer.copy_(value)
        refusals, mixing, self.mapper.forwards, self.mapper.last_pass = self.kept
        self.mapper.refusals.clear()
        self.mapper.refusals.update(refusals)
        self.mapper.mixing.clear()
        self.mapper.mixing.update(mixing)
        layout.PASSES.last = self.last


def _main_input(args, kwargs):
    """(where: an index into args or a keyword, the tensor) holding the examples, as core/inputs.py reads them."""
    for key in EXAMPLE_ARGUMENTS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return key, kwargs[key]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and not SHAPE_ARGUMENT.search(key):
            return key, value
    return None, None


def rows_of(found, t):
    """The Rows of tensor t's rows in the Pass `found` (a (N,) tensor as (N, 1)), or None where not the examples'."""
    rows = found.layout.rows_for(t.shape if t.dim() > 1 else (*t.shape, 1)) if found.layout is not None else None
    return rows if isinstance(rows, Rows) and rows.kind != "shared" else None


def reached_example(grad, rows, j):
    """The example other than j whose rows of `grad` are largest, when that is more than rounding; else None."""
    if grad is None:
        return None
    flat = grad.detach().reshape(-1, grad.shape[-1] if grad.dim() > 1 else 1)
    examples = rows.example_ids(flat.shape[0], flat.device)
    if examples.numel() != flat.shape[0]:
        return None
    size = flat.abs().amax(dim=1).double()
    other = size.masked_fill(examples == j, 0)
    k = int(other.argmax())
    if float(other[k]) > 0 and float(other[k]) > RELATIVE_ZERO * float(size.max()):
        return int(examples[k])
    return None


def _seed(targets, j):
    """A random scalar of example j's output rows (zero weight on every other example's)."""
    generator = torch.Generator().manual_seed(j)
    seed = 0
    for t, rows in targets:
        shaped = t if t.dim() > 1 else t[:, None]
        noise = torch.randn(shaped.shape, generator=generator, dtype=torch.float64).to(shaped.device, shaped.dtype)
        own = rows.example_ids(shaped.numel() // shaped.shape[-1], shaped.device) == j
        seed = seed + (shaped * noise * own.view(*shaped.shape[:-1], 1)).sum()
    return seed


def examples_mixed(module, args, kwargs, mapper, table):
    """None when no example's outputs depend on another example's first rows; (where, why) when they do; "one
    example" for a forward that cannot tell. Runs `module`'s forward again on (args, kwargs), see the docstring."""
    if any(is_dtensor(p) for p in module.parameters()):
        return None  # FSDP2: not checked (a forward and backward here would run the engine's collectives)
    key, main = _main_input(args, kwargs)
    if main is not None and main.is_floating_point():  # the examples' data: followed back to it
        main = main.detach().requires_grad_(True)
        if isinstance(key, int):
            args = (*args[:key], main, *args[key + 1 :])
        else:
            kwargs = {**kwargs, key: main}
    sources, ends = [], []  # (tensor, rows) the examples' first rows; (path, tensor, rows) each module's output rows

    def capture(path):
        def hook(mod, inputs, output):
            found = layout.current_pass()
            if found is None:
                return
            if isinstance(mod, torch.nn.Embedding) and inputs and isinstance(inputs[0], ExampleIds):
                rows = rows_of(found, output) if isinstance(output, torch.Tensor) else None
                if rows is not None and output.requires_grad:
                    sources.append((output, rows))
            for t in trees.leaves(output):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.dim() > 1:
                    rows = layout.rows_for(t.shape)
                    if isinstance(rows, Rows) and rows.kind != "shared":
                        ends.append((path, t, rows))

        return hook

    saved = _Saved(module, mapper, table)
    handles = [m.register_forward_hook(capture(path)) for path, m in module.named_modules()]
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), layout.replay():
            output = module(*args, **kwargs)
        found = mapper.last_pass
        if found is None or found.layout is None:
            return None
        if main is not None and main.requires_grad and rows_of(found, main) is not None:
            sources.insert(0, (main, rows_of(found, main)))
        targets = [
            (t, rows)
            for t in trees.leaves(output)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.dim() >= 1
            for rows in [rows_of(found, t)]
            if rows is not None
        ]
        N = found.layout.examples
        if N < 2:
            return "one example"
        if not sources or not targets:
            return None
        for j in sorted({0, N - 1}):
            seed = _seed(targets, j)
            if not isinstance(seed, torch.Tensor) or not seed.requires_grad:
                continue
            grads = torch.autograd.grad(seed, [s for s, _ in sources], retain_graph=True, allow_unused=True)
            reached = next(
                (i for (_, rows), g in zip(sources, grads) for i in [reached_example(g, rows, j)] if i is not None),
                None,
            )
            if reached is not None:
                return _where(module, seed, ends, j, reached)
        return None
    finally:
        for handle in handles:
            handle.remove()
        saved.restore()


def _where(module, seed, ends, j, i):
    """(where, why) of a mixing found: example j's outputs reach example i's first rows."""
    needed = [(path, t, rows) for path, t, rows in ends if t.requires_grad]
    grads = torch.autograd.grad(seed, [t for _, t, _ in needed], retain_graph=True, allow_unused=True) if needed else []
    mixed = [reached_example(g, rows, j) is not None for (_, _, rows), g in zip(needed, grads)]
    paths = [path for path, _, _ in needed]
    last = max((k for k, m in enumerate(mixed) if m), default=None)
    after = next((k for k in range(last + 1, len(mixed)) if not mixed[k]), None) if last is not None else None
    before_path = paths[last] if last is not None else None
    after_path = paths[after] if after is not None else None
    common = [p for p in (before_path, after_path) if p is not None]
    parts = [p.split(".") if p else [] for p in common]
    shared = []
    for names in zip(*parts) if parts else ():
        if len(set(names)) > 1:
            break
        shared.append(names[0])
    ancestor = ".".join(shared)  # (one path inside the other: the op is in the outer one's forward)
    owner = module.get_submodule(ancestor) if ancestor else module
    label = (
        f"{ancestor} ({own_class_name(owner)})"
        if ancestor
        else f"the forward of the model itself ({own_class_name(owner)})"
    )
    between = ", ".join(
        part
        for part in (
            f"after {before_path or 'its input'}" if before_path is not None else None,
            f"before {after_path}" if after_path is not None else None,
        )
        if part
    )
    mode = "training" if module.training else "eval"
    why = (
        f"the outputs of example {j} depend on the inputs of example {i} ({between}; found by the monitor's check at "
        f"the first step in {mode} mode, monitor/mixing.py), so no example has a gradient of its own for the layers "
        "before that op; if it mixes only in training mode, measure in eval mode, else leave the layers before it out "
        "of convert() (exclude=[...]); nanogns.verify(model, batch, per_example_loss) shows the numbers"
    )
    return f"an op in {label}", why
