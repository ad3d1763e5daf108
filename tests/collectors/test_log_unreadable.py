"""Unreadable lines: lines that hold a marker but are not valid UTF-8, or are longer than the
2 M-character cap, are counted the same way by every reader (fast scanner, line parser, paste path),
so `gpu-doctor logs` can say how many were skipped."""

from __future__ import annotations

import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors import logwrap
from gpuguard.collectors.logparse import MAX_LINE, LogParser
from gpuguard.collectors.logscan import LogScan, read_log

XID = b"[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
BAD = b"\xff\xfe\x80"


def _line_parser(data: bytes) -> int:
    parser = LogParser()
    for n, line in enumerate(io.BytesIO(data), 1):
        parser.feed(line, n)
    return parser.unreadable


def _scanner(data: bytes, chunk: int = 1 << 16, accelerated: bool = True) -> int:
    scan = LogScan(io.BytesIO(data), chunk_size=chunk, accelerated=accelerated)
    list(scan)
    return scan.unreadable_lines


def test_invalid_utf8_lines_with_a_marker_are_counted_once_each():
    data = b"\n".join([XID, BAD + XID, b"plain " + BAD, XID + BAD + b"\r" + BAD + XID, b"NCCL WARN " + BAD]) + b"\n"
    # line 2 and line 4 (two records, one line) and line 5 hold a marker and bad bytes; line 3 has no marker
    assert _line_parser(data) == _scanner(data) == _scanner(data, 7, False) == logwrap.split_paste(data)[1] == 3


def test_a_line_past_the_cap_with_a_marker_is_counted(tmp_path):
    long = XID + b" " + b"x" * MAX_LINE
    data = b"ok\n" + long + b"\n" + b"y" * (MAX_LINE + 5) + b"\n" + XID + b"\n"
    assert _line_parser(data) == _scanner(data, 1 << 20) == logwrap.split_paste(data)[1] == 1
    huge = b"NCCL WARN " + b"z" * (9 << 20) + b"\n" + XID + b"\n"  # longer than the scanner keeps
    assert _scanner(huge, 1 << 20) == _line_parser(huge) == 1
    path = tmp_path / "paste.log"
    path.write_bytes(data)
    events, info = read_log(path)
    assert info["unreadable_lines"] == 1 and [e.line for e in events if e.kind == "xid"][-1] == 4


def test_clean_input_has_none():
    data = (XID + b"\n") * 10
    assert _scanner(data) == logwrap.split_paste(data)[1] == 0


line = st.one_of(
    st.just(XID),
    st.just(b"NCCL WARN Net : Connection closed"),
    st.binary(max_size=40),
    st.builds(lambda a, b: a + b, st.binary(max_size=12), st.just(XID)),
    st.builds(lambda a, b: a + b"\r" + b, st.just(XID), st.binary(max_size=12)),
)


@given(st.lists(line, max_size=40), st.integers(min_value=1, max_value=600))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_reader_counts_the_same(lines, chunk):
    data = b"\n".join(lines) + b"\n"
    want = _line_parser(data)
    assert _scanner(data, chunk) == want
    assert _scanner(data, chunk, accelerated=False) == want
    assert logwrap.split_paste(data)[1] == want
