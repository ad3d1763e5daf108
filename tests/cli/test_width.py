"""Every command's human output at 80 columns: piped with COLUMNS=80, and in a real 80x24 terminal (a pty,
where rich renders tables, panels and `watch`'s live page). No line is longer than 80 columns unless it is
one token that cannot be broken (a path); NO_COLOR leaves no escape sequence that styles text, bold
included.

Before: at 80 columns `diagnose job`, `history`, `explain`, `status`, `logs`, `plugins`, `plan layout` and
the runbooks printed lines of 100-190 columns that the terminal wrapped mid-number, and rich folded table
cells mid-token; NO_COLOR left bold on.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from gpuguard.cli import _app
from tests.support.cli import BIN, REAL_LOGS, every_command, run_cli
from tests.support.cli_job import build_job, write_dumps, write_steps
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

WIDTH = 80
FRESH = "{fresh}"  # a job dir of the test's own: `init` refuses a second run on one dir
SGR = re.compile(r"\x1b\[[0-9;]*m")  # select graphic rendition: colour, bold, underline
CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")  # cursor moves, window titles


def screen(drawn: str) -> str:
    """What the terminal shows, line by line: escape sequences gone, a line redrawn after `\\r` (a
    progress bar) counted as its last drawing."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in CONTROL.sub("", drawn).replace("\r\n", "\n").split("\n"))


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, tuple[str, ...]]:
    tmp = tmp_path_factory.mktemp("width")
    jd, _ = build_job(tmp)
    write_steps(jd)
    import torch  # a real snapshot for `restore` to pin (the doctor's commands never import torch)

    from gpuguard.recovery.snapshots.store import save_snapshot

    save_snapshot(jd, 0, {"w": torch.zeros(4)}, generation=0, owner="width")
    dumps = write_dumps(tmp)
    j = ("--job-dir", str(jd))
    node = ("--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML))
    return {
        "generation show": ("gpu-generation", "show", *j),
        "generation history": ("gpu-generation", "history", *j),
        "generation verify": ("gpu-generation", "verify", *j),
        "generation explain": ("gpu-generation", "explain", *j),
        "bench transitions": ("gpu-generation", "bench", "transitions"),
        "recover status": ("gpu-recover", "status", *j),
        "generation init": ("gpu-generation", "init", "--job-dir", FRESH, "--job-id", "width"),
        "recover abort": ("gpu-recover", "abort", *j, "--dry-run"),
        "recover restore": ("gpu-recover", "restore", *j, "--dry-run"),
        "recover verify": ("gpu-recover", "verify", *j, "--timeout", "1"),
        "runbook list": ("gpu-recover", "runbook", "list"),
        "runbook show": ("gpu-recover", "runbook", "show", "rank-failure"),
        "runbook run": ("gpu-recover", "runbook", "run", "hang", *j, "--dry-run"),
        "diagnose job": ("gpu-doctor", "diagnose", "job", *j),
        "diagnose job --log": ("gpu-doctor", "diagnose", "job", *j, "--log", str(REAL_LOGS / "053-watchdog.log")),
        "watch job": ("gpu-doctor", "watch", "job", *j, "--count", "1"),
        "diagnose torchrun": ("gpu-doctor", "diagnose", "torchrun", *j),
        "picture": ("gpu-doctor", "picture", *j),
        "diagnose node": ("gpu-doctor", "diagnose", "node", *node),
        "sweep": ("gpu-doctor", "sweep", *node, "--state-dir", str(tmp / "state")),
        "watch node": ("gpu-doctor", "watch", "node", *node, "--state-dir", str(tmp / "w"), "--max-judgements", "1"),
        "logs": ("gpu-doctor", "logs", str(SAMPLE_LOG)),
        "plugins": ("gpu-doctor", "plugins"),
        "contract": ("gpu-doctor", "contract", str(dumps)),
        "plan checkpoint": ("gpu-doctor", "plan", "checkpoint", "--cost", "30", "--mtbf-hours", "5000", "--gpus", "8"),
        "plan layout": ("gpu-doctor", "plan", "layout", "--tp", "8", "--pp", "4", "--dp", "16", "--failed-rank", "17"),
        "plan collective": (
            "gpu-doctor",
            "plan",
            "collective",
            "--ranks",
            "64",
            "--bytes",
            "1e9",
            "--bandwidth",
            "5e9",
        ),
    }


def argv_of(commands: dict[str, tuple[str, ...]], name: str, tmp: Path) -> tuple[str, ...]:
    return tuple(str(tmp / "job") if a == FRESH else a for a in commands[name])


def too_wide(text: str) -> list[str]:
    """Lines longer than WIDTH that could have been broken (more than one token)."""
    return [line for line in text.splitlines() if len(line) > WIDTH and len(line.split()) > 1]


NAMES = [
    "generation init",
    "generation show",
    "generation history",
    "generation verify",
    "generation explain",
    "bench transitions",
    "recover status",
    "recover abort",
    "recover restore",
    "recover verify",
    "runbook list",
    "runbook show",
    "runbook run",
    "diagnose job",
    "diagnose job --log",
    "watch job",
    "diagnose torchrun",
    "picture",
    "diagnose node",
    "sweep",
    "watch node",
    "logs",
    "plugins",
    "contract",
    "plan checkpoint",
    "plan layout",
    "plan collective",
]


@pytest.mark.parametrize("name", NAMES)
def test_piped_output_fits_80_columns(commands, name, tmp_path):
    r = run_cli(*argv_of(commands, name, tmp_path), env={"COLUMNS": str(WIDTH), "NO_COLOR": "1"}, timeout=300)
    assert r.stdout.strip(), f"{name}: no output (exit {r.returncode}): {r.stderr}"
    assert too_wide(r.stdout) == [], name
    assert "\x1b" not in r.stdout


def run_in_terminal(argv: tuple[str, ...], env: dict[str, str], timeout: float = 300) -> str:
    """Run a console script on an 80x24 pseudo-terminal (stdin, stdout and stderr) and return what it drew."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, WIDTH, 0, 0))
    full = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    full.update({"TERM": "xterm-256color", **env})
    proc = subprocess.Popen(
        [str(BIN / argv[0]), *argv[1:]], stdin=slave, stdout=slave, stderr=slave, env=full, start_new_session=True
    )
    os.close(slave)
    chunks: list[bytes] = []
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize("name", NAMES)
def test_terminal_output_fits_80_columns_and_no_color_means_no_style(commands, name, tmp_path):
    drawn = run_in_terminal(argv_of(commands, name, tmp_path), {"NO_COLOR": "1"})
    assert drawn.strip(), name
    assert SGR.findall(drawn) == [], f"{name}: styled text under NO_COLOR"
    assert too_wide(screen(drawn)) == [], name


def test_the_terminal_check_sees_style_without_no_color(commands):
    """The same run without NO_COLOR is styled: the check above can fail."""
    assert SGR.search(run_in_terminal(commands["diagnose node"], {}))


def test_watch_job_refreshes_and_says_finished(commands):
    drawn = screen(run_in_terminal(commands["watch job"], {"NO_COLOR": "1"}))
    assert re.search(r"refreshed \d\d:\d\d:\d\d, every 1 s", drawn)
    assert "finished: all 4 ranks closed their step logs cleanly" in drawn
    piped = run_cli(*commands["watch job"], env={"COLUMNS": "80"})
    assert re.fullmatch(r"\d\d:\d\d:\d\d finished: all 4 ranks closed their step logs cleanly\n", piped.stdout)


def test_a_token_is_never_split(tmp_path: Path):
    """A path longer than the width stands alone on its line; every other line is broken between words."""
    from gpuguard.cli._text import wrap

    path = "/" + "a" * 120
    line = f"generation     2 (certificate {'b' * 12}, frontier step 0) in {path} and more words here"
    parts = wrap(line, WIDTH)
    assert path in parts[1:] or any(p.strip() == path for p in parts)
    assert all(len(p) <= WIDTH for p in parts if path not in p)
    assert " ".join(p.strip() for p in parts).split() == line.split()  # nothing lost, nothing split
    assert all(p.startswith(" " * 15) for p in parts[1:])  # continuations hang under the value column


HELPS = every_command()


@pytest.mark.parametrize("path", [p for p, _ in HELPS])
def test_help_fits_80_columns(path):
    """Every --help, examples included (click does not reflow them: `_app.example_lines` breaks them)."""
    cmd = dict(HELPS)[path]
    ctx = _app._click().Context(cmd, info_name=path, terminal_width=WIDTH, max_content_width=WIDTH)
    text = cmd.get_help(ctx)
    assert "Usage:" in text
    assert too_wide(text) == [], path


def test_help_examples_fit_80_columns_in_a_real_run():
    r = run_cli("gpu-doctor", "watch", "node", "--help", env={"COLUMNS": str(WIDTH)})
    assert r.returncode == 0 and "    --format npd" in r.stdout
    assert too_wide(r.stdout) == []
