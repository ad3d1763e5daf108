"""The join behind `gpu-doctor diagnose job` and `watch job`: observe the ranks, vote, assemble `gpuguard.job/1`.

`doctor.job_observation` turns the step records, the process table and the logs into vote features;
this module reads the node reports the user names, runs the vote (`diagnostics.vote`) and builds the
document, and for `watch job` repeats it at an interval with the previous check's verdict (two-check
confirmations) and the interval actually in use. The CLI only parses options and renders.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard.collectors.log_steps import LOG_INCARNATION, LogJob, LogStepSpec, read_log_job, watchdog_words
from gpuguard.collectors.step_records import JobRecords
from gpuguard.diagnostics.jobstats import sorted_distribution
from gpuguard.diagnostics.vote import JobVerdict, load_config, to_json, vote
from gpuguard.diagnostics.watchdog import judge_timeouts
from gpuguard.doctor.job_observation import RECENT_STEPS, observe_job_generations
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.foundation.step_columns import periods_of
from gpuguard.foundation.step_summary import RELATIVE_ERROR, QuantileSketch

NODE_SCHEMA = "gpuguard.node/1"


@dataclass(frozen=True)
class JobDiagnosis:
    """One check of a job: the verdict, its `gpuguard.job/1` document and the records it was voted on."""

    verdict: JobVerdict
    document: dict[str, Any]
    records: JobRecords


def load_node_report(path: Path) -> dict[str, Any]:
    """A `gpuguard.node/1` document from `gpu-doctor diagnose node --json` on a rank's host."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoInputError(f"{path}: no such node report") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != NODE_SCHEMA:
        raise DataError(f"{path}: not a {NODE_SCHEMA} document")
    return doc


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}


def assess(
    job_dir: str | Path,
    *,
    config: Path | None = None,
    previous: JobVerdict | None = None,
    window: int = 20,
    logs: tuple[Path, ...] = (),
    log_spec: LogStepSpec | None = None,
    node_reports: tuple[Path, ...] = (),
    launcher_logs: tuple[Path, ...] = (),
    interval_s: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> JobDiagnosis:
    """Read, observe, vote, document.

    `interval_s`: the time between checks actually in use (hang confirmation), default the YAML's.
    `on_progress(done, total)`: called as the ranks' step logs are read."""
    path = Path(job_dir)
    if not path.is_dir():
        raise NoInputError(f"job directory {path} does not exist")
    cfg = load_config(config)
    if interval_s is not None and interval_s > 0:  # the interval in use, as the document's thresholds show
        cfg = load_config(config, {"check_interval_s": float(interval_s)})
    reports = [load_node_report(p) for p in node_reports]
    for p in launcher_logs:
        if not p.is_file():
            raise NoInputError(f"{p}: no such torchrun log")
    log_job = read_log_job(logs, log_spec) if logs else None
    records, observations, superseded = observe_job_generations(
        path,
        window=window,
        logs=logs,
        log_spec=log_spec,
        log_job=log_job,
        node_reports=reports,
        launcher_logs=launcher_logs,
        outlier_cap_k=cfg.outlier_cap_k,
        on_progress=on_progress,
    )
    job = vote(observations, cfg, previous, interval_s=interval_s, superseded=superseded)
    if log_job is not None and log_job.timeouts:  # a post-mortem: the watchdog's own verdict counts
        from_logs = {r for r, s in records.ranks.items() if s.incarnation == LOG_INCARNATION}
        job = judge_timeouts(job, {r: t for r, t in log_job.timeouts.items() if r in from_logs})
    periods, computes = cohort_sketches(records)
    doc = to_json(
        job,
        job_dir=str(path),
        cohort_steps={"period": _cohort_json(periods), "compute": _cohort_json(computes)},
        config=cfg,
    )
    for rank_doc in doc["ranks"]:
        series = records.ranks.get(rank_doc["rank"])
        recent = series.steps[-RECENT_STEPS:] if series else ()
        rank_doc["recent_periods_s"] = [round(v, 4) for v in periods_of(recent)]
    if records.skipped_files:
        doc["skipped_files"] = list(records.skipped_files)
    doc["post_mortem"] = None if log_job is None else post_mortem_json(log_job)
    # every rank closed its log: the job ended (a healthy vote would otherwise read "progressing" for ever)
    doc["finished"] = bool(observations) and all(o.closed for o in observations)
    if doc["finished"]:
        done = f"finished: all {len(observations)} ranks closed their step logs cleanly"
        doc["reason"] = done if job.verdict == "healthy" else f"{done}; {job.reason}"
    return JobDiagnosis(job, doc, records)


COHORT_EXACT = 4096  # cohort step values kept exactly; beyond, the sketch's bound (foundation.step_summary)


def cohort_sketches(records: JobRecords) -> tuple[QuantileSketch, QuantileSketch]:
    """Every rank's step periods and own computes over its history, merged in bounded memory: the ranks'
    summaries where the reader built them, their samples otherwise (ranks read from training logs)."""
    periods, computes = QuantileSketch(COHORT_EXACT), QuantileSketch(COHORT_EXACT)
    for series in records.ranks.values():
        if series.summary is not None:
            periods.merge(series.summary.periods)
            computes.merge(series.summary.computes)
            continue
        for step in series.steps:
            if step.interval_s:
                periods.add(step.interval_s)
            computes.add(step.compute_s)
    return periods, computes


def _cohort_json(sketch: QuantileSketch) -> dict[str, Any]:
    """The cohort distribution; `exact` false: p50..p99.9 within RELATIVE_ERROR of the true value."""
    out: dict[str, Any] = _rounded(sorted_distribution(sketch.ordered()))
    out["exact"] = sketch.exact
    if not sketch.exact:
        out["relative_error"] = RELATIVE_ERROR
    return out


def post_mortem_json(log_job: LogJob) -> dict[str, Any]:
    """What the logs' ranks were judged as of, and each rank's watchdog evidence."""
    return {
        "as_of": log_job.end_wall,
        "ranks": sorted(log_job.ranks),
        "untimed_steps": log_job.untimed_steps,
        "watchdog": [{"rank": r, "words": watchdog_words(t), **t} for r, t in sorted(log_job.timeouts.items())],
    }


def watch(
    job_dir: str | Path,
    *,
    interval: float,
    config: Path | None = None,
    launcher_logs: tuple[Path, ...] = (),
    count: int = 0,
) -> Iterator[JobDiagnosis]:
    """One diagnosis per check, every `interval` seconds (`count` checks, 0: without end).

    Each check gets the previous one's verdict (deaths and hangs are confirmed across checks) and the
    interval actually in use: the time since the previous check, which reading 10,000 ranks or a slow
    disk makes longer than `interval`, so confirmation is counted in real checks."""
    previous: JobVerdict | None = None
    last: float | None = None
    n = 0
    while True:
        t = time.monotonic()
        elapsed = interval if last is None else max(interval, t - last)
        last = t
        result = assess(job_dir, config=config, previous=previous, interval_s=elapsed, launcher_logs=launcher_logs)
        previous, n = result.verdict, n + 1
        yield result
        if count and n >= count:
            return
        time.sleep(interval)
