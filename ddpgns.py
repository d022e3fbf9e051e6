"""
The reference implementation's `ddpgns` module, kept as a face over the nanogns package: the cross-rank GNS
under DDP (nanogns/monitor/ddp.py).
"""

from nanogns.monitor.ddp import DDPGradientStatsHook, GradientNoiseScale  # noqa: F401
