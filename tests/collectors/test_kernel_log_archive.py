"""Rotated, gzip-compressed kernel logs in the incremental reader: a cursor over an archive, the rest of
a log rotated into `<path>.1.gz`, and the caps that refuse a gzip bomb (DataError, one line, exit 65)."""

from __future__ import annotations

import gzip
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors import kernel_log as kl
from gpuguard.collectors import logscan
from gpuguard.foundation.errors import DataError
from tests.support.cli import run_cli

NOISE = "[ 1000.00] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"


def xid(code: int, n: int) -> str:
    return f"[ {2000 + n}.50] NVRM: Xid (PCI:0000:2b:00): {code}, pid={100 + n}, name=python, event {n}\n"


def _seen(log) -> list[tuple[str, int]]:
    return [(e.text, e.fields["xid"]) for e in log.events if e.kind == "xid"]


def _swept(tmp_path, appended: str = ""):
    """kern.log read once (its cursor), then `appended` written to it: (path, cursor)."""
    path = tmp_path / "kern.log"
    path.write_text(NOISE + xid(79, 1))
    cursor = kl.read_file(path).cursor
    if appended:
        with open(path, "a") as fh:
            fh.write(appended)
    return path, cursor


def test_an_archive_read_again_with_its_cursor_gives_nothing_new(tmp_path):
    gz = tmp_path / "kern.log.2.gz"
    gz.write_bytes(gzip.compress((NOISE + xid(79, 1) + NOISE + xid(13, 2)).encode()))
    first = kl.read_file(gz)
    assert [e.fields["xid"] for e in first.events] == [79, 13] and first.compressed
    assert first.cursor is not None and first.cursor.line == 4 and first.cursor.inode == os.stat(gz).st_ino
    again = kl.read_file(gz, cursor=first.cursor)
    assert again.events == () and again.lines_read == 0
    assert again.cursor == first.cursor


def test_an_archive_without_a_final_newline_is_consumed_whole(tmp_path):
    gz = tmp_path / "kern.log.1.gz"
    gz.write_bytes(gzip.compress((NOISE + xid(48, 1).rstrip("\n")).encode()))
    first = kl.read_file(gz)
    assert [e.fields["xid"] for e in first.events] == [48]
    assert kl.read_file(gz, cursor=first.cursor).events == ()


def test_a_different_archive_under_the_same_name_is_read_from_the_start(tmp_path):
    gz = tmp_path / "kern.log.1.gz"
    gz.write_bytes(gzip.compress((NOISE + xid(79, 1)).encode()))
    cursor = kl.read_file(gz).cursor
    os.unlink(gz)
    gz.write_bytes(gzip.compress((xid(31, 5) + NOISE).encode()))  # the next rotation: a new inode
    log = kl.read_file(gz, cursor=cursor)
    assert [e.fields["xid"] for e in log.events] == [31]


def test_rotation_with_compress_reads_the_rest_from_the_archive_without_repeats(tmp_path):
    path, cursor = _swept(tmp_path, xid(13, 2))  # written after the sweep, before logrotate (compress)
    _logrotate_compress(path, NOISE + xid(31, 3))
    log = kl.read_file(path, cursor=cursor)
    assert [(e.source, e.line, e.fields["xid"]) for e in log.events if e.kind == "xid"] == [
        (str(path) + ".1.gz", 3, 13),
        (str(path), 2, 31),
    ]
    assert any("rotated archive kern.log.1.gz" in n for n in log.notes)
    assert kl.read_file(path, cursor=log.cursor).events == ()


def _logrotate_compress(path, new_content: str) -> None:
    """What logrotate's `compress` does: rename, create the new log, compress the old one, delete it."""
    old = path.with_name(path.name + ".1")
    os.rename(path, old)
    path.write_text(new_content)
    path.with_name(path.name + ".1.gz").write_bytes(gzip.compress(old.read_bytes()))
    os.unlink(old)


def test_copytruncate_reads_the_rest_from_the_copy(tmp_path):
    path, cursor = _swept(tmp_path, xid(13, 2))
    (tmp_path / "kern.log.1").write_bytes(path.read_bytes())  # copytruncate: a copy, the log truncated in place
    path.write_text(xid(31, 3))
    log = kl.read_file(path, cursor=cursor)
    assert [(e.source, e.fields["xid"]) for e in log.events] == [(str(path) + ".1", 13), (str(path), 31)]


def test_inode_reused_by_the_new_log_still_finds_the_rest_in_the_archive(tmp_path):
    path, cursor = _swept(tmp_path, xid(13, 2))
    (tmp_path / "kern.log.1.gz").write_bytes(gzip.compress(path.read_bytes()))
    os.unlink(path)
    path.write_text(xid(31, 3) + NOISE)  # may well get the freed inode back
    log = kl.read_file(path, cursor=cursor)
    assert [e.fields["xid"] for e in log.events] == [13, 31]


def test_a_rotated_archive_that_is_not_the_old_file_is_not_read(tmp_path):
    path, cursor = _swept(tmp_path)
    (tmp_path / "kern.log.1.gz").write_bytes(gzip.compress((xid(13, 9) + NOISE + NOISE).encode()))
    os.unlink(path)
    path.write_text(xid(31, 3))
    log = kl.read_file(path, cursor=cursor)
    assert [e.fields["xid"] for e in log.events] == [31]


