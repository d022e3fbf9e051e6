"""
nanogns: exact per-example gradient norms, and the gradient noise scale (GNS) made of them, for PyTorch models.

    from nanogns import convert, LogWrapper
    log = LogWrapper(out_dir="out-mymodel")
    monitor = convert(model, log=log)       # the model's layers record per-example norms; the monitor reads them
    ...backward of every micro-batch...
    monitor.step(batch_size=B)              # before clipping: one CSV row per optimizer step
    # then: nanogns-analysis out-mymodel  (or nanogns.analyze_gns("out-mymodel"))

The package, from the top of its import layers down (docs/architecture.md):
    integrations  transformers.Trainer, Lightning and Accelerate
    verification  verify(model, batch, per_example_loss): the monitor's numbers against each example's own gradient
    engines.py    one process, DDP or FSDP2 (train.py); schedules.py: batch-size schedules and the controller
    conversion/   convert(model): a finished model's layers made per-example norm layers, checked by probes
    monitor/      GNSMonitor: a step's read, the running GNS, the record of what each parameter is
    kinds/        one module per layer kind, declaring all its variants, listed in KINDS; the classes model.py builds with
    variants/     the fused variant's Triton glue and SOGNS's approximate norms
    core/         what every kind shares: LayerKind, row maps (which example each row is), the pass, buffers, summed uses
    kernels/      Triton kernels (gradients and per-example norms in one pass)
    runlog/       the CSV log: writer (LogWrapper) and reader (load_csv); no torch
    errors.py     what the package raises when it refuses (NanoGNSError and its kinds); it never exits the process
    estimator.py  the GNS maths; no torch
    analysis/     the GNS from a run's log: summary, groups, plots, figures; no torch

The names below are loaded when first used, so that `import nanogns.analysis` (or the log reader) works where
torch is not installed.
"""

import importlib

__version__ = "0.3.0"

_EXPORTS = {
    "convert": "nanogns.conversion.convert",
    "GNSMonitor": "nanogns.monitor.monitor",
    "Measurement": "nanogns.monitor.monitor",
    "MeasurementTracker": "nanogns.monitor.reference",
    "AccumulateMeasurements": "nanogns.monitor.reference",
    "LayerConfig": "nanogns.kinds.choice",
    "config": "nanogns.kinds.choice",
    "get_layer_class": "nanogns.kinds.choice",
    "layer_classes": "nanogns.kinds.choice",
    "set_contextual_config": "nanogns.kinds.choice",
    "tracks_per_example_norms": "nanogns.kinds.choice",
    "zero_pe_sqnorm_buffers": "nanogns.core.buffers",
    "verify": "nanogns.verification",
    "Verification": "nanogns.verification",
    "LogWrapper": "nanogns.runlog.writer",
    "load_csv": "nanogns.runlog.reader",
    "RunningGNS": "nanogns.estimator",
    "BatchSizeController": "nanogns.schedules",
    "analyze_gns": "nanogns.analysis.analyze",
    "NanoGNSError": "nanogns.errors",
    "DirectoryInUse": "nanogns.errors",
    "DirectoryHoldsAnotherRun": "nanogns.errors",
    "WriteFailed": "nanogns.errors",
    "LogNotContinuable": "nanogns.errors",
    "CheckpointNotUsable": "nanogns.errors",
    "StepNotMeasured": "nanogns.errors",
    "LogNotUsable": "nanogns.errors",
    "LogNotFound": "nanogns.errors",
    "DataNotUsable": "nanogns.errors",
    "SettingNotValid": "nanogns.errors",
    "NotSupported": "nanogns.errors",
    "CallNotValid": "nanogns.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanogns' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
