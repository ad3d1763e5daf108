"""`gpu-doctor logs` human output escapes control characters from log lines (issue 15): an ESC
sequence, a C1 control (a one-byte CSI) or a BEL in a process name or file name reaches the
terminal as `\\x1b`, `\\x9b`, `\\x07`, never raw; rich markup in a log line is printed as text.
Both writers: plain (a pipe) and rich (a real pseudo-terminal)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.cli._app import safe_text
from tests.support.cli import BIN, run_cli

EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x85[bold red]x[/]"
LINE = "[Fri Aug 30 14:00:00 2024] NVRM: Xid (PCI:0000:2b:00): 79, pid=99, name={name}, GPU has fallen off the bus.\n"
RAW = ("\x1b", "\x9b", "\x07", "\x85")


def _log(tmp: Path, fname: str = "kern.log") -> Path:
    p = tmp / fname
    p.write_text(LINE.format(name=EVIL), encoding="utf-8")
    return p


def test_plain_output_escapes_esc_c1_and_bel(tmp_path: Path) -> None:
    log = _log(tmp_path, "k\x1b[31mern.log")
    r = run_cli("gpu-doctor", "logs", str(log))
    assert r.returncode == 2, r.stderr
    assert not any(c in r.stdout for c in RAW), repr(r.stdout)
    assert "process=\\x9b31m\\x85[bold red]x[/]" in r.stdout  # what the Xid parser keeps of the name
    assert "k\\x1b[31mern.log:1: critical xid" in r.stdout


def _run_on_pty(args: list[str], timeout: float = 60) -> tuple[int, str]:
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "400", "TERM": "xterm"}
    proc = subprocess.Popen(
        [str(BIN / args[0]), *args[1:]], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
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
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def test_rich_output_on_a_terminal_escapes_and_shows_markup_as_text(tmp_path: Path) -> None:
    rc, out = _run_on_pty(["gpu-doctor", "logs", str(_log(tmp_path))])
    assert rc == 2, out
    # rich styles with ESC [ ... m itself; what must not arrive: a title change, a bell, a clear, a C1 CSI
    assert "\x1b]" not in out and "\x07" not in out and "\x1b[2J" not in out and "\x9b" not in out
    assert "\\x9b31m\\x85[bold red]x[/]" in out  # escaped, and the markup printed as text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_safe_text_leaves_no_control_but_tab_and_newline(text: str) -> None:
    out = safe_text(text)
    assert not any((ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F for c in out)
    if not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
        assert out == text


@pytest.mark.parametrize("char", ["\x1b", "\x9b", "\x90", "\x9d", "\x07", "\x08", "\r", "\x7f", "\x00"])
def test_each_dangerous_control_is_escaped(char: str) -> None:
    assert safe_text(f"a{char}b") == f"a\\x{ord(char):02x}b"
