"""One voter per dimension of the dead-vs-slow vote. Pure functions of (observation, cohort, config).

Each returns a `Vote`: `dead | hung | slow | healthy | abstain`, a reason a human can check, and the
numbers it used. Voters never see each other; `vote.py` combines them (and applies the coupling of
synchronous ranks: who is waiting for whom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpuguard.foundation.observations import COLLECTIVE, STARTING, RankObservation

DEAD, HUNG, SLOW, HEALTHY, ABSTAIN = "dead", "hung", "slow", "healthy", "abstain"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class VoteConfig:
    """Thresholds (defaults documented in diagnostics/data/vote.yaml)."""

    hang_k: float = 2.0
    hang_floor_s: float = 5.0
    hang_cap_s: float = 1800.0
    confirm_checks: int = 2
    check_interval_s: float = 1.0
    pause_k: float = 1.0
    pause_floor_s: float = 1.0
    min_samples: int = 50
    initial_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    cohort_z: float = 3.5
    cohort_ratio: float = 0.75
    cohort_min_ranks: int = 3
    mad_floor_frac: float = 0.05
    cohort_min_excess_s: float = 0.01
    bandwidth_bytes_s: float = 10e9
    latency_s: float = 50e-6
    collective_k: float = 3.0
    comm_min_reports: int = 1
    cpu_progress_frac: float = 0.005
    impact_min_slowdown: float = 1.5
    outlier_cap_k: float = 2.0
    arrival_window: int = 8
    arrival_min_collectives: int = 2
    arrival_min_frac: float = 0.75
    arrival_wait_frac: float = 0.25
    arrival_min_wait_s: float = 0.01
    arrival_noise_k: float = 2.0
    arrival_max_late_frac: float = 0.5


@dataclass(frozen=True)
class Vote:
    dimension: str
    verdict: str
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)
    decisive: bool = False

    def to_json(self) -> dict[str, Any]:
        nums = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.numbers.items()}
        return {
            "dimension": self.dimension,
            "verdict": self.verdict,
            "reason": self.reason,
            "numbers": nums,
            "decisive": self.decisive,
        }


@dataclass(frozen=True)
class Cohort:
    """What the vote knows about all ranks at once (computed once per check)."""

    world: int
    compute_median_s: float
    compute_mad_s: float
    ranks_with_steps: int
    comm_reports: dict[int, int] = field(default_factory=dict)  # peer rank -> reports naming it


# -- cost model used to widen bounds (the planner has the full version) ------------------------------
def ring_allreduce_s(nbytes: float, world: int, bandwidth_bytes_s: float, latency_s: float = 0.0) -> float:
    """T_ring ≈ 2(N−1)/N · S/BW  (+ 2(N−1) latency steps)."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (world - 1) / world * nbytes / bandwidth_bytes_s + 2 * (world - 1) * latency_s


