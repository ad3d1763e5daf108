"""Following a kernel log as it grows: `/dev/kmsg`, `journalctl -k -f`, a file, a FIFO or a terminal.

Why: `gpu-doctor watch node` must see an Xid within a second of the driver printing it, not at the next
cron sweep, and must cost nothing while nothing happens. Each follower exposes the file descriptor to
wait on (`fileno`, for `select`; None for a regular file, which is checked by `stat` at the caller's
poll interval: files cannot be waited on with `select`) and `read_new()`, which returns the events of
the complete lines that arrived since the last call, never blocking.

- `KmsgFollower`: `/dev/kmsg`, one record per read (`<prio>,<seq>,<usec>,<flags>;<text>`). Its cursor
  is the record's sequence number and the boot id: a restart skips what it has judged; records the
  ring buffer overwrote meanwhile (EPIPE) are counted as missed, never a failure.
- `StreamFollower`: a FIFO, a pty, stdin, or a `journalctl -k -f` child: bytes as they come, split into
  complete lines (a line longer than `MAX_LINE` is cut). A FIFO is opened read-write, so a writer that
  closes it is not an end of file: the next writer is followed too.
- `FileFollower`: a regular file, read from its cursor with `kernel_log.read_file` (rotation, truncation
  and rewriting are handled there, as for the sweep).

Events come from the same parser as every other read (`logparse.LogParser`), with the same state across
reads (multi-line messages split over two reads are still one event).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from typing import Any

from gpuguard.collectors import kernel_log
from gpuguard.collectors.kernel_scan import KEYWORDS, MAX_LINE
from gpuguard.collectors.logparse import LogParser
from gpuguard.foundation.errors import DataError, UnavailableError, from_os_error
from gpuguard.foundation.events import Event

KMSG = "/dev/kmsg"
READ_SIZE = 64 * 1024
MAX_BUFFER = 4 * MAX_LINE  # bytes kept of a line still being written (bounded memory)
JOURNAL = ("journalctl", "-k", "-f", "-n", "all", "-b", "--no-pager", "-o", "short-iso", "-q")


def _candidate(line: bytes) -> bool:
    return any(k in line for k in KEYWORDS)


class _Lines:
    """Complete lines out of a byte stream, the parser's state kept between reads."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.parser = LogParser(source)
        self.buffer = b""
        self.line = 0

    def feed(self, data: bytes, *, final: bool = False) -> list[Event]:
        self.buffer += data
        if len(self.buffer) > MAX_BUFFER and b"\n" not in self.buffer:
            self.buffer = self.buffer[:MAX_LINE] + b"\n"  # an endless line: cut it, keep memory bounded
        *complete, self.buffer = self.buffer.split(b"\n")
        if final and self.buffer:
            complete, self.buffer = [*complete, self.buffer], b""
        events: list[Event] = []
        for raw in complete:
            self.line += 1
            if _candidate(raw):
                events.extend(self.parser.feed(raw[:MAX_LINE].decode("utf-8", "replace").rstrip("\r"), self.line))
        return events


