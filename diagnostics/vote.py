"""The dead-vs-slow vote: combine the voters per rank, then apply the coupling of synchronous ranks.

Rules:
* `dead` only on a decisive signal (process gone without a clean close, zombie, GPU lost), or when two
  independent dimensions vote dead/hung together and did so at the previous check too;
* `hung` = alive (or not visibly dead) without progress past its own learned bound for M checks;
* `slow` = progressing below the cohort (own compute time), or paused past its own P99.9;
* coupling: one rank that never arrives at collective N stalls every rank in N. A rank waiting in a
  collective for a rank that has not arrived is `healthy` (blocked_by lists the culprit), and the rank
  that never arrived is the one named. Everyone present and still stuck is `hung` for all.
* generations: the vote is on the active generation's incarnations; ranks whose newest incarnation belongs
  to an earlier generation (`superseded`) are judged among themselves per generation and reported apart,
  never as waiting on the new ranks, and count for neither the verdict nor the exit code;
* impact: the job's step now against its normal step, and what the ranks slow of their own cost each step
  (`jobstats.job_impact`), in the reason of a slow job and as `impact` in the document.

Pure and deterministic: same observations, config and previous result → same verdict. The thresholds are
read by `vote_config`, the coupling in collectives is `coupling`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gpuguard.diagnostics.arrival import Straggler, resolve_roots, stragglers
from gpuguard.diagnostics.coupling import Prelim, Prelims, couple_waiters
from gpuguard.diagnostics.jobstats import Impact, job_impact, mad, median
from gpuguard.diagnostics.vote_config import DEFAULT_CONFIG, load_config
from gpuguard.diagnostics.voters import (
    ABSTAIN,
    DEAD,
    HEALTHY,
    HUNG,
    SLOW,
    UNKNOWN,
    VOTERS,
    Cohort,
    Vote,
    VoteConfig,
    pause_bound_s,
)
from gpuguard.foundation.observations import COLLECTIVE, RankObservation

SCHEMA = "gpuguard.job/1"
UNREADABLE = "step log unreadable"  # a rank's note that starts so is its reason as it stands (its records exist)
_ORDER = {HEALTHY: 0, UNKNOWN: 1, SLOW: 2, HUNG: 3, DEAD: 4}
_SIGTERM_EXITS = (-15, 143)  # how torchrun reports a worker it terminated: killed by SIGTERM, or exited 128+15


@dataclass(frozen=True)
class RankVerdict:
    rank: int
    verdict: str
    reason: str
    votes: tuple[Vote, ...] = ()
    blocked_by: tuple[int, ...] = ()
    culprit: bool = False
    pending_dead: bool = False  # two dimensions agreed on failure once; dead if they agree again
    observation: RankObservation | None = None
    past_bound_checks: int = 0  # consecutive real checks this rank was past its hang bound, in one place
    generation: int | None = None  # set on the incarnations of an earlier generation (reported apart)

    def to_json(self) -> dict[str, Any]:
        o = self.observation
        doc: dict[str, Any] = {
            "rank": self.rank,
            "verdict": self.verdict,
            "reason": self.reason,
            "culprit": self.culprit,
            "blocked_by": list(self.blocked_by),
            "past_bound_checks": self.past_bound_checks,
        }
        if self.generation is not None:
            doc["generation"] = self.generation
        if o is not None:
            doc.update(
                {
                    "phase": o.phase,
                    "step": o.phase_step,
                    "collective_seq": o.phase_seq,
                    "phase_age_s": round(o.phase_age_s, 3),
                    "process": o.alive.state,
                    "steps_recorded": o.n_steps,
                    "own_step_s": {
                        "p50": round(o.period_p50_s, 4),
                        "p99": round(o.period_p99_s, 4),
                        "p999": round(o.period_p999_s, 4),
                    },
                    "own_compute_recent_s": round(o.recent_compute_s, 4),
                    "notes": list(o.notes),
                }
            )
        # every vote that carries something (an abstention with numbers explains itself too)
        doc["evidence"] = [v.to_json() for v in self.votes if v.verdict != ABSTAIN or v.numbers]
        return doc


@dataclass(frozen=True)
class JobVerdict:
    verdict: str
    reason: str
    ranks: tuple[RankVerdict, ...]
    culprits: tuple[int, ...] = ()
    next_steps: tuple[str, ...] = ()
    counts: dict[str, int] = field(default_factory=dict)
    impact: Impact | None = None  # what the slowness costs the job per step, and which rank costs it
    # incarnations of earlier generations, judged among themselves: not part of the verdict, the exit code or
    # the coupling (an old rank is never waiting on a new one)
    superseded: tuple[RankVerdict, ...] = ()

    @property
    def exit_code(self) -> int:
        return {HEALTHY: 0, SLOW: 1, HUNG: 2, DEAD: 2}.get(self.verdict, 3)

    def by_rank(self) -> dict[int, RankVerdict]:
        return {r.rank: r for r in self.ranks}


def cohort_of(observations: Sequence[RankObservation]) -> Cohort:
    computes = [o.recent_compute_s for o in observations if o.n_steps > 0]
    med = median(computes) if computes else 0.0
    reports: dict[int, int] = {}
    for o in observations:
        for c in o.comm_errors:
            if c.peer is not None and c.peer != o.rank:
                reports[c.peer] = reports.get(c.peer, 0) + 1
    return Cohort(
        world=len(observations),
        compute_median_s=med,
        compute_mad_s=mad(computes, med) if computes else 0.0,
        ranks_with_steps=len(computes),
        comm_reports=reports,
    )


def _combine(obs: RankObservation, votes: tuple[Vote, ...], was_pending: bool) -> tuple[str, str, bool]:
    """One rank's verdict from its votes (before coupling). Returns (verdict, reason, pending_dead)."""
    live, prog = votes[0], votes[1]  # VOTERS order: liveness, progress, cohort, collective, hardware, comm
    decisive = [v for v in votes if v.decisive and v.verdict == DEAD]
    if decisive:
        return DEAD, decisive[0].reason, False
    failing = [v for v in votes if v.verdict in (DEAD, HUNG)]
    dims_dead = [v for v in failing if v.verdict == DEAD]
    if len(failing) >= 2 and dims_dead:
        why = "; ".join(v.reason for v in failing)
        if was_pending:
            return DEAD, f"{len(failing)} dimensions agree on two consecutive checks: {why}", False
        return HUNG if prog.verdict == HUNG else SLOW, f"suspect dead (confirming at the next check): {why}", True
    if prog.verdict == HUNG:
        extra = ""
        if live.verdict == HUNG:
            extra = " — " + live.reason
        elif live.verdict == ABSTAIN and obs.alive.state == "disk-sleep":
            extra = " — in D-state: stuck in the kernel (I/O or driver)"
        return HUNG, prog.reason + extra, False
    slow = [v for v in votes if v.verdict == SLOW]
    if live.verdict == HUNG:  # stopped but not yet past its bound: paused
        return SLOW, "paused: " + live.reason, False
    if slow:
        return SLOW, "; ".join(v.reason for v in slow), False
    if dims_dead:  # one non-decisive dimension alone: not enough for dead
        return SLOW, f"one dimension only, not enough for dead: {dims_dead[0].reason}", False
    if all(v.verdict == ABSTAIN for v in votes):
        return UNKNOWN, "no dimension could vote", False
    if obs.closed:
        return HEALTHY, "finished: log closed cleanly", False
    return HEALTHY, prog.reason, False


