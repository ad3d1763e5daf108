"""The kernel-log `--timeout` holds for a FIFO and for stdin, not only for files and live sources.

Before it, `--kernel-log FIFO` with no writer blocked in open() and `--kernel-log -` with a stdin
that never ends blocked in read(), both without bound. Real FIFOs and real pipes here.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from gpuguard.collectors import kernel_log
from gpuguard.foundation.errors import UnavailableError
from tests.support.cli import BIN
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

XID = b"[Fri Aug 30 14:00:00 2024] NVRM: Xid (PCI:0000:61:00): 48, pid=99, name=python, An uncorrectable ECC error\n"


def _diagnose(*args: str, stdin=subprocess.DEVNULL) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [str(BIN / "gpu-doctor"), "diagnose", "node", "--nvml-snapshot", str(SAMPLE_NVML), *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, stdin=stdin, capture_output=True, text=True, timeout=60, check=False)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def baseline() -> float:
    """Start-up and a diagnosis of a small file: what the deadline comes on top of."""
    proc, took = _diagnose("--kernel-log", str(SAMPLE_LOG), "--timeout", "1")
    assert proc.returncode in (0, 1, 2, 3), proc.stderr
    return took


def _one_line_75(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 75, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not end within 1 s" in lines[0], proc.stderr


def test_fifo_without_a_writer_is_75_within_the_timeout(tmp_path, baseline):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    proc, took = _diagnose("--kernel-log", str(fifo), "--timeout", "1")
    _one_line_75(proc)
    assert took < baseline + 1 + 1, (took, baseline)


def test_stdin_that_never_ends_is_75_within_the_timeout(baseline):
    r, w = os.pipe()  # the write end stays open: the stream never ends
    try:
        os.write(w, XID)
        proc, took = _diagnose("--kernel-log", "-", "--timeout", "1", stdin=r)
    finally:
        os.close(r)
        os.close(w)
    _one_line_75(proc)
    assert took < baseline + 1 + 1, (took, baseline)


def test_stdin_that_ends_is_read_whole():
    r, w = os.pipe()
    os.write(w, XID)
    os.close(w)
    try:
        proc, _ = _diagnose("--kernel-log", "-", "--timeout", "5", "--json", stdin=r)
    finally:
        os.close(r)
    assert proc.returncode != 75, proc.stderr
    assert '"0000:61:00.0"' in proc.stdout


def test_fifo_with_a_writer_is_read_to_its_end(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)

    def writer():
        time.sleep(0.3)
        with open(fifo, "wb") as fh:
            fh.write(XID)
            fh.flush()
            time.sleep(0.3)
            fh.write(XID)

    th = threading.Thread(target=writer)
    th.start()
    log = kernel_log.read_file(fifo, timeout=5)
    th.join()
    assert log.status == "ok" and log.cursor is None
    assert [(e.kind, e.fields["xid"]) for e in log.events] == [("xid", 48), ("xid", 48)]


def test_a_stalled_pipe_raises_in_the_reader_within_its_timeout():
    r, w = os.pipe()
    try:
        os.write(w, XID)
        start = time.monotonic()
        with os.fdopen(os.dup(r), "rb") as fh, pytest.raises(UnavailableError, match="did not end within 0.5 s"):
            kernel_log.read_stream(fh, "-", timeout=0.5)
        assert time.monotonic() - start < 1.0
    finally:
        os.close(r)
        os.close(w)
