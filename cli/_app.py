"""What the three commands share: the app factory, the error-to-exit-code runner, output helpers.

Typer/click would print a traceback for an unexpected exception and exit 2 on a usage error,
which collides with the health code "critical". `run` maps every failure to one stderr line and
the documented exit code (see `gpuguard.foundation.errors`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gpuguard import __version__
from gpuguard.foundation.env import DEBUG_ENV, JOB_DIR_ENV
from gpuguard.foundation.errors import (
    EXIT_INTERRUPTED,
    EXIT_IOERR,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_USAGE,
    GpuguardError,
    from_os_error,
)

if TYPE_CHECKING:
    import typer

# typer (and the click it vendors) is imported by the functions that build or run an app, never at
# module level: `cli._fast` runs `gpu-doctor logs` and `diagnose node` through this module's runner
# and output helpers without it (start-up time).


def _click() -> Any:
    """The click typer uses (typer >= 0.24 vendors it; older releases depend on it)."""
    try:
        from typer import _click as click
    except ImportError:  # pragma: no cover - depends on the installed typer
        import click  # type: ignore[no-redef]
    return click


def make_app(name: str, help_text: str) -> typer.Typer:
    """A Typer app with `--version` and no shell-completion install flags (we ship our own)."""
    import typer

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
        debug: bool = typer.Option(
            False, "-v", "--debug", help=f"Show the traceback of an internal error (also ${DEBUG_ENV}=1)."
        ),
    ) -> None:
        if debug:
            os.environ[DEBUG_ENV] = "1"  # this run, and the commands it starts (runbook steps)

    @app.command("completion")
    def _completion(
        shell: str = typer.Argument(..., metavar="bash|zsh|fish", help="The shell to print the completion for."),
    ) -> None:
        """Print the shell completion script (install: see the examples)."""
        from importlib import resources

        if shell not in COMPLETION_SHELLS:
            raise GpuguardError(
                f"completion {shell!r}: expected one of {', '.join(COMPLETION_SHELLS)}", exit_code=EXIT_USAGE
            )
        sys.stdout.write(resources.files("gpuguard.completions").joinpath(f"{name}.{shell}").read_text())

    return app


COMPLETION_SHELLS = ("bash", "zsh", "fish")


def fail(message: str, code: int) -> NoReturn:
    """Raise the one-line error for the runner to print."""
    raise GpuguardError(message, exit_code=code)


class OutputError(GpuguardError):
    """Standard output could not be written (a full disk, an I/O error): exit 74."""

    exit_code = EXIT_IOERR


class _GuardedStdout:
    """sys.stdout for one command run: a reader that went away (`| head`) silences the rest of the
    output and the command still ends with its verdict's exit code; any other write error is one
    `OutputError` (74) instead of a traceback or a verdict printed nowhere."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.reader_gone = False

    @property
    def wrapped(self) -> Any:
        """The stream this one guards (put back when the command ends)."""
        return self._inner

    def _gone(self) -> None:
        self.reader_gone = True
        try:  # the interpreter's own flush at exit must not complain either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text: str) -> int:
        if self.reader_gone:
            return len(text)
        try:
            return int(self._inner.write(text))
        except BrokenPipeError:
            self._gone()
            return len(text)
        except OSError as exc:
            raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None

    def flush(self) -> None:
        if self.reader_gone:
            return
        try:
            self._inner.flush()
        except BrokenPipeError:
            self._gone()
        except OSError as exc:
            raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def run(app: typer.Typer, prog: str, argv: list[str] | None = None) -> int:
    """Run a Typer app; return its exit code. Never lets a traceback reach the user.

    Ctrl-C is 130 with one line; a closed stdout (`| head`) ends quietly with the command's own exit
    code; a failed write to stdout is 74.
    """
    import typer

    command = prepare(typer.main.get_command(app), prog)
    return run_guarded(lambda: _run(command, prog, argv), prog)


def run_guarded(call: Callable[[], int], prog: str) -> int:
    """`call()` with stdout guarded (see `_GuardedStdout`): its exit code, or 74 for a failed write.
    The one runner of the Typer path (`run`) and the fast path (`cli._fast`)."""
    guarded = None
    if sys.stdout is not None and not isinstance(sys.stdout, _GuardedStdout):
        guarded = sys.stdout = _GuardedStdout(sys.stdout)
    try:
        code = call()
        if guarded is not None:
            guarded.flush()
        return code
    except OutputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if guarded is not None and sys.stdout is guarded:
            sys.stdout = guarded.wrapped


