"""Read per-rank step records: the StepLog streams under `<job-dir>/ranks/`, or ordinary training logs.

Tolerant by design: the writer may be mid-write (torn last line), two writers may have shared a file
(interleaved lines), the wall clock may jump, segments may rotate away while we read, a rank may not
have written anything yet. Nothing here raises on bad content: bad lines are counted and skipped.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

from gpuguard.diagnostics.jobmodel import (
    BETWEEN, CLOSED, COLLECTIVE, COMPUTING, STARTING, Phase, ProcessState, RankSeries, StepSample,
)
from gpuguard.recovery.steplog import RANKS_DIR, SUFFIX

_NAME = re.compile(r"^(\d{1,7})\.([A-Za-z0-9_-]{1,64})\.(\d{6,})" + re.escape(SUFFIX) + r"$")
CLOCK_JUMP_S = 1.0  # wall vs monotonic disagreement that counts as a clock jump
MAX_STEPS = 4096  # most recent step samples kept per rank
MAX_ERRORS = 8


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


def _f(tok: str) -> float:
    v = float(tok)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError("not finite")
    return v


def parse_lines(lines: Iterable[str], *, rank: int, incarnation: str,
                max_steps: int = MAX_STEPS) -> RankSeries:
    """Fold one incarnation's record lines (segments in order) into a `RankSeries`. Never raises."""
    header: dict = {}
    steps: list[StepSample] = []
    phase = Phase(STARTING)
    errors: list[str] = []
    bad = jumps = 0
    last_wall = last_mono = 0.0
    prev_wall = prev_mono = None
    prev_end_mono: float | None = None
    last_seq = -1  # the last collective this rank left: tells "already past collective N" apart
    for line in lines:
        if not line:
            continue
        kind = line[0]
        try:
            if kind == "H":
                h = json.loads(line[2:])
                if not isinstance(h, dict):
                    raise ValueError("header is not an object")
                if not header:
                    header = h
                w, m = _f(str(h.get("wall", 0))), _f(str(h.get("mono", 0)))
                if phase.kind == STARTING:
                    phase = Phase(STARTING, since_wall=w, since_mono=m)
            else:
                t = line[2:].split(" ")
                if kind == "S":
                    if len(t) != 3:
                        raise ValueError
                    step, w, m = int(t[0]), _f(t[1]), _f(t[2])
                    phase = Phase(COMPUTING, step=step, seq=last_seq, since_wall=w, since_mono=m)
                elif kind == "C":
                    if len(t) != 6:
                        raise ValueError
                    seq, step, w, m, nb = int(t[0]), int(t[1]), _f(t[2]), _f(t[3]), int(t[4])
                    phase = Phase(COLLECTIVE, step=step, seq=seq, op=t[5], nbytes=nb, since_wall=w, since_mono=m)
                elif kind == "X":
                    if len(t) != 4:
                        raise ValueError
                    seq, w, m = int(t[0]), _f(t[1]), _f(t[2])
                    _f(t[3])
                    last_seq = max(last_seq, seq)
                    phase = Phase(COMPUTING, step=phase.step, seq=last_seq, since_wall=w, since_mono=m)
                elif kind == "E":
                    if len(t) != 6:
                        raise ValueError
                    step, w, m, comp, wait, nb = int(t[0]), _f(t[1]), _f(t[2]), _f(t[3]), _f(t[4]), int(t[5])
                    if comp < 0 or wait < 0:
                        raise ValueError
                    interval = (m - prev_end_mono) if prev_end_mono is not None and m > prev_end_mono else None
                    steps.append(StepSample(step, w, m, comp, wait, nb, interval))
                    if len(steps) > 2 * max_steps:
                        del steps[: len(steps) - max_steps]
                    prev_end_mono = m
                    phase = Phase(BETWEEN, step=step, seq=last_seq, since_wall=w, since_mono=m)
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
                    phase = Phase(CLOSED, step=phase.step, seq=last_seq, since_wall=w, since_mono=m)
                else:
                    raise ValueError
                if prev_wall is not None and abs((w - prev_wall) - (m - prev_mono)) > CLOCK_JUMP_S:
                    jumps += 1
                prev_wall, prev_mono = w, m
                last_wall, last_mono = w, m
        except (ValueError, IndexError, TypeError, OverflowError):
            bad += 1
    pid = header.get("pid")
    lr = header.get("local_rank")
    ws = header.get("world_size")
    return RankSeries(
        rank=rank,
        incarnation=incarnation,
        generation=int(header.get("generation", 0)) if isinstance(header.get("generation", 0), int) else 0,
        pid=pid if isinstance(pid, int) and pid > 0 else None,
        host=str(header.get("host", "")),
        local_rank=lr if isinstance(lr, int) and not isinstance(lr, bool) and lr >= 0 else None,
        world_size=ws if isinstance(ws, int) and not isinstance(ws, bool) and 0 < ws <= 10_000_000 else None,
        start_wall=float(header.get("wall", 0) or 0) if isinstance(header.get("wall", 0), (int, float)) else 0.0,
        start_mono=float(header.get("mono", 0) or 0) if isinstance(header.get("mono", 0), (int, float)) else 0.0,
        steps=tuple(steps[-max_steps:]),
        phase=phase,
        last_wall=last_wall or (phase.since_wall if phase.kind == STARTING else 0.0),
        last_mono=last_mono or (phase.since_mono if phase.kind == STARTING else 0.0),
        errors=tuple(errors),
        bad_lines=bad,
        clock_jumps=jumps,
    )


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
                    data = data[cut + 1:] if cut >= 0 else b""
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
    root = Path(job_dir) / RANKS_DIR
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    skipped: list[str] = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return JobRecords(str(job_dir), {}, ())
    for name in names:
        m = _NAME.match(name)
        if not m:
            if name.endswith(SUFFIX):
                skipped.append(name)
            continue
        groups.setdefault((int(m.group(1)), m.group(2)), []).append((int(m.group(3)), name))
    per_rank: dict[int, list[RankSeries]] = {}
    budget = max(64 * 1024, max_steps * BYTES_PER_STEP)
    for (rank, inc), segs in groups.items():
        lines, files = _tail_lines(root, [name for _, name in sorted(segs)], budget)
        if not files:
            continue
        series = parse_lines(lines, rank=rank, incarnation=inc, max_steps=max_steps)
        per_rank.setdefault(rank, []).append(replace(series, files=tuple(files)))
    ranks: dict[int, RankSeries] = {}
    for rank, all_series in per_rank.items():
        newest = max(all_series, key=lambda s: (s.generation, s.start_wall, s.last_wall, s.incarnation))
        ranks[rank] = replace(newest, incarnations_seen=len(all_series))
    return JobRecords(str(job_dir), dict(sorted(ranks.items())), tuple(sorted(skipped)))


