"""Kernel-log collector: Xid / SXid / fallen-off-bus lines from a file, stdin, `dmesg` or `journalctl -k`.

A cron sweep on 10,000 nodes must not re-read a 1 GiB `kern.log` every minute, so file reads are
incremental: a cursor (device, inode, offset, line number, hash of the last line read) says where the
last sweep stopped. Rotation (a new inode), truncation (size below the offset) and rewriting (the last
line's hash no longer matches) restart from the top, after reading the rest of the old content from
`<path>.1` (renamed: its inode; copied by `copytruncate`: the hash at the offset) or `<path>.1.gz`
(compressed: the hash at the offset). Only complete lines are consumed, and the cursor is written
atomically, so a crash never skips or doubles a line.

Only lines that can matter to the node verdict (`NVRM`, `Xid`, PCIe AER, Fabric Manager, nvidia-smi's
"No devices were found" / "device handle" pasted into a ticket) reach the parser: a byte search finds
them, so the scan runs at close to disk speed. A gzip-compressed (rotated) log is decompressed as it is
read, with a cursor of its own (decompressed offset; the same archive read again gives nothing new); a
truncated archive, or one that decompresses past `logscan.MAX_DECOMPRESSED` or `MAX_RATIO` times its
size (a gzip bomb), is a DataError (exit 65), never "ok".
Lines that look like an Xid but that no rule reads are returned as `unread_lines`.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import stat
import subprocess
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from gpuguard.collectors.kernel_scan import (
    CHUNK,
    _hash,
    _Scan,
    parse_candidates,
    scan,
    unread_xid_lines,
    unreadable_candidates,
)
from gpuguard.collectors.kernel_scan import KEYWORDS as KEYWORDS  # re-exported: the reader's keywords
from gpuguard.collectors.kernel_scan import MAX_LINE as MAX_LINE
from gpuguard.collectors.kernel_scan import _scan_block as _scan_block
from gpuguard.collectors.logscan import close_log, is_corrupt_archive, open_log
from gpuguard.foundation.errors import DataError, UnavailableError, from_os_error
from gpuguard.foundation.events import Event
from gpuguard.foundation.jobdir import atomic_write_bytes

CURSOR_SCHEMA = "gpuguard.kernel-log-cursor/1"
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Cursor:
    """Where the last read of a file stopped. `offset` is always just after a complete line."""

    path: str
    device: int
    inode: int
    offset: int
    line: int  # lines consumed so far: the next line is line + 1
    last_line_sha256: str  # hash of the last consumed line (with its newline), "" at offset 0
    last_line_len: int
    # For stream sources (dmesg, journalctl): the boot and the last line seen.
    boot_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"schema": CURSOR_SCHEMA, **asdict(self)}


@dataclass(frozen=True)
class KernelLog:
    """What one read produced."""

    source: str  # file path, "-", "dmesg", "journalctl -k", ...
    status: str  # ok | unknown
    reason: str | None = None
    events: tuple[Event, ...] = ()
    lines_read: int = 0
    bytes_read: int = 0
    cursor: Cursor | None = None
    notes: tuple[str, ...] = ()
    unread_lines: tuple[int, ...] = ()  # lines that look like an Xid but that no rule read
    compressed: bool = False
    unreadable_lines: int = 0  # candidate lines not valid UTF-8 or cut at MAX_LINE (`unreadable_candidates`)

    def section(self) -> dict[str, Any]:
        """The `kernel_log` section of `gpuguard.node/1`."""
        return {
            "status": self.status,
            "source": self.source,
            "reason": self.reason,
            "lines_read": self.lines_read,
            "bytes_read": self.bytes_read,
            "events": len(self.events),
            "unread_lines": len(self.unread_lines),
            "unreadable_lines": self.unreadable_lines,
            "compressed": self.compressed,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------------
# Cursor file: parse (pure), load, save (atomic).

_CURSOR_FIELDS = {
    "path": str,
    "device": int,
    "inode": int,
    "offset": int,
    "line": int,
    "last_line_sha256": str,
    "last_line_len": int,
    "boot_id": str,
}


def parse_cursor(text: str | bytes, what: str = "cursor") -> Cursor:
    """Validate a cursor document; DataError names what is wrong."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{what}: not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{what}: expected a JSON object")
    if doc.get("schema") != CURSOR_SCHEMA:
        raise DataError(f"{what}: schema must be {CURSOR_SCHEMA!r}, got {str(doc.get('schema'))[:40]!r}")
    values: dict[str, Any] = {}
    for key, kind in _CURSOR_FIELDS.items():
        value = doc.get(key, "" if key == "boot_id" else None)
        if kind is int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"{what}: {key} must be a whole number >= 0")
        elif not isinstance(value, str):
            raise DataError(f"{what}: {key} must be a string")
        values[key] = value
    digest = values["last_line_sha256"]
    if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        raise DataError(f"{what}: last_line_sha256 must be 64 hex digits")
    if values["last_line_len"] > values["offset"]:
        raise DataError(f"{what}: last_line_len is larger than offset")
    return Cursor(**values)


