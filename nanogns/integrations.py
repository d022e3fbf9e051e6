"""
The GNS inside the trainers people use: one object per trainer, added in one line.

    transformers.Trainer   trainer.add_callback(TrainerGNSCallback(trainer))
    Lightning              lightning.Trainer(..., callbacks=[LightningGNSCallback()])
    Accelerate             monitor = AccelerateGNS(accelerator, model); monitor.step() before clip_grad_norm_

Each converts the model's layers (nanogns.convert, unless they already record per-example norms),
reads every optimizer step before gradient clipping (the logged `norm` is the unclipped gradient's), writes
`log.csv` and `gns_parameters.json` to its out_dir on the main process (`python gns-analysis.py OUT_DIR`), and
sends the running GNS to the trainer's own logger under "gns". Every rank must run it (one all-reduce a step).

The out_dir is locked while a run trains (one run per directory) and released however the run ends: at its
end, and when training raises (an exception, a KeyboardInterrupt): Trainer's train() is wrapped to close the
log, Lightning calls on_exception, AccelerateGNS is a context manager (`with AccelerateGNS(...) as monitor:`).
A refusal raises a nanogns.errors.NanoGNSError (DirectoryInUse, DirectoryHoldsAnotherRun, WriteFailed), one
line; it never exits the caller's process.

What is measured, whatever the trainer's loss weighting: the step's gradient G is a sum of one part per example
(all micro-batches, all ranks), and example i's gradient is taken to be h_i = B x (its part), so G = mean_i h_i.
With a loss that is the mean over examples of each example's mean token loss, h_i is the gradient of that
example's loss (docs/log-format.md). transformers.Trainer's default loss instead divides the sum of all token losses of the
step by their number N (`num_items_in_batch`), so h_i = (n_i / mean_j n_j) x (gradient of example i's mean token
loss), n_i its label tokens: the two agree when every example has as many label tokens (packed, unpadded blocks).
docs/integrations.md ("Trainers") says how to get the per-sequence mean.

Each takes `verify_loss=per_example_loss` (off by default): the first step's batch is then checked with
nanogns.verify (the monitor's numbers against each example's own gradient, a table printed on the main process, the
result kept as `.verification`), at a cost of about B + 2 training steps of that micro-batch, in float64, once.
"""

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import torch

from nanogns.conversion.convert import convert
from nanogns.core import trees
from nanogns.core.buffers import BUFFER_SUFFIX, zero_pe_sqnorm_buffers
from nanogns.core.layout import install
from nanogns.errors import CallNotValid, DirectoryHoldsAnotherRun, NotSupported, SettingNotValid, WriteFailed
from nanogns.estimator import RunningGNS
from nanogns.monitor import GNSMonitor
from nanogns.runlog.lock import RunLock
from nanogns.runlog.reader import load_csv
from nanogns.runlog.writer import HEADER_TMP, LOG_CSV, LogWrapper
from nanogns.verification import verify

if TYPE_CHECKING:
    import accelerate
    import transformers


def _monitor(model, ema_decay, scaler, convert_options):
    """The model's GNSMonitor, without a log yet (_open_log gives it one): its layers converted first unless some
    already record per-example norms."""
    options = dict(ema_decay=ema_decay, scaler=scaler)
    if any(name.endswith(BUFFER_SUFFIX) for name, _ in model.named_buffers()):
        if convert_options:
            raise SettingNotValid(
                f"GNS: the model's layers are converted already; convert options {convert_options} "
                "cannot apply (pass them to the first nanogns.convert instead)"
            )
        return GNSMonitor(model, **options)
    return convert(model, **(convert_options or {}), **options)


