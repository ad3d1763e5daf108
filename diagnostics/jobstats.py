"""Turn a rank's record series into the vote's features: learned quantiles, recent medians, ages.

Pure: the caller passes `now` and the process state. Quantiles are learned from the rank's *own*
history (its step period and its own compute time), because step times are heavy-tailed and differ
between ranks (pipeline stages, data shards); a cohort-wide threshold would be wrong for someone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import (
    CLOSED,
    CommError,
    HardwareEvidence,
    ProcessState,
    RankObservation,
    RankSeries,
    StepSample,
)
from gpuguard.foundation.step_columns import CollectiveEntries, computes_of, periods_of
from gpuguard.foundation.step_summary import OrderedView

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


def robust_tail(sorted_values: Sequence[float], q: float, cap_k: float = VoteConfig.outlier_cap_k) -> float:
    """The `q` quantile with the influence of a single outlier capped: the largest value counts as at most
    `cap_k` (vote.yaml `outlier_cap_k`) times the second largest. One 40 s pause in a job of 0.1 s steps
    must not set the hang bound for the rest of the job; a long period that recurs (periodic checkpoints)
    still counts in full."""
    n = len(sorted_values)
    if n < 3:
        return quantile(sorted_values, q)
    top, second = sorted_values[-1], sorted_values[-2]
    if top <= cap_k * second:
        return quantile(sorted_values, q)
    n, capped = len(sorted_values), cap_k * second  # >= the second largest: still sorted, and not copied
    return quantile(OrderedView(n, lambda k: capped if k == n - 1 else sorted_values[k]), q)


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
    outlier_cap_k: float = VoteConfig.outlier_cap_k,
) -> RankObservation:
    """The vote's features for one rank at `now`.

    `now_mono` is given only when the reader runs on the writer's host: then ages come from the
    monotonic clock and a wall-clock jump cannot fake a hang or hide one.
    """
    steps = series.steps[-history:]
    periods, computes, n_steps = _learned(series, steps)
    recent = steps[-window:]
    recent_compute = median(computes_of(recent)) if recent else 0.0
    recent_periods = periods_of(recent)
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
        n_steps=n_steps,
        period_p50_s=quantile(periods, 0.5),
        period_p99_s=quantile(periods, 0.99),
        period_p999_s=robust_tail(periods, 0.999, outlier_cap_k),
        compute_p50_s=quantile(computes, 0.5),
        compute_p999_s=robust_tail(computes, 0.999, outlier_cap_k),
        recent_compute_s=recent_compute,
        recent_period_s=median(recent_periods) if recent_periods else 0.0,
        recent_period_max_s=max(recent_periods) if recent_periods else 0.0,
        cpu_s=cpu_s,
        nbytes=nbytes,
        closed=ph.kind == CLOSED,
        errors=series.errors,
        hardware=hardware,
        comm_errors=comm_errors or comm_errors_from_text(series.rank, series.errors),
        entries=series.entries.times()  # the reader's columns, shared
        if isinstance(series.entries, CollectiveEntries)
        else tuple((seq, wall, wait) for seq, wall, _, wait in series.entries),
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


def _learned(series: RankSeries, steps: Sequence[StepSample]) -> tuple[Sequence[float], Sequence[float], int]:
    """(sorted periods, sorted own computes, steps) over the history: from the reader's bounded summary
    when it built one (`steps` then holds only the recent ones), else from the samples themselves."""
    if series.summary is not None:
        return series.summary.periods.ordered(), series.summary.computes.ordered(), series.summary.n
    periods = sorted(s.interval_s for s in steps if s.interval_s is not None and s.interval_s > 0)
    return periods, sorted(s.compute_s for s in steps), len(steps)


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
    return sorted_distribution(sorted(values))


def sorted_distribution(s: Sequence[float]) -> dict[str, float]:
    """`distribution` of values already sorted (a list, or a sketch's ordered view: nothing copied)."""
    return {
        "n": len(s),
        "p50": quantile(s, 0.5),
        "p90": quantile(s, 0.9),
        "p99": quantile(s, 0.99),
        "p999": quantile(s, 0.999),
        "max": s[-1] if s else 0.0,
    }


@dataclass(frozen=True)
class Impact:
    """What the slowness costs the whole job: its step now against its normal step, and the share of each
    step the named straggler(s) cost their peers (the extra time the peers wait per step for them)."""

    job_step_s: float  # the job's step period now: median over the ranks of their recent median period
    normal_step_s: float  # its normal step: median over the ranks of their own median over the history
    slowdown: float  # job_step_s / normal_step_s
    cost_s: tuple[tuple[int, float], ...] = ()  # (straggler rank, seconds of each step it costs), by rank
    # (straggler rank, what its peers waited for it at each of the recent collectives it was last at): the
    # arrival evidence, immediate, where the window's median step does not show the slowdown yet (its onset)
    wait_s: tuple[tuple[int, float], ...] = ()

    def line(self) -> str:
        """'job step 1.95 s, 11 x its normal 0.18 s; rank 2 accounts for 1.8 s of each step'."""
        head = (
            f"job step {_secs(self.job_step_s)} s, {_times(self.slowdown)} x its normal {_secs(self.normal_step_s)} s"
        )
        if not self.cost_s:
            return head + ("; no rank to blame (the whole job is slower)" if self.slowdown > 1 else "")
        ranks = ", ".join(str(r) for r, _ in self.cost_s)
        total = sum(c for _, c in self.cost_s)
        who = f"rank {ranks}" if len(self.cost_s) == 1 else f"ranks {ranks}"
        line = f"{head}; {who} account{'s' if len(self.cost_s) == 1 else ''} for {_secs(total)} s of each step"
        wait = max((w for _, w in self.wait_s), default=0.0)
        if wait > total:  # the onset: the recent collectives show it before the window's median step does
            line += f" so far, and now {_secs(wait)} s of each collective"
        return line

    def to_json(self) -> dict[str, Any]:
        return {
            "job_step_s": round(self.job_step_s, 4),
            "normal_step_s": round(self.normal_step_s, 4),
            "slowdown": round(self.slowdown, 3),
            "cost_s": {str(r): round(c, 4) for r, c in self.cost_s},
            "collective_wait_s": {str(r): round(w, 4) for r, w in self.wait_s},
            "line": self.line(),
        }


def _secs(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _times(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def job_impact(
    observations: Sequence[RankObservation],
    stragglers: Sequence[int],
    min_slowdown: float,
    waits: Mapping[int, float] | None = None,
) -> Impact | None:
    """The job-level impact of slowness, from the step records' features (pure).

    The job step is the median over the ranks of their recent median step period (the `window` steps), its
    normal the median over the ranks of their own median period over the history; a straggler's cost per
    step is what its peers now wait per step beyond what they waited normally: median over the peers of
    (recent period - recent own compute) - (median period - median own compute). None when the job is not
    at least `min_slowdown` x slower and no straggler is named (nothing worth a line), or without steps.
    `waits`: the arrival evidence of the named stragglers (their peers' median wait at each of the recent
    collectives they were last at), shown as well while the window's median does not show it yet."""
    live = [o for o in observations if o.has_records and not o.closed and o.n_steps > 0 and o.period_p50_s > 0]
    now = [o.recent_period_s for o in live if o.recent_period_s > 0]
    if not now:
        return None
    job_step = median(now)
    normal = median([o.period_p50_s for o in live])
    slowdown = job_step / normal if normal > 0 else 1.0
    named = sorted(set(stragglers))
    if slowdown < min_slowdown and not named:
        return None
    peers = [o for o in live if o.rank not in named and o.recent_period_s > 0]
    cost: tuple[tuple[int, float], ...] = ()
    if named and peers:
        extra = median(
            [max(0.0, (o.recent_period_s - o.recent_compute_s) - (o.period_p50_s - o.compute_p50_s)) for o in peers]
        )
        cost = tuple((r, extra / len(named)) for r in named)  # several at once: shared evenly (not separable)
    wait = tuple((r, float(w)) for r, w in sorted((waits or {}).items()) if r in named)
    return Impact(job_step, normal, slowdown, cost, wait)
