"""Arrival-order evidence: the rank that enters the recent collectives last is the straggler."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.diagnostics.arrival import resolve_roots, stragglers
from gpuguard.diagnostics.jobstats import observe
from gpuguard.diagnostics.vote import vote
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, COMPUTING, ProcessState, RankObservation
from gpuguard.foundation.steplog import decode_lines

CFG = VoteConfig()
ALIVE = ProcessState("running", "pid 1")


def ob(rank: int, entries, phase: str = BETWEEN, age: float = 0.01, seq: int = -1, compute: float = 0.05):
    return RankObservation(
        rank=rank,
        alive=ALIVE,
        phase=phase,
        phase_step=100,
        phase_seq=seq if seq >= 0 else entries[-1][0],
        phase_age_s=age,
        progress_age_s=age,
        n_steps=200,
        period_p50_s=0.1,
        period_p99_s=0.16,
        period_p999_s=0.2,
        compute_p50_s=compute,
        compute_p999_s=compute * 2,
        recent_compute_s=compute,
        recent_period_s=0.1,
        entries=tuple(entries),
    )


def synchronous(n_coll: int, late: dict[int, float], world: int = 4, jitter: float = 0.0, seed: int = 0):
    """Entries of a synchronous job: rank r enters collective s at base + its lateness; everyone leaves when
    the last one arrives (so each rank's wait is the last arrival minus its own)."""
    rng = random.Random(seed)
    per: dict[int, list[tuple[int, float, float]]] = {r: [] for r in range(world)}
    t = 1000.0
    for s in range(n_coll):
        arr = {r: t + late.get(r, 0.0) + rng.uniform(0, jitter) for r in range(world)}
        last = max(arr.values())
        for r in range(world):
            per[r].append((s, arr[r], last - arr[r]))
        t = last + 0.05
    return per


def test_a_rank_last_at_two_collectives_in_a_row_by_a_long_wait_is_slow_and_blocks_the_others() -> None:
    assert stragglers([ob(r, e) for r, e in synchronous(1, {3: 0.2}).items()]) == {}  # one: not yet
    per = synchronous(2, {3: 0.2})
    job = vote([ob(r, per[r]) for r in range(4)], CFG)
    v = job.by_rank()
    assert v[3].verdict == "slow" and "arrived last" in v[3].reason and v[3].culprit
    assert any(x.dimension == "arrival" and x.verdict == "slow" for x in v[3].votes)
    for r in (0, 1, 2):
        assert v[r].verdict == "healthy" and v[r].blocked_by == (3,), v[r]
    assert job.culprits == (3,) and job.exit_code == 1


def test_one_late_collective_is_not_enough() -> None:
    per = synchronous(8, {})
    per[2][-1] = (7, per[2][-1][1] + 0.3, 0.0)  # a single late arrival, the others waited for it
    for r in (0, 1, 3):
        s, t, _ = per[r][-1]
        per[r][-1] = (s, t, 0.3)
    assert stragglers([ob(r, per[r]) for r in range(4)]) == {}


def test_a_late_rank_that_alternates_names_nobody() -> None:
    per = synchronous(8, {})
    for s in range(8):  # ranks 1 and 2 late by turns (a crowded host's scheduler)
        late_rank = 1 + s % 2
        last = per[late_rank][s][1] + 0.08
        per[late_rank][s] = (s, last, 0.0)
        for r in range(4):
            if r != late_rank:
                per[r][s] = (s, per[r][s][1], last - per[r][s][1])
    assert stragglers([ob(r, per[r]) for r in range(4)]) == {}


def test_jitter_names_nobody() -> None:
    for seed in range(20):
        per = synchronous(8, {}, jitter=0.004, seed=seed)
        assert stragglers([ob(r, per[r]) for r in range(4)]) == {}, seed
        assert set(x.verdict for x in vote([ob(r, per[r]) for r in range(4)], CFG).ranks) == {"healthy"}


def test_any_severity_mild_slowdown_is_named() -> None:
    # 50 % quota: compute 0.05 s becomes 0.1 s, the others wait 0.05 s at each collective
    per = synchronous(8, {1: 0.05})
    assert set(stragglers([ob(r, per[r]) for r in range(4)])) == {1}


def test_the_collective_in_progress_counts_the_missing_rank_as_late() -> None:
    per = synchronous(4, {3: 0.2})
    # collective 4: ranks 0-2 entered 2 s ago and still wait, rank 3 is still computing
    obs = []
    for r in range(4):
        e = list(per[r])
        if r != 3:
            e.append((4, 2000.0, -1.0))
            obs.append(ob(r, e, COLLECTIVE, age=2.0, seq=4))
        else:
            obs.append(ob(r, e, COMPUTING, age=2.0, seq=3))
    job = vote(obs, CFG)
    v = job.by_rank()
    assert v[3].verdict == "slow" and v[3].culprit, v[3]
    for r in (0, 1, 2):
        assert v[r].verdict == "healthy" and v[r].blocked_by == (3,), v[r]


def test_blame_is_not_inverted_when_the_straggler_has_just_entered() -> None:
    # every rank is in collective 5; ranks 0-2 have waited 3 s, rank 3 entered a moment ago
    per = synchronous(5, {3: 3.0})
    obs = []
    for r in range(4):
        e = list(per[r]) + [(5, 5000.0 if r != 3 else 5003.0, -1.0)]
        obs.append(ob(r, e, COLLECTIVE, age=3.0 if r != 3 else 0.01, seq=5))
    job = vote(obs, CFG)
    v = job.by_rank()
    assert v[3].verdict == "slow" and job.culprits == (3,), job
    assert all(v[r].verdict == "healthy" and v[r].blocked_by == (3,) for r in (0, 1, 2)), job


def test_half_the_job_late_is_the_pace_not_a_straggler() -> None:
    per = synchronous(8, {0: 0.2, 1: 0.2, 2: 0.2})  # one rank waits for three: it is just fast
    assert stragglers([ob(r, per[r]) for r in range(4)]) == {}


def test_blocked_by_chains_resolve_to_the_root() -> None:
    assert resolve_roots({0: (1,), 1: (2,), 3: (2,)}) == {0: (2,), 1: (2,), 3: (2,)}
    assert resolve_roots({0: (1,), 1: (0,)}) == {0: (1,), 1: (0,)}
    assert resolve_roots({0: (1, 4), 1: (2,), 4: ()}) == {0: (2, 4), 1: (2,), 4: ()}
    # a waiter listed before its own root (rank 2 still in collective k waiting on the stopped rank 3,
    # ranks 0 and 1 already in k+1 waiting on both): the root only, whatever order the chain is walked
    assert resolve_roots({0: (2, 3), 1: (3, 2), 2: (3,)}) == {0: (3,), 1: (3,), 2: (3,)}


@given(st.dictionaries(st.integers(0, 9), st.lists(st.integers(0, 9), max_size=4), max_size=10))
def test_roots_of_an_acyclic_wait_graph_wait_on_nobody(raw: dict[int, list[int]]) -> None:
    blocked = {a: tuple(b for b in bs if b > a) for a, bs in raw.items()}  # edges only upwards: no cycle
    out = resolve_roots(blocked)
    for start, roots in out.items():
        assert start not in roots
        for r in roots:
            assert not blocked.get(r), (start, roots, blocked)


def test_the_decoder_keeps_each_collective_entry_with_its_wait(tmp_path: Path) -> None:
    lines = [
        'H {"v":1,"rank":0,"wall":1.0,"mono":1.0}',
        "S 1 2.0 2.0",
        "C 7 1 2.5 2.5 64 all_reduce",
        "X 7 2.9 2.9 0.400000",
        "E 1 3.0 3.0 0.6 0.4 64",
        "S 2 3.0 3.0",
        "C 8 2 3.5 3.5 64 all_reduce",
    ]
    series = decode_lines(lines, rank=0, incarnation="a")
    assert series.entries == ((7, 2.5, 2.5, 0.4), (8, 3.5, 3.5, -1.0))
    o = observe(series, now_wall=4.0)
    assert o.entries == ((7, 2.5, 0.4), (8, 3.5, -1.0))


def test_last_at_as_many_collectives_as_there_are_ranks_is_named_too() -> None:
    # regression: a rank last at exactly world-size collectives (4 of 4) was refused, so a straggler
    # named at 3 collectives disappeared at the 4th and came back at the 5th
    for n in (3, 4, 5, 8):
        per = synchronous(n, {3: 0.3})
        assert set(stragglers([ob(r, per[r]) for r in range(4)])) == {3}, n


def test_a_straggler_that_has_just_entered_after_a_long_wait_is_blamed_before_three_collectives() -> None:
    # the onset of a severe straggler (one step of ~8 s): its peers waited 6.3 s in collective 73 and it has
    # just entered it; no three collectives in a row yet, so only the current one tells
    per = synchronous(4, {})
    obs = [
        replace(ob(r, per[r], phase=COLLECTIVE, seq=73, age=0.3 if r == 2 else 6.3), phase_step=73, period_p999_s=0.5)
        for r in range(4)
    ]
    job = vote(obs, CFG)
    assert job.culprits == (2,) and job.by_rank()[2].verdict == "slow", job.by_rank()[2]
    assert "arrived last at collective 73" in job.by_rank()[2].reason
    for r in (0, 1, 3):
        assert job.by_rank()[r].verdict == "healthy" and job.by_rank()[r].blocked_by == (2,), job.by_rank()[r]
    # every rank in it for long: the collective itself is stuck, nobody to blame (unchanged)
    stuck = [replace(o, phase_age_s=30.0, progress_age_s=30.0) for o in obs]
    assert vote(stuck, CFG).culprits == ()
    # entered only a little later than the others (within their pause bound): no blame either
    close = [
        replace(o, phase_age_s=6.0 if o.rank == 2 else 6.3, progress_age_s=6.0 if o.rank == 2 else 6.3) for o in obs
    ]
    assert 2 not in vote(close, CFG).culprits


def crowded(n_coll: int, seed: int, straggler_from: int | None = None, by: float = 0.15):
    """Four workers on two cores: the scheduler runs a pair while the other pair waits, so a pair arrives
    late together (within a few ms) by 0-0.1 s of a 0.16 s step, the same pair for a few collectives, by
    turns; from `straggler_from` on, rank 2 alone is later by `by` as well."""
    rng = random.Random(seed)
    per: dict[int, list[tuple[int, float, float]]] = {r: [] for r in range(4)}
    t, pair, left = 1000.0, (0, 1), 0
    for s in range(n_coll):
        if left == 0:
            pair, left = tuple(rng.sample(range(4), 2)), rng.randint(1, 12)
        left -= 1
        lag = rng.uniform(0.0, 0.1)
        arr = {r: t + rng.uniform(0, 0.004) + (lag + rng.uniform(0, 0.008) if r in pair else 0.0) for r in range(4)}
        if straggler_from is not None and s >= straggler_from:
            arr[2] = max(arr.values()) + by * rng.uniform(0.5, 1.3)
        last = max(arr.values())
        for r in range(4):
            per[r].append((s, arr[r], last - arr[r]))
        t = last + 0.05
    return per


def test_a_crowded_hosts_pairs_late_by_turns_name_nobody_and_a_straggler_among_them_is_named_at_once() -> None:
    for seed in range(10):
        per = crowded(120, seed)
        for end in range(8, 121):  # every moment of the job
            obs = [ob(r, per[r][:end], compute=0.1) for r in range(4)]
            assert stragglers(obs) == {}, (seed, end, stragglers(obs))
        per = crowded(80, seed, straggler_from=60, by=0.25)  # later than the pairs by ~1.5 x the step
        firsts = [
            e for e in range(61, 81) if set(stragglers([ob(r, per[r][:e], compute=0.1) for r in range(4)])) == {2}
        ]
        assert firsts and firsts[0] <= 62 and len(firsts) >= 15, (seed, firsts)  # at 2 collectives, then >= 80 %


def test_a_rank_whose_wall_clock_is_ahead_is_not_late_when_nobody_waited_for_it() -> None:
    # rank 3's host clock runs 0.5 s ahead: by the entry times it is last by 0.5 s at every collective, but
    # the X records (each rank's own clock) say nobody waited
    per = synchronous(8, {})
    per[3] = [(s, t + 0.5, w) for s, t, w in per[3]]
    assert stragglers([ob(r, per[r]) for r in range(4)]) == {}
    late = synchronous(8, {3: 0.3})  # really late as well: the waits show it
    late[3] = [(s, t + 0.5, w) for s, t, w in late[3]]
    assert set(stragglers([ob(r, late[r]) for r in range(4)])) == {3}


def test_a_named_straggler_stays_named_when_one_collective_breaks_its_run() -> None:
    # rank 3 late by 0.4 s at collectives 0-4, then rank 1 last by 0.05 s at 5, then rank 3 late again at 6
    lates = [{3: 0.4}] * 5 + [{1: 0.05}, {3: 0.4}]
    per: dict[int, list[tuple[int, float, float]]] = {r: [] for r in range(4)}
    t = 1000.0
    for s, late in enumerate(lates):
        last = t + max(late.values())
        for r in range(4):
            per[r].append((s, t + late.get(r, 0.0), last - t - late.get(r, 0.0)))
        t = last + 0.05
    named = vote([ob(r, per[r][:5]) for r in range(4)], CFG)
    assert named.culprits == (3,)
    obs = [ob(r, per[r]) for r in range(4)]
    assert stragglers(obs) == {}  # on its own: a run of one
    assert vote(obs, CFG, named).culprits == (3,)  # named at the previous check: kept
    assert vote(obs, CFG).culprits == ()


def test_a_rank_its_peers_wait_for_past_their_pause_bound_is_slow_even_while_it_heartbeats() -> None:
    # the onset of a 5 % straggler: no late collective yet; ranks 0-2 wait in collective 4 for 1.9 s (pause
    # bound 1 s), rank 3 still computes step 4 and writes heartbeats (its own progress looks fresh)
    per = synchronous(4, {})
    obs = []
    for r in range(4):
        e = list(per[r])
        if r != 3:
            obs.append(replace(ob(r, [*e, (4, 2000.0, -1.0)], COLLECTIVE, age=1.9, seq=4), phase_step=4))
        else:
            obs.append(replace(ob(r, e, COMPUTING, age=2.0, seq=3), phase_step=4, progress_age_s=0.1))
    job = vote(obs, CFG)
    v = job.by_rank()
    assert v[3].verdict == "slow" and job.culprits == (3,) and "waited 1.9 s for it" in v[3].reason, v[3]
    assert all(v[r].verdict == "healthy" and v[r].blocked_by == (3,) for r in (0, 1, 2)), job
    # waited less than their pause bound: nothing to say yet
    short = [replace(o, phase_age_s=0.5, progress_age_s=0.5) if o.rank != 3 else o for o in obs]
    assert vote(short, CFG).culprits == () and vote(short, CFG).verdict == "healthy"
