"""Arrival-order evidence: who arrives last at the recent collectives, and how long the others wait for it.

In a synchronous job a straggler makes every peer wait in each collective, so wall step times and own
compute drift together and the cohort voter needs many steps to see it. The *order of arrival* shows it
at once: at collective N the rank that entered last is the one every other rank waited for. What it costs
is its *lateness*, how much later than every other rank it entered, and that is judged against the job's
own arrival noise (`arrival_noise_s`): on a crowded host (four workers on two cores) the scheduler makes
ranks, often a pair together, late by turns by a good part of a step, never the same one for long and
never by much more than the usual spread. A rank last at the most recent collectives in a row (at least
`arrival_min_collectives`) by a median lateness above the bar, and at most of the significant ones in the
window, is `slow` and the others are `blocked_by` it. The collective now in progress counts too: a rank
that has not entered it yet, while peers wait there, is later than every peer by at least their wait so
far.

Pure: entry times and waits come from the step records (`RankObservation.entries`: C records, the wait
of the matching X record), `now` from the waiters' own phase ages.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gpuguard.diagnostics.jobstats import median, quantile
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.observations import COLLECTIVE, RankObservation
from gpuguard.foundation.step_summary import OrderedView

# Thresholds: diagnostics/data/vote.yaml, `arrival_*` (window, min_collectives, min_frac, wait_frac, min_wait_s,
# noise_k, max_late_frac), documented there.
DEFAULT = VoteConfig()


@dataclass(frozen=True)
class Straggler:
    rank: int
    last_at: tuple[int, ...]  # the collectives (seq) it arrived last at, by a significant wait
    median_wait_s: float  # what the others waited for it, median over those collectives
    peer_compute_s: float  # the others' own compute per step (median)
    significant: int  # significant collectives in the window
    recent: int = 0  # collectives looked at (the window)
    lateness_s: float = 0.0  # how much later than every other rank it entered the recent ones (median)
    noise_s: float = 0.0  # the job's own arrival noise those are judged against (`arrival_noise_s`)

    def reason(self) -> str:
        seqs = ", ".join(str(s) for s in self.last_at[-4:])
        return (
            f"arrived last at {len(self.last_at)} of the last {max(self.recent, len(self.last_at))} collectives "
            f"({self.significant} made peers wait significantly; seq {seqs}), {self.lateness_s:.3f} s after every other rank (median of the recent ones; the job's "
            f"arrival noise is {self.noise_s:.3f} s); peers waited {self.median_wait_s:.3f} s each time (median) "
            f"against their own compute of {self.peer_compute_s:.3f} s per step"
        )


@dataclass(frozen=True)
class _Collective:
    seq: int
    lasts: tuple[int, ...]  # the rank(s) that arrived last (within arrival_min_wait_s of each other)
    lateness_s: float  # how much later than every other rank they entered: what they alone cost
    wait_s: float  # what the others waited (median): the X records' measure, or their wait so far
    bar_s: float  # the lateness that is significant here (see `stragglers`)
    noise_s: float  # the arrival noise in that bar
    in_progress: bool
    last_set: frozenset[int] = frozenset()  # `lasts` as a set: membership in O(1) at 100,000 ranks


def arrival_noise_s(arrivals: Mapping[int, Mapping[int, float]], late: int = 1) -> float:
    """The job's own arrival noise: over the complete collectives given, the median spread of the arrivals.

    `late=1` (one rank late): the spread of every arrival but the latest (second-latest entry minus the
    earliest). It leaves the late rank out, so a straggler, however long it lasts, does not raise it.
    `late=0` (several ranks late together): the whole spread. On a crowded host the scheduler makes a pair
    of ranks late together by turns (two of four workers on two cores get the CPU second, ~30 % of a step
    later), which looks exactly like two equal stragglers: a late set must stand out of the whole spread."""
    spreads = []
    for got in arrivals.values():
        if len(got) >= 2:
            t = sorted(got.values())
            spreads.append(t[-1 - late] - t[0])
    return median(spreads) if spreads else 0.0


def stragglers(
    observations: Sequence[RankObservation], cfg: VoteConfig = DEFAULT, held: Collection[int] = ()
) -> dict[int, Straggler]:
    """The ranks the arrival order names as the ones the others wait for (usually none or one).

    A collective counts against the rank(s) that entered it last by their *lateness*: how much later than
    every other rank they entered (what they alone cost; a rank last by a hair costs nothing). It is
    significant above `bar` = max(arrival_min_wait_s, arrival_wait_frac x the peers' own compute,
    arrival_noise_k x the job's arrival noise), the noise learned from the job's own recent collectives
    (`arrival_noise_s`), so a crowded host's scheduling, which makes ranks late by turns by a good part of a
    step, is not straggling. A rank is named when it was last at each of the `arrival_min_collectives` most
    recent collectives with a median lateness above the bar there, and at `arrival_min_frac` of the
    significant ones in the window. `held`: the ranks the previous check named (hysteresis): for them the most
    recent collective alone is enough, so a named straggler is not dropped for a check when its run is broken
    by the one collective it was not last at (a 1 % rank resuming after a quota period of its own)."""
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
    # every arrival is a live rank's: a collective is complete when it has as many as there are ranks
    complete = {s: {r: w for r, (w, _) in a.items()} for s, a in arrivals.items() if len(a) == len(ranks)}
    noise_one, noise_set = arrival_noise_s(complete, 1), arrival_noise_s(complete, 0)
    seqs = sorted(s for s in arrivals if s in complete or s == newest)[-window:]
    compute = {o.rank: o.recent_compute_s for o in live}
    rows: list[_Collective] = []
    for seq in seqs:
        got = dict(arrivals[seq])
        missing = ranks - got.keys()
        if missing and now is None:
            continue  # only the newest collective may be incomplete: its missing ranks are late by `now`
        for r in missing:
            got[r] = (now or 0.0, 0.0)
        late = max(t for t, _ in got.values())
        lasts = tuple(sorted(r for r, (t, _) in got.items() if late - t <= min_wait))
        last_set = frozenset(lasts)
        others = [r for r in got if r not in last_set]
        if not others:
            continue
        if len(lasts) > cfg.arrival_max_late_frac * len(ranks):
            lasts = ()  # most ranks late together: the early one is fast, nobody is late (breaks every run)
        # what the others waited: the X record's measure, or (still in it) the time since they entered
        waits = [got[r][1] if got[r][1] >= 0 else (now or got[r][0]) - got[r][0] for r in others]
        # the lateness by the entry times, but no more than every other rank really waited (the X records
        # measure it on each rank's own clock: hosts' wall clocks may disagree, and ranks that never ran at the
        # same time did not wait for each other)
        lateness = min(got[r][0] for r in lasts) - max(got[r][0] for r in others) if lasts else 0.0
        lateness = min(lateness, min(waits))
        peer_compute = median([compute[r] for r in others]) or 0.0
        noise = noise_one if len(lasts) == 1 else noise_set
        bar = max(min_wait, cfg.arrival_wait_frac * peer_compute, cfg.arrival_noise_k * noise)
        if missing and lateness <= bar:
            continue  # the one in progress that is not significant YET neither counts nor breaks a row
        rows.append(_Collective(seq, lasts, lateness, median(waits), bar, noise, bool(missing), last_set))
    significant = [c for c in rows if c.lateness_s > c.bar_s]
    if not significant:
        return {}
    out: dict[int, Straggler] = {}
    need = max(1, cfg.arrival_min_collectives)
    # the current run of the rank(s) last at the newest collective: the most recent collectives in a row they
    # were last at (at least `need`), with the same rank(s) last each time, judged by the median lateness over
    # the run (the quota's period makes every third or fourth late step of a throttled rank shorter: that must
    # not break the row). The same for each of them: found once, not once per rank.
    run: list[_Collective] = []
    for c in reversed(rows):
        if c.lasts != rows[-1].lasts:  # the same rank(s) last: a pair late by turns before is not its run
            break
        run.append(c)
    in_run = {c.seq for c in run}
    run_late = bool(run) and median([c.lateness_s for c in run]) > median([c.bar_s for c in run])
    all_compute = sorted(compute[p] for p in ranks)
    for r in rows[-1].lasts if rows and run_late else ():
        if len(run) < (1 if r in held else need):
            continue
        hits = [c for c in rows if r in c.last_set and (c.lateness_s > c.bar_s or c.seq in in_run)]
        if sum(1 for c in significant if r in c.last_set) < cfg.arrival_min_frac * len(significant):
            continue
        out[r] = Straggler(
            rank=r,
            last_at=tuple(c.seq for c in hits),
            recent=len(rows),
            median_wait_s=median([c.wait_s for c in hits]),
            peer_compute_s=_median_without(all_compute, compute[r]),
            significant=len(significant),
            lateness_s=median([c.lateness_s for c in run]),
            noise_s=median([c.noise_s for c in run]),
        )
    if len(out) > cfg.arrival_max_late_frac * len(
        ranks
    ):  # half the job "late": that is the job's pace, nobody to blame
        return {}
    return out


def _median_without(sorted_values: Sequence[float], value: float) -> float:
    """The median of `sorted_values` with one occurrence of `value` left out (0.0 when none is left):
    O(log n), so naming many ranks at 100,000 is not quadratic."""
    if len(sorted_values) < 2:
        return 0.0
    skip = bisect.bisect_left(sorted_values, value)
    return quantile(OrderedView(len(sorted_values) - 1, lambda k: sorted_values[k if k < skip else k + 1]), 0.5)


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