def tree_allreduce_s(nbytes: float, world: int, bandwidth_bytes_s: float, latency_s: float = 0.0) -> float:
    """Pipelined tree (reduce up, broadcast down): 2·⌈log2 N⌉ latency steps, but every byte crosses a link
    twice (2·S/BW) — latency-optimal for small messages, ring wins for big ones."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(world)) * latency_s + 2 * nbytes / bandwidth_bytes_s


def expected_collective_s(nbytes: int, world: int, cfg: VoteConfig) -> float:
    """The better of ring and tree: the time a healthy collective of this size needs."""
    if nbytes <= 0 or world <= 1:
        return 0.0
    return min(
        ring_allreduce_s(nbytes, world, cfg.bandwidth_bytes_s, cfg.latency_s),
        tree_allreduce_s(nbytes, world, cfg.bandwidth_bytes_s, cfg.latency_s),
    )


def hang_bound_s(obs: RankObservation, world: int, cfg: VoteConfig) -> float:
    """No-progress bound for this rank: K × its own P99.9 step period (floor, cap), widened for big collectives."""
    if obs.phase == STARTING or obs.n_steps == 0:
        base = cfg.startup_timeout_s
    elif obs.n_steps < cfg.min_samples:
        base = max(cfg.initial_timeout_s, cfg.hang_k * obs.period_p999_s)
    else:  # the learned tail, or the rank's own recent slowdown (a throttled rank's steps got longer)
        own = max(obs.period_p999_s, obs.recent_period_max_s)
        base = min(max(cfg.hang_k * own, cfg.hang_floor_s), cfg.hang_cap_s)
    return base + cfg.collective_k * expected_collective_s(obs.nbytes, world, cfg)


def progress_age(obs: RankObservation) -> float:
    """Time since the rank last made progress of ANY kind: a step, a collective entry or exit, a heartbeat
    (`progress_age_s`; 0 = not measured, then the phase age)."""
    if obs.progress_age_s > 0:
        return min(obs.phase_age_s, obs.progress_age_s)
    return obs.phase_age_s


def pause_bound_s(obs: RankObservation, cfg: VoteConfig) -> float:
    """Idle longer than this (own P99.9 × pause_k, at least pause_floor_s) is a pause worth reporting."""
    return max(cfg.pause_k * obs.period_p999_s, cfg.pause_floor_s)


def confirm_window_s(cfg: VoteConfig) -> float:
    """M consecutive checks beyond the bound = the bound plus (M−1) check intervals of age."""
    return max(0, cfg.confirm_checks - 1) * cfg.check_interval_s


# -- the voters ------------------------------------------------------------------------------------
def liveness(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    a = obs.alive
    return _liveness(a.state, a.detail, a.exit_code, obs.closed)


@lru_cache(maxsize=4096)
def _liveness(st: str, detail: str, exit_code: int | None, closed: bool) -> Vote:
    """Cached: at 10,000 ranks most share a state (a Vote is immutable, sharing it is safe)."""
    nums: dict[str, Any] = {"state": st}
    if exit_code is not None:
        nums["exit_code"] = exit_code
    if st in ("gone", "zombie"):
        if closed:
            return Vote("liveness", HEALTHY, f"process exited after closing its log cleanly ({detail})", nums)
        what = "is a zombie" if st == "zombie" else "is gone"
        return Vote("liveness", DEAD, f"process {what} without a clean close ({detail})", nums, decisive=True)
    if st == "stopped":
        return Vote("liveness", HUNG, f"process is stopped (SIGSTOP or a tracer) ({detail})", nums)
    if st == "disk-sleep":
        return Vote("liveness", ABSTAIN, f"process in uninterruptible sleep (D-state) ({detail})", nums)
    if st in ("running", "sleeping"):
        return Vote("liveness", HEALTHY, f"process alive ({detail})", nums)
    return Vote("liveness", ABSTAIN, f"process state not visible here ({detail or 'no pid'})", nums)


def progress(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    """Time without progress against the rank's OWN learned step-period quantiles."""
    if obs.closed:
        return Vote("progress", ABSTAIN, "log closed", {})
    bound = hang_bound_s(obs, cohort.world, cfg)
    confirm = confirm_window_s(cfg)
    pause = pause_bound_s(obs, cfg)
    age = progress_age(obs)
    where = (
        f"waiting in collective {obs.phase_seq}"
        if obs.phase == COLLECTIVE
        else f"{obs.phase} step {obs.phase_step}"
        if obs.phase_step >= 0
        else obs.phase
    )
    nums = {
        "phase": obs.phase,
        "age_s": age,
        "bound_s": bound,
        "confirm_s": confirm,
        "own_p50_s": obs.period_p50_s,
        "own_p99_s": obs.period_p99_s,
        "own_p999_s": obs.period_p999_s,
        "samples": obs.n_steps,
    }
    if age > bound + confirm:
        return Vote(
            "progress",
            HUNG,
            f"no progress for {age:.1f} s ({where}); bound {bound:.1f} s "
            f"= {cfg.hang_k:g} × own P99.9 {obs.period_p999_s:.3f} s (floor {cfg.hang_floor_s:g} s), "
            f"held for {cfg.confirm_checks} checks",
            nums,
        )
    if age > pause:
        tail = " (past the bound, confirming)" if age > bound else ""
        return Vote(
            "progress",
            SLOW,
            f"paused: no progress for {age:.1f} s ({where}){tail}; "
            f"own P99.9 {obs.period_p999_s:.3f} s, hang bound {bound:.1f} s",
            nums,
        )
    return Vote("progress", HEALTHY, f"progressing ({where} for {age:.2f} s)", nums)


