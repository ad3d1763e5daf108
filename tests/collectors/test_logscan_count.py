"""The scanner's numpy newline counter (big regular files, numpy installed) numbers lines exactly as
`bytes.count` does: same events, same line numbers, same cursor, for any mix of lines, `\\r` records and
chunk sizes (its thresholds forced down so small generated files take it)."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors import logscan

pytest.importorskip("numpy", reason="the accelerated counter needs numpy (the runtime extra); bytes.count otherwise")

LINES = [
    "[ 1.5] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "node1:1:1 [0] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer",
    "[ 2.0] usb 1-1: new high-speed USB device number 3 using xhci_hcd",
    "Epoch 0:  40%|####      | 4/10 [00:01<00:02]",
    "",
    "x" * 300,
]


def _scan(path: str, chunk: int) -> tuple[list[dict], int, int]:
    with open(path, "rb") as fh:
        scan = logscan.LogScan(fh, source="t", chunk_size=chunk)
        events = [e.to_json() for e in scan]
    return events, scan.next_line, scan.offset


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.tuples(st.sampled_from(LINES), st.sampled_from(["\n", "\n", "\r", "\r\n"])), max_size=60),
    chunk=st.sampled_from([7, 64, 512, 1 << 16]),
)
def test_numpy_counter_numbers_lines_as_bytes_count(monkeypatch: pytest.MonkeyPatch, parts, chunk: int) -> None:
    data = "".join(text + end for text, end in parts).encode()
    fd, path = tempfile.mkstemp(suffix=".log")
    try:
        os.write(fd, data)
        os.close(fd)
        monkeypatch.setattr(logscan, "NUMPY_FROM", 1 << 62)
        plain = _scan(path, chunk)
        monkeypatch.setattr(logscan, "NUMPY_FROM", 0)
        monkeypatch.setattr(logscan, "_NUMPY_MIN_SPAN", 0)
        assert _scan(path, chunk) == plain
    finally:
        os.unlink(path)


def test_the_counter_is_chosen_by_size_and_kind(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = tmp_path / "small.log"
    small.write_bytes(b"a\nb\n")
    with open(small, "rb") as fh:
        assert logscan._newline_counter(fh, 0) is logscan._count_nl  # below NUMPY_FROM: no numpy import
        monkeypatch.setattr(logscan, "NUMPY_FROM", 0)
        counter = logscan._newline_counter(fh, 0)
    assert counter is not logscan._count_nl and counter(bytearray(b"a\n" * 5000), 0, 10000) == 5000
    r, w = os.pipe()
    try:
        with os.fdopen(r, "rb") as pipe:
            assert logscan._newline_counter(pipe, 0) is logscan._count_nl  # a stream: size unknown
    finally:
        os.close(w)
