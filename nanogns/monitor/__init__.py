"""
What reads a training step's per-example norms, in the order a step's data flows:

    tracked.py    which parameters are tracked and what each is (find_tracked_parameters, Measurement)
    reader.py     a step's numbers in a handful of ops (BufferTable, StepReader)
    monitor.py    GNSMonitor: the one object a training loop makes (read, zero, running GNS, log row)
    ddp.py        the cross-rank GNS under DDP (ddp/ columns), with no per-example layers
    reference.py  the reference implementation's MeasurementTracker and AccumulateMeasurements, over GNSMonitor
"""

from nanogns.monitor.monitor import APPROX_PREFIX, GNSMonitor  # noqa: F401
from nanogns.monitor.reader import BufferTable, StepReader, buffer_table  # noqa: F401
from nanogns.monitor.reference import AccumulateMeasurements, MeasurementTracker  # noqa: F401
from nanogns.monitor.tracked import (  # noqa: F401
    Measurement,
    describe_tracked,
    find_tracked_parameters,
    summed_squares,
)
