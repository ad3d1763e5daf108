"""gpuguard's own per-rank collective trace: a fixed-size ring buffer, dumped as JSON.

Why our own and not only the Flight Recorder: the Flight Recorder cannot record the reduce op,
knows nothing of gpuguard generations, has no automatic dump for gloo, and its analyzer trusts
pickles. This trace is the in-job runtime's record of every collective it issues: one list per
call into a preallocated ring (no allocation growth, no locks, no torch import), so recording
costs a few hundred nanoseconds. It is dumped on failure (`guard`), on a signal
(`install_signal_dump`, chained with any previous handler) or on demand (`dump`), atomically
(temp file + rename) so a reader never sees half a file. With `persist=PATH` every record also
goes into a fixed-size memory-mapped file that outlives the process: gloo answers a collective
size mismatch with SIGABRT (no handler, no atexit), and the ring is still there afterwards.
`gpu-doctor contract` reads the JSON dumps and the persisted rings alike.

Dump schema `gpuguard.collective-trace/1`::

    {"schema": ..., "rank": 3, "generation": 2, "world_size": 4, "job_id": "...", "host": ..., "pid": ...,
     "capacity": 2000, "recorded": 2417, "dropped": 417, "reason": "signal SIGUSR2", "dumped_at_ns": ...,
     "entries": [{"seq": 418, "pg": "default", "op": "all_reduce", "count": 1024, "dtype": "float32",
                  "reduce_op": "sum", "state": "completed", "time_ns": ..., "completed_ns": ...,
                  "call_site": "train.py:52"}, ...]}      # oldest first
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from gpuguard.foundation.jobdir import atomic_write_bytes

SCHEMA = "gpuguard.collective-trace/1"
STATE_SCHEDULED = "scheduled"
STATE_COMPLETED = "completed"

# Positions inside one ring slot (a list, so `complete` can update it in place).
_SEQ, _PG, _OP, _COUNT, _DTYPE, _REDUCE, _SITE, _T0, _T1 = range(9)
_FIELDS = ("seq", "pg", "op", "count", "dtype", "reduce_op", "call_site", "time_ns", "completed_ns")


def call_site(depth: int = 1) -> str:
    """`file:line` `depth` frames above the caller (0: the caller; 1: its caller, what a collective wrapper
    wants): cheap enough to pass to `record` on every call."""
    frame = sys._getframe(depth + 1)  # noqa: SLF001 - CPython's documented frame access, far cheaper than inspect.stack() (which reads source)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class CollectiveTrace:
    """Ring buffer of the last `capacity` collectives issued by one rank in one generation."""

    __slots__ = ("rank", "generation", "capacity", "world_size", "job_id", "_ring", "_next", "_clock", "_mm")

    def __init__(
        self,
        rank: int,
        generation: int,
        capacity: int = 2000,
        *,
        world_size: int | None = None,
        job_id: str | None = None,
        persist: str | os.PathLike[str] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.rank = int(rank)
        self.generation = int(generation)
        self.capacity = int(capacity)
        self.world_size = world_size
        self.job_id = job_id
        self._ring: list[list[Any] | None] = [None] * self.capacity
        self._next = 0  # records ever made; the next slot is _next % capacity
        self._clock: Callable[[], int] = time.time_ns  # wall clock: comparable across ranks on a host
        self._mm: mmap.mmap | None = None
        if persist is not None:
            self._mm = _open_persisted(os.fspath(persist).format(rank=self.rank, generation=self.generation), self)

    def record(
        self,
        op: str,
        pg: str,
        seq: int,
        count: int,
        dtype: str,
        reduce_op: str | None = None,
        call_site: str | None = None,
    ) -> int:
        """Record one collective as it is issued (before the call); returns its record id."""
        n = self._next
        t = self._clock()
        self._ring[n % self.capacity] = [seq, pg, op, count, dtype, reduce_op, call_site, t, None]
        if self._mm is not None:  # the page cache keeps it even if gloo SIGABRTs this process next
            _SLOT.pack_into(
                self._mm,
                _HEADER.size + (n % self.capacity) * _SLOT.size,
                seq,
                -1 if count is None else count,
                t,
                0,
                op.encode(),
                pg.encode(),
                (dtype or "").encode(),
                (reduce_op or "").encode(),
                (call_site or "").encode(),
            )
            _NEXT.pack_into(self._mm, _NEXT_AT, n + 1)
        self._next = n + 1
        return n

    def complete(self, seq: int, pg: str | None = None) -> bool:
        """Mark the newest record with this sequence id (and process group) completed."""
        ring, cap, n = self._ring, self.capacity, self._next
        for i in range(n - 1, max(n - cap, 0) - 1, -1):
            slot = ring[i % cap]
            if slot is not None and slot[_SEQ] == seq and (pg is None or slot[_PG] == pg):
                slot[_T1] = self._clock()
                if self._mm is not None:
                    _T1_FIELD.pack_into(self._mm, _HEADER.size + (i % cap) * _SLOT.size + 24, slot[_T1])
                return True
        return False

    @property
    def recorded(self) -> int:
        return self._next

    def entries(self) -> list[dict[str, Any]]:
        """The ring's content, oldest first, as plain dicts."""
        ring, cap, n = self._ring, self.capacity, self._next
        out = []
        for i in range(max(n - cap, 0), n):
            slot = ring[i % cap]
            if slot is None:  # pragma: no cover - only while another thread is mid-record
                continue
            row = dict(zip(_FIELDS, slot))
            row["state"] = STATE_COMPLETED if slot[_T1] is not None else STATE_SCHEDULED
            out.append(row)
        return out

    def to_json(self, reason: str = "on demand") -> dict[str, Any]:
        entries = self.entries()
        return {
            "schema": SCHEMA,
            "rank": self.rank,
            "generation": self.generation,
            "world_size": self.world_size,
            "job_id": self.job_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "capacity": self.capacity,
            "recorded": self._next,
            "dropped": max(self._next - self.capacity, 0),
            "reason": reason,
            "dumped_at_ns": time.time_ns(),
            "entries": entries,
        }

    def dump(self, path: str | os.PathLike[str], reason: str = "on demand") -> str:
        """Write the trace atomically to `path` (`{rank}` and `{generation}` are filled in)."""
        target = os.fspath(path).format(rank=self.rank, generation=self.generation)
        atomic_write_bytes(target, json.dumps(self.to_json(reason), separators=(",", ":")).encode())
        return target

    def install_signal_dump(self, path: str | os.PathLike[str], signum: int = signal.SIGUSR2) -> None:
        """Dump to `path` when `signum` arrives, then run the previously installed handler."""
        previous = signal.getsignal(signum)

        def _handler(sig: int, frame: FrameType | None) -> None:
            try:
                self.dump(path, reason=f"signal {signal.Signals(sig).name}")
            except OSError as exc:  # never let a full disk kill the training loop
                print(f"gpuguard: collective trace dump failed: {exc}", file=sys.stderr)
            if callable(previous):
                previous(sig, frame)

        signal.signal(signum, _handler)

    @contextlib.contextmanager
    def guard(self, path: str | os.PathLike[str]) -> Iterator[CollectiveTrace]:
        """Dump to `path` if the body raises (the exception is re-raised unchanged)."""
        try:
            yield self
        except BaseException as exc:
            with contextlib.suppress(OSError):
                self.dump(path, reason=f"failure {type(exc).__name__}: {exc}"[:500])
            raise


