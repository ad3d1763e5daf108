"""Per-rank step records: what a rank is doing right now, cheaply, for an outside reader.

Why this exists: in a synchronous job one hung rank stops every other rank at the next collective, and
one slow rank makes everyone's wall step slow. The only way an outside observer can name the rank that
never *arrived* (or the straggler by its *own* compute time) is if every rank says, as it goes, which
phase it is in: computing step S since t, or waiting in collective N since t.

The writer is standard-library only (training processes import it; no torch, no yaml) and costs a few
microseconds per call: each call formats one short text line and hands it to the kernel with a single
``os.write`` on an ``O_APPEND`` descriptor, so a reader in another process sees it at once and a torn
write can only ever be the *last* line (readers drop a line without its newline).

Layout: ``<job-dir>/ranks/<rank>.<incarnation>.<segment>.steplog``. Every segment starts with a header
line (rank, incarnation, generation, pid, host, wall and monotonic start) so that it stands alone after
rotation; when a segment passes ``max_bytes`` the writer opens the next one and deletes segments older
than ``keep``. Record lines (times: wall clock and CLOCK_MONOTONIC, seconds, µs resolution)::

    H {json header}
    S <step> <wall> <mono>                          begin step  -> phase: computing step
    C <seq> <step> <wall> <mono> <nbytes> <op>      enter collective -> phase: waiting in collective
    X <seq> <wall> <mono> <wait_s>                  exit collective  -> phase: computing
    E <step> <wall> <mono> <compute_s> <wait_s> <nbytes>   end step (own compute vs wait split)
    B <wall> <mono>                                 heartbeat
    F <wall> <mono> <message>                       an error the rank saw (e.g. a collective failed)
    Z <wall> <mono>                                 clean close

Wall time answers "when"; monotonic time makes durations and ages immune to wall-clock jumps (the
reader uses it whenever it runs on the writer's host).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from math import isfinite
from sys import intern
from typing import Any

from gpuguard.foundation.boundedread import parse_json, read_bytes
from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.identity import own_start_time
from gpuguard.foundation.jobdir import ranks_dir
from gpuguard.foundation.observations import (
    BETWEEN,
    CLOSED,
    COLLECTIVE,
    COMPUTING,
    STARTING,
    Phase,
    RankSeries,
)
from gpuguard.foundation.step_columns import CollectiveEntries, StepSamples

FORMAT_VERSION = 1
SUFFIX = ".steplog"
DEFAULT_MAX_BYTES = 1 << 20  # 1 MiB per segment: ~20,000 records
DEFAULT_KEEP = 3  # segments kept per incarnation (bounded size: keep × max_bytes)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def safe_incarnation(incarnation_id: str) -> str:
    """The incarnation id as it appears in a file name ('.' separates fields, '/' separates dirs)."""
    return _UNSAFE.sub("-", str(incarnation_id))[:64] or "x"


def segment_name(rank: int, incarnation_id: str, segment: int) -> str:
    return f"{int(rank)}.{safe_incarnation(incarnation_id)}.{segment:06d}{SUFFIX}"


class StepLog:
    """Append-only, rotated step/phase/heartbeat records of one rank incarnation.

    Thread-safe (a heartbeat thread may share it). Methods never raise on I/O errors after
    construction: a full disk must not kill a training step; `errors` counts the lost writes.
    """

    def __init__(
        self,
        job_dir: str | os.PathLike[str],
        rank: int,
        incarnation_id: str,
        generation: int = 0,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        self.dir = os.fspath(ranks_dir(job_dir))
        os.makedirs(self.dir, exist_ok=True)
        self.rank = int(rank)
        self.incarnation = safe_incarnation(incarnation_id)
        self.generation = int(generation)
        self.max_bytes = max(4096, int(max_bytes))
        self.keep = max(1, int(keep))
        self.pid = os.getpid()
        self.start_time = own_start_time()  # the process identity (foundation.identity)
        self.host = socket.gethostname()
        lr = os.environ.get("LOCAL_RANK", "")
        self.local_rank = int(lr) if lr.isdigit() else None  # = the GPU index on most launchers
        ws = os.environ.get("WORLD_SIZE", "")
        self.world_size = int(ws) if ws.isdigit() else None  # lets the reader name ranks that never wrote
        self.errors = 0
        self._lock = threading.Lock()
        self._segment = -1
        self._fd = -1
        self._size = 0
        # per-step accounting (monotonic seconds)
        self._step = -1
        self._step_t0 = 0.0
        self._coll_t0 = 0.0
        self._coll_seq = -1
        self._wait = 0.0
        self._nbytes = 0
        self._open_next()

    # -- file handling -------------------------------------------------------------------------
    def _path(self, segment: int) -> str:
        return os.path.join(self.dir, segment_name(self.rank, self.incarnation, segment))

    def _open_next(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._segment += 1
        path = self._path(self._segment)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        header = {
            "v": FORMAT_VERSION,
            "rank": self.rank,
            "incarnation": self.incarnation,
            "generation": self.generation,
            "pid": self.pid,
            "host": self.host,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "start_time": self.start_time,
            "segment": self._segment,
            "wall": round(time.time(), 6),
            "mono": round(time.monotonic(), 6),
        }
        self._raw(("H " + json.dumps(header, separators=(",", ":")) + "\n").encode())
        old = self._segment - self.keep
        if old >= 0:
            try:
                os.unlink(self._path(old))
            except OSError:
                pass

    def _raw(self, data: bytes) -> None:
        try:
            os.write(self._fd, data)
            self._size += len(data)
        except OSError:
            self.errors += 1

    def _write(self, line: str) -> None:
        with self._lock:
            if self._fd < 0:
                return
            if self._size >= self.max_bytes:
                try:
                    self._open_next()
                except OSError:
                    self.errors += 1
                    return
            self._raw(line.encode())

    # -- the API ---------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Phase: computing step `step` since now."""
        w, m = time.time(), time.monotonic()
        self._step, self._step_t0, self._wait, self._nbytes = int(step), m, 0.0, 0
        self._write(f"S {int(step)} {w:.6f} {m:.6f}\n")

    def enter_collective(self, seq: int, op: str = "all_reduce", nbytes: int = 0) -> None:
        """Phase: waiting in collective `seq` since now (the compute before it is this rank's own)."""
        w, m = time.time(), time.monotonic()
        self._coll_t0, self._coll_seq = m, int(seq)
        self._nbytes += max(0, int(nbytes))
        op = _UNSAFE.sub("_", str(op))[:32] or "op"
        self._write(f"C {int(seq)} {self._step} {w:.6f} {m:.6f} {max(0, int(nbytes))} {op}\n")

    def exit_collective(self, seq: int) -> None:
        """Phase: computing again; the time since `enter_collective` counts as wait."""
        w, m = time.time(), time.monotonic()
        waited = m - self._coll_t0 if self._coll_seq == int(seq) else 0.0
        self._wait += waited
        self._coll_seq = -1
        self._write(f"X {int(seq)} {w:.6f} {m:.6f} {waited:.6f}\n")

    def collective(self, seq: int, op: str = "all_reduce", nbytes: int = 0) -> _Collective:
        """`with log.collective(seq, "all_reduce", t.nbytes): dist.all_reduce(t)` — enter and exit in one line.
        A failing collective records the error (the peer's failure, seen from here) and re-raises."""
        return _Collective(self, seq, op, nbytes)

    def end_step(self, step: int) -> None:
        """Step end: wall time and the split of the step into own compute and collective wait."""
        w, m = time.time(), time.monotonic()
        total = m - self._step_t0 if self._step == int(step) else 0.0
        compute = max(0.0, total - self._wait)
        self._write(f"E {int(step)} {w:.6f} {m:.6f} {compute:.6f} {self._wait:.6f} {self._nbytes}\n")

    def heartbeat(self) -> None:
        """Alive, without a phase change (call from a side thread or a long section)."""
        self._write(f"B {time.time():.6f} {time.monotonic():.6f}\n")

    def error(self, message: str) -> None:
        """Record an error this rank saw (a failed collective names its peer): evidence for the vote."""
        text = " ".join(str(message).split())[:400]
        self._write(f"F {time.time():.6f} {time.monotonic():.6f} {text}\n")

    def close(self) -> None:
        """Clean exit: the reader tells a finished rank from a dead one by this record."""
        with self._lock:
            if self._fd < 0:
                return
            self._raw(f"Z {time.time():.6f} {time.monotonic():.6f}\n".encode())
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:  # an error is not a clean close: the reader must not call it "finished"
            self.error(f"{type(exc).__name__}: {exc}")
            with self._lock:
                if self._fd >= 0:
                    try:
                        os.close(self._fd)
                    except OSError:
                        pass
                    self._fd = -1
            return
        self.close()


