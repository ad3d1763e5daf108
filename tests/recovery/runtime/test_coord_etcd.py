"""The in-place switch's etcd transport against a real etcd on loopback: fenced writes, leases, aborts, store."""

from __future__ import annotations

import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.inplace_files import Report
from gpuguard.recovery.runtime.coordination import DirCoordination, open_coordination
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.lease import LeaseTiming

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


@pytest.fixture
def coord(etcd_url):
    u = urlsplit(etcd_url)
    c = open_coordination("/nonexistent", f"etcd://{u.hostname}:{u.port}/coord-{uuid.uuid4().hex}")
    assert isinstance(c, EtcdCoordination)
    c.client.put(c._key("active"), "1")  # what the ledger says: generation 1 is active
    yield c
    c.close()


def _report(generation: int, rank: int = 0, inc: str = "inc0") -> Report:
    return Report(generation, rank, inc, 10, "h1", 4, {4: "d"}, "closed", time.time())


def test_the_directory_ledger_gets_the_directory_transport(tmp_path):
    assert isinstance(open_coordination(tmp_path, None), DirCoordination)
    assert open_coordination(tmp_path, "dir").kind == "dir"


def test_a_report_of_the_active_generation_lands_and_a_stale_one_is_fenced(coord):
    assert coord.write_report(_report(1))
    assert not coord.write_report(_report(0, 1, "zombie"))  # generation 0 is not active any more
    assert coord.fenced_writes == 1
    assert list(coord.read_reports(1)) == [0] and coord.read_reports(0) == {}


def test_a_lease_that_is_gone_fences_the_holders_reports_and_reads_as_expired(coord):
    fenced: list[str] = []
    hb = coord.hold_lease("inc0", {"rank": 0}, LeaseTiming(3.0), fenced.append)
    assert hb.valid() and coord.expired(["inc0", "never-held"]) == frozenset({"never-held"})
    assert coord.write_report(_report(1))
    hb.stop()
    coord.client.revoke(coord._lease)  # what expiry does, without waiting for the TTL
    assert coord.expired(["inc0"]) == frozenset({"inc0"})
    assert not coord.write_report(_report(1, 0, "inc0"))
    assert not fenced


def test_abort_requests_and_refusals_round_trip(coord):
    assert not coord.abort_requested(1)
    coord.request_abort(1, "test")
    time.sleep(0.25)  # aborts are read at most every ABORT_POLL_S
    assert coord.abort_requested(1) and not coord.abort_requested(2)
    assert coord.refusal(1) is None
    coord.record_refusal(1, {"generation": 1, "reason": "tp group lost a member"})
    assert coord.refusal(1)["reason"] == "tp group lost a member"


def test_the_group_store_is_served_by_rank_0_and_found_through_etcd(coord, etcd_url):
    other = EtcdCoordination.from_url(coord.url)
    got: dict[str, object] = {}

    def join() -> None:
        s = other.group_store(1, 1, 10.0)
        got["value"] = s.get("k")

    t = threading.Thread(target=join)
    t.start()
    store = coord.group_store(1, 0, 10.0)
    store.set("k", "v")
    t.join(15)
    assert got["value"] == b"v"
    with pytest.raises(RuntimeError, match="no longer active"):
        coord.group_store(0, 0, 1.0)  # generation 0 is not active: no store is published for it
    other.close()