def probe_process(pid: int | None, start_wall: float = 0.0) -> ProcessState:
    """The OS view of a rank's process (psutil; no torch). A reused pid counts as gone."""
    if pid is None:
        return ProcessState("unknown", "no pid in the record header")
    import psutil

    try:
        proc = psutil.Process(pid)
        created = proc.create_time()
        if start_wall and created > start_wall + 2.0:
            return ProcessState("gone", f"pid {pid} now belongs to a newer process")
        status = proc.status()
    except psutil.NoSuchProcess:
        return ProcessState("gone", f"pid {pid} does not exist")
    except psutil.AccessDenied:
        return ProcessState("unknown", f"pid {pid}: access denied")
    mapping = {
        psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
        psutil.STATUS_ZOMBIE: "zombie", psutil.STATUS_DEAD: "gone",
        psutil.STATUS_DISK_SLEEP: "disk-sleep", psutil.STATUS_RUNNING: "running",
    }
    return ProcessState(mapping.get(status, "sleeping"), f"pid {pid} status {status}")


_EXIT = re.compile(r"exitcode\s*:?\s*(-?\d+)\)?[^\n]*?\(pid:\s*(\d+)\)")


def exit_codes_from_logs(paths: Iterable[str | os.PathLike[str]]) -> dict[int, int]:
    """pid -> exit code from torchrun's failure lines (`failed (exitcode: -9) local_rank: 3 (pid: 123)`,
    `exitcode  : -6 (pid: 123)`): the launcher is the only one that saw the worker's status."""
    out: dict[int, int] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if "exitcode" in line:
                        m = _EXIT.search(line)
                        if m:
                            out[int(m.group(2))] = int(m.group(1))
        except OSError:
            continue
    return out