def vote(
    observations: Sequence[RankObservation],
    cfg: VoteConfig = DEFAULT_CONFIG,
    previous: JobVerdict | None = None,
    cohort: Cohort | None = None,
    interval_s: float | None = None,
    superseded: Sequence[tuple[int, RankObservation]] = (),
) -> JobVerdict:
    """The vote over every rank. `previous` (the last check's result) confirms two-dimension deaths and
    hangs: with it, `hung` needs `confirm_checks` real consecutive checks past the bound in one place.

    `interval_s`: the time between checks actually in use (the watch interval, or the time since the
    previous check); without a previous check it turns the confirmation into age (bound + (M-1) x it).
    Default: `check_interval_s` of the configuration.

    `cohort` may be given when `observations` is a subset of a larger job (the simulator votes on the
    ranks that matter at an instant, with the statistics of all ranks).

    `superseded`: (generation, observation) of ranks whose newest incarnation belongs to an earlier generation
    than `observations` (`doctor.job_observation.observe_job_generations`). They are judged among
    themselves, per generation (gone, and collateral of which rank), and reported apart.

    The steps, each a pure function: the per-rank votes (`rank_prelims`), the coupling in collectives
    (`coupling.couple_waiters`), a pause of the whole job (`job_wide_pause`), the stragglers of the arrival
    order (`name_stragglers`), the launcher's teardown (`torn_down`), the previous check's culprits
    (`sticky_culprits`), then each rank's final verdict (`final_verdict`) and the job's summary."""
    if superseded:
        return replace(vote(observations, cfg, previous, cohort, interval_s), superseded=_superseded(superseded, cfg))
    if interval_s is not None and interval_s > 0:
        cfg = replace(cfg, check_interval_s=float(interval_s))
    obs = sorted(observations, key=lambda o: o.rank)
    if not obs:
        return JobVerdict(
            UNKNOWN,
            "no rank has written step records yet",
            (),
            counts={UNKNOWN: 0},
            next_steps=("Check that the training script writes StepLog records under <job-dir>/ranks/.",),
        )
    cohort = cohort or cohort_of(obs)
    prelim, past_checks = rank_prelims(obs, cohort, cfg, previous)
    prelim, coupled = couple_waiters(obs, prelim, cfg)
    blocked = dict(coupled.blocked)
    culprits = set(coupled.culprits)
    nobody_to_blame = set(coupled.nobody_to_blame)
    prelim = job_wide_pause(obs, prelim, cfg, anyone_blocked=bool(blocked))
    prelim, late = name_stragglers(obs, prelim, cfg, previous)
    for r in late:
        blocked.pop(r, None)
        culprits.add(r)
    if late:  # the others are blocked by the stragglers
        for o in obs:
            if o.rank in late or o.rank in blocked or not o.has_records or o.closed:
                continue
            if prelim[o.rank][0] in (HEALTHY, SLOW, HUNG):
                blocked[o.rank] = tuple(sorted(late))
    blocked = resolve_roots(blocked)
    active = _active(obs, prelim)
    if len(active) >= 2 and all(prelim[o.rank][0] == HUNG for o in active) and not culprits:
        nobody_to_blame.update(o.rank for o in active)  # all idle together: the job, not a rank
    victims = _victims(obs, prelim)
    teardown = torn_down(obs, prelim, victims)
    for r, first in teardown.items():
        blocked[r] = first
        culprits.discard(r)
    for r in {f for first in teardown.values() for f in first}:
        blocked.pop(r, None)
        culprits.add(r)
    sticky = sticky_culprits(obs, prelim, previous, teardown)
    for o in obs:
        if o.rank in sticky:
            blocked.pop(o.rank, None)
            culprits.add(o.rank)
        elif sticky and prelim[o.rank][0] == DEAD and not blocked.get(o.rank) and o.rank not in teardown:
            blocked[o.rank] = tuple(sorted(sticky))
    why_context = _Context(late, coupled.waited_for_late, teardown, victims)
    verdicts = []
    for o in obs:
        v, why = final_verdict(o, prelim[o.rank], blocked.get(o.rank, ()), why_context)
        _, _, pend, votes = prelim[o.rank]
        b = blocked.get(o.rank, ())
        is_culprit = o.rank in culprits or (
            v in (DEAD, HUNG)
            and not b
            and o.rank not in why_context.victims
            and (o.rank not in nobody_to_blame or v == DEAD)
        )
        verdicts.append(
            RankVerdict(o.rank, v, why, votes, b, is_culprit and v != HEALTHY, pend, o, past_checks.get(o.rank, 0))
        )
    culprit_ranks = tuple(r.rank for r in verdicts if r.culprit)
    # the ranks slow of their own (last at the collectives, or computing slower than the cohort) cost the job
    own_slow = [
        r.rank
        for r in verdicts
        if r.verdict == SLOW
        and not r.blocked_by
        and any(v.dimension in ("arrival", "cohort") and v.verdict == SLOW for v in r.votes)
    ]
    impact = job_impact(
        [o for o in obs if prelim[o.rank][0] != DEAD],
        own_slow,
        cfg.impact_min_slowdown,
        {r: st.median_wait_s for r, st in late.items()},
    )
    return _summarize(tuple(verdicts), culprit_ranks, cohort, impact)