class StreamFollower:
    """A FIFO, pty, stdin or child process: wait on `fileno()`, then `read_new()`."""

    def __init__(self, fd: int, source: str, *, owns_fd: bool = True, child: subprocess.Popen[bytes] | None = None):
        os.set_blocking(fd, False)
        self.fd, self.source, self.owns_fd, self.child = fd, source, owns_fd, child
        self.lines = _Lines(source)
        self.ended = False
        self.cursor: kernel_log.Cursor | None = None

    def fileno(self) -> int | None:
        return None if self.ended else self.fd

    def read_new(self) -> list[Event]:
        events: list[Event] = []
        while not self.ended:
            try:
                data = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EIO:  # a pty whose other end closed
                    data = b""
                else:
                    raise from_os_error(exc, f"kernel log {self.source}") from None
            if not data:
                self.ended = True
                events.extend(self.lines.feed(b"", final=True))
                break
            events.extend(self.lines.feed(data))
        return events

    def close(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            try:
                self.child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.child.kill()
        if self.owns_fd:
            os.close(self.fd)


def parse_kmsg_record(record: bytes) -> tuple[int, float, str] | None:
    """`<prio>,<seq>,<usec>,<flags>[,...];<text>` (plus ` KEY=value` continuation lines) -> (seq, seconds
    since boot, text), or None when the record is not one."""
    head, sep, rest = record.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4 or not fields[1].isdigit() or not fields[2].isdigit():
        return None
    text = rest.split(b"\n", 1)[0]  # dictionary lines (SUBSYSTEM=..., DEVICE=...) follow the text
    return int(fields[1]), int(fields[2]) / 1e6, text.decode("utf-8", "replace")


class KmsgFollower:
    """`/dev/kmsg`: one record per read, resumed after the sequence number of the cursor (same boot)."""

    def __init__(self, cursor: kernel_log.Cursor | None, path: str = KMSG) -> None:
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise from_os_error(exc, f"kernel log {path}") from None
        self.source = path
        self.boot = kernel_log.boot_id()
        self.after = cursor.offset if cursor is not None and cursor.path == path and cursor.boot_id == self.boot else -1
        self.seq = self.after
        self.parser = LogParser(path)
        self.missed = 0

    def fileno(self) -> int | None:
        return self.fd

    @property
    def cursor(self) -> kernel_log.Cursor | None:
        if self.seq < 0:
            return None
        return kernel_log.Cursor(self.source, 0, 0, self.seq, 0, "", 0, self.boot)

    def read_new(self) -> list[Event]:
        events: list[Event] = []
        while True:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:
                return events
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring buffer overwrote records before we read them
                    self.missed += 1
                    continue
                raise from_os_error(exc, f"kernel log {self.source}") from None
            if not record:
                return events
            parsed = parse_kmsg_record(record)
            if parsed is None:
                continue
            seq, uptime, text = parsed
            if seq <= self.after:
                continue
            self.seq = seq
            line = f"[{uptime:12.6f}] {text}"
            if _candidate(line.encode()):
                events.extend(_placed(self.parser.feed(line, seq)))

    def close(self) -> None:
        os.close(self.fd)


def _placed(events: list[Event]) -> list[Event]:
    """Seconds since boot, on the live kernel, are boot time + uptime (as `kernel_log.read_live` does)."""
    return list(kernel_log.place_in_time(tuple(events))) if events else events


class FileFollower:
    """A regular file, read from its cursor on each `read_new` (the caller polls it: `fileno()` is None)."""

    def __init__(self, path: str, cursor: kernel_log.Cursor | None, *, timeout: float = 10.0) -> None:
        self.source, self.timeout = path, timeout
        self.cursor = cursor if cursor is not None and cursor.path == path else None
        self.size: tuple[int, int, int] | None = None

    def fileno(self) -> int | None:
        return None

    def changed(self) -> bool:
        """Has the file grown, shrunk or been replaced since the last read (one `stat`, no read)?"""
        try:
            st = os.stat(self.source)
        except OSError:
            return False
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        return key != self.size

    def read_new(self) -> list[Event]:
        try:
            st = os.stat(self.source)
        except OSError:
            return []  # rotated away and not recreated yet: the next poll looks again
        log = kernel_log.read_file(self.source, cursor=self.cursor, timeout=self.timeout)
        self.cursor = log.cursor
        self.size = (st.st_ino, st.st_size, st.st_mtime_ns)
        return list(log.events)

    def close(self) -> None:
        return None


Follower = Any  # KmsgFollower | StreamFollower | FileFollower


def open_follower(
    spec: str | None,
    cursor: kernel_log.Cursor | None,
    *,
    stdin_fd: int = 0,
    which: Callable[[str], str | None] = shutil.which,
) -> Follower:
    """The follower for `--kernel-log`: `-` stdin, a path (FIFO, terminal or character device: a stream;
    `/dev/kmsg`: records; a regular file: polled), or by default `/dev/kmsg`, else `journalctl -k -f`."""
    if spec == "-":
        return StreamFollower(stdin_fd, "-", owns_fd=False)
    if spec is None:
        if os.access(KMSG, os.R_OK):
            return KmsgFollower(cursor)
        exe = which(JOURNAL[0])
        if exe is None:
            raise UnavailableError(f"no live kernel log: {KMSG} is not readable and journalctl is not installed")
        child = subprocess.Popen([exe, *JOURNAL[1:]], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert child.stdout is not None
        return StreamFollower(child.stdout.fileno(), "journalctl -k", owns_fd=False, child=child)
    try:
        mode = os.stat(spec).st_mode
    except OSError as exc:
        raise from_os_error(exc, f"kernel log {spec}") from None
    if os.path.realpath(spec) == KMSG:
        return KmsgFollower(cursor, spec)
    if stat.S_ISFIFO(mode):
        try:  # read-write: no writer is not an end of file, and the open never blocks
            fd = os.open(spec, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise from_os_error(exc, f"kernel log {spec}") from None
        return StreamFollower(fd, spec)
    if stat.S_ISCHR(mode) or stat.S_ISSOCK(mode):
        try:
            fd = os.open(spec, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
        except OSError as exc:
            raise from_os_error(exc, f"kernel log {spec}") from None
        return StreamFollower(fd, spec)
    if stat.S_ISREG(mode):
        return FileFollower(spec, cursor)
    raise DataError(f"kernel log {spec}: not a file, FIFO, terminal or /dev/kmsg")


def describe(follower: Follower) -> str:
    """How the follower reads, for the document's `kernel_log` section."""
    kind = {KmsgFollower: "kmsg", StreamFollower: "stream", FileFollower: "file"}.get(type(follower), "?")
    return f"{follower.source} ({kind}, followed)"


__all__ = [
    "FileFollower",
    "KmsgFollower",
    "StreamFollower",
    "describe",
    "open_follower",
    "parse_kmsg_record",
]
