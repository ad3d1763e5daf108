"""foundation.fastexit: a process dying of an uncaught exception skips finalization, not its exit work.

A real child process: a slow destructor stands in for torch's teardown after a dead gloo peer; the
exit work others rely on (a non-daemon thread, an atexit handler, a buffered file never closed)
must all land, and only the destructor is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuguard.foundation.env import FAST_EXIT_ENV

SLOW_DEL_S = 3.0

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from gpuguard.foundation import fastexit

    out = Path(sys.argv[1])
    fastexit.install()

    class SlowTeardown:
        def __del__(self):
            time.sleep({slow})
            (out / "del").write_text("ran")

    keep = SlowTeardown()  # freed only by finalization, as torch's objects are
    log = open(out / "buffered.txt", "w")  # never closed: its buffer is flushed at exit
    log.write("tail")
    raw = open(out / "buffered.bin", "wb")
    raw.write(b"tail")
    atexit.register(lambda: (out / "atexit").write_text(f"ran leaving={{fastexit.leaving()}}"))

    def late():
        time.sleep(0.3)
        (out / "thread").write_text("ran")

    threading.Thread(target=late).start()  # non-daemon: exit waits for it
    {raise_it}
    """
)


def _run(tmp_path: Path, env_value: str | None, raise_it: str = "raise RuntimeError('collective timed out')"):
    env = {k: v for k, v in os.environ.items() if k != FAST_EXIT_ENV}
    if env_value is not None:
        env[FAST_EXIT_ENV] = env_value
    script = CHILD.format(slow=SLOW_DEL_S, raise_it=raise_it)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    return proc, time.monotonic() - t0


def test_an_uncaught_exception_exits_after_the_exit_work_without_finalization(tmp_path):
    proc, took = _run(tmp_path, None)
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: collective timed out" in proc.stderr  # the traceback, as Python prints it
    assert (tmp_path / "thread").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran leaving=True"
    assert (tmp_path / "buffered.txt").read_text() == "tail"
    assert (tmp_path / "buffered.bin").read_bytes() == b"tail"
    assert not (tmp_path / "del").exists()  # finalization skipped
    assert took < SLOW_DEL_S, took


def test_off_switch_keeps_pythons_own_exit(tmp_path):
    proc, took = _run(tmp_path, "0")
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "del").read_text() == "ran"  # finalization ran, the slow way
    assert took >= SLOW_DEL_S
    assert (tmp_path / "buffered.txt").read_text() == "tail"


@pytest.mark.parametrize("raise_it", ["raise SystemExit(3)", "pass"])
def test_a_normal_or_explicit_exit_is_pythons(tmp_path, raise_it):
    proc, took = _run(tmp_path, None, raise_it)
    assert proc.returncode == (3 if "3" in raise_it else 0), proc.stderr
    assert (tmp_path / "del").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran leaving=False"
