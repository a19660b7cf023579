"""Temporary names: every file or directory that is not yet (or no longer) committed is named
with this prefix, so listings, verification and the mirror skip it and stale-file cleanup
finds it."""

from __future__ import annotations

TMP_PREFIX = ".tmp-"
