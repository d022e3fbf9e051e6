"""
What train.py does differently on one process, under DDP and under FSDP2, behind one small interface, so
that train.py reads as nanoGPT's loop; and what a checkpoint holds for an exact resume (weights, optimizer,
every rank's random state and prefetched batch). Adding an engine is one class here.

    engine = engines.start(device, backend, fsdp)   # from torchrun's environment: one process, DDP or FSDP2
    model = engine.shard(model)                     # before the optimizer is made (FSDP2 shards the blocks)
    model = engine.wrap(model)                      # after torch.compile (DDP's container)
    engine.sync_gradients(model, last_micro_step)   # reduce the gradients after the last micro-batch only

The GNS read itself needs nothing from the engine: GNSMonitor finds the process group and the gradients'
shards by itself (nanogns/monitor/).
"""

import gc
import inspect
import os
import pickle
import random
import re
import shutil
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from nanogns import settings
from nanogns.errors import CheckpointNotUsable, WriteFailed
from nanogns.monitor.ddp import DDPGradientStatsHook


class OneProcessEngine:
    """One process, one device: every collective is the identity."""

    name = 'one process'
    distributed = False
    evaluates_on_every_rank = False  # only rank 0 evaluates and logs

    def __init__(self, device):
        self.device, self.rank, self.local_rank, self.world_size = device, 0, 0, 1

    @property
    def master_process(self):
        return self.rank == 0  # this process logs and writes checkpoints

    @property
    def seed_offset(self):
        return self.rank  # each process draws its own batches and dropout

    def shard(self, model):
        return model

    def wrap(self, model):
        return model

    def unwrap(self, model):
        """The model itself: without DDP's container and torch.compile's wrapper."""
        model = getattr(model, 'module', model)
        return getattr(model, '_orig_mod', model)

    def sync_gradients(self, model, sync):
        pass

    def gns_hook(self, model):
        """The cross-rank GNS hook (DDP only: it compares each rank's gradient with the averaged one)."""
        return None

    def mean(self, value):
        """The mean of a float over the ranks."""
        return value

    def full(self, tensor):
        """A tensor whole on every rank (a sharded gradient norm)."""
        return tensor

    def gather(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        return [obj]

    def broadcast(self, obj):
        """Rank 0's obj on every rank."""
        return obj

    def state_dicts(self, model, optimizer):
        """(model state, optimizer state), whole, for a checkpoint."""
        return model.state_dict(), optimizer.state_dict()

    def load_optimizer(self, model, optimizer, state):
        optimizer.load_state_dict(state)

    def close(self):
        pass


class DDPEngine(OneProcessEngine):
    """DDP: a copy of the model per rank, gradients averaged over the ranks at the last micro-batch."""

    name = 'DDP'
    distributed = True

    def __init__(self, device, backend):
        dist.init_process_group(backend=backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ['LOCAL_RANK'])
        self.holder = None  # a weak reference to the wrapped or sharded model, checked at close()
        self.device = f'cuda:{self.local_rank}' if device.startswith('cuda') else device
        if self.device.startswith('cuda'):
            torch.cuda.set_device(self.device)

    def wrap(self, model):
        # gns: no buffer broadcast, or rank 0's per-example norm buffers would overwrite the others'
        # (at init they are synced: all zero then); torch >= 2.12 names the option forward_sync_buffers and
        # warns on the old name, torch 2.11 (the GPU images) knows only broadcast_buffers
        device_ids = [self.local_rank] if self.device.startswith('cuda') else None
        no_sync = (
            'forward_sync_buffers'
            if 'forward_sync_buffers' in inspect.signature(DDP.__init__).parameters
            else 'broadcast_buffers'
        )
        model = DDP(model, device_ids=device_ids, **{no_sync: False})
        self.holder = weakref.ref(model)
        return model

    def sync_gradients(self, model, sync):
        # what model.no_sync() toggles, without the context manager
        model.require_backward_grad_sync = sync

    def gns_hook(self, model):
        return DDPGradientStatsHook(model)

    def gather(self, obj):
        found = [None] * self.world_size
        dist.all_gather_object(found, obj)
        return found

    def broadcast(self, obj):
        found = [obj]
        dist.broadcast_object_list(found, 0)
        return found[0]

    def close(self):
        # the caller frees the model first: a DDP or FSDP2 module that outlives its process group until the
        # interpreter exits can abort a gloo rank at teardown ("terminate called without an active exception")
        gc.collect()
        if self.holder is not None and self.holder() is not None:
            warnings.warn(
                f"{self.name}: the model is still referenced when its process group is destroyed; drop "
                "every reference to it (model, optimizer, GNS monitor, the last loss) before close()"
            )
        dist.destroy_process_group()


class FSDPEngine(DDPEngine):
    """FSDP2: each block, then the root, sharded over the ranks (parameters, gradients, optimizer state)."""

    name = 'FSDP2'
    evaluates_on_every_rank = True  # a sharded forward needs every rank

    def shard(self, model):
        with torch.no_grad():  # rank 0's initial weights everywhere (DDP does this itself; each rank seeded its own)
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        self.holder = weakref.ref(model)
        return model

    def wrap(self, model):
        return model

    def sync_gradients(self, model, sync):
        model.set_requires_gradient_sync(sync)

    def gns_hook(self, model):
        return None

    def mean(self, value):
        mean = torch.tensor([value], device=self.device)
        dist.all_reduce(mean)
        return mean.item() / self.world_size

    def full(self, tensor):
        return tensor.full_tensor()

    def state_dicts(self, model, optimizer):
        options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (
            dcp_state.get_model_state_dict(model, options=options),
            dcp_state.get_optimizer_state_dict(model, optimizer, options=options),
        )

    def load_optimizer(self, model, optimizer, state):
        # the full (unsharded) optimizer state, keyed by parameter name; each rank keeps its shards
        dcp_state.set_optimizer_state_dict(
            model, optimizer, state, options=dcp_state.StateDictOptions(full_state_dict=True)
        )


def start(device, backend, fsdp):
    """The engine of this process: under torchrun (RANK set) DDP, or FSDP2 with fsdp; else one process (train.py
    has refused fsdp without torchrun before this)."""
    if int(os.environ.get('RANK', -1)) == -1:
        return OneProcessEngine(device)
    return FSDPEngine(device, backend) if fsdp else DDPEngine(device, backend)


# -----------------------------------------------------------------------------
# checkpoints: an exact resume needs every rank's random state and prefetched batch


def rank_state(device, batch):
    """This process's random generators and its prefetched (X, Y), on the CPU, as tensors and plain containers
    (a checkpoint loads with torch.load(weights_only=True): see read_checkpoint)."""
    numpy_state = np.random.get_state(legacy=False)
    return dict(
        torch=torch.get_rng_state(),
        numpy=dict(
            key=torch.from_numpy(numpy_state['state']['key'].astype(np.int64)),  # MT19937's 624 uint32 words
            pos=int(numpy_state['state']['pos']),
            has_gauss=int(numpy_state['has_gauss']),
            gauss=float(numpy_state['gauss']),
        ),
        python=random.getstate(),  # (version, a tuple of 625 ints, gauss_next)
        cuda=torch.cuda.get_rng_state(device) if 'cuda' in device else None,
        batch=tuple(t.cpu() for t in batch),
    )


def restore_rank_state(state, device):
    """Set the random generators as rank_state found them; returns the prefetched (X, Y) on `device`."""
    torch.set_rng_state(state['torch'])
    numpy_state = state['numpy']
    if isinstance(numpy_state, dict):
        key = numpy_state['key'].numpy().astype(np.uint32)
        numpy_state = ('MT19937', key, numpy_state['pos'], numpy_state['has_gauss'], numpy_state['gauss'])
    np.random.set_state(numpy_state)  # (a checkpoint of an earlier version holds numpy's own tuple)
    random.setstate(tuple(state['python']))
    if state['cuda'] is not None and 'cuda' in device:
        torch.cuda.set_rng_state(state['cuda'], device)
    return tuple(t.to(device) for t in state['batch'])


def save_checkpoint(path, checkpoint):
    """Write `checkpoint` to `path` through a temporary file: a crash while saving keeps the previous one.

    Raises WriteFailed (one line naming the file and the free space) when the write fails (a full disk, an
    unwritable directory); the previous checkpoint and the log are kept."""
    try:
        torch.save(checkpoint, path + '.tmp')
        os.replace(path + '.tmp', path)
    except (OSError, RuntimeError) as e:  # torch's writer raises RuntimeError (basic_ios::clear: iostream error)
        if os.path.exists(path + '.tmp'):
            os.remove(path + '.tmp')
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        kept = 'the previous checkpoint and the log are' if os.path.exists(path) else 'the log is'
        raise WriteFailed(
            f"cannot write the checkpoint {path} ({reason}; {free / 2**20:,.0f} MiB free on its disk): "
            f"{kept} kept; free some space, then continue with --init_from=resume",
            path,
            reason,
        ) from None


def _numpy_array_types():
    """What pickling numpy's random state (a uint32 array, in checkpoints of earlier versions) names: the array's
    class, its dtype and the function that rebuilds it from its bytes. None of them runs code of the file's
    choosing."""
    multiarray = getattr(np, '_core', None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_checkpoint(path):
    """The checkpoint at `path`, loaded as data: tensors, numpy arrays and plain containers (dict, list, tuple,
    str, numbers), with torch.load(weights_only=True). Anything else (an object whose unpickling could run
    code) is refused before it is built.

    Raises:
        CheckpointNotUsable (a ValueError): the file is not a readable checkpoint, or holds more than data (the
            message says which).
    """
    try:
        # on the CPU: the model and optimizer move their state to the device; RNG states must stay CPU tensors
        with torch.serialization.safe_globals(_numpy_array_types()):
            checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # read, not run
        except Exception:  # not a zip checkpoint (torch's legacy format): the name torch's error gives
            names = re.findall(r'GLOBAL ([\w.]+)', str(e))
        allowed = {f'{t.__module__}.{t.__qualname__}' for t in _numpy_array_types()}
        names = [n for n in names if n not in allowed]
        if not names:  # damaged rather than unsafe
            raise CheckpointNotUsable(
                f"{path} is not a readable checkpoint ({str(e).splitlines()[-1][:200]})"
            ) from None
        raise CheckpointNotUsable(
            f"{path} holds objects other than tensors and plain data ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}): it was not loaded, as loading them could run code "
            "(a checkpoint train.py writes never holds them)"
        ) from None
    except Exception as e:
        raise CheckpointNotUsable(f"{path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(checkpoint, dict):
        raise CheckpointNotUsable(f"{path} is not a checkpoint of train.py (it holds a {type(checkpoint).__name__})")
    return checkpoint


def load_checkpoint(path, fsdp, master_process):
    """The checkpoint at `path` for a resume. It changes nothing on disk (a refused resume leaves the run directory
    as it was): remove_unfinished() removes a save a crash cut short, once the resume is accepted.

    Raises CheckpointNotUsable (one line: what is wrong and what to do): no file, a damaged one, one holding more
    than data, keys missing, model_args that build no GPT, or written with another fsdp setting."""
    if not os.path.exists(path):
        raise CheckpointNotUsable(
            f"cannot resume: no checkpoint {path} (the run stopped before its first "
            f"save, at iteration eval_interval); start it again with --init_from=scratch in a fresh out_dir"
        )
    try:
        checkpoint = read_checkpoint(path)
    except ValueError as e:
        raise CheckpointNotUsable(
            f"cannot resume: {e}; restore it from a backup or start again in a fresh out_dir"
        ) from None
    missing = [k for k in ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss') if k not in checkpoint]
    if missing:
        raise CheckpointNotUsable(
            f"cannot resume: {path} is not a readable checkpoint (missing or damaged: "
            f"{', '.join(missing)}); restore it from a backup or start again in a fresh out_dir"
        )
    problem = settings.model_args_problem(checkpoint['model_args'])
    if problem:
        raise CheckpointNotUsable(
            f"cannot resume: {path} is not a checkpoint of train.py's GPT (its model_args {problem}); restore it "
            "from a backup or start again in a fresh out_dir"
        )
    if checkpoint.get('fsdp', False) != fsdp:
        raise CheckpointNotUsable(
            f"cannot resume: {path} was written with fsdp={checkpoint.get('fsdp', False)} "
            f"(its optimizer state is keyed that way); resume with --fsdp={checkpoint.get('fsdp', False)}"
        )
    return checkpoint


def remove_unfinished(path):
    """Remove path + '.tmp', a checkpoint a crash cut short while saving (path is the previous one), saying so."""
    if os.path.exists(path + '.tmp'):
        print(f"removing {path}.tmp, an unfinished checkpoint")
        os.remove(path + '.tmp')


def _first(names, limit=3):
    names = sorted(names)
    return ', '.join(names[:limit]) + (f' and {len(names) - limit} more' if len(names) > limit else '')


def load_weights(model, state_dict, path):
    """model.load_state_dict(state_dict), strict; weights that do not fit the model raise CheckpointNotUsable
    naming the first names that differ (missing, unexpected, another shape), not torch's multi-line error."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state_dict.keys(), state_dict.keys() - own.keys()
    shapes = [k for k in own.keys() & state_dict.keys() if tuple(own[k].shape) != tuple(state_dict[k].shape)]
    if missing or unexpected or shapes:
        what = [f"missing {_first(missing)}"] if missing else []
        what += [f"unexpected {_first(unexpected)}"] if unexpected else []
        what += [f"another shape for {_first(shapes)}"] if shapes else []
        raise CheckpointNotUsable(
            f"cannot resume: the weights in {path} do not fit the model these settings build ({'; '.join(what)}): "
            "resume with the flags the run was trained with (its config is in the checkpoint and config.json)"
        )
    try:
        model.load_state_dict(state_dict)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointNotUsable(
            f"cannot resume: the weights in {path} do not load ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:200]}); restore it from a backup or start again in a fresh out_dir"
        ) from None


def load_optimizer_state(engine, model, optimizer, state, path):
    """engine.load_optimizer, an optimizer state that does not fit this optimizer raised as CheckpointNotUsable."""
    try:
        engine.load_optimizer(model, optimizer, state)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointNotUsable(
            f"cannot resume: the optimizer state in {path} does not fit this run's optimizer ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:200]}); resume with the settings the run was trained with"
        ) from None
