"""The zombie oracle (issue 23): a stale incarnation tries every sink after the next generation activated.

A member of generation 1 is evicted in place as fenced (its host lost: no report, silent to the
survivors' heartbeat), generation 2 activates without waiting for its lease, and then the stale
incarnation, still alive and still holding its lease, goes on doing what its code does: it commits
(the frontier record), coordinates (reports, a refusal, a certificate of its own), publishes a
snapshot, sends heartbeats and tries to join generation 2. Against a real etcd, each attempt is
refused or ignored and nothing becomes visible: what the next activation, a restore or a member
of generation 2 would read is exactly what it was before. docs/fencing.md gives the argument sink
by sink; each sink's check, removed from the code, makes its own assertion here fail (shown by hand
when this was written: listed in the closing note of issue 23).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from urllib.parse import urlsplit

import pytest

from gpuguard.examples.zombie import haunt, reader_view
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Incarnation, Member
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.switch import EvictionFacts, decide_eviction
from gpuguard.recovery.snapshots.store import list_snapshots
from tests.support.generation import KEY, child, genesis

pytestmark = pytest.mark.etcd


def _members(hosts: list[str]) -> tuple[Member, ...]:
    return tuple(Member(r, Incarnation(uuid.uuid4().hex, h, 4000 + r, 1.0 + r)) for r, h in enumerate(hosts))


@pytest.fixture
def switched(tmp_path, etcd_url):
    """Generation 1 on three hosts; rank 2's host is lost; generation 2 (ranks 0, 1) activated in
    place with rank 2 proved quiet by fencing, exactly as the coordinator decides it."""
    u = urlsplit(etcd_url)
    url = f"etcd://{u.hostname}:{u.port}/zombie-{uuid.uuid4().hex}"
    ledger = open_ledger(tmp_path, url, key=KEY)
    ledger.initialize(genesis())
    g1 = child(ledger.require_active(), _members(["h1", "h2", "h3"]), reason="start")
    ledger.activate(g1)
    assert ledger.record_frontier(1, 4, g1.members[0].incarnation.id, "barrier")
    z = g1.members[2].incarnation
    reports = {
        r: Report(1, r, g1.members[r].incarnation.id, 4000 + r, f"h{r + 1}", 5, {}, "no heartbeat", 0.0, {}, (2,))
        for r in (0, 1)
    }
    eviction = decide_eviction(
        EvictionFacts(
            1, g1.members, reports, "h1", {g1.members[0].incarnation.id: "running"}, {}, 0.1, 1.0, fenced_sinks=True
        )
    )
    assert eviction.dead == (2,) and not eviction.waiting  # at once: no grace, no lease wait
    assert eviction.proof[z.id].startswith("fenced")
    g2 = child(
        g1,
        g1.members[:2],
        step=4,
        reason="rank-failure",
        extra={"switch": "in-place", "quiescence_by": dict(eviction.proof)},
    )
    ledger.activate(g2)
    return tmp_path, url, ledger, g1, g2, z


def test_a_stale_incarnation_is_refused_by_every_sink_and_nothing_it_does_is_seen(switched):
    root, url, ledger, g1, g2, z = switched
    pytest.importorskip("torch")
    before = _view(root, url, ledger)
    out = haunt(root, url, rank=2, generation=1, key=KEY, rounds=2)  # the oracle the bench runs too
    assert (out.incarnation, out.generation, out.active) == (z.id, 1, 2)
    per_round = {"frontier": 2, "certificate": 1, "report": 1, "refusal": 1, "join": 1, "snapshot": 2, "heartbeat": 3}
    for sink, n in per_round.items():  # each sink's own check: removed, its own line here fails
        t = out.sink(sink)
        assert (sink, t.attempts, t.refused, t.visible) == (sink, 2 * n, 2 * n, 0), t
    assert "compare-and-swap" in out.sink("certificate").reasons  # the activation CAS, not the rules
    assert "does not admit" in out.sink("join").reasons
    assert (out.attempts, out.refused, out.visible, out.changed) == (22, 22, 0, ())
    # nothing a reader of generation 2 reads changed; the late snapshots are on disk but never chosen
    assert _view(root, url, ledger) == before
    assert [s.generation for s in list_snapshots(root)] == [1, 1]


def _view(root, url, ledger):
    coord = EtcdCoordination.from_url(url)
    try:
        return reader_view(ledger, coord, root, 1)
    finally:
        coord.close()


def test_fenced_quiescence_is_a_proof_the_rules_accept_and_a_live_process_never_is(switched):
    _, _, ledger, g1, g2, z = switched
    assert ledger.require_active() == g2
    assert g2.extra["quiescence_by"][z.id].startswith("fenced")
    # the same member seen alive on the coordinator's own host is never evicted as fenced
    facts = EvictionFacts(1, g1.members, {}, "h3", {z.id: "running"}, {}, 0.1, 1.0, fenced_sinks=True)
    assert 2 not in decide_eviction(facts).dead
    assert 2 in decide_eviction(replace(facts, waited_s=2.0)).killed  # on its host: killed, as before
