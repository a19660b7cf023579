"""Preemption: stop requests, signal handlers and cloud preemption notices.

Empty on purpose: `early` is imported while the process is still starting (runner/entry.py),
before anything but `signal` and `time` may load.
"""
