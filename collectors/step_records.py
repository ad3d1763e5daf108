"""Read the StepLog streams under `<job-dir>/ranks/`: the newest incarnation of each rank, tail only.

Tolerant by design: the writer may be mid-write (torn last line), two writers may have shared a file
(interleaved lines), segments may rotate away while we read, a rank may not have written anything
yet. Nothing here raises on bad content: the decoder (`foundation.steplog`) counts and skips bad lines.
A rank whose newest step log cannot be read (an OS error other than rotation: a directory, no permission)
or holds no record at all (garbage) is reported in `unusable` with the reason, never dropped: without its
records the vote would call it hung, or not see it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuguard.foundation.boundedread import open_regular
from gpuguard.foundation.errors import GpuguardError, NoInputError
from gpuguard.foundation.jobdir import ranks_dir
from gpuguard.foundation.observations import RankSeries
from gpuguard.foundation.step_columns import computes_of, periods_of
from gpuguard.foundation.step_summary import StepSummary
from gpuguard.foundation.steplog import MAX_STEPS, SUFFIX, decode_lines, parse_segment_name


@dataclass(frozen=True)
class JobRecords:
    """What `read_job` found: one series per rank (its newest incarnation) plus what it skipped."""

    job_dir: str
    ranks: dict[int, RankSeries]
    skipped_files: tuple[str, ...] = ()
    # ranks whose newest step log could not be used, with the reason (one line, no "step log unreadable" prefix)
    unusable: dict[int, str] = field(default_factory=dict)

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
        return tuple(r for r in range(w) if r not in self.ranks and r not in self.unusable) if w else ()


def _complete_lines(data: bytes) -> list[str]:
    """Whole lines only: a torn last record (no newline yet) is not a record."""
    end = data.rfind(b"\n")
    if end < 0:
        return []
    return data[:end].decode("utf-8", "replace").split("\n")


BYTES_PER_STEP = 4 * 64  # ~4 records of ~50 bytes per step: how much tail to read for `max_steps`
HEADER_BYTES = 64 * 1024  # a header line is a few hundred bytes; one longer than this is not one


def _tail_lines(root: Path, names: list[str], budget: int) -> tuple[list[str], list[str], str]:
    """The header line plus the last ~`budget` bytes of whole lines across the segments (oldest first), and
    why the newest segment could not be read ("" when it could, or when it rotated away).

    Reading only the tail keeps a check cheap however long the job has run (rotation bounds the rest).
    """
    error = ""
    chunks: list[list[str]] = []
    files: list[str] = []
    header: list[str] = []
    left = budget
    for name in reversed(names):
        if left <= 0:
            break
        try:
            # bounded: no link (a step log linked to /dev/zero), no FIFO (it would block the open),
            # and never more than the header line and the tail budget, however large the file
            with open_regular(root / name, what="a step log", follow_links=False) as (fd, st):
                size = st.st_size
                if size > left:
                    first = _first_line(fd)
                    data = os.pread(fd, left, size - left)
                    cut = data.find(b"\n")
                    data = data[cut + 1 :] if cut >= 0 else b""
                else:
                    data = os.pread(fd, size, 0)
                    first = b""  # the whole segment, header included
        except NoInputError:  # rotated away while we listed
            continue
        except (GpuguardError, OSError) as e:  # a link, a FIFO, a directory, no permission: not rotation
            if not files and not error:
                error = f"{name}: {_reason(e)}"
            continue
        left -= size
        chunks.append(_complete_lines(data))
        files.append(name)
        if first.endswith(b"\n") and first.startswith(b"H "):
            header = [first[:-1].decode("utf-8", "replace")]
    lines = header[:]
    for chunk in reversed(chunks):
        lines.extend(chunk)
    return lines, list(reversed(files)), error


def _first_line(fd: int) -> bytes:
    """The header line (with its newline), or b"" when the first HEADER_BYTES hold none."""
    head = os.pread(fd, HEADER_BYTES, 0)
    end = head.find(b"\n")
    return head[: end + 1] if end >= 0 else b""


def _reason(exc: BaseException) -> str:
    """Why a step log could not be read, without the path (the caller names the file)."""
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    return str(exc).split(": ", 1)[-1]


def _mtime(root: Path, names: list[str]) -> float:
    """The newest modification time among the segments (lstat: a link is not followed), 0 when none."""
    out = 0.0
    for name in names:
        try:
            out = max(out, os.lstat(root / name).st_mtime)
        except OSError:
            continue
    return out


def _segment_groups(root: Path) -> tuple[dict[tuple[int, str], list[str]], list[str]]:
    """{(rank, incarnation): its segment names, oldest first} and the `.steplog` names that are not one."""
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    skipped: list[str] = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return {}, []
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is None:
            if name.endswith(SUFFIX):
                skipped.append(name)
            continue
        rank, inc, segment = parsed
        groups.setdefault((rank, inc), []).append((segment, name))
    return {key: [name for _, name in sorted(segs)] for key, segs in groups.items()}, skipped


def read_job(
    job_dir: str | os.PathLike[str],
    *,
    max_steps: int = MAX_STEPS,
    history: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> JobRecords:
    """Every rank's newest incarnation under `<job-dir>/ranks/` (empty when there is nothing yet).

    `history`: fold each rank's last `history` steps into a bounded `StepSummary` and keep only its last
    `max_steps` samples: memory per rank does not grow with its steps, so 100,000 ranks fit (the tail
    and the series of the one rank being read are the only buffers). `on_progress(done,
    total)`: called after each incarnation's log is read (a progress bar on long reads)."""
    root = ranks_dir(job_dir)
    if not root.is_dir():
        return JobRecords(str(job_dir), {}, ())
    groups, skipped = _segment_groups(root)
    per_rank: dict[int, list[RankSeries]] = {}
    bad: dict[int, list[tuple[float, str, list[str]]]] = {}  # rank -> (mtime, reason, files) per unusable group
    budget = max(64 * 1024, max(max_steps, history or 0) * BYTES_PER_STEP)
    for done, ((rank, inc), names_in) in enumerate(groups.items(), 1):
        if on_progress is not None:
            on_progress(done, len(groups))
        lines, files, error = _tail_lines(root, names_in, budget)
        if error:
            bad.setdefault(rank, []).append((_mtime(root, names_in), error, names_in))
            continue
        if not files:
            continue
        series = decode_lines(lines, rank=rank, incarnation=inc, max_steps=max(max_steps, history or 0))
        if not series.start_wall and not series.last_wall:  # not one record: its age would be "since 1970"
            got = f"{series.bad_lines} line(s), none a step record" if series.bad_lines else "no complete record yet"
            why = f"{files[-1]}: {got}"
            bad.setdefault(rank, []).append((_mtime(root, names_in), why, files))
            continue
        # one copy of the series, not one per change (a frozen dataclass: `replace` builds it whole)
        kept = {} if history is None else _summarised(series, history, max_steps)
        per_rank.setdefault(rank, []).append(replace(series, files=tuple(files), **kept))
    ranks: dict[int, RankSeries] = {}
    unusable: dict[int, str] = {}
    for rank, all_series in per_rank.items():
        newest = max(all_series, key=lambda s: (s.generation, s.start_wall, s.last_wall, s.incarnation))
        ranks[rank] = newest if len(all_series) == 1 else replace(newest, incarnations_seen=len(all_series))
    for rank, groups_bad in bad.items():
        mtime, why, files = max(groups_bad)
        usable = ranks.get(rank)
        if usable is not None and mtime < usable.start_wall:
            skipped.extend(files)  # an older incarnation than the one we read: history only
            continue
        # it may be the rank's newest incarnation: what we could read of it says nothing about it now
        ranks.pop(rank, None)
        unusable[rank] = why
    return JobRecords(str(job_dir), dict(sorted(ranks.items())), tuple(sorted(skipped)), dict(sorted(unusable.items())))