def test_a_truncated_rotated_archive_is_a_note_and_a_truncated_input_an_error(tmp_path):
    path, cursor = _swept(tmp_path)
    whole = gzip.compress((path.read_text() + xid(13, 2) * 50).encode())
    (tmp_path / "kern.log.1.gz").write_bytes(whole[: len(whole) // 2])
    os.unlink(path)
    path.write_text(xid(31, 3))
    log = kl.read_file(path, cursor=cursor)
    assert [e.fields["xid"] for e in log.events] == [31]
    assert any("kern.log.1.gz was not read" in n for n in log.notes)
    with pytest.raises(DataError, match="truncated or corrupt"):
        kl.read_file(tmp_path / "kern.log.1.gz")


def _bomb(tmp_path):
    bomb = tmp_path / "kern.log.3.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (logscan.RATIO_FROM + (8 << 20)), compresslevel=9))
    return bomb


def test_a_gzip_bomb_is_refused_by_every_reader(tmp_path):
    bomb = _bomb(tmp_path)
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(DataError, match="gzip bomb"):
        kl.read_file(bomb)
    with pytest.raises(DataError, match="gzip bomb"):
        logscan.read_log(bomb)
    for args in (("logs", str(bomb)), ("diagnose", "node", "--kernel-log", str(bomb))):
        res = run_cli("gpu-doctor", *args)
        assert res.returncode == 65, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "gzip bomb" in res.stderr
        assert "Traceback" not in res.stderr


def test_the_absolute_cap_holds_for_reads_and_seeks(tmp_path):
    gz = tmp_path / "big.gz"
    gz.write_bytes(gzip.compress((NOISE * 200).encode()))
    fh, compressed = logscan.open_log(gz, max_bytes=4096)
    try:
        assert compressed and fh.read(1000)
        with pytest.raises(DataError, match="more than 4,096 bytes"):
            fh.read(-1)
        with pytest.raises(DataError, match="past the cap"):
            fh.seek(5000)
    finally:
        logscan.close_log(fh)
    fh, _ = logscan.open_log(gz)
    try:
        assert fh.read() == (NOISE * 200).encode()
    finally:
        logscan.close_log(fh)


def noise(n: int) -> str:
    return f"[ {1000 + n}.00] usb 1-1: new high-speed USB device number {n} using xhci_hcd\n"


lines = st.lists(
    st.one_of(
        st.builds(noise, st.integers(0, 10**6)),
        st.builds(xid, st.sampled_from([13, 31, 48, 79, 94]), st.integers(0, 10**6)),
    ),
    max_size=30,
    unique=True,
)


@given(lines, lines, lines, st.sampled_from(["plain", "delaycompress", "compress"]), st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_line_is_reported_once_across_rotations(tmp_path_factory, before, after, new, how, reread_archive):
    """Sweep, append, rotate (a new file, `.1`, or `.1.gz`), sweep again: each Xid exactly once."""
    tmp = tmp_path_factory.mktemp("rot")
    path = tmp / "kern.log"
    path.write_text("".join(before))
    first = kl.read_file(path)
    with open(path, "a") as fh:
        fh.write("".join(after))
    if how == "plain":  # no rotation, only appended
        second = kl.read_file(path, cursor=first.cursor)
        seen = _seen(first) + _seen(second)
        want = before + after
    else:
        if how == "delaycompress":
            os.rename(path, tmp / "kern.log.1")
            path.write_text("".join(new))
        else:
            _logrotate_compress(path, "".join(new))
        second = kl.read_file(path, cursor=first.cursor)
        seen = _seen(first) + _seen(second)
        want = before + after + new
        if reread_archive and how == "compress":  # the archive itself, read twice with its own cursor
            arch = kl.read_file(tmp / "kern.log.1.gz")
            assert kl.read_file(tmp / "kern.log.1.gz", cursor=arch.cursor).events == ()
    expected = [(ln.strip(), int(ln.split("): ")[1].split(",")[0])) for ln in want if "Xid" in ln]
    if not before and how == "compress":
        # nothing was consumed before the rotation (offset 0): an archive (a new file) cannot be
        # recognised without a last line, so what was appended to the old file is not read from it
        expected = [(ln.strip(), int(ln.split("): ")[1].split(",")[0])) for ln in new if "Xid" in ln]
    assert seen == expected


def test_undecodable_and_cut_candidate_lines_are_counted(tmp_path):
    path = tmp_path / "kern.log"
    path.write_bytes(
        NOISE.encode()
        + b"\xff\xfe "
        + xid(79, 1).encode()  # a candidate with invalid UTF-8
        + b"\xff plain line without a keyword\n"  # not a candidate: holds no event whatever its bytes
        + b"NVRM: "
        + b"x" * kl.MAX_LINE
        + b"\n"  # cut at MAX_LINE
        + xid(13, 2).encode()
    )
    log = kl.read_file(path)
    assert log.unreadable_lines == 2 and log.section()["unreadable_lines"] == 2
    assert [e.fields["xid"] for e in log.events if e.kind == "xid"] == [79, 13]
    gz = tmp_path / "kern.log.1.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert kl.read_file(gz).unreadable_lines == 2
    assert kl.read_file(path, cursor=log.cursor).unreadable_lines == 0
