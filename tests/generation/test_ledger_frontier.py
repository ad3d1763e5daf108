"""Frontier records on both ledger backends: one record per generation, only ever raised, fenced in the write."""

from __future__ import annotations

import threading
import uuid
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.errors import RefusedError
from gpuguard.generation.ledger import FrontierRecord
from gpuguard.generation.ledger_open import open_ledger
from tests.support.generation import KEY, child, genesis, members


@pytest.fixture(params=["dir", "etcd"])
def where(request, tmp_path):
    """(job dir, ledger URL) of a fresh ledger whose generation 1 has 3 members."""
    url = None
    if request.param == "etcd":
        u = urlsplit(request.getfixturevalue("etcd_url"))
        url = f"etcd://{u.hostname}:{u.port}/frontier-{uuid.uuid4().hex}"
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    led.activate(child(led.require_active(), members(3)))
    return tmp_path, url


@pytest.fixture
def ledger(where):
    return open_ledger(*where, key=KEY)


def test_the_frontier_record_is_raised_never_lowered_and_proves_committed_by_all(ledger):
    g1 = ledger.require_active()
    who = g1.members[0].incarnation.id
    assert ledger.last_committed_by_all(1) is None  # nothing proved yet
    assert ledger.record_frontier(1, 10, who, "barrier")
    assert ledger.record_frontier(1, 7, who, "barrier")  # an older proof: kept as it is, not an error
    rec = ledger.frontier_record(1)
    assert rec is not None and (rec.step, rec.evidence, rec.by) == (10, "barrier", who)
    assert ledger.last_committed_by_all(1) == 10
    assert ledger.record_frontier(1, 20, g1.members[2].incarnation.id, "snapshot")
    assert ledger.last_committed_by_all(1) == 20


def test_a_frontier_record_is_fenced_for_a_stale_generation_or_a_stranger(ledger):
    g1 = ledger.require_active()
    before = ledger.fenced_count()
    assert not ledger.record_frontier(1, 5, "not-a-member", "barrier")
    ledger.activate(child(g1, members(2), step=0))
    assert not ledger.record_frontier(1, 9, g1.members[0].incarnation.id, "barrier")  # generation 1 is over
    assert ledger.frontier_record(1) is None and ledger.fenced_count() == before + 2


def test_the_frontier_bounds_the_next_certificate(ledger):
    g1 = ledger.require_active()
    ledger.record_frontier(1, 4, g1.members[0].incarnation.id, "barrier")
    with pytest.raises(RefusedError, match="frontier-committed"):
        ledger.activate(child(g1, members(2), step=6))
    ledger.activate(child(g1, members(2), step=4))


def test_racing_writers_leave_the_highest_step(ledger, where):
    """Six writers with their own handles (as rank 0's writer and in-place coordinators would be):
    each raise is a compare-and-swap, so no lower step ever overwrites a higher one."""
    who = ledger.require_active().members[0].incarnation.id
    done: list[bool] = []

    def raise_to(step: int) -> None:
        done.append(open_ledger(*where, key=KEY).record_frontier(1, step, who, "barrier"))

    threads = [threading.Thread(target=raise_to, args=(s,)) for s in (3, 9, 5, 8, 1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert done == [True] * 6 and ledger.frontier_record(1).step == 9


@settings(max_examples=200, deadline=None)
@given(
    gen=st.integers(0, 10**6),
    step=st.integers(0, 10**9),
    by=st.text(max_size=40),
    evidence=st.sampled_from(["barrier", "snapshot", "reports"]),
)
def test_a_frontier_record_round_trips_and_refuses_what_is_not_one(gen, step, by, evidence):
    rec = FrontierRecord(gen, step, by, evidence, 1.5)
    assert FrontierRecord.from_dict(rec.to_dict()) == rec
    for bad in (
        {**rec.to_dict(), "evidence": "hearsay"},
        {**rec.to_dict(), "step": -1},
        {**rec.to_dict(), "schema": "x"},
    ):
        with pytest.raises(ValueError):
            FrontierRecord.from_dict(bad)
