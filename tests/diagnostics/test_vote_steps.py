"""The vote's steps one by one (`diagnostics.vote` and `diagnostics.coupling`): each a pure function of the
observations and the preliminary verdicts, tested apart from the whole vote."""

from __future__ import annotations

from gpuguard.diagnostics.coupling import Prelim, couple_waiters, just_arrived, never_arrived, stalled_waiters
from gpuguard.diagnostics.vote import (
    _Context,
    final_verdict,
    job_wide_pause,
    rank_prelims,
    sticky_culprits,
    torn_down,
    vote,
)
from gpuguard.diagnostics.voters import DEAD, HEALTHY, HUNG, SLOW, UNKNOWN, Vote, VoteConfig
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, COMPUTING, ProcessState, RankObservation
from tests.diagnostics.test_vote import ob  # the vote tests' observation builder

CFG = VoteConfig()


def progress(verdict: str) -> tuple[Vote, ...]:
    return (Vote("liveness", "abstain", ""), Vote("progress", verdict, f"progress {verdict}"))


def test_rank_prelims_votes_each_rank_and_says_why_one_has_no_records():
    obs = [ob(0), ob(1, has_records=False, notes=("WORLD_SIZE is 3 but rank 1 wrote no records",))]
    from gpuguard.diagnostics.vote import cohort_of

    prelim, past = rank_prelims(obs, cohort_of(obs), CFG, None)
    assert prelim[0].verdict == HEALTHY and len(prelim[0].votes) == 6
    assert prelim[1] == Prelim(
        UNKNOWN, "no step records from this rank yet (WORLD_SIZE is 3 but rank 1 wrote no records)", False, ()
    )
    assert past == {0: 0}


def test_a_rank_that_never_entered_the_collective_is_the_one_the_waiters_wait_for():
    waiter, late = ob(0, COLLECTIVE, 30.0, step=5), ob(1, COMPUTING, 30.0, step=5)
    assert never_arrived(waiter, [waiter, late], stopped=set()) == [1]
    assert never_arrived(waiter, [waiter, ob(1, COLLECTIVE, 29.0, step=5)], stopped=set()) == []
    assert never_arrived(waiter, [waiter, ob(1, COLLECTIVE, 29.0, step=5)], stopped={1}) == [1]  # stopped: stalls it


def test_stalled_waiters_are_grouped_by_collective():
    obs = [ob(0, COLLECTIVE, 30, step=5), ob(1, COLLECTIVE, 30, step=5), ob(2, COLLECTIVE, 30, step=6)]
    prelim = {0: Prelim(HUNG, "", False, progress(HUNG)), 1: Prelim(SLOW, "", False, progress(SLOW))}
    prelim[2] = Prelim(HEALTHY, "", False, progress(HEALTHY))
    assert stalled_waiters(obs, prelim) == {5: [0, 1]}


def test_couple_waiters_blames_the_missing_rank_and_leaves_the_input_alone():
    obs = [ob(0, COLLECTIVE, 60, step=5), ob(1, COLLECTIVE, 60, step=5), ob(2, COMPUTING, 60, step=5)]
    prelim = {r: Prelim(HUNG, "hung", False, progress(HUNG)) for r in (0, 1)}
    prelim[2] = Prelim(HEALTHY, "computing", False, progress(HEALTHY))
    before = dict(prelim)
    out, coupled = couple_waiters(obs, prelim, CFG)
    assert prelim == before  # pure: a new mapping
    assert coupled.blocked == {0: (2,), 1: (2,)} and coupled.culprits == {2}
    assert not coupled.nobody_to_blame and not coupled.waited_for_late
    assert out[2].verdict == SLOW and "its peers have waited" in out[2].reason  # the job waits for it


def test_couple_waiters_says_a_collective_everyone_is_stuck_in_is_nobodys_fault():
    obs = [ob(r, COLLECTIVE, 60, step=5) for r in range(3)]
    prelim = {r: Prelim(HUNG, "hung", False, progress(HUNG)) for r in range(3)}
    out, coupled = couple_waiters(obs, prelim, CFG)
    assert coupled.nobody_to_blame == {0, 1, 2} and not coupled.blocked
    assert all("the collective itself is stuck" in out[r].reason for r in range(3))


