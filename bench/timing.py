"""
How the timing benchmarks take their clock, all alike: `--threads` (torch's CPU threads; 0 leaves torch's own
choice) and `--clock` (wall: the elapsed time a user waits for; cpu: the process's CPU time, which with
--threads=1 is the compute alone, whatever else the machine runs).

    import timing
    timing.add_options(parser)
    args = parser.parse_args()
    clock = timing.apply(args)   # sets torch's threads; time.perf_counter or time.process_time
    q1, median, q3 = timing.quartiles(ratios)
"""

import statistics
import time

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_options(parser):
    """Add --threads and --clock to an argparse parser."""
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: 0, torch's own choice)")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=list(CLOCKS),
        help="wall: elapsed time (default); cpu: the process's CPU time, with --threads=1 the compute alone, "
        "whatever else the machine runs",
    )


def apply(args):
    """Set torch's CPU threads from args.threads (0: leave them) and return args.clock's timer."""
    if args.threads:  # one thread: no parallel region waits for a core another job holds (a shared machine)
        torch.set_num_threads(args.threads)
    return CLOCKS[args.clock]


def quartiles(values):
    """(first quartile, median, third quartile) of `values`, as the benchmarks print a ratio over rounds; all three
    the one value when there is one."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]
