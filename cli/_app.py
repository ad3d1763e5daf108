"""What the three commands share: the app factory, the error-to-exit-code runner, output helpers.

Typer/click would print a traceback for an unexpected exception and exit 2 on a usage error,
which collides with the health code "critical". `run` maps every failure to one stderr line and
the documented exit code (see `gpuguard.foundation.errors`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer

try:  # typer >= 0.24 vendors click; older releases depend on it
    from typer import _click as click
except ImportError:  # pragma: no cover - depends on the installed typer
    import click  # type: ignore[no-redef]

from gpuguard import __version__
from gpuguard.foundation.env import DEBUG_ENV, JOB_DIR_ENV
from gpuguard.foundation.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_USAGE,
    GpuguardError,
    from_os_error,
)


def make_app(name: str, help_text: str) -> typer.Typer:
    """A Typer app with `--version` and no shell-completion install flags (we ship our own)."""
    from gpuguard.cli._fastparams import install as install_fast_params

    install_fast_params()  # plain options without a pydantic import on every run
    app = typer.Typer(
        name=name,
        help=help_text,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    def _version(value: bool) -> None:
        if value:
            typer.echo(f"{name} {__version__}")
            raise typer.Exit(EXIT_OK)

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        pass

    return app


def fail(message: str, code: int) -> NoReturn:
    """Raise the one-line error for the runner to print."""
    raise GpuguardError(message, exit_code=code)


def run(app: typer.Typer, prog: str, argv: list[str] | None = None) -> int:
    """Run a Typer app; return its exit code. Never lets a traceback reach the user."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `gpu-doctor`: show the help
            print(exc.format_message(), file=sys.stderr)
            return EXIT_USAGE
        msg = exc.format_message()
        if exc.ctx is not None:
            msg = f"{msg} (try '{exc.ctx.command_path} --help')"
        print(f"{prog}: usage error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except click.exceptions.ClickException as exc:
        print(f"{prog}: error: {exc.format_message()}", file=sys.stderr)
        return EXIT_USAGE
    except typer.Exit as exc:
        return int(getattr(exc, "exit_code", getattr(exc, "code", EXIT_OK)) or EXIT_OK)
    except (typer.Abort, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GpuguardError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # `gpu-doctor logs big.log | head`: not an error worth a line.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's flush
        except OSError:
            pass
        return 0
    except OSError as exc:
        err = from_os_error(exc, exc.filename or "I/O")
        print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as exc:  # a bug: one line, the traceback only on request
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc} (set GPUGUARD_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return EXIT_SOFTWARE
    if isinstance(rv, int):
        return rv
    return 0


def entry(app: typer.Typer, prog: str) -> Callable[[], NoReturn]:
    """A console-script entry point for `app`."""

    def _main() -> NoReturn:
        sys.exit(run(app, prog))

    return _main


def emit_json(document: dict[str, Any]) -> None:
    """Write one JSON document to stdout. Every document carries its `schema` name and version."""
    if "schema" not in document:
        raise ValueError("JSON documents must carry a schema name")
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def console(stderr: bool = False):  # -> rich.console.Console, imported lazily
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def job_dir_option(required: bool = True) -> Any:
    """The shared `--job-dir` option (falls back to $GPUGUARD_JOB_DIR)."""
    return typer.Option(
        None if not required else ...,
        "--job-dir",
        envvar=JOB_DIR_ENV,
        help=f"Job directory (ledger, key, records, snapshots, audit log). Default: ${JOB_DIR_ENV}.",
        show_envvar=True,
        callback=_real_job_dir,
    )


def _real_job_dir(value: Path | None) -> Path | None:
    """The job dir the operator named, its links followed once here; nothing inside it is followed."""
    return None if value is None else Path(os.path.realpath(value))
