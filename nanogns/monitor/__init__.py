"""
What reads a training step's per-example norms: GNSMonitor (monitor.py) and its parts, the cross-rank GNS
under DDP (ddp.py), and the reference implementation's API over them (reference.py).
"""