def rank_prelims(
    obs: Sequence[RankObservation], cohort: Cohort, cfg: VoteConfig, previous: JobVerdict | None
) -> tuple[dict[int, Prelim], dict[int, int]]:
    """Each rank's votes combined, before the coupling, and its consecutive checks past its hang bound.

    A rank without records is `unknown` with the reason it has none; with `previous`, a two-dimension
    death must agree at two checks in a row and a hang is counted in real checks (`_confirm_in_checks`)."""
    pending_before = {r.rank for r in previous.ranks if r.pending_dead} if previous else set()
    before = previous.by_rank() if previous else {}
    past_checks: dict[int, int] = {}
    prelim: dict[int, Prelim] = {}
    for o in obs:
        if not o.has_records:
            note = o.notes[0] if o.notes else ""
            why = (
                note
                if note.startswith(UNREADABLE)
                else "no step records from this rank yet" + (f" ({note})" if note else "")
            )
            prelim[o.rank] = Prelim(UNKNOWN, why, False, ())
            continue
        votes = tuple(voter(o, cohort, cfg) for voter in VOTERS)
        prog, past_checks[o.rank] = _confirm_in_checks(o, votes[1], before.get(o.rank), cfg)
        if prog is not votes[1]:
            votes = (votes[0], prog, *votes[2:])
        verdict, reason, pending = _combine(o, votes, o.rank in pending_before)
        prelim[o.rank] = Prelim(verdict, reason, pending, votes)
    return prelim, past_checks


