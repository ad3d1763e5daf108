"""The coupling of synchronous ranks: who waits for whom in a collective, and who is to blame.

One rank that never arrives at collective N stalls every rank in N. A rank waiting in a collective for
a rank that has not arrived is not at fault (blocked_by names the culprit); the rank that never
arrived is. When every rank is in the collective, the one(s) that entered long after the others are
who the others waited for; when everyone is in it and nobody moves, the collective itself is stuck.

Pure and deterministic: each function takes the observations and the per-rank preliminary verdicts
(`Prelim`, before coupling) and returns new values; nothing is changed in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gpuguard.diagnostics.voters import DEAD, HEALTHY, HUNG, SLOW, UNKNOWN, Vote, VoteConfig, pause_bound_s
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, RankObservation


class Prelim(NamedTuple):
    """One rank's verdict before the coupling: its votes combined (`vote._combine`)."""

    verdict: str
    reason: str
    pending: bool  # two dimensions agreed on failure once: dead if they agree again
    votes: tuple[Vote, ...]


Prelims = Mapping[int, Prelim]


@dataclass(frozen=True)
class Coupling:
    """Who the stalled waiters wait for, as the collectives they sit in show it."""

    blocked: Mapping[int, tuple[int, ...]]  # waiter -> the ranks it waits for
    culprits: frozenset[int]  # ranks that never arrived, or arrived last
    nobody_to_blame: frozenset[int]  # waiters of a collective every live rank is stuck in
    waited_for_late: frozenset[int]  # waiters whose culprit has just entered the collective they wait in


def stalled(votes: tuple[Vote, ...]) -> bool:
    """A rank's own votes say it does not move: no progress (hung or paused), or its process is dead."""
    return any(v.dimension == "progress" and v.verdict in (HUNG, SLOW) for v in votes) or any(
        v.dimension == "liveness" and v.verdict == DEAD for v in votes
    )


def never_arrived(waiter: RankObservation, others: Sequence[RankObservation], stopped: set[int]) -> list[int]:
    """Ranks that have not entered the collective `waiter` sits in (nor passed it). A stopped rank
    stalls the collective even if it entered it, so it counts as missing too."""
    out = []
    for o in others:
        if o.rank == waiter.rank:
            continue
        if o.rank in stopped:
            out.append(o.rank)
            continue
        if o.phase_seq >= waiter.phase_seq or o.phase_step > waiter.phase_step:
            continue  # in it, or already past it
        if o.phase == BETWEEN and o.phase_step >= waiter.phase_step:
            continue
        out.append(o.rank)
    return out


def slow_for_waiters(
    prelim: Prelims,
    obs: Sequence[RankObservation],
    missing: Sequence[int],
    waiters: Sequence[int],
    seq: int,
    cfg: VoteConfig,
) -> dict[int, Prelim]:
    """A live rank that its peers have waited for in collective `seq` past their pause bound, while it is still
    working towards it, is `slow` (a straggler at its onset, before two late collectives exist: a 5 % rank's
    first slow step), not `healthy`: the job stands still for it. `hung` stays its own progress voter's call.
    Returns the ranks whose preliminary verdict changes."""
    by = {o.rank: o for o in obs}
    ws = [by[r] for r in waiters]
    waited = min(o.phase_age_s for o in ws)
    bound = max(pause_bound_s(o, cfg) for o in ws)
    if waited <= bound:
        return {}
    out: dict[int, Prelim] = {}
    for m in missing:
        v, why, pend, votes = prelim[m]
        o = by[m]
        if v != HEALTHY or not o.has_records or o.closed or m in waiters:
            continue
        where = f"{o.phase} step {o.phase_step}" if o.phase_step >= 0 else o.phase
        out[m] = Prelim(
            SLOW,
            f"its peers have waited {waited:.1f} s for it in collective {seq} (past their pause bound "
            f"{bound:.1f} s) while it is still {where}: the job waits for it; {why}",
            pend,
            votes,
        )
    return out


