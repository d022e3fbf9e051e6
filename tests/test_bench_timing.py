"""
bench/timing.py, the --threads and --clock every timing benchmark takes: the clock named is the one timed by, and
--threads sets torch's CPU threads (0 leaves them).

    python -m pytest -q tests/test_bench_timing.py
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import timing  # noqa: E402


def test_the_clock_named_is_the_clock_timed_by_and_threads_are_set_only_when_asked():
    parser = argparse.ArgumentParser()
    timing.add_options(parser)
    threads = torch.get_num_threads()
    try:
        assert timing.apply(parser.parse_args([])) is time.perf_counter  # wall clock, torch's own threads
        assert torch.get_num_threads() == threads
        assert timing.apply(parser.parse_args(["--clock=cpu", "--threads=1"])) is time.process_time
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_quartiles_are_the_first_and_third_quartiles_around_the_median_and_one_value_stands_for_all():
    assert timing.quartiles([1.0, 4.0, 2.0, 3.0, 5.0]) == (1.5, 3.0, 4.5)  # statistics.quantiles' exclusive method
    assert timing.quartiles([1.25]) == (1.25, 1.25, 1.25)
