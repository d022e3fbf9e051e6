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
This module is a face: it keeps the reference's names (big_batch_norm, small_batch_norm, zero_sqgradnorm_buffers),
which the package calls norm, rms_pe_norm and zero_pe_sqnorm_buffers (docs/architecture.md's glossary).
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from nanogns.errors import NotSupported
from nanogns.monitor import tracked
from nanogns.monitor.monitor import GNSMonitor


@dataclasses.dataclass
class Measurement:
    """The reference's Measurement: one parameter's norms for one step, as a big batch (B examples) against a small
    one (1 example, or one rank's examples under its DDP block): `big_batch_norm` = ||grad||, `small_batch_norm` =
    sqrt(mean ||small-batch gradient||^2). `metadata["name"]` is the name in `model.named_parameters()`."""

    big_batch_norm: float
    small_batch_norm: float
    big_batch_size: int
    small_batch_size: int = 1
    metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, measurement: tracked.Measurement) -> "Measurement":
        """The reference's form of the monitor's Measurement (a per-example one: small batches of one example)."""
        return cls(measurement.norm, measurement.rms_pe_norm, measurement.batch_size, 1, dict(measurement.metadata))

    def msg(self, prefix=""):
        """The scalar fields as a flat dict, for a logger."""
        return {prefix + k: v for k, v in dataclasses.asdict(self).items() if k != "metadata"}


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
            raise NotSupported(
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
        measurements = [Measurement.of(m) for m in self.monitor.measure(batch_size)]
        for measurement in measurements:
            for callback in self.callbacks:
                callback(measurement)
        return measurements
