"""Goodput: each attempt's events (records.py), the run's time split into goodput and named
badput from them (account.py), their history beside the mirror (history.py), the timeline
(plot.py) and the checkpoint cadence chosen from the measured cost (cadence.py)."""
