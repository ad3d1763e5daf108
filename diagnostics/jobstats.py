"""Turn a rank's record series into the vote's features: learned quantiles, recent medians, ages.

Pure: the caller passes `now` and the process state. Quantiles are learned from the rank's *own*
history (its step period and its own compute time), because step times are heavy-tailed and differ
between ranks (pipeline stages, data shards); a cohort-wide threshold would be wrong for someone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gpuguard.foundation.observations import (
    CLOSED,
    CommError,
    HardwareEvidence,
    ProcessState,
    RankObservation,
    RankSeries,
)

UNKNOWN_PROCESS = ProcessState("unknown")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted sequence (0.0 for an empty one)."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    if n == 1:
        return float(sorted_values[0])
    pos = min(max(q, 0.0), 1.0) * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)


def robust_tail(sorted_values: Sequence[float], q: float) -> float:
    """The `q` quantile with the influence of a single outlier capped: the largest value counts as at most
    twice the second largest. One 40 s pause in a job of 0.1 s steps must not set the hang bound for the
    rest of the job; a long period that recurs (periodic checkpoints) still counts in full."""
    n = len(sorted_values)
    if n < 3:
        return quantile(sorted_values, q)
    top, second = sorted_values[-1], sorted_values[-2]
    if top <= 2 * second:
        return quantile(sorted_values, q)
    return quantile([*sorted_values[:-1], 2 * second], q)


def median(values: Sequence[float]) -> float:
    return quantile(sorted(values), 0.5)


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Median absolute deviation (unscaled)."""
    if not values:
        return 0.0
    c = median(values) if center is None else center
    return median([abs(v - c) for v in values])


def observe(
    series: RankSeries,
    *,
    now_wall: float,
    now_mono: float | None = None,
    process: ProcessState = UNKNOWN_PROCESS,
    window: int = 20,
    history: int = 2000,
    hardware: tuple[HardwareEvidence, ...] = (),
    comm_errors: tuple[CommError, ...] = (),
    cpu_s: float | None = None,
) -> RankObservation:
    """The vote's features for one rank at `now`.

    `now_mono` is given only when the reader runs on the writer's host: then ages come from the
    monotonic clock and a wall-clock jump cannot fake a hang or hide one.
    """
    steps = series.steps[-history:]
    periods = sorted(s.interval_s for s in steps if s.interval_s is not None and s.interval_s > 0)
    computes = sorted(s.compute_s for s in steps)
    recent = steps[-window:]
    recent_compute = median([s.compute_s for s in recent]) if recent else 0.0
    recent_periods = [s.interval_s for s in recent if s.interval_s]
    if now_mono is not None:
        phase_age = now_mono - series.phase.since_mono
        progress_age = now_mono - series.last_mono
    else:
        phase_age = now_wall - series.phase.since_wall
        progress_age = now_wall - series.last_wall
    ph = series.phase
    nbytes = ph.nbytes or (steps[-1].nbytes if steps else 0)
    return RankObservation(
        rank=series.rank,
        alive=process,
        has_records=True,
        phase=ph.kind,
        phase_step=ph.step,
        phase_seq=ph.seq,
        phase_age_s=max(0.0, phase_age),
        progress_age_s=max(0.0, progress_age),
        n_steps=len(steps),
        period_p50_s=quantile(periods, 0.5),
        period_p99_s=quantile(periods, 0.99),
        period_p999_s=robust_tail(periods, 0.999),
        compute_p50_s=quantile(computes, 0.5),
        compute_p999_s=robust_tail(computes, 0.999),
        recent_compute_s=recent_compute,
        recent_period_s=median(recent_periods) if recent_periods else 0.0,
        recent_period_max_s=max(recent_periods) if recent_periods else 0.0,
        cpu_s=cpu_s,
        nbytes=nbytes,
        closed=ph.kind == CLOSED,
        errors=series.errors,
        hardware=hardware,
        comm_errors=comm_errors or comm_errors_from_text(series.rank, series.errors),
        entries=tuple((seq, wall, wait) for seq, wall, _, wait in series.entries),
        notes=tuple(
            n
            for n in (
                f"{series.bad_lines} unreadable record line(s) skipped" if series.bad_lines else "",
                f"{series.clock_jumps} wall-clock jump(s) seen in the records" if series.clock_jumps else "",
                f"{series.incarnations_seen} incarnations of this rank; newest used"
                if series.incarnations_seen > 1
                else "",
            )
            if n
        ),
    )


_PEER = re.compile(r"\b(?:peer|remote rank|from rank|to rank|rank)\s*[:=#]?\s*(\d{1,7})\b", re.I)


def comm_errors_from_text(rank: int, messages: Sequence[str]) -> tuple[CommError, ...]:
    """A rank's own error messages, with the peer they name (NCCL often does; gloo gives ip:port only)."""
    out = []
    for text in messages:
        peers = {int(m.group(1)) for m in _PEER.finditer(text)} - {rank}
        out.append(CommError(rank, min(peers) if len(peers) == 1 else None, text[:300]))
    return tuple(out)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9 (and count) of a sample: the cohort summary the report shows."""
    s = sorted(values)
    return {
        "n": len(s),
        "p50": quantile(s, 0.5),
        "p90": quantile(s, 0.9),
        "p99": quantile(s, 0.99),
        "p999": quantile(s, 0.999),
        "max": s[-1] if s else 0.0,
    }
