"""The short import paths of the in-process API (the README's example uses them): each is a
lazy PEP 562 re-export of the class or function where it is defined, and importing a package
alone loads none of them (no torch; runner.preemption imports nothing at all, its `early`
recorder must load before anything else)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

PUBLIC = [
    ("runner.session", "TrainSession", "runner.session.train_session"),
    ("runner.session", "TrainState", "runner.session.capture"),
    ("runner.state", "ModuleTrainState", "runner.state.train_state"),
    ("runner.state", "ResumableSampler", "runner.state.sampler"),
    ("runner.state", "Counters", "runner.state.counters"),
    ("runner.preemption", "StopController", "runner.preemption.stop"),
    ("runner.preemption", "install_signal_handlers", "runner.preemption.signals"),
    ("runner.preemption", "exit_process", "runner.preemption.exiting"),
]


@pytest.mark.parametrize(("package", "name", "home"), PUBLIC)
def test_each_short_path_is_the_defining_modules_object(package: str, name: str, home: str) -> None:
    short = getattr(importlib.import_module(package), name)
    assert short is getattr(importlib.import_module(home), name)
    assert short.__module__ == home
    assert name in importlib.import_module(package).__all__
    assert name in dir(importlib.import_module(package))


@pytest.mark.parametrize("package", sorted({p for p, _, _ in PUBLIC}))
def test_all_names_exactly_the_public_ones(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(n for p, n, _ in PUBLIC if p == package)
    missing = "Nope"
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'Nope'"):
        getattr(module, missing)


def test_submodules_still_import_through_the_package() -> None:
    from runner.preemption import early
    from runner.state import rng

    assert early.__name__ == "runner.preemption.early"
    assert rng.__name__ == "runner.state.rng"


def _loaded_by(package: str) -> list[str]:
    """The modules `import package` loads in a fresh interpreter after `import runner`."""
    probe = (
        "import sys, runner; before = set(sys.modules); "
        f"import {package}; print(sorted(set(sys.modules) - before))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(ast.literal_eval(done.stdout))


@pytest.mark.parametrize("package", ["runner.session", "runner.state", "runner.preemption"])
def test_importing_a_package_alone_loads_only_itself(package: str) -> None:
    assert _loaded_by(package) == [package]  # no torch, no checkpoint code, no submodule


@pytest.mark.slow
def test_the_readme_imports_load_torch_only_when_a_name_is_used() -> None:
    probe = (
        "import sys; import runner.session, runner.state, runner.preemption; "
        "print('torch' in sys.modules); from runner.session import TrainSession; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]