_COMM_MARKERS = ("Watchdog caught collective operation timeout", "detected by watchdog", "Connection closed by peer", "Connection reset by peer",
                 "NCCL error", "ncclRemoteError", "ncclSystemError", "ncclInternalError", "Timed out waiting",
                 "Socket Timeout", "remote process exited", "Application timeout caused pair closure")
_RANK_PREFIX = re.compile(r"\[(?:rank|Rank |PG \d+ Rank )(\d{1,7})\]")


def comm_errors_from_logs(paths: Iterable[str | os.PathLike[str]], limit: int = 10_000) -> dict[int, list[str]]:
    """rank -> communication error lines it printed (`[rank3]:` / `[Rank 3]` prefixes: torchrun's
    per-rank prefixes, the NCCL watchdog's own). Lines without a rank are skipped: no one to attach them to."""
    out: dict[int, list[str]] = {}
    n = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if not any(m in line for m in _COMM_MARKERS):
                        continue
                    m = _RANK_PREFIX.search(line)
                    if m is None:
                        continue
                    msgs = out.setdefault(int(m.group(1)), [])
                    if len(msgs) < 8:
                        msgs.append(line.strip()[:400])
                    n += 1
                    if n >= limit:
                        return out
        except OSError:
            continue
    return out


def _with_exit(proc: ProcessState, pid: int | None, codes: dict[int, int]) -> ProcessState:
    if pid is None or pid not in codes or proc.state not in ("gone", "zombie", "unknown"):
        return proc
    code = codes[pid]
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    try:
        import signal as _signal

        if code < 0:
            how = f"killed by {_signal.Signals(-code).name}"
    except ValueError:
        pass
    return ProcessState("gone", f"{proc.detail}; torchrun: {how}", exit_code=code)


def local_host() -> str:
    import socket

    return socket.gethostname()


def observe_job(job_dir: str | os.PathLike[str], *, window: int = 20, history: int = 2000,
                now_wall: float | None = None, probe: bool = True,
                logs: Iterable[str | os.PathLike[str]] = (), log_spec: "LogStepSpec | None" = None,
                node_reports: Iterable[dict] = (), launcher_logs: Iterable[str | os.PathLike[str]] = ()):
    """Read the records and the process table; return (records, observations) ready for the vote.

    With `logs` and `log_spec`, ranks that wrote no StepLog records are read from training logs instead.

    Ages use the monotonic clock for ranks written on this host (immune to wall-clock jumps), the wall
    clock otherwise; processes are probed only on this host (a pid means nothing elsewhere).
    """
    import time

    from gpuguard.diagnostics.jobstats import observe

    records = read_job(job_dir, max_steps=history)
    if log_spec is not None:
        from_logs = read_log_steps(logs, log_spec, max_steps=history)
        merged = {**from_logs, **records.ranks}
        records = JobRecords(records.job_dir, dict(sorted(merged.items())), records.skipped_files)
    from gpuguard.diagnostics.jobevidence import hardware_from_node_reports

    hardware = hardware_from_node_reports(
        node_reports, {r: (s.host, s.local_rank) for r, s in records.ranks.items()})
    codes = exit_codes_from_logs(launcher_logs)
    from gpuguard.diagnostics.jobstats import comm_errors_from_text

    comm = comm_errors_from_logs([*logs, *launcher_logs])
    here = local_host()
    now_w = time.time() if now_wall is None else now_wall
    now_m = time.monotonic()
    out = []
    for series in records.ranks.values():
        local = series.host == here and now_wall is None
        proc = probe_process(series.pid, series.start_wall) if (probe and local) else ProcessState(
            "unknown", f"rank runs on {series.host or 'an unknown host'}, not here" if probe else "not probed")
        proc = _with_exit(proc, series.pid, codes)
        ce = comm_errors_from_text(series.rank, (*series.errors, *comm.get(series.rank, ())))
        out.append(observe(series, now_wall=now_w, now_mono=now_m if local else None, process=proc,
                           window=window, history=history, hardware=hardware.get(series.rank, ()), comm_errors=ce))
    from gpuguard.diagnostics.jobmodel import RankObservation

    for rank in records.silent_ranks[:100_000]:
        out.append(RankObservation(rank=rank, has_records=False,
                                   notes=(f"WORLD_SIZE is {records.expected_world} but rank {rank} wrote no records",)))
    return records, out


