"""`gpu-recover status`: the one page on-call reads first, gathered and decided.

`gather` reads the job (each probe in its own thread with a deadline, so one hung read, an
unreachable etcd or a slow process table never hangs the whole page): the active generation and
its certificate digest, each member's liveness now (`foundation.identity`; a member on another
host is "unknown: on another host"), the dead-versus-slow vote (`doctor.job_observation` +
`diagnostics.vote`), the torchrun hazards (`collectors.torchrun` + `diagnostics.torchrun_hazards`),
fenced commits and refused activations from the ledger, the last audit entries and the incarnations
evicted by in-place switches (the certificates' `extra`).

`decide` is pure (facts in, decision out, no I/O): what the job is doing (`lifecycle`: running,
restarting (agent alive), switching in place, finished, down, each with the evidence it rests on), the
page's health (healthy / warning / critical / unknown, exit 0 / 1 / 2 / 3) and the one line "safe to
resume: yes/no, because …" with the step a resume starts from (`recovery.operator.resume`, the rule
`restore` uses too). Resuming is safe only when the certificate chain checks out to the active
generation, nothing past it is stored unverified, and every member of the active generation is proved
gone: a member on another host, one this user cannot read, or a probe that timed out is never a proof
of quiescence; and no torchrun agent of the job is alive to restart it on its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gpuguard.collectors.torchrun import gather as gather_torchrun
from gpuguard.diagnostics.torchrun_hazards import CRITICAL, WARNING, assess_facts
from gpuguard.diagnostics.vote import load_config, vote
from gpuguard.doctor.job_observation import observe_job
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, DataError, GpuguardError
from gpuguard.foundation.identity import ALIVE_STATES, GONE_STATES, process_status
from gpuguard.foundation.inplace_files import abort_requested, read_refusal, read_reports
from gpuguard.foundation.jobdir import iter_incarnations, ledger_dir, ledger_url_path
from gpuguard.foundation.observations import CLOSED
from gpuguard.foundation.steplog import safe_incarnation
from gpuguard.generation.job import open_job_ledger
from gpuguard.generation.rules import PROOF_FENCED
from gpuguard.recovery.operator import audit
from gpuguard.recovery.operator.lifecycle import (
    DOWN,
    FINISHED,
    NOT_STARTED,
    RESTARTING,
    RUNNING,
    STARTING,
    SWITCHING,
    Lifecycle,
    MemberLiveness,
    MemberRecord,
    SwitchEvidence,
    lifecycle,
    ranks,
)
from gpuguard.recovery.operator.resume import resume_point

SCHEMA = "gpuguard.status/1"
AUDIT_TAIL = 5
HEALTHY, WARN, CRIT, UNKNOWN = "healthy", "warning", "critical", "unknown"
_LEVEL = {HEALTHY: 0, WARN: 1, UNKNOWN: 2, CRIT: 3}
EXIT_BY_STATE = {HEALTHY: EXIT_OK, WARN: EXIT_WARNING, CRIT: EXIT_CRITICAL, UNKNOWN: EXIT_UNKNOWN}

T = TypeVar("T")


@dataclass(frozen=True)
class StatusFacts:
    """Everything the page shows; a part that could not be read carries its problem instead."""

    job_dir: str
    time: float
    ledger_url: str | None = None
    generation: int | None = None
    digest: str | None = None
    frontier_step: int | None = None
    ledger_problem: str | None = None  # no valid certificate, unreadable, unreachable, timed out
    unverified_after_active: tuple[int, ...] = ()
    members: tuple[MemberLiveness, ...] = ()
    members_problem: str | None = None
    vote: Mapping[str, Any] | None = None  # verdict, reason, counts, culprits
    vote_problem: str | None = None
    hazards: tuple[Mapping[str, Any], ...] = ()
    live_workers: int | None = None
    hazards_problem: str | None = None
    fenced_commits: int | None = None
    refusals: int | None = None
    audit_tail: tuple[Mapping[str, Any], ...] = ()
    audit_problem: str | None = None
    evicted: tuple[Mapping[str, Any], ...] = ()
    fenced_incarnations: tuple[Mapping[str, Any], ...] = ()  # old incarnations certified quiet by fencing
    unreadable_incarnations: tuple[str, ...] = ()  # why each unreadable incarnation record could not be read
    incarnations_problem: str | None = None  # the records could not be scanned at all (timed out)
    agents: tuple[int, ...] | None = None  # live torchrun agents of the job on this host (None: not read)
    new_workers: tuple[tuple[int, int], ...] = ()  # (rank, pid): live workers no member of the active generation
    records: Mapping[int, MemberRecord] = field(default_factory=dict)  # member rank -> its step log in G
    switch: SwitchEvidence = SwitchEvidence()
    resume_step: int | None = None  # the step the next activation starts from (`recovery.operator.resume`)
    resume_source: str | None = None
    resume: Mapping[str, Any] | None = None  # `ResumePoint.to_json()`
    resume_problem: str | None = None


@dataclass(frozen=True)
class Decision:
    state: str  # healthy | warning | critical | unknown
    safe_to_resume: bool
    because: str
    reasons: tuple[str, ...] = field(default_factory=tuple)  # why the state is not healthy
    job: Lifecycle = Lifecycle("unknown", ())

    @property
    def exit_code(self) -> int:
        return EXIT_BY_STATE[self.state]

    def line(self) -> str:
        return f"safe to resume: {'yes' if self.safe_to_resume else 'no'}, because {self.because}"


# --- the decision (pure) -----------------------------------------------------------------------


def job_lifecycle(facts: StatusFacts) -> Lifecycle:
    """What the job is doing, with the evidence (`lifecycle.lifecycle` over the gathered facts)."""
    return lifecycle(
        facts.generation,
        facts.members,
        records=facts.records,
        agents=None if facts.hazards_problem else facts.agents,
        new_workers=facts.new_workers,
        switch=facts.switch,
        problem=facts.ledger_problem if facts.generation is None else facts.members_problem,
    )


# the health each lifecycle state gives the page, and why (None: the state says nothing is wrong)
_STATE_HEALTH: dict[str, tuple[str, str] | None] = {
    RUNNING: None,
    FINISHED: None,
    NOT_STARTED: None,
    STARTING: (WARN, "torchrun is starting the workers"),
    RESTARTING: (WARN, "torchrun is restarting the workers"),
    SWITCHING: (WARN, "the survivors are switching generation in place"),
    DOWN: (CRIT, "the job is down"),
    "unknown": (UNKNOWN, "what the job is doing cannot be told from here"),
}


def decide(facts: StatusFacts) -> Decision:
    """The job's lifecycle state, the page's health and "safe to resume"; a pure function of the facts."""
    job = job_lifecycle(facts)
    reasons: list[tuple[str, str]] = []  # (state, why)
    if facts.unverified_after_active:
        reasons.append((CRIT, f"generation(s) {list(facts.unverified_after_active)} are stored but do not verify"))
    if facts.ledger_problem:
        reasons.append((UNKNOWN, f"ledger: {facts.ledger_problem}"))
    if facts.members_problem:
        reasons.append((UNKNOWN, f"members: {facts.members_problem}"))
    health = _STATE_HEALTH.get(job.state)
    if health is not None and not (facts.ledger_problem or facts.members_problem):
        level, why = health
        reasons.append((level, f"{why}: {job.evidence[0]}" if job.evidence else why))
    verdict = (facts.vote or {}).get("verdict")
    # the vote judges live ranks: a finished job, or one torchrun is (re)starting, has no pace to judge
    live = job.state not in (FINISHED, RESTARTING, STARTING, NOT_STARTED)
    if live and verdict in ("dead", "hung"):
        reasons.append((CRIT, f"vote: {verdict}: {(facts.vote or {}).get('reason', '')}".rstrip(": ")))
    elif live and verdict == "slow":
        reasons.append((WARN, f"vote: slow: {(facts.vote or {}).get('reason', '')}".rstrip(": ")))
    if facts.vote_problem and facts.vote is None and "timed out" in facts.vote_problem:
        reasons.append((UNKNOWN, f"vote: {facts.vote_problem}"))
    for h in facts.hazards:
        if h.get("severity") == CRITICAL:
            reasons.append((CRIT, f"torchrun: {h.get('kind')}: {h.get('message')}"))
        elif h.get("severity") == WARNING:
            reasons.append((WARN, f"torchrun: {h.get('kind')}: {h.get('message')}"))
    if facts.hazards_problem:
        reasons.append((UNKNOWN, f"torchrun: {facts.hazards_problem}"))
    if facts.unreadable_incarnations:
        n = len(facts.unreadable_incarnations)
        reasons.append(
            (
                WARN,
                f"{n} incarnation record(s) unreadable (abort cannot verify those workers): "
                f"{facts.unreadable_incarnations[0]}",
            )
        )
    if facts.incarnations_problem:
        reasons.append((UNKNOWN, f"incarnation records: {facts.incarnations_problem}"))

    state = max((s for s, _ in reasons), key=_LEVEL.__getitem__, default=HEALTHY)
    safe, because = _safe_to_resume(facts, job)
    return Decision(state, safe, because, tuple(why for _, why in reasons), job)


def _resume_words(facts: StatusFacts) -> str:
    if facts.resume_step is None:
        return f"the resume step is unknown ({facts.resume_problem or 'not read'})"
    return f"resume from step {facts.resume_step} ({facts.resume_source})"


def _safe_to_resume(facts: StatusFacts, job: Lifecycle) -> tuple[bool, str]:
    gen = facts.generation
    alive = [m for m in facts.members if m.state == "alive"]
    unsure = [m for m in facts.members if m.state not in ("alive", "gone")]
    if facts.unverified_after_active:
        return False, (
            f"generation(s) {list(facts.unverified_after_active)} are stored but do not verify: "
            "the newest generation is unknown (run `gpu-generation verify`)"
        )
    if gen is None:
        return False, f"there is no verified active generation ({facts.ledger_problem or 'no certificate'})"
    if facts.members_problem:
        return False, f"the members' liveness is unknown ({facts.members_problem})"
    if job.state in (RESTARTING, STARTING):
        return False, (
            f"torchrun is {'re' if job.state == RESTARTING else ''}starting the job itself "
            f"({job.evidence[-1]}); a second copy would split it; it will {_resume_words(facts)}"
        )
    if job.state == SWITCHING:
        return False, "the survivors are switching to the next generation in place; a second copy would split it"
    if alive:
        return False, (
            f"{len(alive)} member(s) of generation {gen} are still alive (rank {ranks([m.rank for m in alive])}): "
            "the job is running; a second copy would split it (stop it first: `gpu-recover abort --include-active`)"
        )
    if unsure:
        first = unsure[0]
        return False, (
            f"{len(unsure)} member(s) of generation {gen} cannot be proved gone (rank {first.rank}: "
            f"{first.detail}): quiescence is not proved"
        )
    orphans = [h for h in facts.hazards if h.get("kind") == "orphaned-workers"]
    if orphans:
        return False, f"torchrun: {orphans[0].get('message')}"
    if facts.hazards_problem:
        return False, f"the job's workers on this host could not be checked ({facts.hazards_problem})"
    if not facts.members:
        return True, f"generation {gen} has no members (nothing has run yet)"
    if job.state == FINISHED:
        return True, f"the job finished cleanly in generation {gen}; a new run would {_resume_words(facts)}"
    return (
        True,
        f"every member of generation {gen} is gone and the certificate chain checks out; {_resume_words(facts)}",
    )


# --- gathering (I/O, each probe with a deadline) -----------------------------------------------


class _Timeout(Exception):
    pass


def _bounded(fn: Callable[[], T], timeout_s: float) -> Callable[[], T]:
    """Start `fn` in a daemon thread now; the returned getter waits at most until the deadline."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    deadline = time.monotonic() + timeout_s
    thread.start()

    def get() -> T:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise _Timeout(f"timed out after {timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return get


def _problem(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (GpuguardError, _Timeout)) else f"{type(exc).__name__}: {exc}"


def _here() -> set[str]:
    return {socket.gethostname(), os.uname().nodename}


def liveness(member: Any, here: set[str]) -> MemberLiveness:
    """One member of the certificate, probed by (pid, start time) if it ran on this host."""
    inc = member.incarnation
    if inc.host not in here:
        state, detail = "unknown", f"on another host ({inc.host})"
    else:
        found = process_status(inc.pid, inc.start_time)
        if found in ALIVE_STATES:
            state, detail = "alive", found
        elif found in GONE_STATES:
            detail = "pid now belongs to a newer process" if found == "reused" else found
            state = "gone"
        else:
            state, detail = "unknown", "no access to the process (run as root or as the job's user)"
    return MemberLiveness(member.rank, inc.id, inc.host, inc.pid, state, detail)


def _read_ledger(job_dir: Path, url: str | None, timeout_s: float) -> dict[str, Any]:
    with open_job_ledger(job_dir, url, timeout=timeout_s) as led:
        cert = led.active()
        out: dict[str, Any] = {"url": led.url, "cert": cert}
        if cert is None:
            out["problem"] = "no valid genesis certificate"
            return out
        out["beyond"] = tuple(sorted(n for n in led.generations() if n > cert.generation))
        out["fenced"] = led.fenced_count()
        out["refusals"] = len(led.refusals())
        evicted = []
        for c in led.history():
            ev = (c.extra or {}).get("evicted")
            if isinstance(ev, Mapping) and any(ev.get(k) for k in ("dead", "killed")):
                evicted.append(
                    {
                        "generation": c.generation,
                        "dead": list(ev.get("dead") or ()),
                        "killed": list(ev.get("killed") or ()),
                    }
                )
        out["evicted"] = tuple(evicted)
        out["fenced_incarnations"] = _fenced_incarnations(led, led.history()[-FENCED_HISTORY:])
        return out


FENCED_HISTORY = 8  # certificates back that the page looks for incarnations certified quiet by fencing


def _fenced_incarnations(led: Any, certs: list[Any]) -> tuple[dict[str, Any], ...]:
    """The old incarnations certificates proved quiet by fencing (docs/fencing.md), not by being gone:
    each may still be running. A lease key still in etcd says it may; a missing one that it has fenced
    itself (its host's lease expired, or its host's renewer saw it gone: docs/formats/leases.md)."""
    by_gen = {c.generation: c for c in certs}
    found = []
    for c in certs:
        proofs = (c.extra or {}).get("quiescence_by")
        parent = by_gen.get(c.generation - 1)
        if not isinstance(proofs, Mapping) or parent is None:
            continue
        for m in parent.members:
            if proofs.get(m.incarnation.id) == PROOF_FENCED:
                found.append((c.generation, m))
    if not found:
        return ()
    left = led.lease_time_left([m.incarnation.id for _, m in found])
    out = []
    for gen, m in found:
        ttl = None if left is None else left.get(m.incarnation.id)
        if left is None:
            state, until = "unknown", "this ledger holds no leases"
        elif ttl is None:
            state, until = "ended", "its lease key is gone: it fenced itself (or its host's renewer saw it gone)"
        else:
            state = "may-be-running"
            until = (
                f"until its next commit sees generation {gen} active (its generation watch) or, cut off from etcd, "
                f"half a lease TTL after its host's last keepalive; its host's lease has {ttl} s left"
            )
        out.append(
            {
                "fenced_by_generation": gen,
                "rank": m.rank,
                "incarnation": m.incarnation.id,
                "host": m.incarnation.host,
                "state": state,
                "lease_left_s": ttl,
                "until": until,
            }
        )
    return tuple(out)


def _read_vote(job_dir: Path) -> tuple[dict[str, Any] | None, dict[tuple[int, str], MemberRecord]]:
    """The vote over the step records, and each (rank, incarnation)'s step log: closed cleanly or not."""
    records, observations = observe_job(job_dir)
    logs = {
        (r, s.incarnation): MemberRecord(s.phase.kind == CLOSED, s.steps[-1].step if s.steps else None)
        for r, s in records.ranks.items()
    }
    if not observations:
        return None, logs
    job = vote(observations, load_config(None))
    doc = {
        "verdict": job.verdict,
        "reason": job.reason,
        "counts": dict(job.counts),
        "culprits": list(job.culprits),
        "ranks": len(observations),
    }
    return doc, logs


def _read_hazards(
    job_dir: Path,
) -> tuple[tuple[Mapping[str, Any], ...], int, tuple[int, ...], dict[str, tuple[int, int]]]:
    """torchrun's hazards, live workers, live agents of the job here, and live workers by incarnation id."""
    facts = gather_torchrun(job_dir)
    assessment = assess_facts(facts, now=time.time())
    workers = {w.incarnation_id: (w.rank, w.pid) for w in facts.workers if w.alive}
    agents = tuple(sorted({a.pid for a in facts.agents}))
    return tuple(h.to_json() for h in assessment.hazards), assessment.live_workers, agents, workers


def _read_switch(job_dir: Path, generation: int) -> SwitchEvidence:
    """The in-place switch files of generation G (the directory transport; with etcd they live in etcd)."""
    reports = read_reports(job_dir, generation)
    refused = read_refusal(job_dir, generation)
    return SwitchEvidence(
        reported=tuple(sorted(reports)),
        refused=None if refused is None else str(refused.get("reason", "refused")),
        abort_requested=abort_requested(job_dir, generation),
        committed={r: rep.committed_step for r, rep in reports.items()},
    )


def _read_resume(job_dir: Path, url: str | None, timeout_s: float) -> dict[str, Any]:
    """The step the next activation starts from (`resume.resume_point`: the rule restore uses too)."""
    if url is None and not any(p.exists() for p in (ledger_dir(job_dir), ledger_url_path(job_dir))):
        return resume_point(job_dir, None).to_json()
    with open_job_ledger(job_dir, url, timeout=timeout_s) as led:
        return resume_point(job_dir, led).to_json()


def _read_incarnations(job_dir: Path) -> tuple[str, ...]:
    """Why each unreadable incarnation record could not be read (a link, a FIFO, garbage, no permission)."""
    return tuple(str(r) for r in iter_incarnations(job_dir) if isinstance(r, DataError))


def _read_audit(job_dir: Path) -> tuple[Mapping[str, Any], ...]:
    tail = audit.read(job_dir).records[-AUDIT_TAIL:]
    out = []
    for r in tail:
        d = r.detail
        summary = d.get("summary") or d.get("why") or d.get("error") or ""
        out.append(
            {
                "time": r.time,
                "user": r.user,
                "host": r.host,
                "action": r.action,
                "outcome": r.outcome,
                "exit_code": r.exit_code,
                "dry_run": r.dry_run,
                "run_id": r.run_id,
                "summary": str(summary)[:200],
            }
        )
    return tuple(out)


def gather(
    job_dir: str | os.PathLike[str], *, ledger_url: str | None = None, probe_timeout_s: float = 5.0
) -> StatusFacts:
    """Read everything the page shows; every probe runs in parallel and is bounded by `probe_timeout_s`."""
    path = Path(job_dir)
    now = time.time()
    ledger = _bounded(lambda: _read_ledger(path, ledger_url, probe_timeout_s), probe_timeout_s)
    votes = _bounded(lambda: _read_vote(path), probe_timeout_s)
    hazards = _bounded(lambda: _read_hazards(path), probe_timeout_s)
    tail = _bounded(lambda: _read_audit(path), probe_timeout_s)
    records = _bounded(lambda: _read_incarnations(path), probe_timeout_s)
    resume = _bounded(lambda: _read_resume(path, ledger_url, probe_timeout_s), probe_timeout_s)
    facts: dict[str, Any] = {"job_dir": str(path), "time": now}
    cert = None
    try:
        led = ledger()
        facts["ledger_url"] = led["url"]
        cert = led["cert"]
        if cert is None:
            facts["ledger_problem"] = led["problem"]
        else:
            facts.update(
                generation=cert.generation,
                digest=cert.digest(),
                frontier_step=cert.frontier.step,
                unverified_after_active=led["beyond"],
                fenced_commits=led["fenced"],
                refusals=led["refusals"],
                evicted=led["evicted"],
                fenced_incarnations=led["fenced_incarnations"],
            )
            here = _here()
            members = _bounded(lambda: tuple(liveness(m, here) for m in cert.members), probe_timeout_s)
            switch = _bounded(lambda: _read_switch(path, cert.generation), probe_timeout_s)
            try:
                facts["members"] = members()
            except Exception as exc:  # noqa: BLE001 - the page shows what failed
                facts["members_problem"] = _problem(exc)
            try:
                facts["switch"] = switch()
            except Exception:  # noqa: BLE001 - no readable switch file is no switch evidence
                pass
    except Exception as exc:  # noqa: BLE001
        facts["ledger_problem"] = _problem(exc)
    try:
        facts["vote"], logs = votes()
        if facts["vote"] is None:
            facts["vote_problem"] = "no step records under ranks/"
        if cert is not None:
            facts["records"] = {
                m.rank: logs[(m.rank, safe_incarnation(m.incarnation.id))]
                for m in cert.members
                if (m.rank, safe_incarnation(m.incarnation.id)) in logs
            }
    except Exception as exc:  # noqa: BLE001
        facts["vote_problem"] = _problem(exc)
    try:
        facts["hazards"], facts["live_workers"], facts["agents"], workers = hazards()
        member_ids = {m.incarnation.id for m in cert.members} if cert is not None else set()
        facts["new_workers"] = tuple(sorted(w for inc, w in workers.items() if inc not in member_ids))
    except Exception as exc:  # noqa: BLE001
        facts["hazards_problem"] = _problem(exc)
    try:
        point = resume()
        facts.update(resume=point, resume_step=point["step"], resume_source=point["source"])
    except Exception as exc:  # noqa: BLE001
        facts["resume_problem"] = _problem(exc)
    try:
        facts["audit_tail"] = tail()
    except Exception as exc:  # noqa: BLE001
        facts["audit_problem"] = _problem(exc)
    try:
        facts["unreadable_incarnations"] = records()
    except Exception as exc:  # noqa: BLE001
        facts["incarnations_problem"] = _problem(exc)
    return StatusFacts(**facts)


def to_json(facts: StatusFacts, decision: Decision) -> dict[str, Any]:
    """The `gpuguard.status/1` document."""
    return {
        "schema": SCHEMA,
        "job_dir": facts.job_dir,
        "time": facts.time,
        "state": decision.state,
        "exit_code": decision.exit_code,
        "safe_to_resume": decision.safe_to_resume,
        "because": decision.because,
        "reasons": list(decision.reasons),
        "job": decision.job.to_json(),
        "resume": {
            "step": facts.resume_step,
            "source": facts.resume_source,
            "problem": facts.resume_problem,
            **{k: v for k, v in (facts.resume or {}).items() if k not in ("step", "source")},
        },
        "ledger": {
            "url": facts.ledger_url,
            "active_generation": facts.generation,
            "certificate_digest": facts.digest,
            "frontier_step": facts.frontier_step,
            "unverified_after_active": list(facts.unverified_after_active),
            "fenced_commits": facts.fenced_commits,
            "refusals": facts.refusals,
            "problem": facts.ledger_problem,
        },
        "members": [m.to_json() for m in facts.members],
        "members_problem": facts.members_problem,
        "vote": dict(facts.vote) if facts.vote is not None else None,
        "vote_problem": facts.vote_problem,
        "torchrun": {
            "hazards": [dict(h) for h in facts.hazards],
            "live_workers": facts.live_workers,
            "problem": facts.hazards_problem,
        },
        "audit_tail": [dict(a) for a in facts.audit_tail],
        "audit_problem": facts.audit_problem,
        "evicted": [dict(e) for e in facts.evicted],
        "fenced_incarnations": [dict(f) for f in facts.fenced_incarnations],
        "incarnations": {
            "unreadable": list(facts.unreadable_incarnations),
            "problem": facts.incarnations_problem,
        },
    }