def _active(obs: Sequence[RankObservation], prelim: Prelims) -> list[RankObservation]:
    """The ranks still taking part: with records, not finished, not dead."""
    return [o for o in obs if o.has_records and not o.closed and prelim[o.rank][0] != DEAD]


def job_wide_pause(
    obs: Sequence[RankObservation], prelim: Prelims, cfg: VoteConfig, *, anyone_blocked: bool
) -> dict[int, Prelim]:
    """A pause of the whole job (checkpoint, evaluation, a data stall) is nobody's slowness: a rank is
    "paused" only if it has been idle for longer than the freshest rank by more than its pause bound.
    Only when nobody waits on anybody in a collective and nobody is hung."""
    out = dict(prelim)
    active = _active(obs, prelim)
    if len(active) < 2 or anyone_blocked or any(prelim[o.rank][0] == HUNG for o in active):
        return out
    freshest = min(o.phase_age_s for o in active)
    for o in active:
        v, why, pend, votes = prelim[o.rank]
        if (
            v != SLOW
            or votes[1].verdict != SLOW
            or any(x.verdict in (SLOW, HUNG, DEAD) for x in votes if x.dimension != "progress")
        ):
            continue
        if o.phase_age_s - freshest <= pause_bound_s(o, cfg):
            out[o.rank] = Prelim(
                HEALTHY,
                f"job-wide pause: every rank has been idle for about "
                f"{freshest:.1f} s or more (checkpoint, evaluation or input stall?), "
                "no rank to blame",
                pend,
                votes,
            )
    return out


def name_stragglers(
    obs: Sequence[RankObservation], prelim: Prelims, cfg: VoteConfig, previous: JobVerdict | None
) -> tuple[dict[int, Prelim], dict[int, Straggler]]:
    """The arrival order: the rank that entered the recent collectives last, each time making its peers wait
    long against their own compute, is the straggler at any severity. A straggler the previous check named
    is kept while it is still last at the most recent collective (hysteresis). Returns the verdicts with
    the stragglers' arrival vote added, and the stragglers."""
    out = dict(prelim)
    held = {r.rank for r in previous.ranks if r.culprit and r.verdict == SLOW} if previous else set()
    late = stragglers(obs, cfg, held)
    for r, st in late.items():
        v, why, pend, votes = prelim[r]
        arrival = Vote("arrival", SLOW, st.reason(), {"collectives_last": len(st.last_at), "wait_s": st.median_wait_s})
        if v in (HEALTHY, UNKNOWN) or (v == SLOW and votes[1].verdict != SLOW):
            out[r] = Prelim(SLOW, "straggler: " + st.reason(), pend, (*votes, arrival))
        elif v == SLOW:
            out[r] = Prelim(SLOW, f"straggler: {st.reason()}; {why}", pend, (*votes, arrival))
        else:
            out[r] = Prelim(v, why, pend, (*votes, arrival))
    return out, late


