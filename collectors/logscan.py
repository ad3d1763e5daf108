"""The fast path for big logs: find candidate lines by their markers in large binary chunks.

Why: a cron sweep or an on-call engineer runs `gpu-doctor logs` on a multi-GiB kernel log or job log;
decoding and regex-matching every line would be ~50x slower than `grep`. Here the file is read in
8 MiB chunks, the `PREFILTER` (substrings of every rule marker with rare first bytes) is searched at
once with an Aho-Corasick automaton (`ahocorasick_rs`, SIMD-accelerated; one `bytes.find` pass per
marker is the fallback), newlines are counted only up to each hit for line numbers, and only the
records holding a hit are decoded and handed to the same `LogParser` that `iter_events` uses (which
drops those without a marker) - so both paths yield the same events. What is left is near the floor
of any scan that numbers its lines: on CPython 3.11 `bytes.count(b"\n")` is a scalar loop (~0.35 s
of CPU per GiB, about as much as the search), reported by bench/logs.py. Records end at `\n` or `\r` (progress bars);
line numbers count `\n` only. Memory stays bounded by the chunk size plus the longest record (records
longer than `MAX_LINE_BYTES` are cut).

`open_log` / `read_log` are the one reader of `gpu-doctor logs`, `diagnose node --log` and the
kernel-log collector: gzip-compressed (rotated) logs are decompressed as they are read, and small
inputs (pastes) have their wrapped lines re-joined (`logwrap`).

Lazy imports (start-up time): ahocorasick_rs, only when a chunk is scanned; gzip and logwrap, only when
a file is opened through `open_log` / `read_log`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, cast

from gpuguard.collectors.logparse import MARKERS, MAX_LINE, LogParser
from gpuguard.foundation.events import Event

CHUNK = 8 << 20
MAX_LINE_BYTES = 4 * MAX_LINE  # >= MAX_LINE characters after decoding, so both paths cut alike
_BYTE_MARKERS = [m.encode("ascii") for m in MARKERS]

# The scanner's prefilter: substrings of the markers whose first four bytes are rare in log text.
# Why: the SIMD prefilter (Teddy) fingerprints each pattern by its first bytes and verifies every
# position that matches one; markers that start like common words (`device`, `local_`, `detected`,
# `host`, `closing`, `NCCL` of every NCCL INFO line) made it verify on a quarter of all lines. A record
# holding a prefilter pattern but no marker is dropped by the parser's own marker test, so the events
# are the same (tests/collectors/test_logscan_prefilter.py). Markers no pattern here covers are added
# as they are (`prefilter()`), so a new rule can never be missed.
PREFILTER = (
    "NVRM: ",
    "XidC",
    "SXid",
    "llen off the bus",
    "U is lost",
    "handle for GPU",
    "No devices",
    "annot attach",
    "AER: ",
    "AER-aware",
    "PCIe ",
    "PCI bridge to",
    "abric",
    "NV_ERR_RESET_REQUIRED",
    "Reset required",
    "blocked for more than",
    "orkNCCL",
    "CL WARN",
    "ARN ",
    "CL error in",
    "nccl",
    "runtime error",
    "CUDA",
    "Cuda failure",
    "watchdog",
    "Heartbeat monitor timed out",
    "at NCCL work",
    "taking the entire process down",
    "Terminating the process after",
    "gloo",
    "xitcode",
    "_rank",
    "host      :",
    "Root Cause",
    "g signal",
    "r group",
    "ndezvous",
    "[c10d]",
    "s joined",
    "t_count=",
    "master_",
    "_world_size",
    "e NVML",
    "[Hardware Error]",
    "x locked memory",
)


def prefilter(markers: tuple[str, ...] = MARKERS, patterns: tuple[str, ...] = PREFILTER) -> list[bytes]:
    """The patterns the fast scanner searches: those of `patterns` that lie inside some marker, plus every
    marker none of them lies inside. Every line holding a marker holds one of these."""
    used = [p for p in patterns if any(p in m for m in markers)]
    extra = [m for m in markers if not any(p in m for p in used)]
    return [p.encode("ascii") for p in (*used, *extra)]


PREFILTER_BYTES = prefilter()


Finder = Callable[[bytearray, int, int], list[int]]
_NL = ord("\n")


def _first_delim(buf: bytearray, start: int, end: int) -> int:
    """Offset of the first record delimiter (`\n` or `\r`) in buf[start:end], or -1."""
    nl = buf.find(b"\n", start, end)
    cr = buf.find(b"\r", start, nl if nl >= 0 else end)
    return cr if cr >= 0 else nl


def _bytes_finder(markers: list[bytes] | None = None) -> Finder:
    """A function giving the offsets of marker hits in `buf[start:end]`, in order (default: the rules'
    markers; the kernel-log reader passes its own keywords)."""
    try:
        import ahocorasick_rs
    except ImportError:  # pragma: no cover - the fallback is exercised through `accelerated=False`
        return _fallback_finder(markers)
    ac = ahocorasick_rs.BytesAhoCorasick(markers or _BYTE_MARKERS, matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)

    def find(buf: bytearray, start: int, end: int) -> list[int]:
        with memoryview(buf) as view:
            return [start + s for _, s, _ in ac.find_matches_as_indexes(view[start:end])]

    return find


bytes_finder = _bytes_finder


def _fallback_finder(markers: list[bytes] | None = None) -> Finder:
    """Without ahocorasick_rs: one `bytes.find` pass per marker (memchr-speed, ~10x faster than one
    alternation regex), hits merged in order."""
    patterns = markers or _BYTE_MARKERS

    def find(buf: bytearray, start: int, end: int) -> list[int]:
        hits: list[int] = []
        for marker in patterns:
            i = buf.find(marker, start, end)
            while i >= 0:
                hits.append(i)
                nxt = _first_delim(buf, i, end)  # records end at `\n` or `\r`: the next one may hit too
                i = buf.find(marker, nxt + 1, end) if nxt >= 0 else -1
        hits.sort()
        return hits

    return find


GZIP_MAGIC = b"\x1f\x8b"
# A rotated kernel or job log decompresses to a few GiB at most and compresses ~10-30x; a gzip bomb
# (a small file that decompresses to terabytes) compresses ~1000x. Both limits are refused (DataError, 65).
MAX_DECOMPRESSED = 16 << 30  # bytes one archive may decompress to
MAX_RATIO = 500  # decompressed / compressed bytes, checked once RATIO_FROM bytes are out
RATIO_FROM = 64 << 20


def open_log(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_DECOMPRESSED, max_ratio: int = MAX_RATIO
) -> tuple[BinaryIO, bool]:
    """Open a log file for reading bytes: (file, compressed). A gzip-compressed (rotated) log such as
    `kern.log.2.gz` is recognised by its magic bytes and decompressed as it is read, at most `max_bytes`
    and at most `max_ratio` times its compressed size (`DataError` beyond: a gzip bomb). The one opener
    of `gpu-doctor logs`, `diagnose node` and `sweep`. OSError as the OS gives it."""
    fh = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    try:
        magic = fh.peek(2)[:2] if hasattr(fh, "peek") else b""
    except OSError:
        fh.close()
        raise
    if magic == GZIP_MAGIC:
        return CappedGzip(fh, os.fspath(path), max_bytes, max_ratio), True  # type: ignore[return-value]
    return fh, False


class CappedGzip:
    """A gzip stream read with a cap on what it decompresses to (see `open_log`). Reading past the cap
    raises `DataError` with one line; a truncated or corrupt archive raises what gzip raises
    (`is_corrupt_archive`). Closing it does not close the file under it (`close_log` does)."""

    def __init__(self, raw: BinaryIO, name: str, max_bytes: int = MAX_DECOMPRESSED, max_ratio: int = MAX_RATIO) -> None:
        import gzip  # lazy: only when an archive is opened

        self.fileobj = raw
        self.name = name
        self.max_bytes, self.max_ratio = max_bytes, max_ratio
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def _check(self) -> None:
        out = self._gz.tell()
        if out > self.max_bytes:
            self._refuse(f"decompresses to more than {self.max_bytes:,} bytes")
        if out > RATIO_FROM:
            packed = max(1, self.fileobj.tell())
            if out > self.max_ratio * packed:
                self._refuse(f"decompresses to more than {self.max_ratio}x its size ({out:,} bytes from {packed:,})")

    def _refuse(self, why: str) -> None:
        from gpuguard.foundation.errors import DataError

        raise DataError(f"{self.name}: gzip archive {why}: refused (a gzip bomb, or not a log)")

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:  # never decompress without bound in one call
            parts = []
            while part := self.read(1 << 20):
                parts.append(part)
            return b"".join(parts)
        data = self._gz.read(min(n, self.max_bytes + 1))
        self._check()
        return data

    def readinto(self, view: memoryview | bytearray) -> int:
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0 and offset > self.max_bytes:
            self._refuse(f"is asked for byte {offset:,}, past the cap of {self.max_bytes:,}")
        pos = self._gz.seek(offset, whence)
        self._check()
        return pos

    def tell(self) -> int:
        return self._gz.tell()

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._gz.close()

    def __enter__(self) -> CappedGzip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_log(fh: BinaryIO) -> None:
    inner = getattr(fh, "fileobj", None)
    fh.close()
    if inner is not None:
        inner.close()


def is_corrupt_archive(exc: BaseException) -> bool:
    """A truncated or corrupt .gz (EOFError, zlib.error, gzip.BadGzipFile), as opposed to an I/O error."""
    import zlib

    if isinstance(exc, (EOFError, zlib.error)):
        return True
    return isinstance(exc, OSError) and exc.errno is None


@dataclass
class LogScan:
    """Scan one binary file from `start_offset`; iterate for events.

    After iteration: `offset` is the byte offset just past the last complete line read (a cursor for
    the next incremental run), `next_line` the number the next line will have, `bytes_read` the bytes
    consumed. A final line without a newline is parsed only when `partial_last_line` is True (a file
    being appended to may still be writing it); `\r`-ended records of that line are parsed as they
    complete, so a resumed scan can see those again.
    """

    file: BinaryIO
    source: str | None = None
    start_offset: int = 0
    start_line: int = 1
    partial_last_line: bool = True
    accelerated: bool = True
    chunk_size: int = CHUNK
    year: int | None = None
    on_progress: Callable[[int], None] | None = None
    offset: int = field(init=False, default=0)
    next_line: int = field(init=False, default=1)
    bytes_read: int = field(init=False, default=0)
    unreadable_lines: int = field(init=False, default=0)  # see `LogParser.unreadable`

    def __iter__(self) -> Iterator[Event]:
        parser = LogParser(self.source, year=self.year)
        try:
            yield from self._scan(parser)
        finally:
            self.unreadable_lines = parser.unreadable

    def _scan(self, parser: LogParser) -> Iterator[Event]:
        # accelerated: the prefilter's patterns (a superset of the marker lines; the parser drops the
        # rest); the fallback searches the markers themselves (the reference path of the tests)
        find = _bytes_finder(PREFILTER_BYTES) if self.accelerated else _fallback_finder()
        count_nl = _newline_counter(self.file, self.start_offset) if self.accelerated else _count_nl
        if self.start_offset:
            self.file.seek(self.start_offset)
        self.offset = self.start_offset
        line_no = self.start_line
        chunk = max(1, self.chunk_size)
        # One reused buffer (no per-chunk allocation or page faults): buf[0:have] holds the kept head
        # of the current unfinished line, the next chunk is read right after it.
        buf = bytearray(2 * chunk)
        have = 0
        dropping = False  # the current line is longer than MAX_LINE_BYTES: drop the rest of it
        while True:
            if have + chunk > len(buf):
                buf.extend(bytes(have + chunk - len(buf)))
            with memoryview(buf) as view:
                n = self._read_into(view[have : have + chunk])
            if not n:
                break
            chunk_start = self.start_offset + self.bytes_read
            self.bytes_read += n
            end = have + n
            nl = buf.rfind(b"\n", have, end)
            if nl >= 0:
                self.offset = chunk_start + nl - have + 1
            if self.on_progress is not None:
                self.on_progress(n)
            start = 0
            if dropping:  # skip the rest of an over-long record up to its end
                first = _first_delim(buf, have, end)
                if first < 0:
                    continue
                yield from parser.feed(bytes(buf[:have]), line_no)
                if buf[first] == _NL:
                    line_no += 1
                dropping = False
                start = first + 1
            # the last record delimiter: a `\r` only counts after the last `\n` (searching the whole chunk
            # for a `\r` that is usually not there was one more full pass, ~0.1 s of CPU per GiB)
            last_nl = buf.rfind(b"\n", start, end)
            last = max(last_nl, buf.rfind(b"\r", max(start, last_nl + 1), end))
            rest_start = start
            if last >= 0:
                pos = start  # offset up to which newlines are counted into line_no
                skip_to = start  # hits before this offset belong to a record already parsed
                for hit in find(buf, start, last + 1):
                    if hit < skip_to:
                        continue
                    ls = buf.rfind(b"\n", start, hit) + 1 or start
                    cr = buf.rfind(b"\r", ls, hit)
                    rs = cr + 1 if cr >= 0 else ls
                    re_ = _first_delim(buf, hit, last + 1)
                    line_no += count_nl(buf, pos, rs)
                    pos = rs
                    yield from parser.feed(buf[rs : min(re_, rs + MAX_LINE_BYTES)], line_no)
                    skip_to = re_ + 1
                line_no += count_nl(buf, pos, last + 1)
                rest_start = last + 1
            rest = end - rest_start
            if rest > MAX_LINE_BYTES:
                rest, dropping = MAX_LINE_BYTES, True
            buf[0:rest] = buf[rest_start : rest_start + rest]
            have = rest
        if have and self.partial_last_line:
            yield from parser.feed(bytes(buf[:have]), line_no)
        self.next_line = line_no
        yield from parser.close()

    def _read_into(self, view: memoryview) -> int:
        readinto = getattr(self.file, "readinto", None)
        if readinto is not None:
            return readinto(view) or 0
        data = self.file.read(len(view))  # file-likes without readinto
        view[: len(data)] = data
        return len(data)


# Newline counting is half the scanner's floor: `bytes.count(b"\n")` is a scalar loop on CPython 3.11
# (~0.4 s of CPU per GiB). numpy's vectorised compare-and-count does it in about half that; importing
# numpy costs ~0.08 s, so it is used only for a regular file of at least NUMPY_FROM bytes still to read,
# and only when numpy is installed (the `runtime` extra has it; the light install does without: same
# counts, by the pure loop). Counts are equal either way (tests/collectors/test_logscan_count.py).
NUMPY_FROM = 512 << 20
_NUMPY_MIN_SPAN = 4096  # shorter spans: bytes.count (numpy's per-call overhead is ~2 us)


def _count_nl(buf: bytearray, start: int, end: int) -> int:
    return buf.count(b"\n", start, end)


def _newline_counter(file: object, start_offset: int) -> Callable[[bytearray, int, int], int]:
    """The newline counter for a scan of `file` from `start_offset` (see NUMPY_FROM)."""
    try:
        st = os.fstat(file.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return _count_nl  # a stream, an archive, a file-like: size unknown
    import stat

    if not stat.S_ISREG(st.st_mode) or st.st_size - start_offset < NUMPY_FROM:
        return _count_nl
    try:
        import numpy
    except ImportError:
        return _count_nl
    frombuffer, count_nonzero, uint8 = numpy.frombuffer, numpy.count_nonzero, numpy.uint8

    def count(buf: bytearray, start: int, end: int) -> int:
        if end - start < _NUMPY_MIN_SPAN:
            return buf.count(b"\n", start, end)
        # a temporary view: released before the buffer is next resized (BufferError otherwise)
        return int(count_nonzero(frombuffer(buf, uint8, end - start, start) == 10))

    return count


def iter_file_events(
    path_or_binary_file: str | os.PathLike[str] | BinaryIO,
    *,
    start_offset: int = 0,
    start_line: int = 1,
    source: str | None = None,
    partial_last_line: bool = True,
    accelerated: bool = True,
) -> Iterator[Event]:
    """Events of a (big) file, streaming; same events as `iter_events` over its lines."""
    if isinstance(path_or_binary_file, (str, os.PathLike)):
        path = os.fspath(path_or_binary_file)
        with open(path, "rb") as fh:
            yield from LogScan(
                fh,
                source=source or path,
                start_offset=start_offset,
                start_line=start_line,
                partial_last_line=partial_last_line,
                accelerated=accelerated,
            )
        return
    yield from LogScan(
        path_or_binary_file,
        source=source,
        start_offset=start_offset,
        start_line=start_line,
        partial_last_line=partial_last_line,
        accelerated=accelerated,
    )


def read_log(path: str | os.PathLike[str], *, source: str | None = None) -> tuple[list[Event], dict[str, object]]:
    """All events of one log file, `.gz` or not: (events, {"lines", "bytes", "compressed", "rejoined",
    "unreadable_lines"}) (unreadable: lines holding a marker that were not valid UTF-8 or were cut).

    A small input (a paste, up to `logwrap.MAX_BYTES` after decompression) is read whole and its wrapped
    lines are re-joined (`logwrap`); a bigger one streams through `LogScan`. Errors: OSError from the OS;
    a truncated or corrupt archive raises what gzip raises (see `is_corrupt_archive`).
    """
    from gpuguard.collectors import logwrap

    name = source or os.fspath(path)
    fh, compressed = open_log(path)
    try:
        head = fh.read(logwrap.MAX_BYTES + 1)
        if len(head) <= logwrap.MAX_BYTES:
            lines, unreadable = logwrap.split_paste(head)
            events = list(logwrap.iter_rejoined(lines, source=name))
            return events, {
                "lines": len(lines),
                "bytes": len(head),
                "compressed": compressed,
                "rejoined": True,
                "unreadable_lines": unreadable,
            }
        scan = LogScan(cast(BinaryIO, _Chained(head, fh)), source=name)  # duck-typed: read/readinto
        events = list(scan)
        return events, {
            "lines": scan.next_line - 1,
            "bytes": scan.bytes_read,
            "compressed": compressed,
            "rejoined": False,
            "unreadable_lines": scan.unreadable_lines,
        }
    finally:
        close_log(fh)


class _Chained:
    """A binary reader over `head` and then the rest of `rest` (what was read ahead, then the file)."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def readinto(self, view: memoryview) -> int:
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        readinto = getattr(self._rest, "readinto", None)
        if readinto is not None:
            return readinto(view) or 0
        data = self._rest.read(len(view))
        view[: len(data)] = data
        return len(data)

    def read(self, n: int = -1) -> bytes:
        buf = bytearray(n if n > 0 else 1 << 20)
        with memoryview(buf) as view:
            got = self.readinto(view)
        return bytes(buf[:got])
