"""The fast path for big logs: find candidate lines by their markers in large binary chunks.

Why: a cron sweep or an on-call engineer runs `gpu-doctor logs` on a multi-GiB kernel log or job log;
decoding and regex-matching every line would be ~50x slower than `grep`. Here the file is read in
8 MiB chunks, every rule marker is searched at once with an Aho-Corasick automaton (`ahocorasick_rs`,
SIMD-accelerated; one `bytes.find` pass per marker is the fallback), newlines are counted only up to each hit
for line numbers, and only lines holding a marker are decoded and handed to the same `LogParser` that
`iter_events` uses - so both paths yield the same events. Memory stays bounded by the chunk size plus
the longest line (lines longer than `MAX_LINE_BYTES` are cut).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator

from gpuguard.diagnostics.events import Event
from gpuguard.diagnostics.logparse import MARKERS, MAX_LINE, LogParser

CHUNK = 8 << 20
MAX_LINE_BYTES = 4 * MAX_LINE  # >= MAX_LINE characters after decoding, so both paths cut alike
_BYTE_MARKERS = [m.encode("ascii") for m in MARKERS]


Finder = Callable[[bytes, int], list[int]]


def _bytes_finder() -> Finder:
    """A function giving the start offsets of marker hits in `buf[:end]`, in order."""
    try:
        import ahocorasick_rs
    except ImportError:  # pragma: no cover - the fallback is exercised through `accelerated=False`
        return _fallback_finder()
    ac = ahocorasick_rs.BytesAhoCorasick(_BYTE_MARKERS, matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)

    def find(buf: bytes, end: int) -> list[int]:
        return [start for _, start, _ in ac.find_matches_as_indexes(memoryview(buf)[:end])]

    return find


def _fallback_finder() -> Finder:
    """Without ahocorasick_rs: one `bytes.find` pass per marker (memchr-speed, ~10x faster than one
    alternation regex), hits merged in order."""

    def find(buf: bytes, end: int) -> list[int]:
        hits: list[int] = []
        for marker in _BYTE_MARKERS:
            i = buf.find(marker, 0, end)
            while i >= 0:
                hits.append(i)
                i = buf.find(marker, buf.find(b"\n", i, end) + 1 or end, end)
        hits.sort()
        return hits

    return find


@dataclass
class LogScan:
    """Scan one binary file from `start_offset`; iterate for events.

    After iteration: `offset` is the byte offset just past the last complete line read (a cursor for
    the next incremental run), `next_line` the number the next line will have, `bytes_read` the bytes
    consumed. A final line without a newline is parsed only when `partial_last_line` is True (a file
    being appended to may still be writing it).
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

    def __iter__(self) -> Iterator[Event]:
        find = _bytes_finder() if self.accelerated else _fallback_finder()
        parser = LogParser(self.source, year=self.year)
        if self.start_offset:
            self.file.seek(self.start_offset)
        self.offset = self.start_offset
        line_no = self.start_line
        carry = b""  # the kept head of the current, unfinished line
        dropping = False  # the current line is longer than MAX_LINE_BYTES: drop the rest of it
        while True:
            chunk = self.file.read(self.chunk_size)
            if not chunk:
                break
            chunk_start = self.start_offset + self.bytes_read
            self.bytes_read += len(chunk)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                self.offset = chunk_start + nl + 1
            if self.on_progress is not None:
                self.on_progress(len(chunk))
            if dropping:
                first = chunk.find(b"\n")
                if first < 0:
                    continue
                yield from parser.feed(carry, line_no)
                line_no += 1
                carry, dropping = b"", False
                chunk = chunk[first + 1:]
            buf = carry + chunk if carry else chunk
            last_nl = buf.rfind(b"\n")
            if last_nl >= 0:
                pos = 0  # buffer offset up to which newlines are counted into line_no
                skip_to = 0  # hits before this offset belong to a line already parsed
                for start in find(buf, last_nl + 1):
                    if start < skip_to:
                        continue
                    ls = buf.rfind(b"\n", 0, start) + 1
                    le = buf.find(b"\n", start)
                    line_no += buf.count(b"\n", pos, ls)
                    pos = ls
                    yield from parser.feed(buf[ls:min(le, ls + MAX_LINE_BYTES)], line_no)
                    skip_to = le + 1
                line_no += buf.count(b"\n", pos, last_nl + 1)
            carry = buf[last_nl + 1:]
            if len(carry) > MAX_LINE_BYTES:
                carry, dropping = carry[:MAX_LINE_BYTES], True
        if carry and self.partial_last_line:
            yield from parser.feed(carry, line_no)
        self.next_line = line_no
        yield from parser.close()


def iter_file_events(path_or_binary_file: str | os.PathLike[str] | BinaryIO, *, start_offset: int = 0,
                     start_line: int = 1, source: str | None = None, partial_last_line: bool = True,
                     accelerated: bool = True) -> Iterator[Event]:
    """Events of a (big) file, streaming; same events as `iter_events` over its lines."""
    if isinstance(path_or_binary_file, (str, os.PathLike)):
        path = os.fspath(path_or_binary_file)
        with open(path, "rb") as fh:
            yield from LogScan(fh, source=source or path, start_offset=start_offset, start_line=start_line,
                               partial_last_line=partial_last_line, accelerated=accelerated)
        return
    yield from LogScan(path_or_binary_file, source=source, start_offset=start_offset, start_line=start_line,
                       partial_last_line=partial_last_line, accelerated=accelerated)