def _open_log(out_dir, main_process, monitor, resume_step):
    """(the run's CSV log, the lock of its directory), opened as training starts at optimizer step `resume_step`
    (main process only: (None, None) on the other ranks, which measure and all-reduce, and log nothing). The
    directory is locked until the log closes (or the process ends): a second run on it is refused, in one line
    naming its pid. A new run (step 0) never replaces another run's log. A resumed run continues its log, rows
    written after the checkpoint set aside (as train.py does), and replays the rows kept into the running GNS,
    which a trainer's checkpoint does not hold. Each opening starts from zeroed buffers and a fresh running GNS
    (a run that raised mid-step may have left partial sums).

    Raises DirectoryInUse, DirectoryHoldsAnotherRun or WriteFailed (nanogns.errors), one line each; nothing is
    left locked or open then."""
    zero_pe_sqnorm_buffers(monitor.model)
    monitor.running = RunningGNS(decay=monitor.running.gtg.decay)
    if not main_process:
        return None, None
    try:
        lock = RunLock(out_dir)
    except OSError as e:
        raise WriteFailed(
            f"cannot write the GNS log's directory {out_dir!r} ({e.strerror}); pass another out_dir",
            out_dir,
            e.strerror or str(e),
        ) from None
    try:
        existing = [f for f in (LOG_CSV, HEADER_TMP) if os.path.exists(os.path.join(out_dir, f))]
        if resume_step == 0 and existing:
            raise DirectoryHoldsAnotherRun(
                f"{out_dir!r} already holds the GNS log of another run ({', '.join(existing)}), which this new run "
                "would replace: give this run another output directory, or move the old log away (to continue "
                "that run's log instead, resume it from a checkpoint it saved)",
                out_dir,
                existing,
            )
        log = LogWrapper(out_dir=out_dir, resume=resume_step > 0, resume_step=resume_step if resume_step > 0 else None)
        try:
            monitor.write_record(out_dir)
            if resume_step > 0 and existing:
                try:
                    kept = load_csv(out_dir)
                except ValueError:  # no row was written before the checkpoint
                    kept = None
                if kept is not None:
                    monitor.replay(kept)
        except BaseException:
            log.close()
            raise
    except BaseException:
        lock.release()
        raise
    monitor.log = log
    return log, lock


def _close_log(monitor, log, lock):
    """Write log.csv and release the directory (the lock even when the write fails); the monitor stops logging."""
    if monitor is not None and monitor.log is log:
        monitor.log = None
    try:
        if log is not None:
            log.close()
    finally:
        if lock is not None:
            lock.release()


# -----------------------------------------------------------------------------
# Hugging Face transformers.Trainer

try:
    from transformers import TrainerCallback
except ImportError:  # transformers not installed: TrainerGNSCallback is unavailable
    TrainerCallback = object


