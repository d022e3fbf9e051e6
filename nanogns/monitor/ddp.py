"""
Cross-rank gradient noise scale under DDP.

Each rank's gradient, before DDP averages it, is a small-batch gradient (the
rank's own b examples); the averaged gradient is the big-batch one (all
B = b x world_size examples). McCandlish et al. 2018 (arXiv 1812.06162, app. A)
give unbiased estimates from the two squared norms:

    |G|^2     = (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)
    GNS       = EMA(tr(Sigma)) / EMA(|G|^2)

where |g_b|^2 is the mean over ranks of each rank's local squared norm. This
covers every parameter DDP synchronises (tied ones included) and needs no
per-example norm layers, only more than one rank.

The log gets each step's raw quantities under ddp/ (sq_norm_small, sq_norm_large,
small_batch_size, big_batch_size); gns-analysis.py forms the EMAs with its own
--alpha, as for every GNS it prints (the estimator is estimator.two_batch_stats, the
one behind the per-example GNS too, with b = 1 there).

Usage:

    hook = DDPGradientStatsHook(ddp_model)        # registers a comm hook
    ...backward of every micro-batch (the hook runs on the synchronising one)...
    log(hook.get_msg(b, B))                       # one all-reduce; resets the hook
    ...
    del ddp_model; gc.collect()                   # before destroy_process_group()

With gloo, a DDP model still alive at destroy_process_group() / interpreter exit
was seen to abort a rank ("terminate called without an active exception"), with
or without this hook (seen with a worker like tests/scripts/monitor_worker.py: 5 runs in 16), so free
the DDP model first, as train.py does.
"""

import math

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from nanogns.estimator import RunningGNS, two_batch_stats


class DDPGradientStatsHook:
    """A DDP comm hook that sums the squared norms of this rank's local gradient
    buckets (before they are averaged) and then averages them over the ranks as
    DDP's default hook does. `sq_norms()` adds the averaged gradient's squared norm,
    read from the parameters' .grad after backward."""

    def __init__(self, ddp_model, process_group=None):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.parameters = [p for p in ddp_model.parameters() if p.requires_grad]
        self.local_sq = None  # sum over buckets of ||local bucket||^2 (this rank), since the last sq_norms()
        ddp_model.register_comm_hook(state=process_group, hook=self._hook)

    def _hook(self, process_group, bucket):
        local_sq = bucket.buffer().detach().double().pow(2).sum()
        self.local_sq = local_sq if self.local_sq is None else self.local_sq + local_sq
        return default_hooks.allreduce_hook(process_group, bucket)

    def sq_norms(self, scale=1.0):
        """(mean over ranks of ||local grad||^2, ||averaged grad||^2) of the last synchronised
        backward, divided by scale^2 (a GradScaler's scale); all-reduces once, so every rank must
        call it, after backward and before the gradients are clipped. NaN, NaN if the hook has not run."""
        if self.local_sq is None:
            return math.nan, math.nan
        local = self.local_sq.clone()
        dist.all_reduce(local, group=self.process_group)
        grads = [p.grad for p in self.parameters if p.grad is not None]
        big = sum(g.detach().double().pow(2).sum() for g in grads).item() if grads else math.nan
        self.local_sq = None
        return local.item() / self.world_size / scale**2, big / scale**2

    def get_msg(self, small_batch_size, big_batch_size, scale=1.0, prefix="ddp/"):
        """This step's raw quantities for the log (see sq_norms): each rank's b examples against all B."""
        small, big = self.sq_norms(scale)
        return {
            prefix + "sq_norm_small": small,
            prefix + "sq_norm_large": big,
            prefix + "small_batch_size": small_batch_size,
            prefix + "big_batch_size": big_batch_size,
        }

    def get_stats(self, scale=1.0):
        """The reference's read: the mean over ranks of each rank's local squared gradient norm (the small-batch
        |g_b|^2); the big-batch one is the averaged gradient's norm squared, which its train.py computes itself."""
        return self.sq_norms(scale)[0]


class GradientNoiseScale:
    """The reference's cross-rank GNS accumulator: `update` with one step's small- and big-batch squared norms,
    `get_msg` for the log. EMAs with `decay` (estimator.py's, as everywhere in this project)."""

    def __init__(self, decay=0.95):
        self.running = RunningGNS(decay)

    def update(self, sq_norm_small, sq_norm_large, small_batch_size, big_batch_size):
        gtg, trsigma = two_batch_stats(sq_norm_small, sq_norm_large, small_batch_size, big_batch_size)
        self.running.add(gtg, trsigma)
        return self.running.gns

    def get_gns(self):
        return self.running.gns

    def get_msg(self, prefix="ddp/"):
        return {
            prefix + "gtg_ema": self.running.gtg.value,
            prefix + "trsigma_ema": self.running.trsigma.value,
            prefix + "gns": self.running.gns,
        }