def _summarised(series: RankSeries, history: int, keep: int) -> dict[str, Any]:
    """The series' new `steps` and `summary` (for `replace`): its last `history` steps as a bounded summary and
    only its last `keep` samples. The full series of this one rank is the only transient buffer, so the
    summary is exact in what it covers."""
    summary = StepSummary()
    steps = series.steps[-history:]
    summary.periods.extend([v for v in periods_of(steps) if v > 0])  # as `StepSummary.add`, without a call a step
    summary.computes.extend(computes_of(steps))
    return {"steps": series.steps[-keep:], "summary": summary}


def read_history(job_dir: str | os.PathLike[str], *, max_steps: int = MAX_STEPS) -> tuple[RankSeries, ...]:
    """Every incarnation of every rank, one series per generation it wrote (an in-place switch reopens
    the log under a new header: the lines are split there), oldest first: what the pictures and the
    trace draw. The same bounds as `read_job` (each incarnation's tail); an unreadable one is left out."""
    root = ranks_dir(job_dir)
    groups, _ = _segment_groups(root)
    budget = max(64 * 1024, max_steps * BYTES_PER_STEP)
    out: list[RankSeries] = []
    for (rank, inc), names in groups.items():
        lines, files, _error = _tail_lines(root, names, budget)
        runs: list[list[str]] = []
        for line in lines:
            if line.startswith("H ") or not runs:
                runs.append([])
            runs[-1].append(line)
        for run in runs:
            series = decode_lines(run, rank=rank, incarnation=inc, max_steps=max_steps)
            if series.steps or series.last_wall:
                out.append(replace(series, files=tuple(files)))
    return tuple(sorted(out, key=lambda s: (s.start_wall, s.rank, s.generation)))
