"""An etcd ledger, coordination and leases on a real 3-member etcd cluster that loses the member listed first."""

from __future__ import annotations

import threading
import time

import pytest

from gpuguard.generation.certificate import issue
from gpuguard.generation.job import init_job, issuer
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Frontier, Incarnation, Member
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.lease import LeaseTiming
from tests.support.etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EtcdCluster.start(tmp_path_factory.mktemp("etcd3"))
    yield c
    c.stop()


@pytest.mark.etcd
def test_the_ledger_and_a_lease_keep_working_when_the_first_listed_member_dies(cluster, tmp_path):
    # The member listed first, the one every client talks to first, is a follower: this test is the
    # client's failover. Killing the leader costs an election too (1-2 s at etcd's defaults), which
    # can outlast the 1 s between a due renewal (TTL/3) and the fence margin (TTL/2): the worker then
    # fences itself, as designed (CI saw it once, age 5.6 s, when the first member was the leader).
    leader = cluster.leader()
    assert leader is not None
    first = next(m for m in cluster.members if m is not leader)
    url = f"etcd://{cluster.endpoints(first)}/gpuguard-failover"
    init_job(tmp_path, url=url, job_id="failover")
    led = open_ledger(tmp_path, url)
    genesis = led.require_active()
    coord = EtcdCoordination.from_url(url, timeout=2.0)
    fenced: list[str] = []
    # TTL 6 s (the default): its fence margin of 3 s outlasts a leader election after the kill
    hb = coord.hold_lease("inc-a", {"rank": 0}, LeaseTiming(6.0), fenced.append)
    try:
        cluster.kill(first)  # the member every client talks to first
        t0 = time.monotonic()
        inc = Incarnation("inc-a", "h", 4242, 1.0)
        cert = issue(
            parent=genesis,
            job_id=genesis.job_id,
            members=(Member(0, inc),),
            reason="start",
            frontier=Frontier(0, ""),
            quiescence="proved",
            quiescence_evidence=("no previous members",),
            issued_by=f"test {issuer()}",
            key=led.key,
        )
        led.activate(cert)
        assert led.record_commit(1, 1, 0, "inc-a")
        assert open_ledger(tmp_path, url).require_active().generation == 1
        assert time.monotonic() - t0 < 10
        done = threading.Event()
        done.wait(3.5)  # more than TTL/2: the heartbeat must have renewed through another member
        assert hb.valid() and not fenced, (hb.age(), fenced)
        assert "inc-a" not in coord.expired(["inc-a"])
    finally:
        coord.close()
        led.close()
