"""Hang versus slow: hung only without progress of any kind, confirmed in real checks at the interval in
use, against a bound that one pause cannot inflate for the rest of the job."""

from __future__ import annotations

from gpuguard.diagnostics.jobstats import quantile, robust_tail
from gpuguard.diagnostics.vote import vote
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import BETWEEN, COMPUTING, ProcessState, RankObservation

CFG = VoteConfig()  # bound: max(2 x 0.2 s, 5 s floor) = 5 s; confirm 2 checks


def ob(rank: int, age: float = 0.01, *, progress: float | None = None, phase: str = BETWEEN, step: int = 100):
    return RankObservation(
        rank=rank,
        alive=ProcessState("running", "pid 1"),
        phase=phase,
        phase_step=step,
        phase_seq=step - 1,
        phase_age_s=age,
        progress_age_s=age if progress is None else progress,
        n_steps=200,
        period_p50_s=0.1,
        period_p99_s=0.16,
        period_p999_s=0.2,
        compute_p50_s=0.05,
        compute_p999_s=0.1,
        recent_compute_s=0.05,
        recent_period_s=0.1,
    )


def job(age: float, **kw):
    return [ob(0, age, phase=COMPUTING, **kw)] + [ob(r) for r in (1, 2, 3)]


def test_the_interval_in_use_sets_the_confirmation_window() -> None:
    assert vote(job(6.5), CFG).by_rank()[0].verdict == "hung"  # 5 s + 1 x 1 s
    slow = vote(job(6.5), CFG, interval_s=3.0).by_rank()[0]  # a watcher every 3 s: 5 + 3 s
    assert slow.verdict == "slow" and slow.past_bound_checks == 1
    assert vote(job(8.5), CFG, interval_s=3.0).by_rank()[0].verdict == "hung"


def test_hung_needs_consecutive_real_checks_past_the_bound_in_one_place() -> None:
    before = vote(job(4.0), CFG)  # the previous check: not yet past the bound
    assert before.by_rank()[0].past_bound_checks == 0
    first = vote(job(30.0), CFG, previous=before)  # one late check far past it counts once, not twice
    r0 = first.by_rank()[0]
    assert r0.verdict == "slow" and "confirming: check 1 of 2" in r0.reason, r0
    second = vote(job(31.0), CFG, previous=first)
    assert second.by_rank()[0].verdict == "hung" and second.by_rank()[0].past_bound_checks == 2
    # it moved on (another step) between the checks: the count starts again
    moved = vote([ob(0, 30.0, phase=COMPUTING, step=101)] + [ob(r) for r in (1, 2, 3)], CFG, previous=first)
    assert moved.by_rank()[0].verdict == "hung" and moved.by_rank()[0].past_bound_checks == 2  # by age alone


def test_a_heartbeat_is_progress() -> None:
    r0 = vote(job(30.0, progress=0.5), CFG).by_rank()[0]
    assert r0.verdict != "hung", r0


def test_one_pause_does_not_inflate_the_learned_tail() -> None:
    periods = sorted([0.1] * 199 + [40.0])
    assert quantile(periods, 0.999) > 1.0  # the plain quantile: 40 s x 2 = an 80 s hang bound from then on
    assert robust_tail(periods, 0.999) <= 0.2 + 1e-9
    twice = sorted([0.1] * 198 + [40.0, 40.0])  # a long period that recurs (checkpoints) still counts
    assert robust_tail(twice, 0.999) > 30.0
    assert robust_tail([0.1, 0.2], 0.999) == quantile([0.1, 0.2], 0.999)


def test_a_rank_that_burns_cpu_without_records_is_slow_not_hung() -> None:
    from dataclasses import replace

    first = vote([replace(job(6.0)[0], cpu_s=100.0), *job(6.0)[1:]], CFG)
    assert first.by_rank()[0].verdict == "slow"  # past the bound, not yet confirmed
    # 2 s later it used 0.02 s of CPU (a 1 % quota): working, slowly
    later = vote([replace(job(8.0)[0], cpu_s=100.02), *job(8.0)[1:]], CFG, previous=first)
    r0 = later.by_rank()[0]
    assert r0.verdict == "slow" and "working, slowly" in r0.reason, r0
    # no CPU at all (a deadlock, a stopped process): hung as before
    idle = vote([replace(job(8.0)[0], cpu_s=100.0), *job(8.0)[1:]], CFG, previous=first)
    assert idle.by_rank()[0].verdict == "hung"


def test_the_bound_follows_the_rank_s_own_recent_slowdown() -> None:
    from dataclasses import replace

    # its last steps took 7.7 s (throttled): 7 s into the next one is not a hang
    slowed = replace(job(7.0)[0], recent_period_max_s=7.7)
    assert vote([slowed, *job(7.0)[1:]], CFG).by_rank()[0].verdict != "hung"
    assert vote(job(7.0), CFG).by_rank()[0].verdict == "hung"
