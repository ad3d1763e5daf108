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

Pure and deterministic: same observations, config and previous result → same verdict.

Lazy imports (start-up time): the YAML reader (yaml), only when the vote configuration is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gpuguard.diagnostics.arrival import resolve_roots, stragglers
from gpuguard.diagnostics.jobstats import Impact, job_impact, mad, median
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
from gpuguard.foundation.errors import DataError
from gpuguard.foundation.observations import BETWEEN, COLLECTIVE, RankObservation

SCHEMA = "gpuguard.job/1"
UNREADABLE = "step log unreadable"  # a rank's note that starts so is its reason as it stands (its records exist)
_ORDER = {HEALTHY: 0, UNKNOWN: 1, SLOW: 2, HUNG: 3, DEAD: 4}
DATA = Path(__file__).resolve().parent / "data" / "vote.yaml"
_SIGTERM_EXITS = (-15, 143)  # how torchrun reports a worker it terminated: killed by SIGTERM, or exited 128+15
VOTE_YAML_MAX_BYTES = 64 * 1024  # the packaged file is ~6 KiB


DEFAULT_CONFIG = VoteConfig()


# what each threshold may be (load_config refuses the rest with one line naming it)
_AT_LEAST_ONE = {"confirm_checks", "min_samples", "cohort_min_ranks", "comm_min_reports", "arrival_window"}
_AT_LEAST_ONE |= {"arrival_min_collectives", "outlier_cap_k", "impact_min_slowdown"}
_POSITIVE = {"check_interval_s", "bandwidth_bytes_s", "hang_k"}
_FRACTIONS = {"cohort_ratio", "mad_floor_frac", "cpu_progress_frac", "arrival_min_frac", "arrival_max_late_frac"}


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> VoteConfig:
    """The YAML thresholds (package default, or `path`), validated: unknown keys, non-numbers, non-finite or
    out-of-range values and integers given as fractions refuse (DataError, one line naming the key)."""
    import math

    from gpuguard.foundation.yamlfile import load_yaml

    p = Path(path) if path else DATA
    # the one YAML reader: a regular file under a size cap, no repeated key, finite numbers, bounded aliases
    doc = load_yaml(p, max_bytes=VOTE_YAML_MAX_BYTES, what="vote thresholds") or {}
    if not isinstance(doc, dict):
        raise DataError(f"{p}: expected a mapping of thresholds")
    doc = dict(doc.get("vote", doc))
    doc.update(overrides or {})
    known = {f.name: f for f in fields(VoteConfig)}
    kw: dict[str, Any] = {}
    for k, v in doc.items():
        if k not in known:
            raise DataError(f"{p}: unknown vote threshold {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise DataError(f"{p}: {k} must be a finite non-negative number, got {v!r}")
        if known[k].type in ("int", int):
            if v != int(v):
                raise DataError(f"{p}: {k} must be a whole number, got {v!r}")
            v = int(v)
        if k in _AT_LEAST_ONE and v < 1:
            raise DataError(f"{p}: {k} must be at least 1, got {v!r}")
        if k in _POSITIVE and v <= 0:
            raise DataError(f"{p}: {k} must be more than 0, got {v!r}")
        if k in _FRACTIONS and v > 1:
            raise DataError(f"{p}: {k} is a fraction (0 to 1), got {v!r}")
        kw[k] = v if isinstance(v, int) and known[k].type in ("int", int) else float(v)
    cfg = VoteConfig(**kw)
    if cfg.arrival_min_collectives > cfg.arrival_window:
        raise DataError(
            f"{p}: arrival_min_collectives ({cfg.arrival_min_collectives}) must not exceed arrival_window "
            f"({cfg.arrival_window}): the straggler could never be named"
        )
    if cfg.hang_floor_s > cfg.hang_cap_s:
        raise DataError(f"{p}: hang_floor_s ({cfg.hang_floor_s:g}) is above hang_cap_s ({cfg.hang_cap_s:g})")
    return cfg


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


def _never_arrived(waiter: RankObservation, others: Sequence[RankObservation], stopped: set[int]) -> list[int]:
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
    themselves, per generation (gone, and collateral of which rank), and reported apart."""
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
    pending_before = {r.rank for r in previous.ranks if r.pending_dead} if previous else set()
    before = previous.by_rank() if previous else {}
    past_checks: dict[int, int] = {}
    prelim: dict[int, tuple[str, str, bool, tuple[Vote, ...]]] = {}
    v_live, v_prog, v_coh, v_coll, v_hw, v_comm = VOTERS
    for o in obs:
        if not o.has_records:
            note = o.notes[0] if o.notes else ""
            why = (
                note
                if note.startswith(UNREADABLE)
                else "no step records from this rank yet" + (f" ({note})" if note else "")
            )
            prelim[o.rank] = (UNKNOWN, why, False, ())
            continue
        votes: tuple[Vote, ...] = (
            v_live(o, cohort, cfg),
            v_prog(o, cohort, cfg),
            v_coh(o, cohort, cfg),
            v_coll(o, cohort, cfg),
            v_hw(o, cohort, cfg),
            v_comm(o, cohort, cfg),
        )
        prog, past_checks[o.rank] = _confirm_in_checks(o, votes[1], before.get(o.rank), cfg)
        if prog is not votes[1]:
            votes = (votes[0], prog, *votes[2:])
        verdict, reason, pending = _combine(o, votes, o.rank in pending_before)
        prelim[o.rank] = (verdict, reason, pending, votes)

    # --- coupling: who is waiting for whom -----------------------------------------------------
    stopped = {o.rank for o in obs if o.alive.state == "stopped"}
    stalled_waiters = [
        o
        for o in obs
        if o.phase == COLLECTIVE
        and prelim[o.rank][0] in (HUNG, SLOW, DEAD)
        and o.rank not in stopped
        and _stalled(prelim[o.rank][3])
    ]
    blocked: dict[int, tuple[int, ...]] = {}
    culprits: set[int] = set()
    nobody_to_blame: set[int] = set()
    waited_for_late: set[int] = set()  # waiters whose culprit has just entered the collective they wait in
    by_seq: dict[int, list[int]] = {}
    for w in stalled_waiters:
        by_seq.setdefault(w.phase_seq, []).append(w.rank)
    # one pass per distinct collective, not per waiter: fast at 10,000 ranks
    for seq, waiters in by_seq.items():
        w0 = next(o for o in obs if o.rank == waiters[0])
        missing = tuple(_never_arrived(w0, obs, stopped))
        if missing:
            for r in waiters:
                blocked[r] = tuple(m for m in missing if m != r)
            culprits.update(m for m in missing if m not in waiters)
            if len(missing) <= cfg.arrival_max_late_frac * len(obs):
                _slow_for_waiters(prelim, obs, missing, waiters, seq, cfg)
        elif fresh := _just_arrived(seq, waiters, obs, cfg):
            # everyone is in it, but the rank(s) that entered last did so long after the others: they are who
            # the others waited for (the collective completes in a moment), not the waiters (blame not inverted)
            for r in waiters:
                blocked[r] = fresh
                waited_for_late.add(r)
            for r in fresh:
                v, why, pend, votes = prelim[r]
                w0_age = min(o.phase_age_s for o in obs if o.rank in waiters)
                me = next(o for o in obs if o.rank == r)
                prelim[r] = (
                    SLOW if v in (HEALTHY, UNKNOWN) else v,
                    f"arrived last at collective {seq}, {w0_age - me.phase_age_s:.1f} s after its peers, who "
                    f"waited for it; {why}",
                    pend,
                    votes,
                )
                culprits.add(r)
        else:  # everyone is in it and nobody moves: the collective itself is stuck
            nobody_to_blame.update(waiters)
            for r in waiters:
                v, why, pend, votes = prelim[r]
                if v == HUNG:
                    prelim[r] = (
                        v,
                        why + f" — every live rank is in collective {seq}: the collective itself is stuck "
                        "(network / collective library), no rank to blame",
                        pend,
                        votes,
                    )

    # a pause of the whole job (checkpoint, evaluation, a data stall) is nobody's slowness: a rank is
    # "paused" only if it has been idle for longer than the freshest rank by more than its pause bound
    active = [o for o in obs if o.has_records and not o.closed and prelim[o.rank][0] != DEAD]
    if len(active) >= 2 and not blocked and not any(prelim[o.rank][0] == HUNG for o in active):
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
                prelim[o.rank] = (
                    HEALTHY,
                    f"job-wide pause: every rank has been idle for about "
                    f"{freshest:.1f} s or more (checkpoint, evaluation or input stall?), "
                    "no rank to blame",
                    pend,
                    votes,
                )

    # arrival order: the rank that entered the recent collectives last, each time making its peers wait
    # long against their own compute, is the straggler at any severity; the others are blocked by it
    # named at the previous check: kept while still last at the most recent collective (hysteresis)
    held = {r.rank for r in previous.ranks if r.culprit and r.verdict == SLOW} if previous else set()
    late = stragglers(obs, cfg, held)
    for r, st in late.items():
        v, why, pend, votes = prelim[r]
        arrival = Vote("arrival", SLOW, st.reason(), {"collectives_last": len(st.last_at), "wait_s": st.median_wait_s})
        if v in (HEALTHY, UNKNOWN) or (v == SLOW and votes[1].verdict != SLOW):
            prelim[r] = (SLOW, "straggler: " + st.reason(), pend, (*votes, arrival))
        elif v == SLOW:
            prelim[r] = (SLOW, f"straggler: {st.reason()}; {why}", pend, (*votes, arrival))
        else:
            prelim[r] = (v, why, pend, (*votes, arrival))
        blocked.pop(r, None)
        culprits.add(r)
    if late:
        for o in obs:
            if o.rank in late or o.rank in blocked or not o.has_records or o.closed:
                continue
            if prelim[o.rank][0] in (HEALTHY, SLOW, HUNG):
                blocked[o.rank] = tuple(sorted(late))
    blocked = resolve_roots(blocked)

    if len(active) >= 2 and all(prelim[o.rank][0] == HUNG for o in active) and not culprits:
        nobody_to_blame.update(o.rank for o in active)  # all idle together: the job, not a rank

    # The launcher saw how each worker ended (diagnose job --torchrun-log, watch job --torchrun-log): after the
    # first failure torchrun terminates the other workers with SIGTERM. Dead ranks that ended by SIGTERM beside
    # one that ended otherwise (SIGKILL, a crash, an exit code) are its teardown, whichever order the checks saw
    # them go in (a whole group is torn down between two checks), and whatever an earlier check inferred before
    # the launcher had said it. All by SIGTERM (a preemption): no change.
    torn_down: dict[int, tuple[int, ...]] = {}
    ended = {o.rank: o.alive.exit_code for o in obs if prelim[o.rank][0] == DEAD and o.alive.exit_code is not None}
    first = tuple(sorted(r for r, c in ended.items() if c not in _SIGTERM_EXITS))
    if first and len(first) < len(ended):
        for r in ended:
            if r in first:
                blocked.pop(r, None)
                culprits.add(r)
            else:
                torn_down[r] = first
                blocked[r] = first
                culprits.discard(r)

    # A culprit named by the previous check that is now dead stays the cause: ranks that die after it
    # without evidence of their own are its collateral (torchrun tearing the group down), even when the
    # culprit had already entered the collective it stalled and so no longer looks "missing".
    sticky = {
        r for r in (previous.culprits if previous else ()) if prelim.get(r, (None,))[0] == DEAD and r not in torn_down
    }
    for o in obs:
        if o.rank in sticky:
            blocked.pop(o.rank, None)
            culprits.add(o.rank)
        elif sticky and prelim[o.rank][0] == DEAD and not blocked.get(o.rank) and o.rank not in torn_down:
            blocked[o.rank] = tuple(sorted(sticky))

    victims = _victims(obs, prelim)
    verdicts = []
    for o in obs:
        v, why, pend, votes = prelim[o.rank]
        b = blocked.get(o.rank, ())
        if b and v in (HUNG, SLOW) and set(b) <= set(late):
            v = HEALTHY
            why = f"waits at each collective for straggler rank(s) {_fmt_ranks(b)} (not this rank's fault)"
        elif b and v in (HUNG, SLOW) and o.rank in waited_for_late:
            v = HEALTHY
            why = (
                f"waited in collective {o.phase_seq} for {o.phase_age_s:.1f} s on rank(s) {_fmt_ranks(b)}, "
                "which arrived last (not this rank's fault)"
            )
        elif b and v in (HUNG, SLOW):
            v = HEALTHY
            why = (
                f"waiting in collective {o.phase_seq} for {o.phase_age_s:.1f} s on rank(s) "
                f"{_fmt_ranks(b)} that never arrived (not this rank's fault)"
            )
        elif b and v == HEALTHY and set(b) <= set(late):
            why = f"{why}; waits at each collective for straggler rank(s) {_fmt_ranks(b)}"
        elif o.rank in torn_down:
            why = f"{why}; collateral: torchrun terminated it (SIGTERM) after rank(s) {_fmt_ranks(b)} failed first"
        elif b and v == DEAD:
            why = f"{why}; it was waiting in collective {o.phase_seq} on rank(s) {_fmt_ranks(b)} (collateral)"
        elif v == DEAD and o.rank in victims:
            seen = o.errors[-1] if o.errors else next((c.text for c in o.comm_errors if c.rank == o.rank), "")
            why = f"{why}; collateral: it reported a peer's failure itself ({seen[:120]})"
        is_culprit = o.rank in culprits or (
            v in (DEAD, HUNG) and not b and o.rank not in victims and (o.rank not in nobody_to_blame or v == DEAD)
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


def _slow_for_waiters(
    prelim: dict[int, tuple[str, str, bool, tuple[Vote, ...]]],
    obs: Sequence[RankObservation],
    missing: Sequence[int],
    waiters: Sequence[int],
    seq: int,
    cfg: VoteConfig,
) -> None:
    """A live rank that its peers have waited for in collective `seq` past their pause bound, while it is still
    working towards it, is `slow` (a straggler at its onset, before two late collectives exist: a 5 % rank's
    first slow step), not `healthy`: the job stands still for it. `hung` stays its own progress voter's call."""
    by = {o.rank: o for o in obs}
    ws = [by[r] for r in waiters]
    waited = min(o.phase_age_s for o in ws)
    bound = max(pause_bound_s(o, cfg) for o in ws)
    if waited <= bound:
        return
    for m in missing:
        v, why, pend, votes = prelim[m]
        o = by[m]
        if v != HEALTHY or not o.has_records or o.closed or m in waiters:
            continue
        where = f"{o.phase} step {o.phase_step}" if o.phase_step >= 0 else o.phase
        prelim[m] = (
            SLOW,
            f"its peers have waited {waited:.1f} s for it in collective {seq} (past their pause bound "
            f"{bound:.1f} s) while it is still {where}: the job waits for it; {why}",
            pend,
            votes,
        )


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


def _just_arrived(seq: int, waiters: Sequence[int], obs: Sequence[RankObservation], cfg: VoteConfig) -> tuple[int, ...]:
    """Ranks in collective `seq` that are not stalled there themselves because they entered it long after the
    stalled waiters (by more than the waiters' pause bound): the ones those waited for. At most
    `arrival_max_late_frac` of the ranks; none when every rank in it is stalled (a stuck collective)."""
    stalled = set(waiters)
    ws = [o for o in obs if o.rank in stalled]
    if not ws:
        return ()
    earliest_wait = min(o.phase_age_s for o in ws)
    gap = max(pause_bound_s(o, cfg) for o in ws)
    fresh = tuple(
        o.rank
        for o in obs
        if o.rank not in stalled
        and o.phase == COLLECTIVE
        and o.phase_seq == seq
        and not o.closed
        and earliest_wait - o.phase_age_s > gap
    )
    if not fresh or len(fresh) > cfg.arrival_max_late_frac * len(obs):
        return ()
    return fresh


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


def _stalled(votes: tuple[Vote, ...]) -> bool:
    return any(v.dimension == "progress" and v.verdict in (HUNG, SLOW) for v in votes) or any(
        v.dimension == "liveness" and v.verdict == DEAD for v in votes
    )


def _victims(obs: Sequence[RankObservation], prelim: dict[int, tuple[str, str, bool, tuple[Vote, ...]]]) -> set[int]:
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


__all__ = ["SCHEMA", "JobVerdict", "RankVerdict", "VoteConfig", "load_config", "vote", "to_json", "cohort_of"]
