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


# The tests that build or run images share one Docker engine and its image tags: under
# pytest-xdist they run on one worker, one after another (tests/fixtures/docker.py).
DOCKER_FIXTURES = frozenset(
    {"docker_engine", "docker_base_image", "docker_pep668_base_image", "runner_image",
     "runner_image_venv_base"}
)  # fmt: skip


# first: pytest-xdist's worker reads the groups in its own hook of the same name
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith("tests/e2e/") or item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.slow)
        # `-n N` (README) hands whole groups to a worker (--dist loadgroup): a module's tests
        # stay together with its module-scoped fixtures; Docker's all go to one worker
        docker = not DOCKER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
        group = "docker" if docker else item.nodeid.partition("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
