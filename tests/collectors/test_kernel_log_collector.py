"""Kernel-log collector: fast candidate scan, incremental cursor (append, rotation, truncation), live sources."""

from __future__ import annotations

import io
import json
import os
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors import kernel_log as kl
from gpuguard.foundation.errors import DataError, NoInputError

XID = "[ 1843.30] NVRM: Xid (PCI:0000:2b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
XID13 = "[ 1900.10] NVRM: Xid (PCI:0000:cb:00): 13, pid=12, name=python, Graphics SM Warp Exception\n"
NOISE = "[ 1000.00] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"


def _xids(log):
    return [(e.line, e.fields.get("xid")) for e in log.events if e.kind == "xid"]


def test_scan_finds_candidates_with_their_real_line_numbers():
    data = (NOISE * 3 + XID + NOISE + XID13 + NOISE).encode()
    result = kl.scan(io.BytesIO(data), final=True)
    assert [n for n, _ in result.candidates] == [4, 6]
    assert result.line == 7 and result.offset == len(data)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(st.sampled_from([NOISE, XID, XID13, "NVRM: loading module\n", "\n", "plain\r\n"]), max_size=60))
def test_scan_matches_a_naive_filter(lines):
    data = "".join(lines).encode()
    result = kl.scan(io.BytesIO(data), final=True)
    naive = [(i, ln.rstrip("\n").encode()) for i, ln in enumerate(lines, 1) if "NVRM" in ln or "Xid" in ln]
    assert result.candidates == naive
    assert result.line == len(lines)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=2000))
def test_random_bytes_never_raise_and_invent_nothing(raw):
    log = kl.read_stream(io.BytesIO(raw))
    assert all(e.kind != "xid" or b"Xid" in raw for e in log.events)


def test_long_lines_crlf_and_invalid_utf8(tmp_path):
    path = tmp_path / "kern.log"
    path.write_bytes(
        b"x" * (1024 * 1024) + b"\n" + b"\xff\xfe garbage NVRM \xc3\n" + XID.replace("\n", "\r\n").encode()
    )
    log = kl.read_file(path)
    assert _xids(log) == [(3, 79)]


def test_incremental_reads_only_what_is_new(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(NOISE * 2 + XID)
    first = kl.read_file(path)
    assert _xids(first) == [(3, 79)] and first.cursor.line == 3
    again = kl.read_file(path, cursor=first.cursor)
    assert again.events == () and again.lines_read == 0 and again.bytes_read == 0
    with open(path, "a") as fh:
        fh.write(NOISE + XID13 + "partial NVRM: Xid (PCI:0000:cb:00): 31")  # last line still being written
    second = kl.read_file(path, cursor=again.cursor)
    assert _xids(second) == [(5, 13)] and second.lines_read == 2
    with open(path, "a") as fh:
        fh.write(", pid=1, name=x, MMU Fault\n")
    third = kl.read_file(path, cursor=second.cursor)
    assert _xids(third) == [(6, 31)]


def test_truncation_and_rewrite_restart_from_the_top(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(NOISE * 5 + XID)
    cursor = kl.read_file(path).cursor
    path.write_text(XID13)  # truncated in place (same inode), smaller than the offset
    log = kl.read_file(path, cursor=cursor)
    assert _xids(log) == [(1, 13)] and any("truncated" in n for n in log.notes)
    cursor = log.cursor
    path.write_text(XID13.replace("python", "pythom") + NOISE)  # same size prefix, different last line
    log = kl.read_file(path, cursor=cursor)
    assert _xids(log) == [(1, 13)] and any("rewritten" in n for n in log.notes)


def test_rotation_reads_the_rest_of_the_old_file_then_the_new_one(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(NOISE + XID)
    cursor = kl.read_file(path).cursor
    with open(path, "a") as fh:
        fh.write(XID13)  # written after the last sweep, before rotation
    os.rename(path, tmp_path / "kern.log.1")
    path.write_text(NOISE + XID)
    log = kl.read_file(path, cursor=cursor)
    assert [(e.source, e.line, e.fields["xid"]) for e in log.events if e.kind == "xid"] == [
        (str(path) + ".1", 3, 13),
        (str(path), 2, 79),
    ]
    assert any("rotated" in n for n in log.notes)
    assert log.cursor.inode == os.stat(path).st_ino and log.cursor.line == 2


def test_cursor_round_trip_and_atomic_save(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text(NOISE + XID)
    cursor = kl.read_file(path).cursor
    kl.save_cursor(tmp_path / "state" / "cursor.json", cursor)
    assert kl.load_cursor(tmp_path / "state" / "cursor.json") == cursor
    assert kl.load_cursor(tmp_path / "missing.json") is None
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["cursor.json"]  # no temp file left


_valid = {
    "schema": kl.CURSOR_SCHEMA,
    "path": "/var/log/kern.log",
    "device": 1,
    "inode": 2,
    "offset": 10,
    "line": 1,
    "last_line_sha256": "a" * 64,
    "last_line_len": 10,
    "boot_id": "",
}


@settings(max_examples=200, deadline=None)
@given(
    key=st.sampled_from(sorted(_valid)),
    value=st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5) | st.lists(st.integers(), max_size=2),
)
def test_cursor_with_a_wrong_field_is_a_data_error(key, value):
    doc = dict(_valid, **{key: value})
    try:
        cursor = kl.parse_cursor(json.dumps(doc))
    except DataError as exc:
        assert str(exc).startswith("cursor")
        return
    assert cursor.offset >= cursor.last_line_len >= 0


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_cursor_garbage_and_truncation_are_data_errors(raw):
    text = json.dumps(_valid).encode()
    for candidate in (raw, text[: len(raw) % len(text)]):
        try:
            kl.parse_cursor(candidate)
        except DataError:
            pass


def test_missing_file_is_no_input(tmp_path):
    with pytest.raises(NoInputError):
        kl.read_file(tmp_path / "nope.log")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_live_sources_fall_back_and_say_why():
    refused = _py(
        "import sys; sys.stderr.write('dmesg: read kernel buffer failed: Operation not permitted\\n'); sys.exit(1)"
    )
    empty = _py("print('-- No entries --')")
    lines = _py(f"print({XID.strip()!r})")
    log = kl.read_live(sources=(("dmesg", refused), ("journalctl -k", empty), ("kern", lines)), files=())
    assert log.status == "ok" and log.source == "kern"
    assert _xids(log) == [(1, 79)]
    assert "refused" in log.notes[0] and "CAP_SYSLOG" in log.notes[0] and "no entries" in log.notes[0]


def test_live_source_that_hangs_times_out(tmp_path):
    start = time.monotonic()
    log = kl.read_live(
        sources=(("dmesg", _py("import time; time.sleep(30)")),), files=(str(tmp_path / "none"),), timeout=0.5
    )
    assert time.monotonic() - start < 10
    assert log.status == "unknown"
    assert "timed out after 0.5 s" in log.reason and "not readable" in log.reason


def test_live_stream_cursor_skips_what_was_seen():
    out = _py(f"print({NOISE.strip()!r}); print({XID.strip()!r})")
    first = kl.read_live(sources=(("dmesg", out),), files=())
    assert len(_xids(first)) == 1
    second = kl.read_live(sources=(("dmesg", out),), files=(), cursor=first.cursor)
    assert _xids(second) == []