def torn_down(
    obs: Sequence[RankObservation], prelim: Prelims, victims: AbstractSet[int] = frozenset()
) -> dict[int, tuple[int, ...]]:
    """Dead ranks torchrun terminated after another worker failed first -> the ranks that failed first.

    The launcher saw how each worker ended (diagnose job --torchrun-log, watch job --torchrun-log): after the
    first failure torchrun terminates the other workers with SIGTERM. Dead ranks that ended by SIGTERM beside
    one that ended otherwise (SIGKILL, a crash, an exit code) are its teardown, whichever order the checks saw
    them go in (a whole group is torn down between two checks), and whatever an earlier check inferred before
    the launcher had said it. All by SIGTERM (a preemption): none.

    `victims` (`_victims`) did not fail first even though they ended by an exit code: they saw a peer's
    failure in a collective and left before torchrun's SIGTERM reached them. They are neither the cause
    nor terminated; the final verdict names them collateral of their own report."""
    ended = {o.rank: o.alive.exit_code for o in obs if prelim[o.rank][0] == DEAD and o.alive.exit_code is not None}
    first = tuple(sorted(r for r, c in ended.items() if c not in _SIGTERM_EXITS and r not in victims))
    if not first or len(first) + len(victims & ended.keys()) == len(ended):
        return {}
    return {r: first for r in ended if r not in first and r not in victims}


def sticky_culprits(
    obs: Sequence[RankObservation],
    prelim: Prelims,
    previous: JobVerdict | None,
    teardown: Mapping[int, tuple[int, ...]],
) -> set[int]:
    """A culprit named by the previous check that is now dead stays the cause: ranks that die after it
    without evidence of their own are its collateral (torchrun tearing the group down), even when the
    culprit had already entered the collective it stalled and so no longer looks "missing"."""
    return {
        r for r in (previous.culprits if previous else ()) if prelim.get(r, (None,))[0] == DEAD and r not in teardown
    }


@dataclass(frozen=True)
class _Context:
    """What the final reasons need to know about the job beyond one rank."""

    late: Mapping[int, Straggler]  # the stragglers of the arrival order
    waited_for_late: frozenset[int]  # waiters whose culprit has just entered the collective they wait in
    teardown: Mapping[int, tuple[int, ...]]  # ranks torchrun terminated -> the ones that failed first
    victims: set[int]  # dead ranks that reported a peer's failure themselves


def final_verdict(o: RankObservation, prelim: Prelim, blocked_by: tuple[int, ...], ctx: _Context) -> tuple[str, str]:
    """(verdict, reason) of one rank after the coupling: a rank only waiting for others is healthy, and
    every reason says whose fault it is."""
    v, why, _, _ = prelim
    b = blocked_by
    if b and v in (HUNG, SLOW) and set(b) <= set(ctx.late):
        return HEALTHY, f"waits at each collective for straggler rank(s) {_fmt_ranks(b)} (not this rank's fault)"
    if b and v in (HUNG, SLOW) and o.rank in ctx.waited_for_late:
        return HEALTHY, (
            f"waited in collective {o.phase_seq} for {o.phase_age_s:.1f} s on rank(s) {_fmt_ranks(b)}, "
            "which arrived last (not this rank's fault)"
        )
    if b and v in (HUNG, SLOW):
        return HEALTHY, (
            f"waiting in collective {o.phase_seq} for {o.phase_age_s:.1f} s on rank(s) "
            f"{_fmt_ranks(b)} that never arrived (not this rank's fault)"
        )
    if b and v == HEALTHY and set(b) <= set(ctx.late):
        return v, f"{why}; waits at each collective for straggler rank(s) {_fmt_ranks(b)}"
    if o.rank in ctx.teardown:
        return v, f"{why}; collateral: torchrun terminated it (SIGTERM) after rank(s) {_fmt_ranks(b)} failed first"
    if b and v == DEAD:
        return v, f"{why}; it was waiting in collective {o.phase_seq} on rank(s) {_fmt_ranks(b)} (collateral)"
    if v == DEAD and o.rank in ctx.victims:
        seen = o.errors[-1] if o.errors else next((c.text for c in o.comm_errors if c.rank == o.rank), "")
        return v, f"{why}; collateral: it reported a peer's failure itself ({seen[:120]})"
    return v, why


