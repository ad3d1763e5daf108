"""Arrival-order evidence: who arrives last at the recent collectives, and how long the others wait for it.

In a synchronous job a straggler makes every peer wait in each collective, so wall step times and own
compute drift together and the cohort voter needs many steps to see it. The *order of arrival* shows it
at once: at collective N the rank that entered last is the one every other rank waited for. A rank that
was last at the most recent collectives, each time by a wait that is large against its peers' own
compute, is `slow` and the others are `blocked_by` it (the last `arrival_min_collectives` collectives in a row, and
most of the significant ones in the window: scheduler noise on a crowded host makes a random rank late
now and then, never the same one every time). The collective now in progress counts too: a
rank that has not entered it yet, while peers wait there, is later than every peer by at least their
wait so far.

Pure: entry times and waits come from the step records (`RankObservation.entries`: C records, the wait
of the matching X record), `now` from the waiters' own phase ages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuguard.diagnostics.jobstats import median
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import COLLECTIVE, RankObservation

# Thresholds (diagnostics/data/vote.yaml, `arrival_*`): the recent collectives looked at (window); the most
# recent ones in a row the straggler must be last at, each significant (min_collectives), and the share of
# the significant ones in the window (min_frac); a wait is significant above wait_frac of the peers' own
# compute per step and above min_wait_s (scheduler noise on tiny steps is not straggling); more than
# max_late_frac of the ranks "late" is the job's pace, nobody to blame.
DEFAULT = VoteConfig()


@dataclass(frozen=True)
class Straggler:
    rank: int
    last_at: tuple[int, ...]  # the collectives (seq) it arrived last at, by a significant wait
    median_wait_s: float  # what the others waited for it, median over those collectives
    peer_compute_s: float  # the others' own compute per step (median)
    significant: int  # significant collectives in the window

    def reason(self) -> str:
        seqs = ", ".join(str(s) for s in self.last_at[-4:])
        return (
            f"arrived last at {len(self.last_at)} of the last {self.significant} collectives that made peers wait "
            f"(seq {seqs}); peers waited {self.median_wait_s:.3f} s each time (median) against their own "
            f"compute of {self.peer_compute_s:.3f} s per step"
        )


def stragglers(observations: Sequence[RankObservation], cfg: VoteConfig = DEFAULT) -> dict[int, Straggler]:
    """The ranks the arrival order names as the ones the others wait for (usually none or one)."""
    window, min_wait = max(1, cfg.arrival_window), cfg.arrival_min_wait_s
    live = [o for o in observations if o.has_records and not o.closed and o.entries]
    if len(live) < 2:
        return {}
    arrivals: dict[int, dict[int, tuple[float, float]]] = {}
    for o in live:
        for seq, wall, wait in o.entries[-4 * window :]:
            arrivals.setdefault(seq, {})[o.rank] = (wall, wait)
    # "now", from the ranks waiting in a collective: entry time + how long they have been in it
    now = None
    for o in live:
        if o.phase == COLLECTIVE and o.entries and o.entries[-1][0] == o.phase_seq:
            t = o.entries[-1][1] + o.phase_age_s
            now = t if now is None else max(now, t)
    ranks = {o.rank for o in live}
    newest = max(arrivals)
    seqs = sorted(s for s, a in arrivals.items() if set(a) == ranks or s == newest)[-window:]
    compute = {o.rank: o.recent_compute_s for o in live}
    last_at: dict[int, list[tuple[int, float]]] = {}
    significant: list[tuple[int, tuple[int, ...]]] = []
    in_row: list[tuple[int, ...]] = []  # per collective, oldest first: who was last by a significant wait
    for seq in seqs:
        got = dict(arrivals[seq])
        missing = ranks - set(got)
        if missing and (now is None or seq != newest):
            continue  # only the newest collective may be incomplete: its missing ranks are late by `now`
        for r in missing:
            got[r] = (now or 0.0, 0.0)
        late = max(t for t, _ in got.values())
        lasts = tuple(sorted(r for r, (t, _) in got.items() if late - t <= min_wait))
        others = [r for r in got if r not in lasts]
        if not others:
            continue
        # what the others waited: the X record's measure, or (still in it) the time since they entered
        waits = [got[r][1] if got[r][1] >= 0 else (now or got[r][0]) - got[r][0] for r in others]
        wait = median(waits)
        peer_compute = median([compute[r] for r in others]) or 0.0
        if wait <= max(min_wait, cfg.arrival_wait_frac * peer_compute):
            if not missing:  # the one in progress that is not significant YET neither counts nor breaks a row
                in_row.append(())
            continue
        in_row.append(lasts)
        significant.append((seq, lasts))
        for r in lasts:
            last_at.setdefault(r, []).append((seq, wait))
    if len(significant) < 1:
        return {}
    out: dict[int, Straggler] = {}
    need = max(1, cfg.arrival_min_collectives)
    recent = in_row[-need:]
    for r, hits in last_at.items():
        if len(recent) < need or not all(r in lasts for lasts in recent):
            continue
        if len(hits) < cfg.arrival_min_frac * len(significant):
            continue
        peers = [compute[p] for p in ranks if p != r]
        out[r] = Straggler(
            rank=r,
            last_at=tuple(s for s, _ in hits),
            median_wait_s=median([w for _, w in hits]),
            peer_compute_s=median(peers) if peers else 0.0,
            significant=len(significant),
        )
    if len(out) > cfg.arrival_max_late_frac * len(
        ranks
    ):  # half the job "late": that is the job's pace, nobody to blame
        return {}
    return out


def resolve_roots(blocked: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Follow `blocked_by` chains to their roots: A waits on B, B waits on C → A is blocked by C.
    Cycles (A on B, B on A) end at the ranks of the cycle itself."""
    out: dict[int, tuple[int, ...]] = {}
    for start, direct in blocked.items():
        roots: set[int] = set()
        seen = {start}
        todo = list(direct)
        while todo:
            r = todo.pop()
            if r in seen:
                if r != start:
                    continue
                roots.add(r)
                continue
            seen.add(r)
            nxt = blocked.get(r, ())
            if nxt:  # r waits itself: its roots are ours (already-seen ones were handled when first seen)
                todo.extend(nxt)
            else:
                roots.add(r)
        roots.discard(start)
        out[start] = tuple(sorted(roots)) or tuple(sorted(set(direct) - {start}))
    return out