def load_cursor(path: str | Path) -> Cursor | None:
    """The saved cursor, None if there is none yet; DataError if it is unreadable."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise from_os_error(exc, f"cursor {path}") from None
    return parse_cursor(raw, f"cursor {path}")


def save_cursor(path: str | Path, cursor: Cursor) -> None:
    try:
        atomic_write_bytes(path, (json.dumps(cursor.to_json(), sort_keys=True) + "\n").encode())
    except OSError as exc:
        raise from_os_error(exc, f"cursor {path}") from None


# --------------------------------------------------------------------------------------------------
# Files, with the incremental cursor.


def _resume_point(fh: IO[bytes], st: os.stat_result, cursor: Cursor | None, notes: list[str]) -> tuple[int, int]:
    """(offset, line) to start from in the open file `fh`."""
    if cursor is None:
        return 0, 0
    if (cursor.device, cursor.inode) != (st.st_dev, st.st_ino):
        notes.append("log rotated (new inode): reading the new file from the start")
        return 0, 0
    if st.st_size < cursor.offset:
        notes.append("log truncated (smaller than the cursor): reading from the start")
        return 0, 0
    if cursor.last_line_len:
        fh.seek(cursor.offset - cursor.last_line_len)
        if _hash(fh.read(cursor.last_line_len)) != cursor.last_line_sha256:
            notes.append("log rewritten (last line changed): reading from the start")
            fh.seek(0)
            return 0, 0
    fh.seek(cursor.offset)
    return cursor.offset, cursor.line


def _rotated_tail(path: Path, cursor: Cursor, deadline: float, notes: list[str]) -> tuple[_Scan, str] | None:
    """After rotation (or a copy-and-truncate), the lines the last sweep missed in the old content:
    `<path>.1` (logrotate's rename: the cursor's inode; `copytruncate`: a copy, recognised by the hash of
    the last line read at the cursor's offset), else `<path>.1.gz` (`compress`: recognised by that hash).
    (scan, file name) or None."""
    old = path.with_name(path.name + ".1")
    try:
        with open(old, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size >= cursor.offset:
                if (st.st_dev, st.st_ino) == (cursor.device, cursor.inode):
                    offset, line = _resume_point(fh, st, cursor, [])
                else:
                    offset, line = _resume_archive(fh, cursor, []) if cursor.last_line_len else (0, 0)
                if offset == cursor.offset and (offset or (st.st_dev, st.st_ino) == (cursor.device, cursor.inode)):
                    notes.append(f"read the rest of the rotated file {old.name}")
                    return scan(fh, offset=offset, line=line, end=st.st_size, deadline=deadline), str(old)
    except OSError:
        pass
    return _rotated_archive_tail(path.with_name(path.name + ".1.gz"), cursor, deadline, notes)


def _rotated_archive_tail(old: Path, cursor: Cursor, deadline: float, notes: list[str]) -> tuple[_Scan, str] | None:
    if not cursor.offset or not cursor.last_line_len:
        return None
    try:
        fh, compressed = open_log(old)
    except OSError:
        return None
    try:
        if not compressed:
            return None
        offset, line = _resume_archive(fh, cursor, [])
        if offset != cursor.offset:
            return None  # not the file the cursor was in
        notes.append(f"read the rest of the rotated archive {old.name}")
        return scan(fh, offset=offset, line=line, deadline=deadline, final=True), str(old)
    except (OSError, EOFError, zlib.error, DataError) as exc:
        why = "truncated or corrupt" if not isinstance(exc, DataError) or "truncated" in str(exc) else str(exc)
        notes.append(f"the rest of the rotated archive {old.name} was not read: {why[:200]}")
        return None
    finally:
        close_log(fh)


def _resume_archive(fh: IO[bytes], cursor: Cursor, notes: list[str]) -> tuple[int, int]:
    """(offset, line) to continue an archive from (decompressing up to the cursor): the cursor's, when
    the last line it read is still there, else the start."""
    if not cursor.offset:
        return 0, 0
    fh.seek(cursor.offset - cursor.last_line_len)
    if _hash(fh.read(cursor.last_line_len)) == cursor.last_line_sha256:
        return cursor.offset, cursor.line
    notes.append("archive differs from the one the cursor was for: reading it from the start")
    fh.seek(0)
    return 0, 0


def _read_archive(
    path: Path, fh: IO[bytes], cursor: Cursor | None, deadline: float, timeout: float, parse: bool
) -> KernelLog:
    """A gzip-compressed (rotated) log, with a cursor like a plain file's: `offset` counts decompressed
    bytes, `device`/`inode` are the archive's. The same archive read again gives nothing new; a last
    line without a newline is consumed (an archive does not grow)."""
    notes: list[str] = []
    st = os.fstat(fh.fileobj.fileno())  # type: ignore[attr-defined]
    if cursor is not None and cursor.path != str(path):
        notes.append(f"cursor was for {cursor.path}: reading from the start")
        cursor = None
    offset = line = 0
    if cursor is not None:
        if (cursor.device, cursor.inode) != (st.st_dev, st.st_ino):
            notes.append("a different archive (new inode): reading it from the start")
            cursor = None
        else:
            offset, line = _resume_archive(fh, cursor, notes)
    result = scan(fh, offset=offset, line=line, deadline=deadline, final=True)
    if result.stopped_early:
        notes.append(f"stopped after {timeout:g} s at line {result.line}: the next sweep continues there")
    if result.offset > offset:
        last_hash, last_len = _hash(result.last_line), len(result.last_line)
    elif cursor is not None and offset:
        last_hash, last_len = cursor.last_line_sha256, cursor.last_line_len
    else:
        last_hash, last_len = "", 0
    new_cursor = Cursor(str(path), st.st_dev, st.st_ino, result.offset, result.line, last_hash, last_len)
    events: tuple[Event, ...] = ()
    unread: tuple[int, ...] = ()
    if parse:
        events = parse_candidates(result.candidates, str(path))
        unread = unread_xid_lines(result.candidates, events)
    notes.append("gzip-compressed: decompressed as read")
    return KernelLog(
        str(path),
        "ok",
        None,
        events,
        result.line - line,
        result.bytes_read,
        new_cursor,
        tuple(notes),
        unread,
        compressed=True,
        unreadable_lines=unreadable_candidates(result.candidates),
    )


def read_file(
    path: str | Path,
    *,
    cursor: Cursor | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    parse: bool = True,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
) -> KernelLog:
    """Read a kernel log file from the cursor (or the start) to its current end.

    progress: called once with (bytes to read, 0) and returning a per-chunk callback (a progress bar).
    """
    path = Path(path)
    deadline = time.monotonic() + timeout
    notes: list[str] = []
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            return _read_fifo(path, timeout)
        fh, compressed = open_log(path)
    except OSError as exc:
        raise from_os_error(exc, f"kernel log {path}") from None
    if compressed:
        try:
            return _read_archive(path, fh, cursor, deadline, timeout, parse)
        except (OSError, EOFError, zlib.error) as exc:
            if is_corrupt_archive(exc):
                raise DataError(f"kernel log {path}: compressed log is truncated or corrupt ({exc})") from None
            assert isinstance(exc, OSError)  # is_corrupt_archive took EOFError and zlib.error
            raise from_os_error(exc, f"kernel log {path}") from None
        finally:
            close_log(fh)
    with fh:
        st = os.fstat(fh.fileno())
        if not _is_regular(st):  # a pipe or device (/dev/stdin): read it whole, no cursor
            return read_stream(fh, str(path), timeout=timeout)
        if cursor is not None and cursor.path != str(path):
            notes.append(f"cursor was for {cursor.path}: reading from the start")
            cursor = None
        offset, line = _resume_point(fh, st, cursor, notes)
        previous: _Scan | None = None
        previous_source = ""
        if (
            cursor is not None
            and not offset
            and (cursor.offset or (cursor.device, cursor.inode) != (st.st_dev, st.st_ino))
        ):
            tail = _rotated_tail(path, cursor, deadline, notes)  # started over: the old content's rest
            if tail is not None:
                previous, previous_source = tail
        advance = progress(st.st_size - offset, 0) if progress is not None else None
        result = scan(fh, offset=offset, line=line, end=st.st_size, deadline=deadline, progress=advance)
        if result.stopped_early:
            notes.append(f"stopped after {timeout:g} s at line {result.line}: the next sweep continues there")
    last_len = len(result.last_line) if result.offset > offset else (cursor.last_line_len if cursor and offset else 0)
    last_hash = (
        _hash(result.last_line) if result.offset > offset else (cursor.last_line_sha256 if cursor and offset else "")
    )
    new_cursor = Cursor(str(path), st.st_dev, st.st_ino, result.offset, result.line, last_hash, last_len)
    events: tuple[Event, ...] = ()
    unread: tuple[int, ...] = ()
    if parse:
        source = str(path)
        if previous is not None:
            events = parse_candidates(previous.candidates, previous_source)
        own = parse_candidates(result.candidates, source)
        unread = unread_xid_lines(result.candidates, own)
        events += own
    lines = result.line - line + (previous.line - (cursor.line if cursor else 0) if previous else 0)
    return KernelLog(
        str(path),
        "ok",
        None,
        events,
        lines,
        result.bytes_read + (previous.bytes_read if previous else 0),
        new_cursor,
        tuple(notes),
        unread,
        unreadable_lines=unreadable_candidates(result.candidates)
        + (unreadable_candidates(previous.candidates) if previous else 0),
    )


def _is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


class _PipeReader:
    """A pipe, FIFO, socket or terminal read under a deadline: `read` waits for bytes (select) only
    until the deadline, then raises `UnavailableError` (exit 75). A blocking read would wait for a
    writer, or for the end of a stream that never ends, without bound."""

    def __init__(self, fd: int, source: str, deadline: float, timeout: float) -> None:
        self.fd, self.source, self.deadline, self.timeout = fd, source, deadline, timeout

    def read(self, n: int = -1) -> bytes:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise UnavailableError(
                    f"kernel log {self.source}: the stream did not end within {self.timeout:g} s "
                    "(a FIFO without a writer, or a pipe that stays open); --timeout sets the limit"
                )
            try:
                ready, _, _ = select.select([self.fd], [], [], left)
                if ready:
                    return os.read(self.fd, n if n > 0 else CHUNK)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise from_os_error(exc, f"kernel log {self.source}") from None


def _is_stream(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))


def _read_fifo(path: Path, timeout: float) -> KernelLog:
    """A named pipe: opened without blocking (a blocking open waits for a writer), read under the deadline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise from_os_error(exc, f"kernel log {path}") from None
    try:
        return read_stream(_PipeReader(fd, str(path), time.monotonic() + timeout, timeout), str(path))  # type: ignore[arg-type]
    finally:
        os.close(fd)


def read_stream(fh: IO[bytes], source: str = "-", *, timeout: float = DEFAULT_TIMEOUT_S) -> KernelLog:
    """Read a whole stream (stdin, command output): no cursor.

    A pipe, socket or terminal (stdin) is read under the deadline: when no end of stream comes
    within `timeout`, `UnavailableError` (75), never a wait without bound.
    """
    deadline = time.monotonic() + timeout
    if not isinstance(fh, _PipeReader):
        try:
            fd = fh.fileno()
        except (OSError, ValueError, AttributeError):  # io.BytesIO and friends: no descriptor
            fd = -1
        if fd >= 0 and _is_stream(fd):  # read by descriptor: the caller has read nothing from fh yet
            fh = _PipeReader(fd, source, deadline, timeout)  # type: ignore[assignment]
    result = scan(fh, final=True, deadline=deadline)
    notes = ("stopped at the deadline",) if result.stopped_early else ()
    events = parse_candidates(result.candidates, source)
    return KernelLog(
        source,
        "ok",
        None,
        events,
        result.line,
        result.bytes_read,
        None,
        notes,
        unread_xid_lines(result.candidates, events),
        unreadable_lines=unreadable_candidates(result.candidates),
    )


# --------------------------------------------------------------------------------------------------
# Live sources: dmesg, journalctl -k, /var/log/kern.log (the first that answers).


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _skip_seen(output: bytes, cursor: Cursor | None, notes: list[str]) -> bytes:
    """For stream sources: drop what the last sweep already saw (same boot, up to its last line)."""
    if cursor is None or not cursor.last_line_sha256 or cursor.boot_id != boot_id():
        return output
    pos = 0
    found = -1
    for raw in io.BytesIO(output):
        pos += len(raw)
        if len(raw) == cursor.last_line_len and _hash(raw) == cursor.last_line_sha256:
            found = pos
    if found == -1:
        notes.append("last seen line no longer in the ring buffer: reading all of it")
        return output
    return output[found:]


def place_in_time(events: tuple[Event, ...]) -> tuple[Event, ...]:
    """dmesg stamps lines with seconds since boot: on the live kernel that is boot time + uptime."""
    try:
        booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return events
    return tuple(
        replace(e, timestamp=booted + e.fields["uptime_s"])
        if e.timestamp is None and isinstance(e.fields.get("uptime_s"), (int, float))
        else e
        for e in events
    )


def _run(cmd: list[str], timeout: float) -> tuple[int | None, bytes, str]:
    """Run a command (never through a shell); (returncode or None on timeout, stdout, stderr line)."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return 127, b"", f"{cmd[0]} not installed"
    try:
        proc = subprocess.run(
            [exe, *cmd[1:]], capture_output=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return None, b"", f"timed out after {timeout:g} s"
    except OSError as exc:
        return 126, b"", str(exc)
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return proc.returncode, proc.stdout, (err[0] if err else "")


LIVE_SOURCES = (
    ("dmesg", ["dmesg"]),
    ("journalctl -k", ["journalctl", "-k", "-b", "--no-pager", "-o", "short-iso", "-q"]),
)
KERN_LOG_FILES = ("/var/log/kern.log",)


def read_live(
    *,
    cursor: Cursor | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    sources: tuple[tuple[str, list[str]], ...] = LIVE_SOURCES,
    files: tuple[str, ...] = KERN_LOG_FILES,
) -> KernelLog:
    """The running kernel's log: dmesg, else journalctl -k, else a readable kern.log. Says why not."""
    reasons: list[str] = []
    for name, cmd in sources:
        rc, out, err = _run(cmd, timeout)
        if rc is None:
            reasons.append(f"{name}: {err}")
            continue
        if rc != 0:
            if "not permitted" in err.lower() or "permission" in err.lower():
                err = f"refused ({err}); needs root or CAP_SYSLOG (kernel.dmesg_restrict=1)"
            reasons.append(f"{name}: {err or f'exit {rc}'}")
            continue
        lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith(b"-- ")]
        if not lines:
            reasons.append(f"{name}: no entries{f' ({err})' if err else ''}")
            continue
        notes = [f"fell back to {name}: " + "; ".join(reasons)] if reasons else []
        if cursor is not None and cursor.path != name:
            cursor = None
        new_part = _skip_seen(out, cursor, notes)
        log = read_stream(io.BytesIO(new_part), name, timeout=timeout)
        last = out.splitlines(keepends=True)[-1]
        new_cursor = Cursor(name, 0, 0, len(last), 0, _hash(last), len(last), boot_id())
        return replace(
            log,
            events=place_in_time(log.events),
            bytes_read=len(out),
            cursor=new_cursor,
            notes=tuple(notes) + log.notes,
        )
    for path in files:
        if os.access(path, os.R_OK):
            log = read_file(path, cursor=cursor if cursor and cursor.path == path else None, timeout=timeout)
            return replace(log, reason=None, notes=(f"fell back to {path}: " + "; ".join(reasons),) + log.notes)
        reasons.append(f"{path}: not readable")
    return KernelLog("live", "unknown", "; ".join(reasons))
