"""Finding the kernel-log lines that can matter, fast: one multi-pattern byte search for `KEYWORDS`, complete
lines only, the candidates handed to the log parser in contiguous runs with their real line numbers.

Why a module of its own: the one-shot reader (`kernel_log`), the sweep's incremental reader and the
watcher's follower (`kernel_follow`) all scan the same way; a 1 GiB `kern.log` must be read at close
to disk speed, so only lines holding a keyword are ever decoded.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from gpuguard.collectors.logparse import iter_events
from gpuguard.collectors.logscan import bytes_finder
from gpuguard.foundation.events import Event

KEYWORDS = (
    b"NVRM",
    b"Xid",
    b"XID",
    b"AER",
    b"PCIe Bus Error",
    b"abric",
    b"No devices were found",
    b"device handle for GPU",
    b"annot attach",
    b"fallen off the bus",
    b"RESET_REQUIRED",
    b"Hardware Error",
    b"Failed to initialize NVML",
    b"uncorrectable",  # a training log passed as --kernel-log: CUDA's uncorrectable ECC / NVLink errors
    b"not yet initialized",
    b"PCI bridge to",  # boot-time topology: maps an AER error on a port to the GPU below it
    b"mlx5",  # the NIC driver's memory-registration errors: job-level network evidence
    # a job's log passed as --kernel-log: its collective timeouts and errors are counted as job-level events
    b"WorkNCCL",
    b"NCCL WARN",
    b"NCCL error",
    b"] Assertion",
)
_XID_WORD = re.compile(r"\bX[Ii][Dd]\b")
# bytes one of which every pasted `nvidia-smi` report (`-q` or the table) holds (`collectors.nvidia_smi`):
# a file without them is not read as a report
REPORT_MARKS = (
    b"NVSMI LOG",
    b"Attached GPUs",
    b"Product Name",
    b"Remapped Rows",
    b"ECC Errors",
    b"NVIDIA-SMI",
    b"Bus-Id",
)
CHUNK = 8 * 1024 * 1024
MAX_LINE = 4 * 1024 * 1024  # a "line" longer than this is cut (a binary file must not exhaust memory)


@dataclass
class _Scan:
    candidates: list[tuple[int, bytes]] = field(default_factory=list)
    offset: int = 0  # just after the last complete line consumed
    line: int = 0  # lines consumed
    last_line: bytes = b""
    bytes_read: int = 0
    stopped_early: bool = False


_FINDER: list[Any] = []


def _scan_block(block: bytes, first_line: int, out: list[tuple[int, bytes]]) -> None:
    if not _FINDER:  # one Aho-Corasick pass for all keywords (a find pass per keyword was 3x slower)
        _FINDER.append(bytes_finder(list(KEYWORDS)))
    starts: set[int] = set()
    line_end = -1
    for i in _FINDER[0](block, 0, len(block)):
        if i <= line_end:
            continue  # another keyword on a line already taken
        starts.add(block.rfind(b"\n", 0, i) + 1)
        line_end = block.find(b"\n", i)
        if line_end == -1:
            line_end = len(block)
    line, pos = first_line, 0
    for start in sorted(starts):
        line += block.count(b"\n", pos, start)
        pos = start
        end = block.find(b"\n", start)
        out.append((line, block[start : end if end != -1 else len(block)]))


def scan(
    fh: IO[bytes],
    *,
    offset: int = 0,
    line: int = 0,
    end: int | None = None,
    deadline: float | None = None,
    final: bool = False,
    progress: Callable[[int], None] | None = None,
) -> _Scan:
    """Scan complete lines from `fh` (positioned at `offset`) up to `end` bytes (None: EOF).

    final: also consume a trailing line without newline (a stream that has ended: stdin, dmesg).
    """
    result = _Scan(offset=offset, line=line)
    carry = b""
    pos = offset
    while end is None or pos < end:
        want = CHUNK if end is None else min(CHUNK, end - pos)
        chunk = fh.read(want)
        if not chunk:
            break
        pos += len(chunk)
        result.bytes_read += len(chunk)
        if progress is not None:
            progress(len(chunk))
        buf = carry + chunk if carry else chunk
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            if len(buf) <= MAX_LINE:
                carry = buf
                continue
            cut = len(buf)  # an endless line: consume it in pieces
        block, carry = buf[:cut], buf[cut:]
        _scan_block(block, result.line + 1, result.candidates)
        result.line += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
        result.offset += len(block)
        result.last_line = block[block.rfind(b"\n", 0, len(block) - 1) + 1 :]
        if deadline is not None and time.monotonic() > deadline:
            result.stopped_early = True
            break
    if final and carry and not result.stopped_early:
        _scan_block(carry, result.line + 1, result.candidates)
        result.line += 1
        result.offset += len(carry)
        result.last_line = carry
    return result


def _runs(candidates: list[tuple[int, bytes]]) -> Iterable[tuple[int, list[str]]]:
    run: list[str] = []
    first = prev = 0
    for line_no, raw in candidates:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if run and line_no == prev + 1:
            run.append(text)
        else:
            if run:
                yield first, run
            run, first = [text], line_no
        prev = line_no
    if run:
        yield first, run


def parse_candidates(candidates: list[tuple[int, bytes]], source: str | None) -> tuple[Event, ...]:
    """Run the log parser over the candidate lines, keeping their real line numbers."""

    events: list[Event] = []
    for first, lines in _runs(candidates):
        events.extend(iter_events(lines, source=source, start_line=first))
    return tuple(events)


def unread_xid_lines(candidates: list[tuple[int, bytes]], events: tuple[Event, ...]) -> tuple[int, ...]:
    """Candidate lines that name an Xid but carry no event: the parser could not read them."""
    seen = {e.line for e in events}
    return tuple(
        n for n, raw in candidates if n not in seen and _XID_WORD.search(raw.decode("utf-8", "replace")) is not None
    )


def unreadable_candidates(candidates: list[tuple[int, bytes]]) -> int:
    """Candidate lines (they hold a keyword) that are not valid UTF-8 or were cut at `MAX_LINE`: read
    with replacement characters or in part, so their events may be missing or incomplete."""
    n = 0
    for _, raw in candidates:
        if len(raw) >= MAX_LINE:
            n += 1
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            n += 1
    return n


def _hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()
