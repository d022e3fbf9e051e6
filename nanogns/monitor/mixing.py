"""
The mixing check: an op of the forward that combines the examples of the batch (its output for one example depends
on another example's inputs) leaves no example a gradient of its own for the layers before it, and no layer can see
it. A BatchNorm is caught by its class (kinds/batchnorm.py); an op without parameters in a model's own code (a
reshape that folds the batch into the heads, a mean over dim 0) is caught here.

At the first step of a monitor in each training mode (model.train(), model.eval()), `examples_mixed` runs the step's
first forward of more than one example (micro-batches of 1 and 3: the 3) again on its inputs, the layers computing plainly (recording nothing: layout.replay()), and asks
autograd whether the outputs of one example reach the inputs of another: a backward from example j's output rows (a
random cotangent on them, zero elsewhere) to the examples' first rows (the main floating-point input, or the outputs
of the Embeddings looking up the examples' ids) gives exactly zero on every row of every other example unless an op
mixes them; it is run for the first and the last example. Where they mix, the outputs of every module are asked too,
to say where: the op lies after the last module (in the order their forwards end) whose rows of other examples reach
example j's outputs, and before the next one. The steps in that training mode are then refused, as a BatchNorm's.

What it cannot see: a mixing that happens before any parameter (it mixes data, and leaves every example's gradient
its own), one that only some batches trigger (it checks the first), the loss (nanogns.verify checks that), models
run under torch.compile (the root's hooks are compiled) or sharded by FSDP2 (a forward outside the step would run the
engine's collectives), and a step whose every forward holds one example (checked at the next step).

Cost: once per training mode, one forward and two backward passes to the first rows (where the examples mix, one more
to every module's output); at every other step, a dict lookup (and at a step whose forwards each hold one example,
which cannot mix them, nothing more). bench/mixing_check.py measures it against a step. The
model's state is left as it was: its buffers (a BatchNorm's running statistics), the random number generators
(dropout), the per-example norm buffers and the RowMapper's record of the step.
"""

import warnings

import torch

from nanogns.core import history, layout, trees
from nanogns.core.ids import ExampleIds, examples_dim
from nanogns.core.inputs import EXAMPLE_ARGUMENTS, SHAPE_ARGUMENT
from nanogns.core.registry import own_class_name
from nanogns.core.rowmaps import Rows
from nanogns.core.table import is_dtensor

ONE_EXAMPLE = "one example"  # examples_mixed's finding for a forward of one example: nothing to tell
UNDECIDED = "undecided"  # its finding for (N, N, ...) rows where the forward moved the examples: sizes cannot tell
RELATIVE_ZERO = 1e-6  # a gradient on another example's rows below this fraction of the largest is rounding, not mixing


