"""The CLI's one progress bar (`cli/_progress.py`): drawn on a real terminal, never when piped, and
not before the first tick (a reader pool forks first)."""

from __future__ import annotations

import io
import os
import select
import sys

from gpuguard.cli._progress import ProgressBar


def _drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


def test_the_bar_draws_on_a_terminal_only_after_the_first_tick(monkeypatch) -> None:
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("TERM", "xterm")
    try:
        with ProgressBar(in_bytes=True) as bar:
            tick = bar.ticker("reading big.log", 1 << 20)
            assert tick is not None
            assert _drain(master) == b""  # nothing drawn, no refresh thread, before the work begins
            for _ in range(4):
                tick(1 << 18)
            bar.update("reading dumps", 3, 64)  # a second task, counted rather than advanced
        tty.flush()
        out = _drain(master)
    finally:
        tty.close()
        os.close(master)
    assert b"reading big.log" in out and b"reading dumps" in out, out[-400:]


def test_no_bar_when_piped_disabled_or_without_a_total(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    piped = ProgressBar()
    assert piped.ticker("x", 10) is None
    piped.update("x", 1, 10)  # a no-op, nothing started
    piped.stop()
    assert sys.stderr.getvalue() == ""
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", tty)
    try:
        assert ProgressBar(enabled=False).ticker("x", 10) is None
        assert ProgressBar().ticker("x", 0) is None and ProgressBar().ticker("x", None) is None
        assert ProgressBar().ticker("x", 10) is not None
    finally:
        tty.close()
        os.close(master)
