"""Read the StepLog streams under `<job-dir>/ranks/`: the newest incarnation of each rank, tail only.

Tolerant by design: the writer may be mid-write (torn last line), two writers may have shared a file
(interleaved lines), segments may rotate away while we read, a rank may not have written anything
yet. Nothing here raises on bad content: the decoder (`foundation.steplog`) counts and skips bad lines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from gpuguard.foundation.jobdir import ranks_dir
from gpuguard.foundation.observations import RankSeries
from gpuguard.foundation.steplog import MAX_STEPS, SUFFIX, decode_lines, parse_segment_name


@dataclass(frozen=True)
class JobRecords:
    """What `read_job` found: one series per rank (its newest incarnation) plus what it skipped."""

    job_dir: str
    ranks: dict[int, RankSeries]
    skipped_files: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def expected_world(self) -> int | None:
        """WORLD_SIZE as the ranks recorded it (the largest claim), if any did."""
        sizes = [s.world_size for s in self.ranks.values() if s.world_size]
        return max(sizes) if sizes else None

    @property
    def silent_ranks(self) -> tuple[int, ...]:
        """Ranks below the recorded WORLD_SIZE that have not written a record (yet)."""
        w = self.expected_world
        return tuple(r for r in range(w) if r not in self.ranks) if w else ()


def _complete_lines(data: bytes) -> list[str]:
    """Whole lines only: a torn last record (no newline yet) is not a record."""
    end = data.rfind(b"\n")
    if end < 0:
        return []
    return data[:end].decode("utf-8", "replace").split("\n")


BYTES_PER_STEP = 4 * 64  # ~4 records of ~50 bytes per step: how much tail to read for `max_steps`


def _tail_lines(root: Path, names: list[str], budget: int) -> tuple[list[str], list[str]]:
    """The header line plus the last ~`budget` bytes of whole lines across the segments (oldest first).

    Reading only the tail keeps a check cheap however long the job has run (rotation bounds the rest).
    """
    chunks: list[list[str]] = []
    files: list[str] = []
    header: list[str] = []
    left = budget
    for name in reversed(names):
        if left <= 0:
            break
        try:
            with open(root / name, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                first = fh.readline()
                if size > left:
                    fh.seek(size - left)
                    data = fh.read()
                    cut = data.find(b"\n")
                    data = data[cut + 1 :] if cut >= 0 else b""
                else:
                    fh.seek(0)
                    data = fh.read()
                    first = b""  # the whole segment, header included
        except OSError:  # rotated away while we listed
            continue
        left -= size
        chunks.append(_complete_lines(data))
        files.append(name)
        if first.endswith(b"\n") and first.startswith(b"H "):
            header = [first[:-1].decode("utf-8", "replace")]
    lines = header[:]
    for chunk in reversed(chunks):
        lines.extend(chunk)
    return lines, list(reversed(files))


def read_job(job_dir: str | os.PathLike[str], *, max_steps: int = MAX_STEPS) -> JobRecords:
    """Every rank's newest incarnation under `<job-dir>/ranks/` (empty when there is nothing yet)."""
    root = ranks_dir(job_dir)
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    skipped: list[str] = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return JobRecords(str(job_dir), {}, ())
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is None:
            if name.endswith(SUFFIX):
                skipped.append(name)
            continue
        rank, inc, segment = parsed
        groups.setdefault((rank, inc), []).append((segment, name))
    per_rank: dict[int, list[RankSeries]] = {}
    budget = max(64 * 1024, max_steps * BYTES_PER_STEP)
    for (rank, inc), segs in groups.items():
        lines, files = _tail_lines(root, [name for _, name in sorted(segs)], budget)
        if not files:
            continue
        series = decode_lines(lines, rank=rank, incarnation=inc, max_steps=max_steps)
        per_rank.setdefault(rank, []).append(replace(series, files=tuple(files)))
    ranks: dict[int, RankSeries] = {}
    for rank, all_series in per_rank.items():
        newest = max(all_series, key=lambda s: (s.generation, s.start_wall, s.last_wall, s.incarnation))
        ranks[rank] = replace(newest, incarnations_seen=len(all_series))
    return JobRecords(str(job_dir), dict(sorted(ranks.items())), tuple(sorted(skipped)))