def _superseded(old: Sequence[tuple[int, RankObservation]], cfg: VoteConfig) -> tuple[RankVerdict, ...]:
    """The earlier generations' incarnations, each generation voted on alone (its own coupling: who died
    first, who was collateral), every reason saying that it is superseded."""
    by_gen: dict[int, list[RankObservation]] = {}
    for g, o in old:
        by_gen.setdefault(g, []).append(o)
    out = []
    for g in sorted(by_gen):
        for r in vote(by_gen[g], cfg).ranks:
            state = r.observation.alive.state if r.observation is not None else "unknown"
            gone = "gone" if state in ("gone", "zombie") else f"process {state}"
            why = f"generation {g} incarnation, superseded ({gone}; not part of the active generation): {r.reason}"
            out.append(replace(r, reason=why, generation=g, blocked_by=r.blocked_by))
    return tuple(sorted(out, key=lambda r: (r.generation or 0, r.rank)))


def _same_place(a: RankObservation | None, b: RankObservation) -> bool:
    return a is not None and (a.phase, a.phase_step, a.phase_seq) == (b.phase, b.phase_step, b.phase_seq)


def _confirm_in_checks(o: RankObservation, prog: Vote, prev: RankVerdict | None, cfg: VoteConfig) -> tuple[Vote, int]:
    """Hang confirmation counted in real checks. Returns (the progress vote, checks past the bound).

    The progress voter's age rule (age > bound + (M-1) x the interval in use) always holds; with a previous
    check of this rank in the same place, `hung` needs M consecutive real checks past the bound as well: a
    check that came late (a slow watcher, a long interval) does not count as several."""
    if prog.verdict not in (HUNG, SLOW) or "bound_s" not in prog.numbers:
        return prog, 0
    past = prog.numbers["age_s"] > prog.numbers["bound_s"]
    if not past:
        return prog, 0
    working = _cpu_progress(o, prev, cfg)
    if working is not None and prog.numbers["age_s"] <= cfg.hang_cap_s:
        return working, 0
    if prev is None or not _same_place(prev.observation, o):
        return prog, (max(1, cfg.confirm_checks) if prog.verdict == HUNG else 1)
    n = prev.past_bound_checks + 1
    m = max(1, cfg.confirm_checks)
    nums = {**prog.numbers, "checks_past_bound": n, "confirm_checks": m}
    if n < m and prog.verdict == HUNG:
        return (
            Vote(
                "progress",
                SLOW,
                f"paused: no progress for {prog.numbers['age_s']:.1f} s, past its bound "
                f"{prog.numbers['bound_s']:.1f} s (confirming: check {n} of {m})",
                nums,
            ),
            n,
        )
    return replace(prog, numbers=nums), n


def _cpu_progress(o: RankObservation, prev: RankVerdict | None, cfg: VoteConfig) -> Vote | None:
    """No records, but the process burns CPU outside a collective: it is working, slowly (a CPU quota,
    a throttled host), which is progress too. Needs the previous check of the rank in the same place."""
    p = prev.observation if prev is not None else None
    if p is None or not _same_place(p, o) or o.phase == COLLECTIVE or o.cpu_s is None or p.cpu_s is None:
        return None
    elapsed = o.phase_age_s - p.phase_age_s
    used = o.cpu_s - p.cpu_s
    if elapsed <= 0 or used < cfg.cpu_progress_frac * elapsed:
        return None
    return Vote(
        "progress",
        SLOW,
        f"no record for {o.phase_age_s:.1f} s ({o.phase} step {o.phase_step}), but its process used "
        f"{used:.2f} s of CPU in the last {elapsed:.1f} s ({100 * used / elapsed:.0f} %): working, slowly "
        "(CPU quota or throttled host?), not hung",
        {"age_s": o.phase_age_s, "cpu_used_s": used, "elapsed_s": elapsed, "cpu_frac": used / elapsed},
    )