def install_signal_dump(trace: CollectiveTrace, path: str | os.PathLike[str], signum: int = signal.SIGUSR2) -> None:
    """Module-level spelling of `CollectiveTrace.install_signal_dump`."""
    trace.install_signal_dump(path, signum)


# ----------------------------------------------------------------------------------------------
# Crash-surviving ring: the same entries in a file-backed mmap.
#
# gloo answers a collective size mismatch with SIGABRT: no Python handler, no atexit, no dump. With
# `persist=PATH` every record is also written into a fixed-size memory-mapped file, which the kernel
# keeps when the process dies. `decode_persisted` turns it into the usual JSON document.

PERSIST_MAGIC = b"GGCTRING"
_HEADER = struct.Struct("<8sqqqqqq")  # magic, rank, generation, capacity, world_size (-1), next, slot size
_NEXT_AT = 40
_NEXT = struct.Struct("<q")
_SLOT = struct.Struct("<qqqq24s24s16s16s144s")  # seq, count, time_ns, completed_ns, op, pg, dtype, reduce, site
_T1_FIELD = struct.Struct("<q")


def _open_persisted(path: str, trace: CollectiveTrace) -> mmap.mmap:
    size = _HEADER.size + trace.capacity * _SLOT.size
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    _HEADER.pack_into(
        mm,
        0,
        PERSIST_MAGIC,
        trace.rank,
        trace.generation,
        trace.capacity,
        -1 if trace.world_size is None else trace.world_size,
        0,
        _SLOT.size,
    )
    return mm


def decode_persisted(data: bytes) -> dict[str, Any]:
    """A persisted ring (bytes) -> the `gpuguard.collective-trace/1` document. Raises ValueError."""
    if len(data) < _HEADER.size or data[:8] != PERSIST_MAGIC:
        raise ValueError("not a gpuguard persisted collective ring")
    _, rank, generation, capacity, world, n, slot = _HEADER.unpack_from(data, 0)
    if slot != _SLOT.size or capacity < 1 or rank < 0 or n < 0:
        raise ValueError(f"bad header (capacity {capacity}, slot size {slot}, rank {rank}, records {n})")
    if len(data) < _HEADER.size + capacity * slot:
        raise ValueError(f"truncated: {len(data)} bytes for {capacity} slots")
    entries = []
    for i in range(max(n - capacity, 0), n):
        seq, count, t0, t1, op, pg, dtype, red, site = _SLOT.unpack_from(data, _HEADER.size + (i % capacity) * slot)
        text = [b.rstrip(b"\0").decode("utf-8", "replace") for b in (op, pg, dtype, red, site)]
        entries.append(
            {
                "seq": seq,
                "pg": text[1],
                "op": text[0],
                "count": None if count < 0 else count,
                "dtype": text[2] or None,
                "reduce_op": text[3] or None,
                "call_site": text[4] or None,
                "time_ns": t0,
                "completed_ns": t1 or None,
                "state": STATE_COMPLETED if t1 else STATE_SCHEDULED,
            }
        )
    return {
        "schema": SCHEMA,
        "rank": rank,
        "generation": generation,
        "world_size": None if world < 0 else world,
        "job_id": None,
        "capacity": capacity,
        "recorded": n,
        "dropped": max(n - capacity, 0),
        "reason": "persisted ring (read after the fact; the process may have died)",
        "entries": entries,
    }
