"""Shared pytest set-up: every module in tests/fixtures/ is loaded as a plugin, and every
end-to-end test (tests/e2e/, or marked e2e) is in the slow tier; `python -m pytest -m "not
slow"` is the fast one. Elsewhere a test that takes a second or more is marked slow itself."""

from pathlib import Path

import pytest

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith("tests/e2e/") or item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.slow)
