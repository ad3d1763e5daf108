"""The etcd ledger against a real etcd on loopback: CAS transactions, fencing, races, timeouts."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.errors import RefusedError, UnavailableError
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.verify import verify_ledger
from tests.support.cli import free_port
from tests.support.generation import KEY, child, genesis, members
from tests.support.ledger_race import race

pytestmark = pytest.mark.etcd


def etcd_ledger_url(etcd_url: str) -> str:
    u = urlsplit(etcd_url)
    return f"etcd://{u.hostname}:{u.port}/test-{uuid.uuid4().hex}"


@pytest.fixture
def url(etcd_url):
    return etcd_ledger_url(etcd_url)


@pytest.fixture
def ledger(tmp_path, url):
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    return led


def test_activation_is_a_compare_and_swap_transaction(ledger):
    g0 = ledger.require_active()
    a, b = child(g0, members(2)), child(g0, members(2))
    ledger.activate(a)
    with pytest.raises(RefusedError, match="compare-and-swap"):
        ledger.activate(b)
    # a stale view cannot win either: the transaction compares the generation key and active revision
    assert ledger._create(1, b.canonical()) is False
    assert ledger.refusals()[-1].violations[0].rule == "compare-and-swap"
    assert [c.generation for c in ledger.history()] == [0, 1]
    assert ledger.require_active() == a


def test_commits_frontier_fencing_and_refusals(ledger):
    g1 = child(ledger.require_active(), members(2))
    ledger.activate(g1)
    a, b = g1.members
    assert ledger.record_commit(1, 7, 0, a.incarnation.id)
    assert ledger.record_commit(1, 5, 1, b.incarnation.id)
    assert ledger.last_committed_by_all(1) == 5
    with pytest.raises(RefusedError, match="frontier-committed"):
        ledger.activate(child(g1, g1.members, step=7))
    ledger.activate(child(g1, g1.members, step=5))
    assert ledger.record_commit(1, 8, 0, a.incarnation.id) is False
    assert ledger.fenced_count() == 1 and ledger.last_committed_by_all(1) == 5
    assert ledger.refusals()[-1].violations[0].rule == "frontier-committed"
    assert verify_ledger(ledger, KEY).ok


def test_transactional_fencing_closes_the_window(ledger):
    """Even a writer that passed the generation check before G+1 activated is rejected in the txn."""
    g1 = child(ledger.require_active(), members(1))
    ledger.activate(g1)
    ledger.activate(child(g1, g1.members, step=0))
    assert ledger._append_if_active(1, "commits-1", {"late": 1}) is False
    assert ledger.commits(1) == ([], 0)


def test_tampered_value_in_etcd_is_named(ledger):
    g1 = child(ledger.require_active(), members(1))
    ledger.activate(g1)
    raw = bytearray(ledger.raw(1))
    raw[30] ^= 0x04
    ledger.client.put(ledger._gen_key(1), bytes(raw))
    rep = verify_ledger(ledger, KEY)
    assert not rep.ok and "gen/000000000001" in rep.findings[0].record


def test_unreachable_etcd_is_a_clear_error_within_the_timeout(tmp_path):
    dead = open_ledger(tmp_path, f"etcd://127.0.0.1:{free_port()}/x", key=KEY, timeout=1.0)
    t = time.monotonic()
    with pytest.raises(UnavailableError, match="unreachable"):
        dead.initialize(genesis())
    assert time.monotonic() - t < 3


def test_silent_etcd_times_out_and_nothing_is_written(tmp_path):
    """A server that accepts and never answers: the call gives up within its timeout."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        led = open_ledger(tmp_path, f"etcd://127.0.0.1:{srv.getsockname()[1]}/x", key=KEY, timeout=1.0)
        t = time.monotonic()
        with pytest.raises(UnavailableError):
            led.activate(genesis())
        assert time.monotonic() - t < 4
        assert not any(tmp_path.iterdir())
    finally:
        stop.set()
        th.join(timeout=2)
        for c in conns:
            c.close()
        srv.close()


def test_sixteen_racers_one_winner_per_round(tmp_path, url):
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    rounds = 100
    winners = race(tmp_path, url, racers=16, rounds=rounds)
    assert winners == {g: 1 for g in range(rounds)}
    fresh = open_ledger(tmp_path, url, key=KEY)
    assert fresh.require_active().generation == rounds and verify_ledger(fresh, KEY).ok
