"""The layering in pyproject.toml ([tool.importlinter]) holds: layers point one way, type-only
imports included, and no two sibling modules or packages import each other in a cycle."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports")
    assert lint_imports, "lint-imports is missing: pip install -e '.[test]'"
    done = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout, done.stdout
