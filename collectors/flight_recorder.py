"""Read per-rank collective traces from files: find them (`discover`), open only regular files,
load each under a deadline in reader processes (`load_all`), and warn about Flight Recorder format
versions outside the known ones. Decoding the two formats (Flight Recorder dumps, gpuguard's own
`gpuguard.collective-trace/1`) is `collectors.trace_formats`; its names are importable from here.

Why a restricted unpickler: a Flight Recorder dump is a pickle, and `pickle.load` on a file from
a shared job directory runs whatever the file says (`os.system`, ...). The dumps hold only dicts,
lists, tuples, strings, numbers and None, which need no class lookup at all, so `find_class`
admits nothing: any reference to a callable is refused with a clear error (exit 65).

Many files are read by a small process pool (every file in a reader process with a deadline: see
`load_all`).

Lazy imports (start-up time): multiprocessing, only when the dumps are read (foundation.workers).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import struct
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuguard.collectors.trace_formats import (
    FORMAT_FR_JSON,
    FORMAT_FR_PICKLE,
    FORMAT_GPUGUARD,
    FORMAT_GPUGUARD_RING,
    GPUGUARD_SCHEMA,
    Loaded,
    from_fr,
    from_gpuguard,
    rank_from_name,
)
from gpuguard.foundation import unpickle
from gpuguard.foundation.collective_trace import PERSIST_MAGIC, decode_persisted
from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, UsageError, from_os_error
from gpuguard.foundation.gcpause import gc_paused
from gpuguard.foundation.traces import Interner, RankTrace, Signature, Stream
from gpuguard.foundation.workers import Overdue, map_with_deadlines

__all__ = [
    "FORMAT_FR_JSON",
    "FORMAT_FR_PICKLE",
    "FORMAT_GPUGUARD",
    "FORMAT_GPUGUARD_RING",
    "GPUGUARD_SCHEMA",
    "KNOWN_FR_VERSIONS",
    "MAX_BYTES",
    "Loaded",
    "check_usage_pg",
    "discover",
    "load_all",
    "load_dump",
    "load_many",
    "rank_from_name",
    "restricted_loads",
    "unknown_version_notes",
]

MAX_BYTES = 1 << 30  # a 2,000-entry dump is well under 1 MiB; refuse absurd inputs


def restricted_loads(data: bytes) -> Any:
    """`pickle.loads` that refuses anything but plain data (raises pickle.UnpicklingError)."""
    return unpickle.restricted_loads(data, what="a Flight Recorder dump")


# Flight Recorder dump format versions this reader was written and tested against (`version` in the
# dump): a version outside them may have moved or renamed fields, so it is read but reported.
KNOWN_FR_VERSIONS = ((2, 0), (2, 10))


def unknown_version_notes(traces: Iterable[RankTrace]) -> list[str]:
    """One warning per rank whose Flight Recorder dump has a format version outside
    `KNOWN_FR_VERSIONS` (or none that reads as MAJOR.MINOR): such a dump is read as the newest known
    one, and the result is only as good as that guess. gpuguard's own traces carry their schema."""
    low, high = KNOWN_FR_VERSIONS
    notes = []
    for t in traces:
        if t.format not in (FORMAT_FR_PICKLE, FORMAT_FR_JSON):
            continue
        major, _, minor = str(t.version).partition(".")
        known = major.isdigit() and minor.isdigit() and low <= (int(major), int(minor)) <= high
        if not known:
            shown = repr(str(t.version)[:20])
            notes.append(
                f"rank {t.rank}: Flight Recorder format version {shown} is outside the known "
                f"{low[0]}.{low[1]}-{high[0]}.{high[1]}: read as {high[0]}.{high[1]}, the comparison may be wrong"
            )
    return notes


# ----------------------------------------------------------------------------------------------
# Discovery


def discover(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[Path], list[str]]:
    """Files named on the command line, plus every plausible dump under named directories."""
    files: list[Path] = []
    notes: list[str] = []
    for raw in paths:
        p = Path(raw)
        try:
            st = p.stat()
        except OSError as exc:
            raise from_os_error(exc, str(p)) from None
        if stat.S_ISDIR(st.st_mode):
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if name.startswith(".") or name.endswith((".tmp", ".log", ".txt", ".md")):
                        continue
                    f = Path(root, name)
                    kind = _sniff(f)
                    if kind is None:
                        notes.append(f"skipped {f}: not a Flight Recorder dump or gpuguard trace")
                        continue
                    found.append(f)
            if not found:
                raise NoInputError(f"{p}: no Flight Recorder dumps or gpuguard traces in this directory")
            files.extend(found)
        else:
            files.append(p)
    return files, notes


