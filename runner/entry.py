"""The console script and `python -m runner`: signal handlers first, everything else after.

Kept tiny on purpose: until `install_early_handlers` has run, a SIGTERM kills the process
(the default action), so nothing is imported before it but the package and the recorder.
"""

from __future__ import annotations

from typing import NoReturn


def main() -> NoReturn:
    from runner.preemption.early import install_early_handlers

    install_early_handlers()
    from runner.cli.main import main as cli_main

    cli_main()
