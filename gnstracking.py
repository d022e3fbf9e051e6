"""
The reference implementation's `gnstracking` module, kept as a face over the nanogns package: what reads a
step's per-example norms. GNSMonitor (nanogns/monitor/monitor.py) is the one object new code uses;
MeasurementTracker and AccumulateMeasurements (nanogns/monitor/reference.py) are the reference's API over it.
"""

from nanogns.monitor import (  # noqa: F401
    AccumulateMeasurements,
    GNSMonitor,
    MeasurementTracker,
    describe_tracked,
    find_tracked_parameters,
)
from nanogns.monitor.reference import Measurement  # noqa: F401  (the reference's fields: big_batch_norm, ...)
from nanogns.runlog.record import PARAMETERS_JSON  # noqa: F401
