"""The layering in pyproject.toml ([tool.importlinter]) holds: layers point one way, type-only
imports included, and no two sibling modules or packages import each other in a cycle. The
check can fail (an upward import in a copy of the package breaks it), and the test tree keeps
its shared helpers in tests/fixtures/: no test module imports another."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# tests.<pkg>.test_x or tests.test_x: a test module, never a place to import helpers from
TEST_MODULE = re.compile(r"^tests(\.[A-Za-z_0-9]+)*\.test_[A-Za-z_0-9]*$")


def _lint_imports() -> str:
    lint_imports = shutil.which("lint-imports")
    assert lint_imports, "lint-imports is missing: pip install -e '.[test]'"
    return lint_imports


def test_import_contracts_are_kept() -> None:
    done = subprocess.run(
        [_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout, done.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    """The same contracts on a copy of the package with one upward import (storage -> cli):
    lint-imports must fail and name the layers contract and the offending import."""
    shutil.copytree(ROOT / "runner", tmp_path / "runner", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    base = tmp_path / "runner" / "storage" / "base.py"
    source = base.read_text()
    anchor = "from runner.errors import IntegrityError, StorageError\n"
    assert anchor in source
    base.write_text(source.replace(anchor, anchor + "import runner.cli.main  # noqa: F401\n"))

    done = subprocess.run(
        [_lint_imports(), "--no-cache", "--config", str(tmp_path / "pyproject.toml")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Layers point one way BROKEN" in out, out
    assert "runner.storage.base -> runner.cli.main" in out, out
    assert re.search(r"Contracts: \d+ kept, [12] broken\.", out), out


def _imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in `source`, a module of `package`, relative
    ones resolved; for `from X import a, b` both X and X.a, X.b (a name may be a module)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{parent}.{module}" if module else parent
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parts[:-1])


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in _imported_modules(path.read_text(), _package_of(path))
        if TEST_MODULE.match(module)
    ]
    assert offenders == [], "shared helpers belong in tests/fixtures/:\n" + "\n".join(offenders)


@pytest.mark.slow
def test_the_import_scan_finds_test_module_imports() -> None:
    """The scan above can fail: each way of importing a test module is caught (the source
    is scanned as if it were a module of tests/cli/)."""
    lines = [
        "from tests.mirror.test_mirror import make_checkpoint",
        "import tests.cli.test_mirror_cli",
        "from tests.cli import test_mirror_cli",
        "from .test_metrics_cli import scrape",
        "from tests.fixtures.ckpt import make_checkpoint",
    ]
    scanned = _imported_modules("\n".join(lines) + "\n", "tests.cli")
    found = [module for _, module in scanned if TEST_MODULE.match(module)]
    assert found == [
        "tests.mirror.test_mirror",
        "tests.cli.test_mirror_cli",
        "tests.cli.test_mirror_cli",
        "tests.cli.test_metrics_cli",
    ]
