"""The lean start of `gpu-doctor logs` and `gpu-doctor diagnose node`: no typer, no other command module.

Why: these two run from cron on every node and on multi-GiB logs; importing typer, click and every
command module to parse `--json FILE` costs more than the rest of the start-up. `try_fast` parses the
plain argument forms itself and calls the same command function with the same values typer would
pass; the outcome is identical because anything it does not fully understand - `-h`/`--help`, an
unknown or misspelt option, a missing or odd value (one that starts with `-`, a float that is not a
finite number), `--`, an option before the subcommand, shell completion - makes it return None, and
the full Typer app handles the whole command line: its help, its completion, its usage errors.
Errors of the command itself go through the same runner (`_app.run_guarded` / `_app.run_command`).

`COMMANDS` mirrors the Typer signatures; tests/cli/test_fast_path.py fails when they drift apart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

FLAG, STR, FLOAT, MULTI = "flag", "str", "float", "multi"


@dataclass(frozen=True)
class Opt:
    """One option: the command function's parameter it fills, how its value is read, and for a
    `--x/--no-x` pair the value each spelling sets."""

    param: str
    kind: str
    value: Any = True  # what a FLAG spelling sets


@dataclass(frozen=True)
class Command:
    """A subcommand the fast path runs: its words, options, positional parameter (if any) and the
    function (`module:name`) typer would call, with the defaults typer would pass."""

    words: tuple[str, ...]
    target: str
    options: Mapping[str, Opt]
    defaults: Mapping[str, Any]
    positional: str | None = None  # the parameter collecting arguments (nargs=-1, required)


COMMANDS: tuple[Command, ...] = (
    Command(
        words=("logs",),
        target="gpuguard.cli.doctor_logs:logs_command",
        positional="files",
        options={"--json": Opt("as_json", FLAG), "--min-severity": Opt("min_severity", STR)},
        defaults={"as_json": False, "min_severity": "info"},
    ),
    Command(
        words=("diagnose", "node"),
        target="gpuguard.cli.doctor_node:diagnose_node",
        options={
            "--kernel-log": Opt("kernel_log", STR),
            "--nvml-snapshot": Opt("nvml_snapshot", STR),
            "--since": Opt("since", STR),
            "--config": Opt("config", STR),
            "--json": Opt("json_", FLAG),
            "--format": Opt("fmt", STR),
            "--demo": Opt("demo", FLAG),
            "--dump-nvml": Opt("dump_nvml", STR),
            "--force": Opt("force", FLAG),
            "--processes": Opt("processes", FLAG, True),
            "--no-processes": Opt("processes", FLAG, False),
            "--nvml-timeout": Opt("nvml_timeout", FLOAT),
            "--timeout": Opt("timeout", FLOAT),
            "--log": Opt("log", MULTI),
            "--mode": Opt("mode", STR),
        },
        defaults={
            "kernel_log": None,
            "nvml_snapshot": None,
            "since": None,
            "config": None,
            "json_": False,
            "fmt": None,
            "demo": False,
            "dump_nvml": None,
            "force": False,
            "processes": None,
            "nvml_timeout": 10.0,
            "timeout": 10.0,
            "log": [],
            "mode": None,
        },
    ),
)


def parse(command: Command, args: list[str]) -> dict[str, Any] | None:
    """The keyword arguments typer would pass for `args` (after the command's words), or None when
    the arguments are anything but plain (typer must then parse them, and report what is wrong)."""
    values: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in command.defaults.items()}
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "-" or not arg.startswith("-"):
            if command.positional is None:
                return None
            positional.append(arg)
            continue
        name, eq, inline = arg.partition("=")
        opt = command.options.get(name)
        if opt is None or (eq and not name.startswith("--")):
            return None  # -h, --help, --, an unknown or short option: typer's to answer
        if opt.kind == FLAG:
            if eq:
                return None
            values[opt.param] = opt.value
            continue
        if eq:
            value = inline
        elif i < len(args):
            value = args[i]
            i += 1
        else:
            return None  # a missing value
        if value.startswith("-") and value != "-":
            return None  # a value that looks like an option: what typer makes of it is typer's
        if opt.kind == FLOAT:
            try:
                number = float(value)
            except ValueError:
                return None
            if not math.isfinite(number):
                return None
            values[opt.param] = number
        elif opt.kind == MULTI:
            values[opt.param].append(value)
        else:
            values[opt.param] = value
    if command.positional is not None:
        if not positional:
            return None  # a missing argument
        values[command.positional] = positional
    return values


def _completing() -> bool:
    """Is a shell asking for completions (click's `_<PROG>_COMPLETE` variables)?"""
    return any(key.startswith("_") and key.endswith("_COMPLETE") for key in os.environ)


def match(argv: list[str]) -> tuple[Command, dict[str, Any]] | None:
    """The fast command and its arguments for `argv` (without the program name), or None."""
    if _completing():
        return None
    for command in COMMANDS:
        n = len(command.words)
        if tuple(argv[:n]) == command.words:
            kwargs = parse(command, argv[n:])
            return None if kwargs is None else (command, kwargs)
    return None


def _load(target: str) -> Callable[..., Any]:
    from importlib import import_module

    module, _, name = target.partition(":")
    return getattr(import_module(module), name)


def try_fast(prog: str, argv: list[str]) -> int | None:
    """Run `argv` on the fast path and return its exit code, or None when typer must run it."""
    found = match(argv)
    if found is None:
        return None
    command, kwargs = found
    from gpuguard.cli._app import run_command, run_guarded

    return run_guarded(lambda: run_command(lambda: _load(command.target)(**kwargs), prog), prog)
