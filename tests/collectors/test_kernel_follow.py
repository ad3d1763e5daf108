"""Following a kernel log (`collectors.kernel_follow`): /dev/kmsg records, streams read in arbitrary
chunks giving the same events as one read, a FIFO whose writers come and go."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors import kernel_follow, kernel_log
from gpuguard.collectors.kernel_follow import StreamFollower, parse_kmsg_record

DATA = Path(__file__).resolve().parents[1] / "data" / "node-evidence"


def test_kmsg_records():
    rec = b"4,1234,84300488,-;NVRM: GPU6 _kgspLogRpcTimeout: *** GSP Timeout ***\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
    assert parse_kmsg_record(rec) == (1234, 84.300488, "NVRM: GPU6 _kgspLogRpcTimeout: *** GSP Timeout ***")
    assert parse_kmsg_record(b"6,5,1,-,caller=T1;hello\n") == (5, 1e-06, "hello")  # extra fields after flags
    assert parse_kmsg_record(b"garbage") is None and parse_kmsg_record(b"a,b,c,d;x") is None


@given(st.binary(max_size=300))
def test_any_kmsg_record_parses_or_is_refused(raw):
    got = parse_kmsg_record(raw)
    assert got is None or (got[0] >= 0 and got[1] >= 0)


def test_the_live_kmsg_is_read_without_blocking_and_resumes_after_its_cursor():
    if not os.access(kernel_follow.KMSG, os.R_OK):
        return  # not readable here (no CAP_SYSLOG): nothing to read
    first = kernel_follow.KmsgFollower(None)
    try:
        first.read_new()  # the whole ring buffer, without blocking
        cursor = first.cursor
    finally:
        first.close()
    assert cursor is not None and cursor.boot_id == kernel_log.boot_id()
    again = kernel_follow.KmsgFollower(cursor)
    try:
        assert again.read_new() == [] or again.seq > cursor.offset  # only records newer than the cursor
    finally:
        again.close()


def _chunked(data: bytes, cuts: list[int]) -> list:
    r, w = os.pipe()
    follower = StreamFollower(r, "test")
    events = []
    try:
        last = 0
        for cut in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
            os.write(w, data[last:cut])
            last = cut
            events += follower.read_new()
        os.close(w)
        events += follower.read_new()
    finally:
        follower.close()
    return [(e.kind, e.line, dict(e.fields)) for e in events]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=12))
def test_a_stream_read_in_any_chunks_gives_the_events_of_one_read(cuts):
    data = (DATA / "gsp-gh100.log").read_bytes() + (DATA / "mlx5-reg-mr.log").read_bytes()
    assert _chunked(data, cuts) == _chunked(data, [])
    assert [k for k, _, _ in _chunked(data, [])].count("gpu_fault") == 4


def test_a_fifo_outlives_its_writers(tmp_path):
    fifo = tmp_path / "k"
    os.mkfifo(fifo)
    follower = kernel_follow.open_follower(str(fifo), None)
    try:
        for n in range(3):  # three writers, one after the other
            fd = os.open(fifo, os.O_WRONLY)
            os.write(fd, b"[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n")
            os.close(fd)
            assert [e.fields["xid"] for e in follower.read_new()] == [79], n
            assert follower.fileno() is not None  # not ended
    finally:
        follower.close()
