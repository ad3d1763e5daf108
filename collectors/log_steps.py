"""A job read from its training logs, post-mortem: per-rank steps, where each rank stopped, and when.

For jobs that do not use the StepLog writer, or whose ranks are gone and only their logs are left. A
regex with named groups says where a step is in a line; durations from a log are wall step times (the
log cannot split a rank's own compute from its collective wait). Streamed; bad lines skipped.

Judged like live records (issue 26): before, ages came from the file's mtime and a rank came only from
a `rank` group, so a log whose ranks 0-2 timed out in the NCCL watchdog while rank 3 had stopped a
step earlier read "all ranks progressing". Now:
- **when**: the line's own time (the regex's `ts` group, else the timestamp prefix the line carries:
  ISO / Python logging, glog `[E0626 06:24:44.9]`, syslog, `dmesg -T`; `collectors.logtime`), and the
  log's "now" is its newest timestamp (`LogJob.end_wall`): a post-mortem is judged as of its last line;
- **who**: the regex's `rank` group, else the line's prefix (`line_rank`);
- **where it stopped**: a rank whose ProcessGroupNCCL watchdog timed out sits in that collective
  (`SeqNum`, `OpType`) since the timeout minus what it ran for, one step past its last logged step;
  a rank that did not time out stays where its log stopped. The vote's coupling then names the rank
  the victims waited for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from gpuguard.collectors.logparse import LogParser
from gpuguard.collectors.logrules_comm import rank_of
from gpuguard.collectors.logtime import line_time
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, Phase, RankSeries, StepSample
from gpuguard.foundation.steplog import MAX_STEPS
from gpuguard.foundation.unpickle import brief
from gpuguard.foundation.yamlfile import load_yaml

MAX_SPEC_BYTES = 64 << 10
"""A log-step spec is a regex and a rank: 64 KiB is generous."""
MAX_RANK = 10_000_000
LOG_INCARNATION = "log"  # the incarnation of a rank read from a log (it names none)
WATCHDOG_MARKS = ("WorkNCCL(", "detected by watchdog")  # ProcessGroupNCCL's timeout and failure lines
WATCHDOG_KINDS = ("watchdog_timeout", "watchdog_failure")  # `logrules_comm`'s events for those lines

# torchrun's own per-worker prefix (`[<role><local_rank>]:`, default role `default`; with
# `--log-line-prefix-template "[${rank}]:"` the rank), at the start of a line. The local rank is the
# rank on a one-node job; a multi-node log should carry PyTorch's `[rankN]:` (global) prefix.
_TORCHRUN_PREFIX = re.compile(r"^\s*\[(?:[A-Za-z_][A-Za-z_-]{0,31}?)?(\d{1,7})\]:")
_DATED = re.compile(r"(?<!\d)(\d{4})-\d{2}-\d{2}[T ]\d{2}:")  # a timestamp with its year (ISO, Python logging)


def line_rank(text: str) -> int | None:
    """The rank a log line names: `[Rank N]` / `[PG 1 Rank N]` inside a PyTorch line or its `[rankN]:`
    prefix (`logrules_comm.rank_of`, global ranks), else torchrun's `[defaultN]:` / `[N]:` prefix."""
    rank = rank_of(text)
    if rank is None:
        m = _TORCHRUN_PREFIX.match(text)
        rank = int(m.group(1)) if m else None
    return rank if rank is not None and rank < MAX_RANK else None