def _end_startup() -> None:
    """Ctrl-C is a KeyboardInterrupt again (handled below) once the imports are done (cli/__init__.py)."""
    from gpuguard import cli

    if threading_main() and signal.getsignal(signal.SIGINT) is getattr(cli, "_interrupted_at_startup", None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _Done(Exception):
    """A click-level outcome (usage error, `typer.Exit`, abort) already reported: end with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code


def _run(command: Any, prog: str, argv: list[str] | None) -> int:
    import typer

    click = _click()

    def call() -> Any:
        try:
            return command.main(args=argv, prog_name=prog, standalone_mode=False)
        except click.exceptions.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `gpu-doctor`: show the help
                print(exc.format_message(), file=sys.stderr)
                raise _Done(EXIT_USAGE) from None
            msg = exc.format_message()
            if exc.ctx is not None:
                msg = f"{msg} (try '{exc.ctx.command_path} --help')"
            print(f"{prog}: usage error: {msg}", file=sys.stderr)
            raise _Done(EXIT_USAGE) from None
        except click.exceptions.ClickException as exc:
            print(f"{prog}: error: {exc.format_message()}", file=sys.stderr)
            raise _Done(EXIT_USAGE) from None
        except typer.Exit as exc:
            raise _Done(int(getattr(exc, "exit_code", getattr(exc, "code", EXIT_OK)) or EXIT_OK)) from None
        except typer.Abort:
            raise KeyboardInterrupt from None

    return run_command(call, prog)


def run_command(call: Callable[[], Any], prog: str) -> int:
    """Run one command's function: its int result is the exit code; every failure is one stderr line
    and the documented exit code (the error mapping both the Typer and the fast path share)."""
    try:
        _end_startup()
        rv = call()
    except _Done as done:
        return done.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GpuguardError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # a write that bypassed the guard (a raw fd): `| head` is not an error worth a line
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
            import traceback

            traceback.print_exc(file=sys.stderr)
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc} (-v or GPUGUARD_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return EXIT_SOFTWARE
    if rv == EXIT_INTERRUPTED:  # typer turns Ctrl-C into a silent 130: the one line is ours to say
        print(f"{prog}: interrupted", file=sys.stderr)
    if isinstance(rv, int):
        return rv
    return 0


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def prepare(command: Any, prog: str) -> Any:
    """The click tree as the user sees it: every --help with its examples and its values named."""
    from gpuguard.cli._params import name_values

    return name_values(attach_examples(command, prog))


def attach_examples(command: Any, prog: str) -> Any:
    """Give every command of the tree its `Examples:` epilog from `EXAMPLES` (one table, so every
    --help has examples and a test can check each one names real subcommands and options)."""

    def walk(cmd: Any, path: str) -> None:
        lines = EXAMPLES.get(path)
        if lines and not cmd.epilog:
            cmd.epilog = "\b\nExamples:\n" + "\n".join(f"  {part}" for line in lines for part in example_lines(line))
        for sub_name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {sub_name}")

    walk(command, prog)
    return command


EXAMPLE_WIDTH = 76  # click indents the epilog by 2 and we by 2 more: an example fits 80 columns


def example_lines(line: str, width: int = EXAMPLE_WIDTH) -> list[str]:
    """One example as printed under `Examples:` (click does not reflow it): a `# comment` that does not
    fit beside its command goes on the line above it, and a command longer than `width` is continued
    with ` \\` before an option (copy-pasteable into a shell, never broken inside a quoted argument)."""
    if len(line) <= width:
        return [line]
    command, sep, comment = line.partition("  #")
    out = [f"#{comment}"] if sep else []
    parts: list[str] = []
    for word in command.rstrip().split(" --"):
        if parts and len(parts[-1]) + len(word) + 3 <= width - 2:
            parts[-1] += " --" + word
        else:
            parts.append(word if not parts else "--" + word)
    out += [("    " if i else "") + p + (" \\" if i < len(parts) - 1 else "") for i, p in enumerate(parts)]
    return out


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
    """The rich console of human output. NO_COLOR (https://no-color.org, any value) turns off every
    escape sequence, bold and underline included: rich's own NO_COLOR handling drops colour only."""
    from rich.console import Console

    if os.environ.get("NO_COLOR"):
        return Console(stderr=stderr, highlight=False, color_system=None)
    return Console(stderr=stderr, highlight=False)


def job_dir_option(required: bool = True) -> Any:
    """The shared `--job-dir` option (falls back to $GPUGUARD_JOB_DIR)."""
    import typer

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


# C0 and C1 control characters except tab and newline (ESC starts terminal escape sequences: a log
# line or a dump field must never move the cursor, retitle the window or hide the text after it), and
# the invisible characters that reorder or break what a person reads without being controls: the
# bidirectional marks, embeddings, overrides and isolates (U+202E shows "gnp.exe" as "exe.png"), the
# line and paragraph separators, the byte-order mark
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
_NEWLINE = re.compile("\n")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def safe_text(value: object) -> str:
    """`value` as text with every control and invisible reordering character but tab and newline
    escaped (`\\x1b`, `\\u202e`), for human output. The one escape: every human output goes through
    it (or `safe_line`)."""
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(_escaped, text)


def safe_line(value: object) -> str:
    """`safe_text` for one line of output: a newline is escaped too (`\\x0a`), so a job-provided string
    (a job id, a host, a reason) can never start a line of its own and forge one."""
    return _NEWLINE.sub(_escaped, safe_text(value))


def require_job(job_dir: Path | None) -> Path:
    """The job dir, or one line and 66: see `foundation.jobdir.require_job_dir`."""
    from gpuguard.foundation.jobdir import require_job_dir

    if job_dir is None:
        fail(f"no job directory: pass --job-dir or set ${JOB_DIR_ENV}", EXIT_USAGE)
    return require_job_dir(job_dir)


# Every command's --help ends with examples (issue 15, CLI habits). Keys: the command path as typed.
# tests/cli/test_cli_habits.py checks every command has some and each names real subcommands and options.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "gpu-doctor": (
        "gpu-doctor diagnose node                     # Xid, ECC, NVML on this node",
        "gpu-doctor diagnose job --job-dir /ckpt/job  # is a rank dead or only slow?",
        "gpu-doctor logs /var/log/kern.log            # the GPU events in a log",
        "gpu-doctor completion bash > /etc/bash_completion.d/gpu-doctor",
    ),
    "gpu-doctor diagnose": (
        "gpu-doctor diagnose node --since 2h --json",
        "gpu-doctor diagnose job --job-dir /ckpt/job",
        "gpu-doctor diagnose torchrun --job-dir /ckpt/job",
    ),
    "gpu-doctor diagnose node": (
        "gpu-doctor diagnose node                                  # live NVML and kernel log",
        "gpu-doctor diagnose node --since 2h --format nagios       # for a monitoring check",
        "gpu-doctor diagnose node --kernel-log kern.log --nvml-snapshot snap.json --json",
        "gpu-doctor diagnose node --dump-nvml /tmp/snap.json       # record NVML for a replay",
    ),
    "gpu-doctor diagnose job": (
        "gpu-doctor diagnose job --job-dir /ckpt/job",
        "gpu-doctor diagnose job --job-dir /ckpt/job --log train.log --log-regex 'step (?P<step>\\d+) (?P<step_s>[0-9.]+)s'",
        "gpu-doctor diagnose job --job-dir /ckpt/job --config vote.yaml --json",
    ),
    "gpu-doctor diagnose torchrun": (
        "gpu-doctor diagnose torchrun --job-dir /ckpt/job",
        "gpu-doctor diagnose torchrun --job-dir /ckpt/job --init-timeout 600 --json",
    ),
    "gpu-doctor logs": (
        "gpu-doctor logs /var/log/kern.log",
        "journalctl -k | gpu-doctor logs -             # from stdin",
        "gpu-doctor logs train.log.1.gz --min-severity warning --json",
    ),
    "gpu-doctor contract": (
        "gpu-doctor contract /ckpt/job/traces           # one Flight Recorder dump per rank",
        "gpu-doctor contract dumps/ --world-size 8 --json",
    ),
    "gpu-doctor sweep": (
        "gpu-doctor sweep --textfile /var/lib/node_exporter/gpudoctor.prom   # from cron",
        "gpu-doctor sweep --format npd                                       # node-problem-detector",
        "gpu-doctor sweep --webhook http://alertmanager:9093/api/v2/alerts --drain",
    ),
    "gpu-doctor watch": ("gpu-doctor watch job --job-dir /ckpt/job", "gpu-doctor watch node --format npd"),
    "gpu-doctor watch node": (
        "gpu-doctor watch node --textfile /var/lib/node_exporter/gpudoctor.prom --format npd   # /dev/kmsg + NVML",
        "gpu-doctor watch node --kernel-log /var/log/kern.log --run-drain --node gpu17",
        "journalctl -k -f -o short-iso | gpu-doctor watch node --kernel-log - --json",
    ),
    "gpu-doctor watch job": (
        "gpu-doctor watch job --job-dir /ckpt/job --interval 10",
        "gpu-doctor watch job --job-dir /ckpt/job --count 3 --json",
    ),
    "gpu-doctor plan": (
        "gpu-doctor plan checkpoint --cost 30 --mtbf-hours 5000 --gpus 1024",
        "gpu-doctor plan layout --tp 8 --pp 4 --dp 16 --failed-rank 17",
    ),
    "gpu-doctor plan checkpoint": (
        "gpu-doctor plan checkpoint --cost 30 --mtbf-hours 5000 --gpus 1024",
        "gpu-doctor plan checkpoint --cost 30 --failures-per-hour 0.2 --json",
    ),
    "gpu-doctor plan collective": (
        "gpu-doctor plan collective --ranks 64 --bytes 1e9 --bandwidth 50e9 --latency 5e-6",
    ),
    "gpu-doctor plan layout": ("gpu-doctor plan layout --tp 8 --pp 4 --dp 16 --failed-rank 17 --json",),
    "gpu-doctor picture": (
        "gpu-doctor picture --job-dir /ckpt/job              # heatmap and restart timeline",
        "gpu-doctor picture --job-dir /ckpt/job --export perfetto > trace.json",
        "gpu-doctor picture --job-dir /ckpt/job --plot steps.svg",
    ),
    "gpu-doctor plugins": ("gpu-doctor plugins", "gpu-doctor plugins --json"),
    "gpu-doctor completion": (
        "gpu-doctor completion bash > /etc/bash_completion.d/gpu-doctor",
        "gpu-doctor completion zsh > ~/.zfunc/_gpu-doctor",
    ),
    "gpu-generation": (
        "gpu-generation init --job-dir /ckpt/job",
        "gpu-generation show --job-dir /ckpt/job",
        "gpu-generation verify --job-dir /ckpt/job --deep",
    ),
    "gpu-generation init": (
        "gpu-generation init --job-dir /ckpt/job",
        "gpu-generation init --job-dir /ckpt/job --ledger etcd://etcd1:2379/jobs/llm --timeout 10",
    ),
    "gpu-generation show": (
        "gpu-generation show --job-dir /ckpt/job",
        "gpu-generation show --job-dir /ckpt/job --json",
    ),
    "gpu-generation history": ("gpu-generation history --job-dir /ckpt/job",),
    "gpu-generation verify": (
        "gpu-generation verify --job-dir /ckpt/job",
        "gpu-generation verify --job-dir /ckpt/job --generation 3 --deep --json",
    ),
    "gpu-generation explain": (
        "gpu-generation explain --job-dir /ckpt/job",
        "gpu-generation explain --job-dir /ckpt/job --all --json",
    ),
    "gpu-generation bench": ("gpu-generation bench transitions",),
    "gpu-generation bench transitions": (
        "gpu-generation bench transitions --json",
        "gpu-generation bench transitions --real      # real torchrun jobs (needs torch)",
    ),
    "gpu-generation completion": ("gpu-generation completion bash > /etc/bash_completion.d/gpu-generation",),
    "gpu-recover": (
        "gpu-recover status --job-dir /ckpt/job            # what on-call runs first",
        "gpu-recover runbook run rank-failure --job-dir /ckpt/job --dry-run",
        "gpu-recover abort --job-dir /ckpt/job --dry-run",
    ),
    "gpu-recover status": (
        "gpu-recover status --job-dir /ckpt/job",
        "gpu-recover status --job-dir /ckpt/job --follow --interval 5",
        "gpu-recover status --job-dir /ckpt/job --json",
    ),
    "gpu-recover abort": (
        "gpu-recover abort --job-dir /ckpt/job --dry-run              # the signal plan, nothing sent",
        "gpu-recover abort --job-dir /ckpt/job --generation 2 --grace 10 --yes",
    ),
    "gpu-recover rendezvous": (
        "gpu-recover rendezvous --job-dir /ckpt/job --rdzv-endpoint etcd1:2379 --run-id llm --dry-run",
    ),
    "gpu-recover restore": (
        "gpu-recover restore --job-dir /ckpt/job --dry-run",
        "gpu-recover restore --job-dir /ckpt/job --step 1200 --yes",
    ),
    "gpu-recover verify": (
        "gpu-recover verify --job-dir /ckpt/job --timeout 120",
        "gpu-recover verify --job-dir /ckpt/job --newer-than 3 --json",
    ),
    "gpu-recover runbook": (
        "gpu-recover runbook list",
        "gpu-recover runbook show rank-failure",
        "gpu-recover runbook run rank-failure --job-dir /ckpt/job --dry-run",
    ),
    "gpu-recover runbook list": ("gpu-recover runbook list --json",),
    "gpu-recover runbook show": (
        "gpu-recover runbook show rank-failure",
        "gpu-recover runbook show ./mine.yaml --json",
    ),
    "gpu-recover runbook run": (
        "gpu-recover runbook run rank-failure --job-dir /ckpt/job --dry-run",
        "gpu-recover runbook run hang --job-dir /ckpt/job --yes",
    ),
    "gpu-recover demo": (
        "gpu-recover demo --job-dir /tmp/demo-job              # a real 4-worker job, killed and recovered",
        "gpu-recover demo --job-dir /tmp/demo-job --workers 2 --steps 20 --json",
    ),
    "gpu-recover completion": ("gpu-recover completion bash > /etc/bash_completion.d/gpu-recover",),
}
