"""
The reference implementation's `gnstracking` module, kept as a face over the nanogns package: what reads a
step's per-example norms. GNSMonitor (nanogns/monitor/monitor.py) is the one object new code uses;
MeasurementTracker and AccumulateMeasurements (nanogns/monitor/reference.py) are the reference's API over it.
"""

from nanogns.monitor import (  # noqa: F401
    AccumulateMeasurements,
    GNSMonitor,
    Measurement,
    MeasurementTracker,
    describe_tracked,
    find_tracked_parameters,
)
from nanogns.runlog.record import PARAMETERS_JSON  # noqa: F401
