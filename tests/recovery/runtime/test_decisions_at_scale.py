"""The coordinators' pure decisions and the certificate they issue, at 50,000 ranks (issue 29 item 5).

Not a benchmark (bench/scale.py is): a guard against anything quadratic. At 50,000 ranks a linear
pass takes about a second on a loaded CPU; the membership test in a tuple that `admit_survivors` had
took about 40 s. The bound sits between the two."""

from __future__ import annotations

import time
import uuid

from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.certificate import check, issue
from gpuguard.generation.records import Frontier, Incarnation, Member
from gpuguard.recovery.runtime import activation, switch
from gpuguard.recovery.snapshots.store import Selection
from tests.support.generation import KEY, genesis

RANKS = 50_000
BOUND_S = 10.0


def _host(rank: int) -> str:
    return f"gpu-{rank // 8:05d}"


def _started(n: int, pid: int = 100_000) -> list[Member]:
    return [Member(r, Incarnation(uuid.uuid4().hex, _host(r), pid + r, 1.7e9 + r / 8)) for r in range(n)]


def _issue(parent, members, plan, quiescence, frontier):
    return issue(
        parent=parent,
        job_id=parent.job_id,
        members=members,
        reason=plan.reason,
        frontier=frontier,
        quiescence=quiescence,
        quiescence_evidence=plan.quiescence_evidence,
        issued_by="test",
        key=KEY,
        extra=plan.extra,
    )


def test_the_in_place_decision_and_its_certificate_are_linear_in_the_ranks():
    g1 = issue(
        parent=genesis(),
        job_id="job",
        members=_started(RANKS),
        reason="start",
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="t",
        key=KEY,
    )
    dead = set(range(24_000, 24_008))  # one replica (tp=8) on one host
    reports = {
        m.rank: Report(1, m.rank, m.incarnation.id, m.incarnation.pid, m.incarnation.host, 9, {9: "d" * 64}, "", 1.0)
        for m in g1.members
        if m.rank not in dead
    }
    facts = switch.EvictionFacts(
        generation=1,
        members=tuple(g1.members),
        reports=reports,
        host=_host(0),
        status={m.incarnation.id: "running" for m in g1.members[:8]},
        killed_before={},
        waited_s=1.0,
        grace_s=10.0,
        lease_expired=frozenset(g1.members[r].incarnation.id for r in dead),
    )
    layout = switch.Layout(dp=RANKS // 8, tp=8)
    t = time.perf_counter()
    assert switch.choose_coordinator(reports.keys(), ()) == 0
    assert len(switch.coordinator_probes(reports, g1.ranks, _host(0))) == 8
    ev = switch.decide_eviction(facts)
    adm = switch.admit_survivors(layout, ev)
    agreed = switch.agree_on_state([reports[r] for r in adm.kept], 9)
    plan = switch.plan_switch(
        switch.SwitchFacts(
            parent=g1,
            previous_layout=layout,
            layout=adm.layout,
            kept=adm.kept,
            eviction=ev,
            reports=reports,
            committed_by_all=9,
            frontier=9,
            manifest="",
            state_digest=agreed.digest,
            operator=False,
            phases={"detect": 1.0},
            since=1.0,
            coordinator_rank=0,
            coordinator_incarnation=g1.members[0].incarnation.id,
        )
    )
    decided = time.perf_counter() - t
    assert ev.dead == tuple(sorted(dead)) and len(plan.members) == RANKS - 8 and adm.layout.dp == RANKS // 8 - 1
    t = time.perf_counter()
    cert = _issue(g1, plan.members, plan, "proved", plan.frontier)
    assert check(cert, parent=g1, key=KEY, committed_by_all=9) == []
    certified = time.perf_counter() - t
    assert decided < BOUND_S and certified < BOUND_S, (decided, certified)


def test_the_restart_decision_and_its_certificate_are_linear_in_the_ranks():
    old = _started(RANKS)
    g1 = issue(
        parent=genesis(),
        job_id="job",
        members=old,
        reason="start",
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="t",
        key=KEY,
    )
    new = _started(RANKS, pid=300_000)
    hellos = tuple(
        activation.Hello(r, new[r].incarnation.to_dict(), _host(r), old_gone=(old[r].incarnation.id,))
        for r in range(RANKS)
    )
    t = time.perf_counter()
    assert activation.check_hellos(hellos, RANKS) == []
    plan = activation.plan_activation(
        activation.ActivationFacts(
            parent=g1,
            hellos=hellos,
            committed_by_all=9,
            selection=Selection(None, (), 9),
            restore_pin=None,
            world_size=RANKS,
        )
    )
    decided = time.perf_counter() - t
    assert plan.quiescence == "proved" and len(plan.members) == RANKS
    t = time.perf_counter()
    cert = _issue(g1, plan.members, plan, plan.quiescence, plan.choice.frontier)
    assert check(cert, parent=g1, key=KEY, committed_by_all=9) == []
    certified = time.perf_counter() - t
    assert decided < BOUND_S and certified < BOUND_S, (decided, certified)
