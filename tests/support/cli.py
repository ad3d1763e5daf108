"""Where things are and how to run the real console scripts: shared by every test package."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
JOBS = SUPPORT / "jobs"  # training scripts the tests launch under torchrun
FAKES = SUPPORT / "fakes"  # the pynvml fake: the one part faked, at the module boundary
SHARED = Path(os.environ.get("GPUGUARD_SHARED", REPO.parent / "shared"))
REAL_LOGS = SHARED / "real-logs"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: str | Path | None = None,
) -> CliResult:
    """Run one of the installed console scripts (gpu-doctor, gpu-generation, gpu-recover) for real."""
    cmd = [str(BIN / args[0]), *args[1:]]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("GPUGUARD_DEBUG", None)
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def every_command() -> list[tuple[str, object]]:
    """(path as typed, click command) of every command of the three console scripts, as `run` prepares
    them (examples attached, values named): for the tests that check every --help."""
    import typer

    from gpuguard.cli import _app, doctor, generation, recover

    out: list[tuple[str, object]] = []

    def walk(cmd: object, path: str) -> None:
        out.append((path, cmd))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {name}")

    for prog, app in (("gpu-doctor", doctor.app), ("gpu-generation", generation.app), ("gpu-recover", recover.app)):
        walk(_app.prepare(typer.main.get_command(app), prog), prog)
    return out