def just_arrived(seq: int, waiters: Sequence[int], obs: Sequence[RankObservation], cfg: VoteConfig) -> tuple[int, ...]:
    """Ranks in collective `seq` that are not stalled there themselves because they entered it long after the
    stalled waiters (by more than the waiters' pause bound): the ones those waited for. At most
    `arrival_max_late_frac` of the ranks; none when every rank in it is stalled (a stuck collective)."""
    stalled_ranks = set(waiters)
    ws = [o for o in obs if o.rank in stalled_ranks]
    if not ws:
        return ()
    earliest_wait = min(o.phase_age_s for o in ws)
    gap = max(pause_bound_s(o, cfg) for o in ws)
    fresh = tuple(
        o.rank
        for o in obs
        if o.rank not in stalled_ranks
        and o.phase == COLLECTIVE
        and o.phase_seq == seq
        and not o.closed
        and earliest_wait - o.phase_age_s > gap
    )
    if not fresh or len(fresh) > cfg.arrival_max_late_frac * len(obs):
        return ()
    return fresh


def stalled_waiters(obs: Sequence[RankObservation], prelim: Prelims) -> dict[int, list[int]]:
    """Collective sequence number -> the ranks stalled in it (not stopped, not moving, judged unwell)."""
    stopped = {o.rank for o in obs if o.alive.state == "stopped"}
    by_seq: dict[int, list[int]] = {}
    for o in obs:
        if (
            o.phase == COLLECTIVE
            and prelim[o.rank][0] in (HUNG, SLOW, DEAD)
            and o.rank not in stopped
            and stalled(prelim[o.rank][3])
        ):
            by_seq.setdefault(o.phase_seq, []).append(o.rank)
    return by_seq


def couple_waiters(
    obs: Sequence[RankObservation], prelim: Prelims, cfg: VoteConfig
) -> tuple[dict[int, Prelim], Coupling]:
    """Who waits for whom, one pass per distinct collective (not per waiter: fast at 10,000 ranks).

    Returns the preliminary verdicts updated (a missing rank its peers wait for is slow; a rank that
    arrived last names itself; waiters in a stuck collective say so) and the coupling."""
    out = dict(prelim)
    stopped = {o.rank for o in obs if o.alive.state == "stopped"}
    by_rank = {o.rank: o for o in obs}
    blocked: dict[int, tuple[int, ...]] = {}
    culprits: set[int] = set()
    nobody: set[int] = set()
    waited_for_late: set[int] = set()
    for seq, waiters in stalled_waiters(obs, prelim).items():
        missing = tuple(never_arrived(by_rank[waiters[0]], obs, stopped))
        if missing:
            for r in waiters:
                blocked[r] = tuple(m for m in missing if m != r)
            culprits.update(m for m in missing if m not in waiters)
            if len(missing) <= cfg.arrival_max_late_frac * len(obs):
                out.update(slow_for_waiters(out, obs, missing, waiters, seq, cfg))
        elif fresh := just_arrived(seq, waiters, obs, cfg):
            # everyone is in it, but the rank(s) that entered last did so long after the others: they are who
            # the others waited for (the collective completes in a moment), not the waiters (blame not inverted)
            for r in waiters:
                blocked[r] = fresh
                waited_for_late.add(r)
            w0_age = min(by_rank[w].phase_age_s for w in waiters)
            for r in fresh:
                v, why, pend, votes = out[r]
                out[r] = Prelim(
                    SLOW if v in (HEALTHY, UNKNOWN) else v,
                    f"arrived last at collective {seq}, {w0_age - by_rank[r].phase_age_s:.1f} s after its peers, "
                    f"who waited for it; {why}",
                    pend,
                    votes,
                )
                culprits.add(r)
        else:  # everyone is in it and nobody moves: the collective itself is stuck
            nobody.update(waiters)
            for r in waiters:
                v, why, pend, votes = out[r]
                if v == HUNG:
                    out[r] = Prelim(
                        v,
                        why + f" — every live rank is in collective {seq}: the collective itself is stuck "
                        "(network / collective library), no rank to blame",
                        pend,
                        votes,
                    )
    return out, Coupling(blocked, frozenset(culprits), frozenset(nobody), frozenset(waited_for_late))