def _open_regular(path: Path) -> Any:
    """The file opened for reading if it is a regular file, else DataError: a FIFO, a device
    (`/dev/zero` never ends) or a socket is refused at once (opened O_NONBLOCK: a FIFO without a
    writer does not block the open)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{path}: not a regular file (a FIFO, device or socket is not a dump)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _sniff(path: Path) -> str | None:
    try:
        with _open_regular(path) as fh:
            head = fh.read(64)
    except (OSError, DataError):
        return None
    if head[:1] == b"\x80":
        return FORMAT_FR_PICKLE
    if head[:8] == PERSIST_MAGIC:
        return FORMAT_GPUGUARD_RING
    if head.lstrip()[:1] == b"{":
        return "json"
    return None


# ----------------------------------------------------------------------------------------------
# Loading


def load_dump(path: str | os.PathLike[str], interner: Interner) -> Loaded:
    """Load one dump of any supported format; raise a one-line GpuguardError when it is unusable."""
    p = Path(path)
    try:
        with _open_regular(p) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_BYTES:
                raise DataError(f"{p}: {size} bytes is too large for a collective trace")
            head = fh.peek(8)[:8] if hasattr(fh, "peek") else b""
            if head[:1] == b"\x80":
                return from_fr(p, _unpickle(p, fh), FORMAT_FR_PICKLE, interner)
            data = fh.read()
            if head == PERSIST_MAGIC:  # a crash-surviving CollectiveTrace ring (mmap file)
                try:
                    doc = decode_persisted(data)
                except (ValueError, struct.error) as exc:
                    raise DataError(f"{p}: corrupt gpuguard ring: {exc}") from None
                loaded = from_gpuguard(p, doc, interner)
                return Loaded(replace(loaded.trace, format=FORMAT_GPUGUARD_RING), loaded.entries)
    except GpuguardError:
        raise
    except OSError as exc:
        raise from_os_error(exc, str(p)) from None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        if not data.strip():
            raise DataError(f"{p}: empty file") from None
        if data.rstrip().endswith(b"."):  # maybe a protocol 0/1 pickle: never run it, but say what it is
            return from_fr(p, _unpickle(p, io.BufferedReader(io.BytesIO(data))), FORMAT_FR_PICKLE, interner)
        raise DataError(f"{p}: neither a Flight Recorder pickle nor JSON ({str(exc)[:80]})") from None
    if isinstance(doc, dict) and doc.get("schema") == GPUGUARD_SCHEMA:
        return from_gpuguard(p, doc, interner)
    if isinstance(doc, dict) and isinstance(doc.get("schema"), str) and "entries" not in doc:
        raise DataError(f"{p}: JSON schema {doc['schema']!r} is not a collective trace")
    return from_fr(p, doc, FORMAT_FR_JSON, interner)


def _unpickle(p: Path, fh: Any) -> Any:
    try:
        return unpickle.RestrictedUnpickler(fh, what="a Flight Recorder dump").load()
    except unpickle.Refused as exc:
        raise DataError(
            f"{p}: unsafe pickle refused: {exc}; Flight Recorder dumps hold only plain containers and scalars"
        ) from None
    except EOFError:
        raise DataError(f"{p}: truncated pickle (ends before its STOP opcode)") from None
    except (
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        MemoryError,
        RecursionError,
        OverflowError,
        UnicodeDecodeError,
    ) as exc:
        raise DataError(f"{p}: corrupt pickle: {type(exc).__name__}: {str(exc)[:120]}") from None


# ----------------------------------------------------------------------------------------------
# Many files


def _load_or_refuse(path: str, interner: Interner) -> Loaded | GpuguardError:
    try:
        return load_dump(path, interner)
    except GpuguardError as exc:
        return exc


def _remap(loaded: Loaded, sig_map: list[int], site_map: list[int]) -> Loaded:
    streams = tuple(
        Stream(
            pg=s.pg,
            generation=s.generation,
            seqs=s.seqs,
            sig_ids=[sig_map[i] for i in s.sig_ids],
            states=s.states,
            site_ids=None if s.site_ids is None else [site_map[i] if i >= 0 else -1 for i in s.site_ids],
            times_ns=s.times_ns,
            pg_desc=s.pg_desc,
            states_reliable=s.states_reliable,
        )
        for s in loaded.trace.streams
    )
    t = loaded.trace
    return Loaded(
        RankTrace(
            rank=t.rank,
            source=t.source,
            format=t.format,
            streams=streams,
            version=t.version,
            world_size=t.world_size,
            pg_ranks=t.pg_ranks,
            skipped=t.skipped,
            dropped=t.dropped,
        ),
        loaded.entries,
        loaded.p2p,
        loaded.completed,
    )


def load_all(
    files: Iterable[Path], interner: Interner, *, jobs: int | None = None, progress: Any = None
) -> tuple[list[Loaded], list[GpuguardError]]:
    """Load every file; return the loaded dumps and, one per refused file, its one-line error (the
    caller analyses the rest and marks the result partial), both in input order.

    Files are read in forked reader processes (`jobs`, default: one, or up to 8 with 64 files or
    more), each file under a deadline (`unpickle.load_deadline` of its size): a pickle can make the
    C load itself endless (a dict key built from shared references is hashed without bound), which
    only killing the process that runs it stops; such a file is refused like any other. Each worker
    interns into an Interner of its own and sends the new signatures and sites with each file;
    they are merged here in input order, so ids are the same whatever the number of workers."""
    paths = [str(f) for f in files]
    if jobs is None:
        jobs = min(os.cpu_count() or 1, 8) if len(paths) >= 64 else 1
    deadlines = [unpickle.load_deadline(_size(p)) for p in paths]
    mine: dict[str, Any] = {}

    def read(i: int) -> tuple[Loaded | GpuguardError, list[Signature], list[str]]:  # in the worker
        it = mine.setdefault("interner", Interner())
        n_sigs, n_sites = len(it.signatures), len(it.sites)
        item = _load_or_refuse(paths[i], it)
        return item, it.signatures[n_sigs:], it.sites[n_sites:]

    results: dict[int, tuple[int, Any]] = {}
    maps: dict[int, tuple[list[int], list[int]]] = {}
    items: list[Loaded | GpuguardError] = []
    # unpickling builds millions of acyclic dicts and lists: the cycle collector would only rescan them
    # (torchfrtrace's loader disables it for the same reason)
    with gc_paused(), closing(map_with_deadlines(read, deadlines, jobs=max(1, jobs))) as done:
        for d in done:
            results[d.index] = (d.worker, d.value)
            while len(items) in results:  # merge in input order: the interner's ids do not depend on timing
                i = len(items)
                worker, value = results.pop(i)
                items.append(_merged(paths[i], worker, value, interner, maps))
                if progress:
                    progress(1)
    out = [x for x in items if not isinstance(x, GpuguardError)]
    return out, [x for x in items if isinstance(x, GpuguardError)]


def _merged(
    path: str,
    worker: int,
    value: Any,
    interner: Interner,
    maps: dict[int, tuple[list[int], list[int]]],
) -> Loaded | GpuguardError:
    if isinstance(value, Overdue):
        return DataError(
            f"{path}: refused: reading it {value.reason} (a pickle can make the load itself endless: "
            f"a dict key or set member built from shared references is hashed without bound)"
        )
    item, sigs, sites = value
    sig_map, site_map = maps.setdefault(worker, ([], []))
    sig_map.extend(interner.sig(s) for s in sigs)
    site_map.extend(interner.site(s) for s in sites)
    return item if isinstance(item, GpuguardError) else _remap(item, sig_map, site_map)


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def load_many(
    files: Iterable[Path], interner: Interner, *, jobs: int | None = None, progress: Any = None
) -> list[Loaded]:
    """Load every file or raise the first file's error (see `load_all` to analyse the rest)."""
    out, refused = load_all(files, interner, jobs=jobs, progress=progress)
    if refused:
        raise refused[0]
    return out


def check_usage_pg(names: Iterable[str], wanted: str) -> None:
    """`--pg NAME` must name a process group that exists in the input."""
    have = sorted(set(names))
    if wanted not in have:
        raise UsageError(f"--pg {wanted}: no such process group in the input (have: {', '.join(have) or 'none'})")
