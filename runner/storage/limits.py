"""Time limits of store calls, in one place (docs/storage.md, "Time limits")."""

from __future__ import annotations

DEFAULT_STORE_TIMEOUT_S = 60.0
"""How long a store call keeps trying while the store fails or does not answer."""
MAX_STORE_TIMEOUT_S = 86_400.0
"""A day: a longer store timeout is a typo, not a setting."""
MIN_STORE_TIMEOUT_S = 1.0
