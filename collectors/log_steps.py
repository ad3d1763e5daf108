"""Step times from ordinary training logs, for jobs that do not use the StepLog writer.

A regex with named groups says where a step is in a line; durations from a log are wall step times
(the log cannot split a rank's own compute from its collective wait). Streamed; bad lines skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.foundation.observations import BETWEEN, Phase, RankSeries, StepSample
from gpuguard.foundation.steplog import MAX_STEPS
from gpuguard.foundation.unpickle import brief
from gpuguard.foundation.yamlfile import load_yaml

MAX_SPEC_BYTES = 64 << 10
"""A log-step spec is a regex and a rank: 64 KiB is generous."""


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
        if not {"step_s", "step_ms", "ts"} & set(rx.groupindex):
            raise DataError(f"{where}: the regex needs (?P<step_s>...), (?P<step_ms>...) or (?P<ts>...)")
        return cls(rx, default_rank)


def _ts(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace(",", "."))
        if when.tzinfo is None:
            when = when.astimezone()
        return when.timestamp()


def read_log_steps(
    paths: Iterable[str | os.PathLike[str]], spec: LogStepSpec, max_steps: int = MAX_STEPS
) -> dict[int, RankSeries]:
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
        out[rank] = RankSeries(
            rank=rank,
            incarnation="log",
            steps=tuple(steps),
            phase=Phase(BETWEEN, step=steps[-1].step, since_wall=end),
            last_wall=end,
            bad_lines=bad.get(rank, 0),
            files=tuple(sorted(files.get(rank, ()))),
        )
    return out
