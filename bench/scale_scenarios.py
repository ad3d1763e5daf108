"""The synthetic jobs of bench/scale.py: members as a large job has them, and the two coordinators'
decisions on them (pure, no etcd). Shared with tests/recovery/runtime/test_decisions_at_scale.py,
which runs the same decisions as a guard against anything quadratic."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.gcpause import gc_paused
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.certificate import check, issue
from gpuguard.generation.ledger import encode_certificate
from gpuguard.generation.records import Certificate, Frontier, Incarnation, Member, Violation
from gpuguard.recovery.runtime import activation, switch
from gpuguard.recovery.snapshots.store import Selection

KEY = os.urandom(32)
STEP = 100  # the step every survivor committed and holds


def host_of(rank: int) -> str:
    return f"gpu-{rank // 8:05d}.rack{rank // 256:03d}.example"  # 8 ranks a host, 32 hosts a rack


def table(n: int, start_pid: int = 100_000) -> list[Member]:
    """`n` members as a real job has them: random ids, 8 ranks a host, 6-digit pids."""
    return [Member(r, Incarnation(uuid.uuid4().hex, host_of(r), start_pid + r, 1.7e9 + r / 8)) for r in range(n)]


def genesis() -> Certificate:
    return issue(
        parent=None,
        job_id="scale",
        members=(),
        reason="genesis",
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="bench",
        key=KEY,
    )


def started(parent: Certificate, members: list[Member], **kw: Any) -> Certificate:
    return issue(
        parent=parent,
        job_id=parent.job_id,
        members=members,
        reason=kw.pop("reason", "start"),
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="gpuguard-runtime bench@host:4242",
        key=KEY,
        **kw,
    )


# ---------------------------------------------------------------------- in place
@dataclass(frozen=True)
class InPlace:
    """Generation 1 of N members (TP 8: a replica is one host); one replica died, the rest reported."""

    parent: Certificate
    reports: dict[int, Report]
    facts: switch.EvictionFacts
    layout: switch.Layout
    dead: tuple[int, ...]


def in_place(ranks: int) -> InPlace:
    g1 = started(genesis(), table(ranks))
    dead = tuple(range((ranks // 16) * 8, (ranks // 16) * 8 + 8))
    reports = {
        m.rank: Report(
            1, m.rank, m.incarnation.id, m.incarnation.pid, m.incarnation.host, STEP, {STEP: "d" * 64}, "", 1.0
        )
        for m in g1.members
        if m.rank not in dead
    }
    me = host_of(0)
    facts = switch.EvictionFacts(
        generation=1,
        members=tuple(g1.members),
        reports=reports,
        host=me,
        status={m.incarnation.id: "running" for m in g1.members if m.incarnation.host == me},
        killed_before={},
        waited_s=1.0,
        grace_s=10.0,
        lease_expired=frozenset(g1.members[r].incarnation.id for r in dead),
    )
    return InPlace(g1, reports, facts, switch.Layout(dp=ranks // 8, tp=8), dead)


Admit = Callable[[switch.Layout, switch.Eviction], switch.Admission]


def admit_as_before(layout: switch.Layout, eviction: switch.Eviction) -> switch.Admission:
    """`switch.admit_survivors` as main had it: membership tested in a tuple, O(ranks²)."""
    shrink = switch.shrink_layout(layout, eviction.lost)
    assert shrink.layout is not None
    return switch.Admission(shrink.layout, tuple(r for r in eviction.kept if r in shrink.kept_ranks))


def decide_in_place(sc: InPlace, admit: Admit = switch.admit_survivors) -> switch.SwitchPlan:
    """One pass of the in-place coordinator's decision, every pure step of it, the cycle collector
    paused (the coordinator pauses it for the eviction, and for the plan and the certificate, the
    steps that allocate per member: foundation/gcpause.py)."""
    with gc_paused():
        return _decide_in_place(sc, admit)


def _decide_in_place(sc: InPlace, admit: Admit) -> switch.SwitchPlan:
    switch.choose_coordinator(sc.reports.keys(), ())
    switch.coordinator_probes(sc.reports, sc.parent.ranks, sc.facts.host)
    ev = switch.decide_eviction(sc.facts)
    adm = admit(sc.layout, ev)
    assert adm.layout is not None, adm.refused
    agreed = switch.agree_on_state([sc.reports[r] for r in adm.kept], STEP)
    return switch.plan_switch(
        switch.SwitchFacts(
            parent=sc.parent,
            previous_layout=sc.layout,
            layout=adm.layout,
            kept=adm.kept,
            eviction=ev,
            reports=sc.reports,
            committed_by_all=STEP,
            frontier=STEP,
            manifest="",
            state_digest=agreed.digest,
            operator=False,
            phases={"detect": 1.0},
            since=1.0,
            coordinator_rank=0,
            coordinator_incarnation=sc.parent.members[0].incarnation.id,
        )
    )


# ---------------------------------------------------------------------- restart
@dataclass(frozen=True)
class Restart:
    """Generation 1 of N members; all restarted; each new member saw its predecessor gone."""

    parent: Certificate
    hellos: tuple[activation.Hello, ...]


def restart(ranks: int) -> Restart:
    g1 = started(genesis(), table(ranks))
    new = table(ranks, start_pid=300_000)
    hellos = tuple(
        activation.Hello(r, new[r].incarnation.to_dict(), host_of(r), old_gone=(g1.members[r].incarnation.id,))
        for r in range(ranks)
    )
    return Restart(g1, hellos)


def decide_restart(sc: Restart) -> activation.ActivationPlan:
    """The restart coordinator's pure part: the hellos checked, then the plan (quiescence included)."""
    with gc_paused():
        return _decide_restart(sc)


def _decide_restart(sc: Restart) -> activation.ActivationPlan:
    problems = activation.check_hellos(sc.hellos, len(sc.hellos))
    assert not problems, problems
    return activation.plan_activation(
        activation.ActivationFacts(
            parent=sc.parent,
            hellos=sc.hellos,
            committed_by_all=STEP,
            selection=Selection(None, (), STEP),
            restore_pin=None,
            world_size=len(sc.hellos),
        )
    )


# ---------------------------------------------------------------------- the certificate
def certify(parent: Certificate, plan: Any, quiescence: str, frontier: Frontier) -> tuple[Certificate, list[Violation]]:
    """Issue the plan's certificate, check every rule, encode it (header and chunks)."""
    with gc_paused():
        return _certify(parent, plan, quiescence, frontier)


def _certify(
    parent: Certificate, plan: Any, quiescence: str, frontier: Frontier
) -> tuple[Certificate, list[Violation]]:
    cert = issue(
        parent=parent,
        job_id=parent.job_id,
        members=plan.members,
        reason=plan.reason,
        frontier=frontier,
        quiescence=quiescence,
        quiescence_evidence=plan.quiescence_evidence,
        issued_by="bench",
        key=KEY,
        extra=plan.extra,
    )
    violations = check(cert, parent=parent, key=KEY, committed_by_all=STEP)
    encode_certificate(cert)
    cert.chunks()
    return cert, violations