def _victims(obs: Sequence[RankObservation], prelim: Prelims) -> set[int]:
    """Dead ranks that died *after* reporting a communication error themselves: collateral, not culprits,
    as long as some other dead rank reported none."""
    dead = [o for o in obs if prelim[o.rank][0] == DEAD]
    silent = {o.rank for o in dead if not o.errors and not any(c.rank == o.rank for c in o.comm_errors)}
    if not silent:
        return set()
    return {o.rank for o in dead if o.rank not in silent}


def _fmt_ranks(ranks: Sequence[int], limit: int = 8) -> str:
    head = ", ".join(str(r) for r in ranks[:limit])
    return head + (f" (+{len(ranks) - limit} more)" if len(ranks) > limit else "")


def _summarize(
    verdicts: tuple[RankVerdict, ...], culprits: tuple[int, ...], cohort: Cohort, impact: Impact | None = None
) -> JobVerdict:
    counts: dict[str, int] = {}
    for r in verdicts:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    worst = max((r.verdict for r in verdicts), key=lambda v: _ORDER[v])
    if worst == UNKNOWN and any(r.verdict == HEALTHY for r in verdicts):
        worst = UNKNOWN
    if len(verdicts) == 1 and worst in (HEALTHY, SLOW):
        note = " (one rank: no cohort to compare against)"
    else:
        note = ""
    named = ", ".join(f"rank {r.rank} {r.verdict}" for r in verdicts if r.verdict in (DEAD, HUNG, SLOW))
    reason = {
        HEALTHY: f"all {len(verdicts)} ranks progressing{note}",
        UNKNOWN: "some ranks have no usable records",
    }.get(worst, named or worst)
    if culprits:
        reason += f"; culprit: rank(s) {_fmt_ranks(culprits)}"
    if impact is not None and worst == SLOW:
        reason += f"; {impact.line()}"
    steps: list[str] = []
    by = {r.rank: r for r in verdicts}
    for c in culprits or tuple(r.rank for r in verdicts if r.verdict in (DEAD, HUNG)):
        r = by[c]
        if r.verdict == DEAD:
            steps.append(
                f"rank {c}: dead — replace it (gpu-recover runbook run rank-failure) and check its node "
                "(gpu-doctor diagnose node on its host)"
            )
        elif r.verdict == HUNG:
            steps.append(f"rank {c}: hung — dump its stacks (py-spy dump --pid PID), then gpu-recover runbook run hang")
    for r in verdicts:
        if r.verdict == SLOW:
            steps.append(
                f"rank {r.rank}: slow — check its node for throttling / ECC / PCIe (gpu-doctor diagnose node); "
                "not a reason to restart"
            )
    if worst == UNKNOWN:
        steps.append("ranks without records: check that they started and call StepLog (or pass --log-regex)")
    if not steps:
        steps.append("nothing to do")
    return JobVerdict(worst, reason, verdicts, culprits, tuple(steps[:20]), counts, impact)


def to_json(
    job: JobVerdict,
    *,
    job_dir: str = "",
    cohort_steps: Mapping[str, Any] | None = None,
    config: VoteConfig | None = None,
) -> dict[str, Any]:
    """The `gpuguard.job/1` document."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "job_dir": job_dir,
        "verdict": job.verdict,
        "exit_code": job.exit_code,
        "reason": job.reason,
        "culprits": list(job.culprits),
        "counts": job.counts,
        "cohort_step_s": dict(cohort_steps or {}),
        "impact": job.impact.to_json() if job.impact is not None else None,
        "next_steps": list(job.next_steps),
        "ranks": [r.to_json() for r in job.ranks],
        "superseded": [r.to_json() for r in job.superseded],
    }
    if config is not None:
        doc["thresholds"] = {f.name: getattr(config, f.name) for f in fields(config)}
    return doc


__all__ = [
    "DEFAULT_CONFIG",
    "SCHEMA",
    "UNREADABLE",
    "JobVerdict",
    "RankVerdict",
    "VoteConfig",
    "cohort_of",
    "load_config",
    "to_json",
    "vote",
]
