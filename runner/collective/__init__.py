"""The ranks' own channel under torchrun: agree, broadcast, all_gather, barrier on a dedicated
gloo group; `SINGLE` for a process alone."""

from runner.collective.group import SINGLE, Group, dedicated_group

__all__ = ["SINGLE", "Group", "dedicated_group"]
