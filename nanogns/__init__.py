"""
nanogns: exact per-example gradient norms, and the gradient noise scale (GNS) made of them, for PyTorch models.

    from nanogns import convert, LogWrapper
    log = LogWrapper(out_dir="out-mymodel")
    monitor = convert(model, log=log)       # the model's layers record per-example norms; the monitor reads them
    ...backward of every micro-batch...
    monitor.step(batch_size=B)              # before clipping: one CSV row per optimizer step
    # then: python gns-analysis.py out-mymodel  (or nanogns.analysis.analyze.analyze_gns)

The package, in the order one step's data flows through it (README, "Architecture"):
    kernels/      Triton kernels (gradients and per-example norms in one pass)
    layers/       one module per layer kind, the registry, row maps (which example each row is), buffers
    monitor/      GNSMonitor: a step's read, the running GNS, the record of what each parameter is
    conversion/   convert(model): a finished model's layers made per-example norm layers, checked by probes
    engines.py    one process, DDP or FSDP2 (train.py); schedules.py: batch-size schedules and the controller
    integrations  transformers.Trainer, Lightning and Accelerate
    runlog/       the CSV log: writer (LogWrapper) and reader (load_csv); no torch
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
    "LayerConfig": "nanogns.layers.choice",
    "config": "nanogns.layers.choice",
    "get_layer_class": "nanogns.layers.choice",
    "layer_classes": "nanogns.layers.choice",
    "set_contextual_config": "nanogns.layers.choice",
    "tracks_per_example_norms": "nanogns.layers.choice",
    "zero_sqgradnorm_buffers": "nanogns.layers.buffers",
    "LogWrapper": "nanogns.runlog.writer",
    "load_csv": "nanogns.runlog.reader",
    "RunningGNS": "nanogns.estimator",
    "BatchSizeController": "nanogns.schedules",
    "analyze_gns": "nanogns.analysis.analyze",
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
