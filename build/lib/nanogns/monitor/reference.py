"""
The reference implementation's measurement API (CerebrasResearch/nanoGNS `exact/`), kept so that code written
against it runs unchanged:

    accumulate_gns = AccumulateMeasurements(prefix="train/gns/")
    gns_tracker = MeasurementTracker.from_model(model, callback=accumulate_gns, scaler=scaler)
    ...backward of every micro-batch...
    gns_tracker.step(batch_size=B)          # each tracked parameter's Measurement goes to the callbacks
    zero_sqgradnorm_buffers(model)          # the reference zeroes the buffers itself, after the read
    tracker.log(accumulate_gns.get_msg())   # {"train/gns/<param>/norm", "/pegn", "/batch_size"}

Both are thin over GNSMonitor (monitor.py), which reads, zeroes and logs in one call and is what new code uses.
"""

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from nanogns.monitor.monitor import GNSMonitor, Measurement

MeasurementCallback = Callable[[Measurement], object]


class AccumulateMeasurements:
    """A callback that collects one step's Measurements as log columns `<prefix><param>/norm`, `/pegn` and
    `/batch_size`; `get_msg()` hands them over and starts again."""

    def __init__(self, prefix: str = "train/gns/"):
        self.prefix = prefix
        self.columns: Dict[str, float] = {}

    def __call__(self, measurement: Measurement) -> None:
        key = self.prefix + measurement.metadata["name"]
        self.columns[key + "/norm"] = measurement.big_batch_norm
        self.columns[key + "/pegn"] = measurement.small_batch_norm
        self.columns[key + "/batch_size"] = measurement.big_batch_size

    def get_msg(self) -> Dict[str, float]:
        columns, self.columns = self.columns, {}
        return columns


class MeasurementTracker:
    """Reads a model's per-example norms once per optimizer step and gives each tracked parameter's Measurement to
    the callbacks. Unlike GNSMonitor it leaves the buffers as they are: call `zero_sqgradnorm_buffers(model)` after
    `step`, as the reference's train.py does. It reads one process's examples, so under torch.distributed use
    GNSMonitor, which every rank calls."""

    def __init__(self, monitor: GNSMonitor, callbacks: Sequence[MeasurementCallback] = ()):
        self.monitor = monitor
        self.callbacks = list(callbacks)

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        callback: Union[None, MeasurementCallback, List[MeasurementCallback]] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> "MeasurementTracker":
        """A tracker of every trainable parameter of `model` whose layer records per-example norms."""
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            raise ValueError(
                "MeasurementTracker reads the examples of one process; under torch.distributed use "
                "gnstracking.GNSMonitor(model, log=...) and call its step() on every rank"
            )
        callbacks = [] if callback is None else list(callback) if isinstance(callback, (list, tuple)) else [callback]
        return cls(GNSMonitor(model, scaler=scaler), callbacks)

    @property
    def tracked(self):
        return self.monitor.tracked

    @property
    def skipped(self) -> Dict[str, str]:
        """{parameter: why it is not tracked}."""
        return self.monitor.untracked

    def step(self, batch_size: int) -> List[Measurement]:
        """Measure this step (B = batch_size examples over every micro-batch) and call the callbacks with each
        Measurement; returns them. A step the GradScaler will skip gives none."""
        measurements = self.monitor.measure(batch_size)
        for measurement in measurements:
            for callback in self.callbacks:
                callback(measurement)
        return measurements