def test_just_arrived_names_the_rank_that_entered_long_after_the_waiters():
    obs = [ob(0, COLLECTIVE, 60, step=5), ob(1, COLLECTIVE, 60, step=5), ob(2, COLLECTIVE, 0.01, step=5)]
    obs += [ob(r, COLLECTIVE, 60, step=5) for r in range(3, 8)]
    waiters = [0, 1, 3, 4, 5, 6, 7]
    assert just_arrived(5, waiters, obs, CFG) == (2,)
    assert just_arrived(5, [r for r in range(8)], obs, CFG) == ()  # everyone stalled: nobody arrived late


def test_job_wide_pause_clears_a_paused_rank_only_when_the_whole_job_is_idle():
    paused = (Vote("liveness", "abstain", ""), Vote("progress", SLOW, "paused"))
    obs = [ob(0, BETWEEN, 5.0), ob(1, BETWEEN, 5.05)]
    prelim = {r: Prelim(SLOW, "paused", False, paused) for r in (0, 1)}
    out = job_wide_pause(obs, prelim, CFG, anyone_blocked=False)
    assert all(p.verdict == HEALTHY and p.reason.startswith("job-wide pause") for p in out.values())
    assert job_wide_pause(obs, prelim, CFG, anyone_blocked=True) == prelim  # someone waits on someone: no pause


def test_torn_down_maps_sigterm_deaths_to_the_rank_that_failed_first():
    def dead(rank: int, code: int) -> RankObservation:
        return ob(rank, alive=ProcessState("gone", "", code))

    prelim = {r: Prelim(DEAD, "gone", False, ()) for r in range(3)}
    assert torn_down([dead(0, 1), dead(1, -15), dead(2, 143)], prelim) == {1: (0,), 2: (0,)}
    assert torn_down([dead(0, -15), dead(1, -15), dead(2, 143)], prelim) == {}  # all SIGTERM: a preemption
    # rank 1 exited on a peer's failure before the SIGTERM came: neither a cause nor terminated
    three = [dead(0, -9), dead(1, 1), dead(2, -15)]
    assert torn_down(three, prelim, victims={1}) == {2: (0,)}
    assert torn_down(three, prelim) == {2: (0, 1)}
    assert torn_down([dead(0, -9), dead(1, 1)], prelim, victims={1}) == {}  # nobody was terminated


def test_sticky_culprits_keep_a_dead_culprit_of_the_previous_check():
    first = vote([ob(0, COLLECTIVE, 400, step=5), ob(1, COMPUTING, 400, step=5)], CFG)
    assert first.culprits == (1,)
    prelim = {0: Prelim(DEAD, "gone", False, ()), 1: Prelim(DEAD, "gone", False, ())}
    assert sticky_culprits([ob(0), ob(1)], prelim, first, {}) == {1}
    assert sticky_culprits([ob(0), ob(1)], prelim, first, {1: (0,)}) == set()  # torn down: not the cause
    assert sticky_culprits([ob(0), ob(1)], prelim, None, {}) == set()


def test_final_verdict_clears_a_waiter_and_names_whose_fault_it_is():
    ctx = _Context(late={}, waited_for_late=frozenset(), teardown={}, victims=set())
    waiter = ob(0, COLLECTIVE, 30.0, step=5)
    v, why = final_verdict(waiter, Prelim(HUNG, "hung", False, ()), (3,), ctx)
    assert v == HEALTHY and "on rank(s) 3 that never arrived (not this rank's fault)" in why
    v, why = final_verdict(waiter, Prelim(DEAD, "gone", False, ()), (3,), ctx)
    assert v == DEAD and why.endswith("on rank(s) 3 (collateral)")
    torn = _Context(late={}, waited_for_late=frozenset(), teardown={0: (2,)}, victims=set())
    assert (
        "torchrun terminated it (SIGTERM) after rank(s) 2 failed first"
        in final_verdict(waiter, Prelim(DEAD, "gone", False, ()), (2,), torn)[1]
    )
    assert final_verdict(waiter, Prelim(SLOW, "slow", False, ()), (), ctx) == (SLOW, "slow")