# -- step times from ordinary training logs (jobs that do not use the StepLog writer) ----------------
@dataclass(frozen=True)
class LogStepSpec:
    """How to find a step in a log line: a regex with named groups.

    `step` (required); `step_s` or `step_ms` (the step's duration); `ts` (a timestamp: epoch seconds or
    ISO 8601); `rank` (else `default_rank`). Durations from a log are wall step times: the log cannot
    split the rank's own compute from its collective wait, so the cohort compares wall steps.
    """

    pattern: re.Pattern[str]
    default_rank: int = 0

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "LogStepSpec":
        import yaml

        from gpuguard.errors import DataError, NoInputError

        try:
            doc = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise NoInputError(f"{path}: no such log spec") from None
        except yaml.YAMLError as exc:
            raise DataError(f"{path}: not valid YAML: {exc}") from None
        doc = (doc or {}).get("step_log", doc) if isinstance(doc, dict) else doc
        if not isinstance(doc, dict) or not isinstance(doc.get("pattern"), str):
            raise DataError(f"{path}: expected `step_log: {{pattern: REGEX}}`")
        return cls.compile(doc["pattern"], int(doc.get("default_rank", 0)), str(path))

    @classmethod
    def compile(cls, pattern: str, default_rank: int = 0, where: str = "pattern") -> "LogStepSpec":
        from gpuguard.errors import DataError

        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise DataError(f"{where}: bad regex: {exc}") from None
        if "step" not in rx.groupindex:
            raise DataError(f"{where}: the regex needs a named group (?P<step>...)")
        if not {"step_s", "step_ms", "ts"} & set(rx.groupindex):
            raise DataError(f"{where}: the regex needs (?P<step_s>...), (?P<step_ms>...) or (?P<ts>...)")
        return cls(rx, default_rank)


def _ts(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        from datetime import datetime

        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace(",", "."))
        if when.tzinfo is None:
            when = when.astimezone()
        return when.timestamp()


def read_log_steps(paths: Iterable[str | os.PathLike[str]], spec: LogStepSpec,
                   max_steps: int = MAX_STEPS) -> dict[int, RankSeries]:
    """Per-rank series from log lines matching `spec` (streamed; unmatched and unparsable lines skipped)."""
    per: dict[int, list[StepSample]] = {}
    last: dict[int, float] = {}
    bad: dict[int, int] = {}
    files: dict[int, set[str]] = {}
    for path in paths:
        try:
            mtime = os.stat(path).st_mtime
            fh = open(path, encoding="utf-8", errors="replace")
        except OSError:
            continue
        with fh:
            for line in fh:
                m = spec.pattern.search(line)
                if not m:
                    continue
                g = m.groupdict()
                rank = spec.default_rank
                try:
                    rank = int(g["rank"]) if g.get("rank") is not None else spec.default_rank
                    step = int(g["step"])
                    ts = _ts(g["ts"]) if g.get("ts") else None
                    if g.get("step_s") is not None:
                        dur = float(g["step_s"])
                    elif g.get("step_ms") is not None:
                        dur = float(g["step_ms"]) / 1000
                    else:
                        dur = None
                except (ValueError, TypeError, OverflowError):
                    bad[rank] = bad.get(rank, 0) + 1
                    continue
                prev = last.get(rank)
                if dur is None:
                    if ts is None or prev is None or ts <= prev:
                        last[rank] = ts if ts is not None else (prev or mtime)
                        continue
                    dur = ts - prev
                if dur < 0 or dur != dur:
                    continue
                end = ts if ts is not None else mtime
                interval = (end - prev) if (ts is not None and prev is not None and end > prev) else dur
                series = per.setdefault(rank, [])
                series.append(StepSample(step, end, 0.0, dur, 0.0, 0, interval))
                if len(series) > 2 * max_steps:
                    del series[:-max_steps]
                last[rank] = end
                files.setdefault(rank, set()).add(os.fspath(path))
    out = {}
    for rank, steps in sorted(per.items()):
        steps = steps[-max_steps:]
        end = steps[-1].end_wall
        out[rank] = RankSeries(rank=rank, incarnation="log", steps=tuple(steps),
                               phase=Phase(BETWEEN, step=steps[-1].step, since_wall=end), last_wall=end,
                               bad_lines=bad.get(rank, 0), files=tuple(sorted(files.get(rank, ()))))
    return out
