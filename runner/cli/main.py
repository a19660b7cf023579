"""`runner` entry point: a lazy click group and the one place errors become exit codes."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import NoReturn

import click

from runner import __version__
from runner.cli.options import finite_float_type
from runner.errors import EXIT_FAILURE, EXIT_USAGE, RunnerError
from runner.preemption.exiting import exit_process

# name -> "module:attribute"; importing lazily keeps `runner --help` fast (no torch import).
COMMANDS: dict[str, str] = {
    "demo": "runner.cli.demo_cmd:demo",
    "drill": "runner.cli.demo_cmd:drill",
    "run": "runner.cli.run_cmd:run",
    "ls": "runner.cli.checkpoint_cmds:ls",
    "verify": "runner.cli.checkpoint_cmds:verify",
    "inspect": "runner.cli.checkpoint_cmds:inspect",
    "convert": "runner.cli.transform_cmds:convert",
    "fork": "runner.cli.transform_cmds:fork",
    "goodput": "runner.cli.goodput_cmd:goodput",
    "prune": "runner.cli.transform_cmds:prune",
    "pivot": "runner.cli.sidecar_cmds:pivot",
    "push": "runner.cli.transfer_cmds:push",
    "pull": "runner.cli.transfer_cmds:pull",
    "repair": "runner.cli.repair_cmd:repair",
    "status": "runner.cli.status_cmd:status",
}


# Commands that hand SIGTERM/SIGINT/SIGUSR1 to a StopController (install_signal_handlers):
# the signals recorded since the process started are theirs. Every other command gets the
# default dispositions back (Ctrl-C / SIGTERM end `runner ls` as they always did).
STOP_AWARE = frozenset({"demo", "run"})


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if name not in STOP_AWARE:
            from runner.preemption import early

            if early.early_handlers_installed():
                early.release_early()
        return name, command, rest

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command)  # programming error, not input
        with_env_defaults(command)
        return command


# Eager options that answer and exit before anything runs: read from the environment they
# would hijack every command (RUNNER_VERSION is a common CI variable name).
NO_ENV_OPTIONS = frozenset({"help", "version"})


def with_env_defaults(command: click.Command) -> click.Command:
    """Every option is also read from RUNNER_<OPTION> (DESIGN.md, CLI): options that do not
    name their variable get the default one, so no command can forget it. Every float option
    also rejects nan and inf, which pass click's float parsing and every `> 0` check."""
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        param.type = finite_float_type(param.type)
        if param.name in NO_ENV_OPTIONS:
            param.envvar = None
            param.show_envvar = False
            continue
        if param.envvar is None:
            long_names = [o for o in param.opts if o.startswith("--")]
            if not long_names:
                continue
            option = max(long_names, key=len)[2:]
            param.envvar = f"RUNNER_{option.replace('-', '_').upper()}"
        param.show_envvar = True
    return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spot-runner")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Run training on spot / preemptible machines without losing work."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("runner").setLevel(min(level, logging.INFO))


with_env_defaults(cli)


def main(argv: list[str] | None = None) -> NoReturn:
    """The `runner` command. Called without argv it owns the process (console script,
    `python -m runner`, both through runner.entry, which records signals from the first
    instant): it ignores repeated signals once the command returned and exits on time even
    with an upload thread stuck after a stop; with argv (embedding, tests) it raises
    SystemExit as usual and leaves signal handling alone."""
    if argv is None:
        from runner.preemption import early

        if not early.early_handlers_installed():  # entered through an old console script
            early.install_early_handlers()
        code = _run(argv)
        # The code is decided: a SIGTERM from here on (Kubernetes and systemd repeat them,
        # operators press Ctrl-C twice) is recorded and ignored instead of killing us.
        early.ignore_late()
        exit_process(code)
    sys.exit(_run(argv))


def _run(argv: list[str] | None) -> int:
    try:
        # without standalone mode click returns (not raises) the code of a ctx.exit(n)
        returned = cli.main(args=argv, prog_name="runner", standalone_mode=False)
    except SystemExit as exc:  # a command's sys.exit(code)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        click.echo(exc.code, err=True)
        return EXIT_FAILURE
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return EXIT_FAILURE
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE if exc.exit_code == 2 else exc.exit_code
    except RunnerError as exc:
        click.echo(f"runner: error: {exc}", err=True)
        return exc.exit_code
    return returned if isinstance(returned, int) else 0