def cohort_speed(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    """Own compute time against the cohort's: robust z on median/MAD plus the NVRx ratio of medians."""
    if cohort.ranks_with_steps < cfg.cohort_min_ranks or obs.n_steps == 0:
        return Vote("cohort", ABSTAIN, f"cohort too small ({cohort.ranks_with_steps} ranks with steps)", {})
    own, med = obs.recent_compute_s, cohort.compute_median_s
    scale = max(1.4826 * cohort.compute_mad_s, cfg.mad_floor_frac * med, 1e-6)
    z = (own - med) / scale
    ratio = med / own if own > 0 else 1.0
    nums = {"own_compute_s": own, "cohort_median_s": med, "mad_s": cohort.compute_mad_s, "z": z, "score": ratio}
    if z > cfg.cohort_z and ratio < cfg.cohort_ratio and own - med > cfg.cohort_min_excess_s:
        return Vote(
            "cohort",
            SLOW,
            f"own compute {own:.3f} s vs cohort median {med:.3f} s "
            f"(z {z:.1f} > {cfg.cohort_z:g}, score {ratio:.2f} < {cfg.cohort_ratio:g})",
            nums,
        )
    return Vote("cohort", HEALTHY, f"own compute {own:.3f} s within the cohort (median {med:.3f} s, z {z:.1f})", nums)


_NOT_IN_COLLECTIVE = Vote("collective", ABSTAIN, "not in a collective")
_NO_HARDWARE = Vote("hardware", ABSTAIN, "no hardware evidence")
_NO_COMM = Vote("communication", ABSTAIN, "no communication errors")


def collective(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    """Expected collective time from its size: a large all-gather may legitimately take long."""
    if obs.phase != COLLECTIVE:
        return _NOT_IN_COLLECTIVE
    exp = expected_collective_s(obs.nbytes, cohort.world, cfg)
    nums = {"nbytes": obs.nbytes, "world": cohort.world, "expected_s": exp, "widened_by_s": cfg.collective_k * exp}
    if obs.phase_age_s <= cfg.collective_k * exp:
        return Vote(
            "collective",
            HEALTHY,
            f"in collective {obs.phase_seq} for {obs.phase_age_s:.2f} s: within "
            f"{cfg.collective_k:g} × the expected {exp:.3f} s for {obs.nbytes} bytes",
            nums,
        )
    return Vote(
        "collective",
        ABSTAIN,
        f"in collective {obs.phase_seq} for {obs.phase_age_s:.2f} s "
        f"(expected {exp:.3f} s for {obs.nbytes} bytes): waiting on peers",
        nums,
    )


def hardware(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    if not obs.hardware:
        return _NO_HARDWARE
    lost = [h for h in obs.hardware if h.kind == "gpu-lost"]
    fatal = [h for h in obs.hardware if h.fatal]
    nums = {"events": [f"{h.kind}: {h.text}" for h in obs.hardware]}
    if lost:
        return Vote("hardware", DEAD, f"GPU lost: {lost[0].text}", nums, decisive=True)
    if fatal:
        return Vote("hardware", DEAD, f"fatal {fatal[0].kind} on the rank's GPU: {fatal[0].text}", nums)
    return Vote("hardware", HEALTHY, f"{len(obs.hardware)} non-fatal hardware event(s)", nums)


def communication(obs: RankObservation, cohort: Cohort, cfg: VoteConfig) -> Vote:
    """Peers' communication errors that name this rank count against it; its own errors show it is a victim."""
    if not obs.errors and not obs.comm_errors and obs.rank not in cohort.comm_reports:
        return _NO_COMM
    named = cohort.comm_reports.get(obs.rank, 0) + sum(1 for c in obs.comm_errors if c.peer == obs.rank)
    own = len(obs.errors) + sum(1 for c in obs.comm_errors if c.rank == obs.rank and c.peer != obs.rank)
    nums = {"reports_naming_rank": named, "errors_seen_by_rank": own}
    if named >= cfg.comm_min_reports:
        return Vote("communication", DEAD, f"{named} communication error report(s) from peers name this rank", nums)
    if own:
        last = obs.errors[-1] if obs.errors else next(c.text for c in obs.comm_errors if c.rank == obs.rank)
        return Vote(
            "communication",
            ABSTAIN,
            f"saw {own} communication error(s) itself (a victim, not a culprit): {last[:160]}",
            nums,
        )
    return _NO_COMM


VOTERS = (liveness, progress, cohort_speed, collective, hardware, communication)