@dataclass(frozen=True)
class LogStepSpec:
    """How to find a step in a log line: a regex with named groups.

    `step` (required); `step_s` or `step_ms` (the step's duration); `ts` (a timestamp: epoch seconds or
    ISO 8601; without it the line's own timestamp prefix is used); `rank` (else the line's rank prefix,
    else `default_rank`). Durations from a log are wall step times: the log cannot split the rank's own
    compute from its collective wait, so the cohort compares wall steps.
    """

    pattern: re.Pattern[str]
    default_rank: int = 0

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> LogStepSpec:
        """Read through the one YAML reader (size cap, regular file, no repeated key): 65 otherwise."""
        try:
            doc = load_yaml(path, max_bytes=MAX_SPEC_BYTES, what="a log-step spec")
        except NoInputError:
            raise NoInputError(f"{path}: no such log spec") from None
        doc = (doc or {}).get("step_log", doc) if isinstance(doc, dict) else doc
        if not isinstance(doc, dict) or not isinstance(doc.get("pattern"), str):
            raise DataError(f"{path}: expected `step_log: {{pattern: REGEX}}`")
        rank = doc.get("default_rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise DataError(f"{path}: default_rank must be a whole number >= 0, got {brief(rank)}")
        return cls.compile(doc["pattern"], rank, str(path))

    @classmethod
    def compile(cls, pattern: str, default_rank: int = 0, where: str = "pattern") -> LogStepSpec:
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise DataError(f"{where}: bad regex: {exc}") from None
        if "step" not in rx.groupindex:
            raise DataError(f"{where}: the regex needs a named group (?P<step>...)")
        return cls(rx, default_rank)


@dataclass(frozen=True)
class LogJob:
    """What the logs say of each rank, and the time they end at."""

    ranks: dict[int, RankSeries]
    end_wall: float | None  # the newest timestamp of any line: the post-mortem's "now" (None: no line had one)
    untimed_steps: int = 0  # step lines with no time of their own (their ages fall back to the file's mtime)
    timeouts: dict[int, dict[str, object]] = field(default_factory=dict)  # rank -> its watchdog timeout


def _ts(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace(",", "."))
        if when.tzinfo is None:
            when = when.astimezone()
        return when.timestamp()


@dataclass
class _Rank:
    steps: list[StepSample] = field(default_factory=list)
    last_step_end: float | None = None
    last_seen: float | None = None  # the newest timestamp of any line naming the rank
    bad: int = 0
    files: set[str] = field(default_factory=set)
    timeout: dict[str, object] | None = None  # the first watchdog timeout it printed


class _Reader:
    """One pass over the lines of every log, rank by rank (see the module docstring)."""

    def __init__(self, spec: LogStepSpec | None, max_steps: int) -> None:
        self.spec, self.max_steps = spec, max_steps
        self.per: dict[int, _Rank] = {}
        self.end: float | None = None
        self.untimed = 0
        self.year: int | None = None  # of the newest dated line: glog and syslog prefixes carry none

    def rank(self, r: int) -> _Rank:
        return self.per.setdefault(r, _Rank())

    def read(self, path: str | os.PathLike[str]) -> None:
        try:
            mtime = os.stat(path).st_mtime
            fh = open(path, encoding="utf-8", errors="replace")
        except OSError:
            return
        parser = LogParser(os.fspath(path), year=self.year)
        with fh:
            for n, line in enumerate(fh, 1):
                self.line(line, n, parser, mtime, os.fspath(path))

    def line(self, line: str, n: int, parser: LogParser, mtime: float, path: str) -> None:
        dated = _DATED.search(line, 0, 160)
        if dated is not None:  # the year of the undated lines (glog, syslog) that follow
            self.year = parser.state.year = int(dated.group(1))
        stamp, _ = line_time(line, self.year)
        if stamp is not None:
            self.end = stamp if self.end is None else max(self.end, stamp)
        who = line_rank(line)
        if who is not None and stamp is not None:
            r = self.rank(who)
            r.last_seen = stamp if r.last_seen is None else max(r.last_seen, stamp)
        if any(mark in line for mark in WATCHDOG_MARKS):
            for event in parser.feed(line, n):
                self.timeout(event.kind, dict(event.fields), event.timestamp)
        if self.spec is not None:
            m = self.spec.pattern.search(line)
            if m is not None:
                self.step(m.groupdict(), who, stamp, mtime, path)

    def timeout(self, kind: str, fields: dict[str, object], stamp: float | None) -> None:
        """Where the rank's watchdog saw it stuck: its first timeout (later ones are the same hang seen
        again), else the work its watchdog's failure line names (`detected by watchdog at work: N`)."""
        rank = fields.get("rank")
        if kind not in WATCHDOG_KINDS or not isinstance(rank, int) or rank >= MAX_RANK or stamp is None:
            return
        r = self.rank(rank)
        if r.timeout is None or (r.timeout["kind"] != WATCHDOG_KINDS[0] and kind == WATCHDOG_KINDS[0]):
            r.timeout = {**fields, "kind": kind, "timestamp": stamp}

    def step(self, g: dict[str, str | None], who: int | None, stamp: float | None, mtime: float, path: str) -> None:
        assert self.spec is not None
        rank = self.spec.default_rank if who is None else who
        try:
            if g.get("rank") is not None:
                rank = int(g["rank"] or "")
            step = int(g["step"] or "")
            ts = _ts(g["ts"] or "") if g.get("ts") else stamp
            if g.get("step_s") is not None:
                dur: float | None = float(g["step_s"] or "")
            elif g.get("step_ms") is not None:
                dur = float(g["step_ms"] or "") / 1000
            else:
                dur = None
        except (ValueError, TypeError, OverflowError):
            if 0 <= rank < MAX_RANK:
                self.rank(rank).bad += 1
            return
        if not 0 <= rank < MAX_RANK:
            return
        r = self.rank(rank)
        if ts is None:
            self.untimed += 1
        prev = r.last_step_end
        if dur is None:
            if ts is None or prev is None or ts <= prev:
                r.last_step_end = ts if ts is not None else (prev or mtime)
                return
            dur = ts - prev
        if dur < 0 or dur != dur:
            return
        end = ts if ts is not None else mtime
        interval = (end - prev) if (ts is not None and prev is not None and end > prev) else dur
        r.steps.append(StepSample(step, end, 0.0, dur, 0.0, 0, interval))
        if len(r.steps) > 2 * self.max_steps:
            del r.steps[: -self.max_steps]
        r.last_step_end = end
        if ts is not None:
            r.last_seen = ts if r.last_seen is None else max(r.last_seen, ts)
        r.files.add(path)

    def entered(self) -> dict[int, float]:
        """When each collective a watchdog timed out in was entered: its earliest timeout minus what it ran
        for. A failure line (`detected by watchdog at work: N`) gives no duration: that rank is taken to
        have entered collective N with its peers that timed out in it (the lines come at one moment)."""
        out: dict[int, float] = {}
        for r in self.per.values():
            t = r.timeout
            if t is not None and t["kind"] == WATCHDOG_KINDS[0] and isinstance(t.get("seq"), int):
                since = _number(t.get("timestamp")) - _number(t.get("elapsed_ms")) / 1000
                seq = int(_number(t["seq"]))
                out[seq] = min(out.get(seq, since), since)
        return out

    def series(self, rank: int, r: _Rank, entered: dict[int, float]) -> RankSeries | None:
        steps = r.steps[-self.max_steps :]
        last = steps[-1].step if steps else -1
        t = r.timeout
        if t is not None:
            stamp = _number(t.get("timestamp"))
            ran = _number(t.get("elapsed_ms")) / 1000
            seq = int(_number(t.get("seq"), -1))
            op = str(t.get("op") or "")
            since = stamp - ran if t["kind"] == WATCHDOG_KINDS[0] else entered.get(seq, stamp)
            phase = Phase(COLLECTIVE, step=last + 1, seq=seq, op=op, since_wall=since)
            entries: tuple[tuple[int, float, float, float], ...] = ((seq, since, 0.0, -1.0),)
            errors: tuple[str, ...] = (watchdog_words(t),)
        elif steps:
            phase, entries, errors = Phase(BETWEEN, step=last, since_wall=steps[-1].end_wall), (), ()
        elif r.last_seen is not None:  # it printed, but no step and no timeout: where its log stops
            phase, entries, errors = Phase(BETWEEN, step=-1, since_wall=r.last_seen), (), ()
        else:
            return None
        # progress is a step or a collective entry; a later line (the watchdog's own) is not
        last_wall = max(steps[-1].end_wall if steps else 0.0, phase.since_wall)
        return RankSeries(
            rank=rank,
            incarnation=LOG_INCARNATION,
            steps=tuple(steps),
            phase=phase,
            last_wall=last_wall,
            errors=errors,
            bad_lines=r.bad,
            files=tuple(sorted(r.files)),
            entries=entries,
        )


def _number(value: object, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def watchdog_words(t: dict[str, object]) -> str:
    """A rank's watchdog evidence in words (for its notes and errors)."""
    where = f"{t.get('op') or 'collective'} #{t.get('seq')}"
    if t.get("kind") == WATCHDOG_KINDS[0]:
        return f"its NCCL watchdog timed out in {where} after {_number(t.get('elapsed_ms')) / 1000:.0f} s"
    return f"its NCCL watchdog saw it stuck at work #{t.get('seq')} (last completed {t.get('last_completed')})"


def read_log_job(
    paths: Iterable[str | os.PathLike[str]], spec: LogStepSpec | None, max_steps: int = MAX_STEPS
) -> LogJob:
    """Every rank the logs tell of: its steps (with `spec`), its watchdog timeout, its last line's time."""
    reader = _Reader(spec, max_steps)
    for path in paths:
        reader.read(path)
    ranks = {}
    entered = reader.entered()
    for rank, r in sorted(reader.per.items()):
        s = reader.series(rank, r, entered)
        if s is not None:
            ranks[rank] = s
    timeouts = {rank: r.timeout for rank, r in reader.per.items() if r.timeout is not None}
    return LogJob(ranks, reader.end, reader.untimed, timeouts)


def read_log_steps(
    paths: Iterable[str | os.PathLike[str]], spec: LogStepSpec, max_steps: int = MAX_STEPS
) -> dict[int, RankSeries]:
    """Per-rank series from log lines matching `spec` (streamed; unmatched and unparsable lines skipped)."""
    return read_log_job(paths, spec, max_steps).ranks
