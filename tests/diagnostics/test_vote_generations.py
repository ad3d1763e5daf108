"""Generations and teardowns: the vote is on the active generation (earlier incarnations judged apart, among
themselves), and the workers torchrun terminated after a failure are its collateral."""

from __future__ import annotations

from dataclasses import replace

from gpuguard.diagnostics.vote import to_json, vote
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, COMPUTING, ProcessState, RankObservation

CFG = VoteConfig()
ALIVE = ProcessState("running", "pid 1")
GONE = ProcessState("gone", "pid 9 is gone")


def ob(rank: int, phase: str = BETWEEN, *, step: int = 100, seq: int = 99, alive=ALIVE, age: float = 0.01):
    return RankObservation(
        rank=rank,
        alive=alive,
        phase=phase,
        phase_step=step,
        phase_seq=seq,
        phase_age_s=age,
        progress_age_s=age,
        n_steps=200,
        period_p50_s=0.1,
        period_p99_s=0.16,
        period_p999_s=0.2,
        compute_p50_s=0.05,
        compute_p999_s=0.1,
        recent_compute_s=0.05,
        recent_period_s=0.1,
    )


def test_old_incarnations_waiting_in_a_collective_are_not_blocked_by_the_new_generation() -> None:
    new = [ob(r, step=20, seq=19) for r in range(3)]  # generation 1: a fresh start, low step numbers
    old = [(0, ob(3, COLLECTIVE, step=60, seq=60, alive=GONE, age=30.0)), (0, ob(4, step=59, seq=59, alive=GONE))]
    job = vote(new, CFG, superseded=old)
    assert job.verdict == "healthy" and job.exit_code == 0 and job.culprits == ()
    assert [r.rank for r in job.ranks] == [0, 1, 2]
    assert [(r.rank, r.generation, r.verdict) for r in job.superseded] == [(3, 0, "dead"), (4, 0, "dead")]
    # judged among themselves: 3 waited in collective 60 for 4, which never arrived (the old fault's culprit)
    assert job.superseded[0].blocked_by == (4,) and "collateral" in job.superseded[0].reason
    assert job.superseded[1].culprit and all("superseded" in r.reason for r in job.superseded)
    doc = to_json(job)
    assert [(r["rank"], r["generation"]) for r in doc["superseded"]] == [(3, 0), (4, 0)]
    assert all("generation" not in r for r in doc["ranks"])


def test_without_earlier_generations_nothing_changes() -> None:
    obs = [ob(r) for r in range(4)]
    assert vote(obs, CFG, superseded=()) == vote(obs, CFG)
    assert to_json(vote(obs, CFG))["superseded"] == []


def test_each_earlier_generation_is_judged_alone() -> None:
    # generation 0's rank 5 and generation 1's rank 6: two faults of their own, no coupling between them
    old = [(0, ob(5, COLLECTIVE, step=60, seq=60, alive=GONE)), (1, ob(6, step=10, seq=9, alive=GONE))]
    job = vote([ob(r) for r in range(3)], CFG, superseded=old)
    assert [(r.rank, r.generation) for r in job.superseded] == [(5, 0), (6, 1)]
    assert all(r.blocked_by == () for r in job.superseded)


def test_the_ranks_torchrun_terminated_are_collateral_of_the_one_that_failed_first() -> None:
    # the whole group went between two checks: rank 2 was SIGKILLed, torchrun then sent SIGTERM to the rest
    codes = {0: 143, 1: -15, 2: -9, 3: -15}
    obs = [ob(r, alive=ProcessState("gone", "pid gone", exit_code=codes[r])) for r in range(4)]
    job = vote(obs, CFG)
    assert job.culprits == (2,) and all(r.verdict == "dead" for r in job.ranks)
    for r in (0, 1, 3):
        rv = job.by_rank()[r]
        assert rv.blocked_by == (2,) and not rv.culprit and "torchrun terminated it" in rv.reason, rv
    # every rank ended by SIGTERM (a preemption): nobody is singled out by it
    same = [ob(r, alive=ProcessState("gone", "pid gone", exit_code=-15)) for r in range(4)]
    assert not any("torchrun terminated" in r.reason for r in vote(same, CFG).ranks)
    # without the launcher's word nothing changes either
    plain = [ob(r, alive=GONE) for r in range(4)]
    assert vote(plain, CFG).culprits == (0, 1, 2, 3)


def test_the_launchers_word_overrides_what_an_earlier_check_inferred() -> None:
    # the first check after the kill, before torchrun had logged anything: ranks 1 and 3 waited in collective
    # 341 on 0 and 2 (both computing), so 0 and 2 were named; then torchrun says 0 was terminated (143)
    before = [ob(r, alive=GONE) for r in range(4)]
    first = vote(before, CFG)
    codes = {0: 143, 1: -15, 2: -9, 3: -15}
    after = vote([ob(r, alive=ProcessState("gone", "pid gone", exit_code=codes[r])) for r in range(4)], CFG, first)
    assert after.culprits == (2,), [(r.rank, r.culprit, r.blocked_by) for r in after.ranks]


def test_a_rank_that_left_on_a_peers_failure_before_the_sigterm_is_not_a_cause() -> None:
    # seen in CI: rank 3 SIGKILLed; rank 2's all_reduce failed on the closed connection and it exited 1
    # before torchrun's SIGTERM reached it; 0 and 1 were terminated. Only rank 3 failed first.
    peer = ("all_reduce 41: Connection closed by peer [127.0.0.1]:4000",)
    codes = {0: -15, 1: 143, 2: 1, 3: -9}
    obs = [
        replace(
            ob(r, COLLECTIVE, step=41, seq=41, age=2.0, alive=ProcessState("gone", "pid gone", exit_code=codes[r])),
            errors=peer if r == 2 else (),
        )
        for r in range(4)
    ]
    job = vote(obs, CFG)
    assert job.culprits == (3,), [(r.rank, r.culprit, r.reason) for r in job.ranks]
    assert "reported a peer's failure itself" in job.by_rank()[2].reason
    for r in (0, 1):
        assert job.by_rank()[r].blocked_by == (3,) and "torchrun terminated it" in job.by_rank()[r].reason
    # the same a check after the one that named rank 3 (a watcher's sticky culprit)
    before = [ob(r, COLLECTIVE, step=41, seq=41, age=2.0) for r in range(3)]
    named = vote(before + [ob(3, COMPUTING, step=41, seq=40, alive=GONE)], CFG)
    assert named.culprits == (3,)
    assert vote(obs, CFG, named).culprits == (3,)