class _Collective:
    __slots__ = ("log", "seq", "op", "nbytes")

    def __init__(self, log: StepLog, seq: int, op: str, nbytes: int) -> None:
        self.log, self.seq, self.op, self.nbytes = log, seq, op, nbytes

    def __enter__(self) -> None:
        self.log.enter_collective(self.seq, self.op, self.nbytes)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.log.error(f"{self.op} {self.seq}: {exc}")
            return
        self.log.exit_collective(self.seq)


# -- the reader side: segment names and records back into a RankSeries -----------------------------
SEGMENT_NAME = re.compile(r"^(\d{1,7})\.([A-Za-z0-9_-]{1,64})\.(\d{6,})" + re.escape(SUFFIX) + r"$")
_NAN = float("nan")
CLOCK_JUMP_S = 1.0  # wall vs monotonic disagreement that counts as a clock jump
MAX_STEPS = 4096  # most recent step samples kept per rank
MAX_ERRORS = 8
MAX_ENTRIES = 64  # most recent collective entries (seq, wall, mono, wait) kept per rank: the arrival order


def parse_segment_name(name: str) -> tuple[int, str, int] | None:
    """(rank, incarnation, segment) of a segment file name, or None for anything else."""
    m = SEGMENT_NAME.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def _start_time(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _f(tok: str) -> float:
    v = float(tok)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError("not finite")
    return v


def decode_lines(lines: Iterable[str], *, rank: int, incarnation: str, max_steps: int = MAX_STEPS) -> RankSeries:
    """Fold one incarnation's record lines (segments in order) into a `RankSeries`. Never raises.

    A line is applied whole or not at all (a bad one is counted in `bad_lines`). The samples and entries
    are kept as columns (`foundation.step_columns`), the phase as plain values until the end: at 100,000
    ranks this fold is most of `diagnose job`'s time and its result most of its memory."""
    header: dict[str, Any] = {}
    # the samples and the entries as row-major lists of numbers (`StepSamples.from_columns`)
    step_f: list[float] = []  # end_wall, end_mono, compute_s, wait_s, interval_s (NaN: none) a step
    step_i: list[int] = []  # step, nbytes a step
    entry_seq: list[int] = []
    entry_f: list[float] = []  # wall, mono, wait_s (-1.0 while in it) an entry
    # the phase, field by field (one `Phase` at the end): kind, step, seq, op, nbytes, since wall/mono
    kind_p, step_p, seq_p, op_p, nb_p, w_p, m_p = STARTING, -1, -1, "", 0, 0.0, 0.0
    errors: list[str] = []
    bad = jumps = 0
    last_wall = last_mono = 0.0
    prev_wall: float | None = None
    prev_mono: float | None = None
    prev_end_mono: float | None = None
    last_seq = -1  # the last collective this rank left: tells "already past collective N" apart
    for line in lines:
        if not line:
            continue
        kind = line[0]
        try:
            if kind == "H":
                h = parse_json(line[2:])  # depth-bounded: a hostile header is one bad line
                if not isinstance(h, dict):
                    raise ValueError("header is not an object")
                if not header:
                    header = h
                elif isinstance(h.get("generation"), int):  # an in-place switch reopens the log: the newest counts
                    header = {**header, "generation": h["generation"]}
                w, m = _f(str(h.get("wall", 0))), _f(str(h.get("mono", 0)))
                if kind_p in (STARTING, CLOSED):  # after a close, a new header opens the next generation's log
                    kind_p, step_p, seq_p, op_p, nb_p, w_p, m_p = STARTING, -1, -1, "", 0, w, m
            else:
                t = line[2:].split(" ")
                if kind == "S":
                    if len(t) != 3:
                        raise ValueError
                    step, w, m = int(t[0]), float(t[1]), float(t[2])
                    if not (isfinite(w) and isfinite(m)):
                        raise ValueError
                    kind_p, step_p, seq_p, op_p, nb_p, w_p, m_p = COMPUTING, step, last_seq, "", 0, w, m
                elif kind == "C":
                    if len(t) != 6:
                        raise ValueError
                    seq, step, w, m, nb = int(t[0]), int(t[1]), float(t[2]), float(t[3]), int(t[4])
                    if not (isfinite(w) and isfinite(m)):
                        raise ValueError
                    kind_p, step_p, seq_p, op_p, nb_p, w_p, m_p = COLLECTIVE, step, seq, t[5], nb, w, m
                    entry_seq.append(seq)
                    entry_f.extend((w, m, -1.0))
                    if len(entry_seq) > 2 * MAX_ENTRIES:
                        del entry_seq[: len(entry_seq) - MAX_ENTRIES]
                        del entry_f[: len(entry_f) - 3 * MAX_ENTRIES]
                elif kind == "X":
                    if len(t) != 4:
                        raise ValueError
                    seq, w, m, waited = int(t[0]), float(t[1]), float(t[2]), float(t[3])
                    if not (isfinite(w) and isfinite(m) and isfinite(waited)):
                        raise ValueError
                    if entry_seq and entry_seq[-1] == seq and entry_f[-1] < 0:
                        entry_f[-1] = max(0.0, waited)
                    last_seq = max(last_seq, seq)
                    kind_p, seq_p, op_p, nb_p, w_p, m_p = COMPUTING, last_seq, "", 0, w, m
                elif kind == "E":
                    if len(t) != 6:
                        raise ValueError
                    step, w, m, comp, wait, nb = (
                        int(t[0]),
                        float(t[1]),
                        float(t[2]),
                        float(t[3]),
                        float(t[4]),
                        int(t[5]),
                    )
                    if not (isfinite(w) and isfinite(m) and isfinite(comp) and isfinite(wait)):
                        raise ValueError
                    if comp < 0 or wait < 0:
                        raise ValueError
                    interval = (m - prev_end_mono) if prev_end_mono is not None and m > prev_end_mono else None
                    step_i.extend((step, nb))
                    step_f.extend((w, m, comp, wait, _NAN if interval is None else interval))
                    if len(step_i) > 4 * max_steps:
                        del step_i[: len(step_i) - 2 * max_steps]
                        del step_f[: len(step_f) - 5 * max_steps]
                    prev_end_mono = m
                    kind_p, step_p, seq_p, op_p, nb_p, w_p, m_p = BETWEEN, step, last_seq, "", 0, w, m
                elif kind == "B":
                    if len(t) != 2:
                        raise ValueError
                    w, m = _f(t[0]), _f(t[1])
                elif kind == "F":
                    if len(t) < 2:
                        raise ValueError
                    w, m = _f(t[0]), _f(t[1])
                    errors.append(" ".join(t[2:]))
                    del errors[:-MAX_ERRORS]
                elif kind == "Z":
                    if len(t) != 2:
                        raise ValueError
                    w, m = _f(t[0]), _f(t[1])
                    kind_p, seq_p, op_p, nb_p, w_p, m_p = CLOSED, last_seq, "", 0, w, m
                else:
                    raise ValueError
                if (
                    prev_wall is not None
                    and prev_mono is not None
                    and abs((w - prev_wall) - (m - prev_mono)) > CLOCK_JUMP_S
                ):
                    jumps += 1
                prev_wall, prev_mono = w, m
                last_wall, last_mono = w, m
        except (ValueError, IndexError, TypeError, OverflowError):
            bad += 1
    phase = Phase(kind_p, step=step_p, seq=seq_p, op=intern(op_p), nbytes=nb_p, since_wall=w_p, since_mono=m_p)
    pid = header.get("pid")
    lr = header.get("local_rank")
    ws = header.get("world_size")
    drop = len(step_i) // 2 - max_steps
    if drop > 0:
        del step_i[: 2 * drop], step_f[: 5 * drop]
    drop = len(entry_seq) - MAX_ENTRIES
    if drop > 0:
        del entry_seq[:drop], entry_f[: 3 * drop]
    return RankSeries(
        rank=rank,
        incarnation=intern(incarnation),
        generation=int(header.get("generation", 0)) if isinstance(header.get("generation", 0), int) else 0,
        pid=pid if isinstance(pid, int) and pid > 0 else None,
        host=intern(str(header.get("host", ""))),  # one string per host, not per rank
        local_rank=lr if isinstance(lr, int) and not isinstance(lr, bool) and lr >= 0 else None,
        world_size=ws if isinstance(ws, int) and not isinstance(ws, bool) and 0 < ws <= 10_000_000 else None,
        start_time=_start_time(header.get("start_time")),
        start_wall=float(header.get("wall", 0) or 0) if isinstance(header.get("wall", 0), (int, float)) else 0.0,
        start_mono=float(header.get("mono", 0) or 0) if isinstance(header.get("mono", 0), (int, float)) else 0.0,
        steps=StepSamples.from_columns(step_f, step_i),
        phase=phase,
        last_wall=last_wall or (phase.since_wall if phase.kind == STARTING else 0.0),
        last_mono=last_mono or (phase.since_mono if phase.kind == STARTING else 0.0),
        errors=tuple(errors),
        bad_lines=bad,
        clock_jumps=jumps,
        entries=CollectiveEntries.from_columns(entry_seq, entry_f),
    )


# ------------------------------------------------------------------ the local commit records

SEGMENT_READ_BYTES = DEFAULT_MAX_BYTES * 4  # one segment, with room for a writer that rotated late


@dataclass(frozen=True)
class StepCommit:
    """One committed step, as the rank's own step record says (its `E` line)."""

    generation: int  # of the segment header in force when the line was written
    rank: int
    incarnation: str
    step: int
    wall: float


def committed_steps(job_dir: str | os.PathLike[str], generation: int | None = None) -> list[StepCommit]:
    """Every committed step the step records of this job dir hold (of `generation`, if given), in
    file order. A commit is local: the step record is its only record (the ledger holds one frontier
    record per generation). Rotated-away segments are gone; unreadable files and lines are skipped."""
    root = ranks_dir(job_dir)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    files = sorted(
        (parsed, name) for name in names if name.endswith(SUFFIX) and (parsed := parse_segment_name(name)) is not None
    )
    out: list[StepCommit] = []
    for (rank, inc, _segment), name in files:
        try:
            data = read_bytes(root / name, max_bytes=SEGMENT_READ_BYTES, what="a step log")
        except GpuguardError:
            continue
        current = None
        for line in data.decode(errors="replace").split("\n")[:-1]:  # the unfinished last line is not one
            if line.startswith("H "):
                try:
                    head = parse_json(line[2:])
                    current = int(head["generation"]) if isinstance(head, dict) else None
                except (ValueError, KeyError, TypeError):
                    current = None
            elif line.startswith("E ") and current is not None and generation in (None, current):
                t = line[2:].split(" ")
                try:
                    out.append(StepCommit(current, rank, inc, int(t[0]), _f(t[1])))
                except (ValueError, IndexError):
                    continue
    return out