class TrainerGNSCallback(TrainerCallback):
    """transformers.Trainer callback: exact per-example gradient norms and the GNS, read before clipping.

        trainer = Trainer(model=model, args=args, train_dataset=ds)
        trainer.add_callback(TrainerGNSCallback(trainer))      # before trainer.train()

    Trainer clips the gradients (accelerator.clip_grad_norm_) before any callback event of the step, so this
    callback wraps that call on the trainer's accelerator (at on_train_begin) and reads the step just before it
    runs. With max_grad_norm=0 Trainer calls it with an infinite norm, so the step is read there too. A callback
    event gets no trainer, hence the argument.

    Args:
        trainer: the transformers.Trainer; its model is converted here (before train() wraps it for DDP).
        out_dir: where log.csv and gns_parameters.json go (default: args.output_dir). A new run refuses a
            directory holding another run's log; train(resume_from_checkpoint=...) continues that log from the
            checkpoint's step, its earlier rows rebuilding the running GNS. It is locked while training (one
            run per directory: another is refused, in one line naming its pid).
        ema_decay: the running GNS's decay (gns-analysis.py's --alpha).
        verify_loss: per_example_loss(model, inputs) -> (B,) losses (e.g. `causal_lm_losses`): the first training
            step's inputs are checked with nanogns.verify before it runs (once; about B + 2 steps of compute).
        convert_options: keyword arguments of nanogns.convert (linearclass, exclude, ...).
    The running GNS goes to Trainer's log (`gns`) at every logging step.

    Trainer calls no callback when train() raises (an exception, Ctrl-C in a notebook), so this callback wraps
    the trainer's train(): however it ends, the log is written (log.csv) and the directory released, and a later
    train(resume_from_checkpoint=...) in the same process continues the log. Refusals raise NanoGNSError.
    """

    def __init__(
        self,
        trainer: "transformers.Trainer",
        out_dir: Optional[str] = None,
        ema_decay: float = 0.95,
        verify_loss: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        **convert_options: Any,
    ):
        if TrainerCallback is object:
            raise ImportError('TrainerGNSCallback needs transformers: pip install "nanogns[trainers]"')
        self.trainer = trainer
        self.verify_loss, self.verification = verify_loss, None  # Optional[Verification] of the first step
        self.out_dir = out_dir if out_dir is not None else trainer.args.output_dir
        self.log = self.lock = None  # opened at on_train_begin, when Trainer knows whether it resumes
        scaler = getattr(trainer.accelerator, "scaler", None)
        self.monitor = _monitor(trainer.model, ema_decay, scaler, convert_options)
        self.measured = False  # this optimizer step has been read
        train = trainer.train

        @functools.wraps(train)
        def train_then_close(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            finally:
                self.close()

        trainer.train = train_then_close

    def close(self) -> None:
        """Write log.csv and release the directory (done when train() returns or raises; safe to repeat)."""
        log, lock, self.log, self.lock = self.log, self.lock, None, None
        _close_log(self.monitor, log, lock)

    def on_train_begin(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        kind = str(accelerator.distributed_type)
        if "DEEPSPEED" in kind or ("FSDP" in kind and not getattr(accelerator, "is_fsdp2", False)):
            raise NotSupported(
                f"TrainerGNSCallback: {kind} keeps gradients its own way (partitioned, flattened) "
                "and clips them itself; the GNS is read under one process, DDP and FSDP2"
            )
        self.close()  # a log still open: Trainer restarted its loop (auto_find_batch_size after an OOM)
        self.measured = False
        # state.global_step: 0, or the checkpoint's step under train(resume_from_checkpoint=...)
        self.log, self.lock = _open_log(
            self.out_dir, self.trainer.is_world_process_zero(), self.monitor, state.global_step
        )
        if self.verify_loss is not None and not getattr(self.trainer.training_step, "_gns_verifies", False):
            self.trainer.training_step = self._verifying(self.trainer.training_step)
        if getattr(accelerator.clip_grad_norm_, "_gns_reads", False):
            return  # wrapped already (train() called again)
        clip = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            if accelerator.sync_gradients and not self.measured:
                self.measured = True
                self.monitor.step()  # before clipping; batch_size from the layers' counts
            return clip(parameters, max_norm, norm_type=norm_type)

        clip_grad_norm_._gns_reads = True
        accelerator.clip_grad_norm_ = clip_grad_norm_

    def _verifying(self, training_step):
        """Trainer's training_step, which first checks the first step's inputs with nanogns.verify (verify_loss)."""

        @functools.wraps(training_step)
        def verified_step(model, inputs, *args, **kwargs):
            if self.verification is None:
                on_device = trees.map_leaves(
                    lambda t: t.to(self.trainer.args.device) if isinstance(t, torch.Tensor) else t, dict(inputs)
                )
                self.verification = verify(
                    self.trainer.model, on_device, self.verify_loss, show=self.trainer.is_world_process_zero()
                )
            return training_step(model, inputs, *args, **kwargs)

        verified_step._gns_verifies = True
        return verified_step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.measured:
            raise CallNotValid(
                "TrainerGNSCallback: Trainer did not call accelerator.clip_grad_norm_ before this "
                "optimizer step (a tensor-parallel mesh or SageMaker clips otherwise), so the "
                "unclipped gradients were not read; no GNS can be logged for this setup"
            )

    def on_step_end(self, args, state, control, **kwargs):
        self.measured = False
        if self.log is not None:
            self.log.log({"iter_num": state.global_step - 1})
            self.log.step()
        if control.should_log:  # Trainer's own log entry of this step: Trainer.log clears should_log, so set it
            self.trainer.log({"gns": self.monitor.gns})
            control.should_log = True  # again for the loss entry that follows

    def on_train_end(self, args, state, control, **kwargs):
        self.close()


# -----------------------------------------------------------------------------
# Lightning

try:
    from lightning.pytorch.callbacks import Callback as LightningCallback
except ImportError:  # lightning not installed
    LightningCallback = object


class LightningGNSCallback(LightningCallback):
    """Lightning callback: exact per-example gradient norms and the GNS, read before clipping.

        trainer = lightning.Trainer(..., callbacks=[LightningGNSCallback()])

    Lightning calls `on_before_optimizer_step` after the step's last backward (and, under 16-bit mixed precision,
    after unscaling) and before `gradient_clip_val` clips: the step is read there. The LightningModule's layers
    are converted at `setup`, before Lightning wraps it for DDP; the forward of each child module holding
    parameters (a `self.model` called with input_ids) sets which example each row belongs to.

    Args:
        out_dir: where log.csv and gns_parameters.json go (default: the trainer's default_root_dir). A new run
            refuses a directory holding another run's log; fit(ckpt_path=...) continues that log from the
            checkpoint's step, its earlier rows rebuilding the running GNS. It is locked while training (one
            run per directory: another is refused, in one line naming its pid).
        ema_decay: the running GNS's decay (gns-analysis.py's --alpha).
        verify_loss: per_example_loss(pl_module, batch) -> (B,) losses: the first training batch is checked with
            nanogns.verify before its step (once; about B + 2 steps of compute).
        convert_options: keyword arguments of nanogns.convert.
    The running GNS is logged with `pl_module.log("gns", ...)` every step. The log is written and the directory
    released at teardown, and at on_exception when fit raises (a later fit(ckpt_path=...) in the same process
    continues the log). Refusals raise NanoGNSError (Lightning runs on_exception, then raises it from fit).
    """

    def __init__(
        self,
        out_dir: Optional[str] = None,
        ema_decay: float = 0.95,
        verify_loss: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        **convert_options: Any,
    ):
        if LightningCallback is object:
            raise ImportError('LightningGNSCallback needs lightning: pip install "nanogns[trainers]"')
        self.out_dir, self.ema_decay, self.convert_options = out_dir, ema_decay, convert_options
        self.verify_loss, self.verification = verify_loss, None  # Optional[Verification] of the first batch
        self.monitor = self.gns_log = self.lock = None  # (Lightning sets callback.log to the module's log method)

    def setup(self, trainer, pl_module, stage):
        if stage != "fit" or self.monitor is not None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.monitor = _monitor(pl_module, self.ema_decay, scaler, self.convert_options)
        for child in pl_module.children():  # the LightningModule's own forward is not called: its children's are
            if any(True for _ in child.parameters()):
                install(child, mapper=self.monitor.row_map)

    def on_train_start(self, trainer, pl_module):
        self.close()  # (a log left open would be this process's own lock: closed at teardown and on_exception)
        # trainer.global_step: 0, or the checkpoint's step under fit(ckpt_path=...), restored by now
        out_dir = self.out_dir if self.out_dir is not None else trainer.default_root_dir
        self.gns_log, self.lock = _open_log(out_dir, trainer.is_global_zero, self.monitor, trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.verify_loss is not None and self.verification is None:
            self.verification = verify(pl_module, batch, self.verify_loss, show=trainer.is_global_zero)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        row = self.monitor.step(gradients_unscaled=True)  # Lightning unscaled a GradScaler's gradients already
        if self.gns_log is not None:
            self.gns_log.log({"iter_num": trainer.global_step})
            self.gns_log.step()
        pl_module.log("gns", row["gns"], on_step=True, on_epoch=False, rank_zero_only=True)

    def close(self) -> None:
        """Write log.csv and release the directory (at teardown and on_exception; safe to repeat)."""
        log, lock, self.gns_log, self.lock = self.gns_log, self.lock, None, None
        _close_log(self.monitor, log, lock)

    def on_exception(self, trainer, pl_module, exception):
        self.close()

    def teardown(self, trainer, pl_module, stage):
        self.close()


# -----------------------------------------------------------------------------
# Accelerate


class AccelerateGNS:
    """Accelerate: exact per-example gradient norms and the GNS, read where the loop clips.

        with AccelerateGNS(accelerator, model) as monitor:      # before or after accelerator.prepare
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(loss_of(model, batch))
                    if accelerator.sync_gradients:              # the last micro-batch of the step
                        monitor.step()                          # before clipping
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step(); optimizer.zero_grad()

    The `with` block writes log.csv and releases the directory however the loop ends, an exception included
    (without it, call monitor.close(); the process's end releases them too).

    Args:
        accelerator: the accelerate.Accelerator (its GradScaler, if fp16, is divided out).
        model: the model, prepared or not; its layers are converted.
        out_dir: where log.csv and gns_parameters.json go (main process only), locked until close() (one run per
            directory: another is refused, in one line naming its pid).
        ema_decay: the running GNS's decay (gns-analysis.py's --alpha).
        resume_step: the optimizer step a resumed loop starts at (after accelerator.load_state): the log in
            out_dir is continued from there and its earlier rows rebuild the running GNS; 0 starts a new log.
        verify_loss: per_example_loss(model, batch) -> (B,) losses: the batch passed to the first step(batch=...)
            is checked with nanogns.verify (once; about B + 2 steps of compute).
        convert_options: keyword arguments of nanogns.convert.
    `step` sends the running GNS to `accelerator.log` (the trackers of accelerator.init_trackers, if any).
    """

    def __init__(
        self,
        accelerator: "accelerate.Accelerator",
        model: torch.nn.Module,
        out_dir: str = "out-accelerate",
        ema_decay: float = 0.95,
        resume_step: int = 0,
        verify_loss: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        **convert_options: Any,
    ):
        self.accelerator = accelerator
        self.verify_loss, self.verification = verify_loss, None  # Optional[Verification] of the first step
        self.monitor = _monitor(accelerator.unwrap_model(model), ema_decay, accelerator.scaler, convert_options)
        self.log, self.lock = _open_log(out_dir, accelerator.is_main_process, self.monitor, resume_step)
        self.steps = resume_step

    @property
    def tracked(self):
        """The tracked tensors (the monitor's Tracked entries)."""
        return self.monitor.tracked

    @property
    def gns(self):
        return self.monitor.gns

    def step(self, gradients_unscaled: bool = False, batch: Any = None) -> Dict[str, float]:
        """Read the step (after the last micro-batch's backward, before clipping), log it; returns the row.
        gradients_unscaled: True when accelerator.unscale_gradients() ran before (fp16). batch: with verify_loss,
        the first step's batch, checked by nanogns.verify (the step's gradients are left as they are)."""
        if self.verify_loss is not None and self.verification is None:
            if batch is None:
                raise SettingNotValid(
                    "AccelerateGNS(verify_loss=...): pass the first step's batch, monitor.step(batch=batch)"
                )
            self.verification = verify(
                self.monitor.model, batch, self.verify_loss, show=self.accelerator.is_main_process
            )
        if not self.accelerator.sync_gradients:
            raise CallNotValid(
                "AccelerateGNS.step() inside accelerator.accumulate() before the step's last "
                "micro-batch: its gradients are not complete (nor averaged over the ranks); call it "
                "under `if accelerator.sync_gradients:`"
            )
        row = self.monitor.step(gradients_unscaled=gradients_unscaled)
        if self.log is not None:
            self.log.log({"iter_num": self.steps})
            self.log.step()
        self.accelerator.log({"gns": row["gns"]}, step=self.steps)
        self.steps += 1
        return row

    def __enter__(self) -> "AccelerateGNS":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Write log.csv and release the directory (also done at exit; safe to repeat)."""
        log, lock, self.log, self.lock = self.log, self.lock, None, None
        _close_log(self.monitor, log, lock)


# -----------------------------------------------------------------------------
# the per-sequence-mean loss (docs/log-format.md's definition) for a causal LM


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy (B,) (labels shifted by one, as transformers' causal LM losses;
    `ignore_index` labels are not counted). A sequence with no label has 0.

    Args:
        logits: (B, T, V); labels: (B, T) token ids, ignore_index where no loss is wanted.
    """
    logits, labels = logits[:, :-1], labels[:, 1:]
    token_losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="none"
    ).view(labels.shape)
    tokens = labels.ne(ignore_index).sum(1).clamp(min=1)  # (B,)
    return token_losses.sum(1) / tokens


def sequence_mean_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean over the sequences of each sequence's mean next-token cross-entropy (sequence_losses)."""
    return sequence_losses(logits, labels, ignore_index).mean()


def causal_lm_losses(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A per_example_loss for nanogns.verify (and the trainers' verify_loss): each sequence's mean next-token loss
    of a causal LM called with the batch's input_ids, attention_mask and position_ids (labels: the batch's, else
    the input ids)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    return sequence_losses(model(**inputs).logits, labels)