class MixingCheck:
    """The monitor's mixing check: the inputs of the first forward of a step in a training mode not yet checked
    (`note_inputs`, at the step's first forward; replaced by a later forward's while the held one had one example,
    `note_later`), checked when the step is read (`run`), and the finding of each mode noted in the RowMapper at
    every read (`note`), so that the monitor refuses those steps."""

    def __init__(self):
        self.found = {}  # {training mode: None (no mixing seen), or (where, why)}
        self.pending = None  # (module, args, kwargs) of this step's first forward, to be checked at the read
        self.module = None  # the module whose forward was checked (the model; a LightningModule's child)
        self.cotangents = {}  # {leaf index: the loss's gradient} of the held forward's outputs (_hold_cotangents)
        self.handle = None  # the forward hook that asks for those gradients

    def note_inputs(self, module, args, kwargs):
        if self.pending is None and module.training not in self.found and torch.is_grad_enabled():
            self.hold(module, args, kwargs)

    def hold(self, module, args, kwargs):
        """Hold a forward for the check, and ask for the gradients the step's loss gives its outputs: the check
        follows those back (an output the loss reads on the diagonal only, as CLIP's logits by a per-pair loss, does
        not mix the examples for it)."""
        if self.handle is not None:
            self.handle.remove()
        self.pending, self.cotangents = (module, args, kwargs), {}
        self.handle = module.register_forward_hook(self._hold_cotangents)

    def _hold_cotangents(self, module, args, output):
        self.handle.remove()
        self.handle = None
        for i, t in enumerate(trees.leaves(output)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                t.register_hook(lambda g, i=i: self._note_cotangent(i, g))

    def _note_cotangent(self, i, grad):
        if grad is not None:  # (an output the loss does not read is given None by some backward functions)
            self.cotangents[i] = grad.detach()

    def note_later(self, module, args, kwargs, layouts):
        """A later forward of the step, given the Layouts of its forwards so far (the last is the held one's): it
        replaces the held forward when that one had a single example. True while later forwards are still wanted."""
        if self.pending is None or not layouts or layouts[-1] is None or layouts[-1].examples > 1:
            return False
        self.hold(module, args, kwargs)
        return True

    def run(self, mapper, table):
        """Check the forward noted this step, if any (after the step's backward: its own state is then complete)."""
        if self.pending is None:
            return
        module, args, kwargs = self.pending
        cotangents, self.pending, self.cotangents = self.cotangents, None, {}
        if module.training in self.found:
            return
        if mapper.layouts and all(found is not None and found.examples < 2 for found in mapper.layouts):
            return  # every forward of the step held one example: none can mix them (the check waits for one that can)
        self.module = module
        try:
            found = examples_mixed(module, args, kwargs, mapper, table, cotangents or None)
        except Exception as e:  # the check is the monitor's own: a failure of it refuses nothing, and is said
            warnings.warn(f"GNS: the check that the forward does not mix the examples could not run ({e!r})")
            found = None
        if found not in (ONE_EXAMPLE, UNDECIDED):  # (checked at a later step)
            self.found[module.training] = found

    def note(self, mapper):
        """Note the mixing found in the model's training mode now, unless a layer refused the step itself (a module
        replayed per example names the parameter and what it saw)."""
        found = self.found.get(self.module.training) if self.module is not None else None
        if found is not None and not mapper.refusals:
            mapper.note_mixing(*found)


class _Saved:
    """What the check's forward may change, put back afterwards: the module's buffers (running statistics, the
    per-example norm buffers), the flat table, and the RowMapper's and the Passes' record of the step."""

    def __init__(self, module, mapper, table):
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.flats = [(f, f.clone()) for f in table.flats.values()]
        self.mapper = mapper
        self.kept = (dict(mapper.refusals), dict(mapper.mixing), mapper.forwards, mapper.last_pass, mapper.step_started)
        self.last = layout.PASSES.last
        self.layouts = list(mapper.layouts)  # (the forwards a count refusal says it observed)
        mapper.step_started = True  # the check's forward starts no step: the monitors are not told of it

    def restore(self):
        with torch.no_grad():
            for buffer, value in self.buffers + self.flats:
                if not torch.equal(buffer, value):  # (a write bumps a buffer's version: one saved for a backward
                    buffer.copy_(value)  # still to run, as token_type_ids by an Embedding, would then fail it)
        refusals, mixing, self.mapper.forwards, self.mapper.last_pass, self.mapper.step_started = self.kept
        self.mapper.refusals.clear()
        self.mapper.refusals.update(refusals)
        self.mapper.mixing.clear()
        self.mapper.mixing.update(mixing)
        self.mapper.layouts[:] = self.layouts
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
    """A scalar of example j's output rows (zero weight on every other example's): weighted by the loss's gradient
    where the step's backward gave it (targets' third item), else at random."""
    generator = torch.Generator().manual_seed(j)
    seed = 0
    for t, rows, cotangent in targets:
        shaped = t if t.dim() > 1 else t[:, None]
        if cotangent is not None:
            noise = cotangent.reshape(shaped.shape).to(shaped.device, shaped.dtype)
        else:
            noise = torch.randn(shaped.shape, generator=generator, dtype=torch.float64).to(shaped.device, shaped.dtype)
        own = rows.example_ids(shaped.numel() // shaped.shape[-1], shaped.device) == j
        seed = seed + (shaped * noise * own.view(*shaped.shape[:-1], 1)).sum()
    return seed


def examples_mixed(module, args, kwargs, mapper, table, cotangents=None):
    """None when no example's outputs depend on another example's first rows; (where, why) when they do; ONE_EXAMPLE
    or UNDECIDED for a forward that cannot tell. Runs `module`'s forward again on (args, kwargs), see the docstring.
    cotangents: {index among the output's leaves: the gradient the step's loss gave it}, or None (all at random)."""
    if any(is_dtensor(p) for p in module.parameters()):
        return None  # FSDP2: not checked (a forward and backward here would run the engine's collectives)
    key, main = _main_input(args, kwargs)
    follow_main = main is not None and main.is_floating_point()
    try:
        return _probe(module, args, kwargs, mapper, table, key if follow_main else None, cotangents)
    except RuntimeError:
        if not follow_main:
            raise
        # a forward that sets requires_grad on what it computes from its input (wav2vec2's feature encoder) runs
        # only with an input that needs no gradient: then the Embeddings' outputs alone are the first rows
        return _probe(module, args, kwargs, mapper, table, None, cotangents)


def _probe(module, args, kwargs, mapper, table, key, cotangents):
    """examples_mixed with the input at `key` (an index into args, a keyword, or None) followed back too."""
    if key is not None:  # the examples' data: followed back to it
        main = (args[key] if isinstance(key, int) else kwargs[key]).detach().requires_grad_(True)
        args, kwargs = (
            ((*args[:key], main, *args[key + 1 :]), kwargs) if isinstance(key, int) else (args, {**kwargs, key: main})
        )
    sources, points, running = [], [], []  # sources (tensor, rows); points (stack, tensor, rows) in forward order
    moved = []  # the Embeddings whose ids had their examples moved off dim 0
    seen = set()  # a tensor is a point where it first appears (not again in a container's output tuple)

    def note(t, found):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.dim() > 1:
            rows = layout.rows_for(t.shape)
            if isinstance(rows, Rows) and rows.kind != "shared" and id(t) not in seen:
                seen.add(id(t))
                points.append((tuple(running), t, rows))

    def entering(path):
        def hook(mod, inputs):
            running.append(path)
            found = layout.current_pass()
            for t in trees.leaves(inputs) if found is not None else ():
                note(t, found)

        return hook

    def leaving(path):
        def hook(mod, inputs, output):
            found = layout.current_pass()
            replaced = None
            if found is not None and isinstance(mod, torch.nn.Embedding) and isinstance(output, torch.Tensor):
                rows = None
                if inputs and isinstance(inputs[0], ExampleIds) and examples_dim(inputs[0]) != 0:
                    moved.append(path)  # ids whose examples the forward moved (XLNet's (T, N)): rows from the tag
                    rows = history.rows_of_moved_ids(inputs[0].unsqueeze(-1))
                elif inputs and isinstance(inputs[0], ExampleIds):
                    rows = rows_of(found, output)
                if isinstance(rows, Rows) and rows.kind != "shared":
                    replaced = output.detach().requires_grad_(True)  # the examples' first rows: followed back to
                    sources.append((replaced, rows))
            for t in trees.leaves(replaced if replaced is not None else output) if found is not None else ():
                note(t, found)
            if running and running[-1] == path:
                running.pop()
            return replaced

        return hook

    saved = _Saved(module, mapper, table)
    handles = []
    for path, m in module.named_modules():
        handles += [m.register_forward_pre_hook(entering(path)), m.register_forward_hook(leaving(path))]
    params = [p for p in module.parameters() if p.requires_grad]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        for p in params:  # no parameter's gradient is formed (nor an engine's hook on it run): only the rows'
            p.requires_grad_(False)
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), layout.replay():
            output = module(*args, **kwargs)  # (a recompute by activation checkpointing runs in here too)
            found = mapper.last_pass
            if found is None or found.layout is None:
                return None
            if key is not None and rows_of(found, main) is not None:
                sources.insert(0, (main, rows_of(found, main)))
            targets = [
                (t if t.dim() > 1 else t[:, None], rows, None if cotangents is None else cotangents[i])
                for i, t in enumerate(trees.leaves(output))
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad and t.dim() >= 1
                if cotangents is None or (i in cotangents and cotangents[i].shape == t.shape)  # (unread by the loss)
                for rows in [rows_of(found, t)]
                if rows is not None
            ]
            N = found.layout.examples
            if N < 2:
                return ONE_EXAMPLE
            if moved and any(t.dim() > 2 and t.shape[0] == t.shape[1] == N for t, *_ in sources + targets):
                return UNDECIDED  # (N, N, ...) rows where the examples moved: sizes cannot tell; a later step
            if not sources or not targets:
                return None
            for j in sorted({0, N - 1}):
                seed = _seed(targets, j)
                if not isinstance(seed, torch.Tensor) or not seed.requires_grad:
                    continue
                grads = gradients(seed, [s for s, _ in sources])
                reached = next(
                    (i for (_, rows), g in zip(sources, grads) for i in [reached_example(g, rows, j)] if i is not None),
                    None,
                )
                if reached is not None:
                    return _where(module, seed, points, j, reached)
            return None
    finally:
        for p in params:
            p.requires_grad_(True)
        for handle in handles:
            handle.remove()
        saved.restore()


def gradients(seed, tensors):
    """The gradients of scalar `seed` with respect to `tensors` (None where it has none), by a backward with hooks
    on them: autograd.grad(inputs=...) is refused through a reentrant activation checkpoint. Keeps the graph."""
    found = [None] * len(tensors)
    handles = []
    for k, t in enumerate(tensors):
        if t.requires_grad:
            handles.append(
                t.register_hook(lambda g, k=k: found.__setitem__(k, g if found[k] is None else found[k] + g))
            )
    try:
        torch.autograd.backward(seed, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
        for t in tensors:
            if t.is_leaf:
                t.grad = None
    return found


def _where(module, seed, points, j, i):
    """(where, why) of a mixing found: example j's outputs reach example i's first rows. The op lies between the
    last point of the forward (a module's input or output, in the order they happen) whose other examples' rows reach
    example j's outputs and the next point whose do not; in the innermost module running across both."""
    grads = gradients(seed, [t for _, t, _ in points])
    mixed = [reached_example(g, rows, j) is not None for (_, _, rows), g in zip(points, grads)]
    last = max((k for k, m in enumerate(mixed) if m), default=None)
    after = next((k for k in range(last + 1, len(mixed)) if not mixed[k]), None) if last is not None else None
    enclosing = []  # the modules running at both points, outermost first
    if last is not None and after is not None:
        for outer, inner in zip(points[last][0], points[after][0]):
            if outer != inner:
                break
            enclosing.append(outer)
    path = next((p for p in reversed(enclosing) if p), "")
    owner = module.get_submodule(path) if path else module
    label = (
        f"{path} ({own_class_name(owner)})" if path else f"the forward of the model itself ({own_class_name(owner)})"
    )
    at = [points[k][0][-1] if k is not None and points[k][0] else None for k in (last, after)]
    between = ", ".join(f"{word} {p}" for word, p in zip(("after", "before"), at) if p is not None and p != path)
    mode = "training" if module.training else "eval"
    why = (
        f"the outputs of example {j} depend on the inputs of example {i} ({'in its forward' + (', ' + between if between else '')}; "
        f"found by running the forward in {mode} mode again and following example {j}'s outputs back, "
        "monitor/mixing.py), so no example has a gradient of its own for the layers before that op; if it mixes only "
        "in training mode, measure in eval mode, else leave the layers before it out of convert() (exclude=[...])"
    )
    return f"an op in {label}", why
