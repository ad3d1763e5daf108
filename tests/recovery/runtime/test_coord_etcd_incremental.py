"""The coordinator's reads of reports and lease keys, later passes incremental (foundation.etcd_mirror),
against a real etcd: after any sequence of report writes, rewrites, malformed records, deletions and
lease keys that come and go, the long-lived reader's answer equals a fresh reader's full read; and
the survivor that reads only the lowest blocks and their lease keys (`lowest_live_reporter`) finds
itself the coordinator exactly when the full read names it."""

from __future__ import annotations

import json
import os
import socket
import uuid
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.identity import own_start_time
from gpuguard.foundation.inplace_files import HOST_BLOCK, HostReport, Report
from gpuguard.generation.records import Incarnation
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.switch_coordinator import coordinator_of, lowest_live_reporter

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]

INCS = ["a1", "b2", "c3"]
IDS = [f"inc{i}" for i in range(12)]
PADDING = [f"never{i}" for i in range(140)]  # more than 127 ids: the lease mirror, not the ids' own keys


def _report(rank: int, inc: str, host: str, step: int, generation: int = 1) -> Report:
    return Report(generation, rank, inc, 100 + rank, host, step, {step: "d" * 64}, "closed", 1.0)


report_op = st.one_of(
    # a rank's own key: (kind, rank, incarnation, step, generation in the record)
    st.tuples(st.just("rank"), st.integers(0, 9), st.sampled_from(INCS), st.integers(1, 3), st.integers(1, 2)),
    # a host's aggregated record of block 0: ranks of that host, reported at `step`
    st.tuples(st.just("host"), st.integers(0, 2), st.sampled_from(INCS), st.integers(1, 3), st.integers(1, 2)),
    st.tuples(st.just("junk"), st.integers(0, 9), st.sampled_from(INCS), st.just(0), st.just(1)),
    st.tuples(st.just("delete"), st.integers(0, 9), st.sampled_from(INCS), st.just(0), st.just(1)),
    st.tuples(st.just("delete-host"), st.integers(0, 2), st.just(""), st.just(0), st.just(1)),
)
lease_op = st.tuples(st.sampled_from(["put", "delete"]), st.sampled_from(IDS))


@pytest.fixture(scope="module")
def where(etcd_url):
    u = urlsplit(etcd_url)
    return f"etcd://{u.hostname}:{u.port}"


@settings(max_examples=50, deadline=None)
@given(
    rounds=st.lists(st.tuples(st.lists(report_op, max_size=5), st.lists(lease_op, max_size=4)), min_size=1, max_size=5)
)
def test_every_later_read_equals_a_fresh_full_read(where, rounds):
    url = f"{where}/incr-{uuid.uuid4().hex}"
    coord = EtcdCoordination.from_url(url)
    try:
        for reports, leases in [([], []), *rounds]:
            for kind, n, inc, step, gen in reports:
                if kind == "rank":
                    rep = _report(n, inc, f"h{n % 3}", step, gen)
                    coord.client.put(coord.report_key(rep), json.dumps(rep.to_dict()))
                elif kind == "host":
                    reps = tuple(_report(r, inc, f"h{n}", step, gen) for r in range(10) if r % 3 == n)
                    doc = HostReport(gen, f"h{n}", 0, reps[0].rank, inc, reps)
                    coord.client.put(coord.host_key(1, 0, f"h{n}"), json.dumps(doc.to_dict()))
                elif kind == "junk":
                    coord.client.put(coord.report_key(_report(n, inc, "h0", 1)), b"{not json")
                elif kind == "delete":
                    coord.client.delete(coord.report_key(_report(n, inc, "h0", 1)))
                else:
                    coord.client.delete(coord.host_key(1, 0, f"h{n}"))
            for kind, inc in leases:
                if kind == "put":
                    coord.client.put(coord._key("lease", inc), "{}")
                else:
                    coord.client.delete(coord._key("lease", inc))
            got_reports, got_expired = coord.read_reports(1), coord.expired(IDS + PADDING)
            fresh = EtcdCoordination.from_url(url)
            try:
                assert got_reports == fresh.read_reports(1)
                assert got_expired == fresh.expired(IDS + PADDING)
                assert got_expired & set(IDS) == coord.expired(IDS)  # few ids: read on their own keys
            finally:
                fresh.close()
    finally:
        coord.client.delete(coord.prefix + "/", prefix=True)
        coord.close()


def test_a_later_pass_reads_only_the_records_written_since(where):
    url = f"{where}/incr-{uuid.uuid4().hex}"
    coord = EtcdCoordination.from_url(url)
    try:
        for h in range(40):
            reps = tuple(_report(h * 8 + i, "a1", f"h{h}", 3) for i in range(8))
            coord.client.put(
                coord.host_key(1, h * 8 // 64, f"h{h}"),
                json.dumps(HostReport(1, f"h{h}", h * 8 // 64, h * 8, "a1", reps).to_dict()),
            )
        assert len(coord.read_reports(1)) == 320 and coord.keys_read == 40
        assert len(coord.read_reports(1)) == 320 and coord.keys_read == 0
        late = _report(999, "z9", "h99", 3)
        coord.client.put(coord.report_key(late), json.dumps(late.to_dict()))
        got = coord.read_reports(1)
        assert len(got) == 321 and got[999] == late and coord.keys_read == 1
    finally:
        coord.client.delete(coord.prefix + "/", prefix=True)
        coord.close()


LOCAL = socket.gethostname()
reporter = st.tuples(
    st.integers(0, 199),  # rank: blocks 0..3
    st.sampled_from([LOCAL, "ha", "hb"]),
    st.booleans(),  # alive: its process runs (this host), its lease key is there (another)
    st.sampled_from(["host", "rank", "misplaced"]),  # in its host's record, on its own key, or under a wrong key
    st.sampled_from(INCS),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(reporter, max_size=25), st.integers(1, 4))
def test_who_coordinates_read_block_by_block_is_who_the_full_read_names(where, rows, blocks_alone):
    url = f"{where}/who-{uuid.uuid4().hex}"
    coord = EtcdCoordination.from_url(url)
    me = own_start_time()
    members: dict[int, Incarnation] = {}
    records: dict[tuple[str, int, str], list[Report]] = {}
    try:
        for rank, host, alive, via, inc in rows:
            inc_id = f"{inc}r{rank}"
            rep = Report(1, rank, inc_id, os.getpid(), host, 3, {3: "d"}, "closed", 1.0)
            if host == LOCAL:
                members[rank] = Incarnation(inc_id, host, os.getpid(), me if alive else 1.0)
            elif alive:
                coord.client.put(coord._key("lease", inc_id), "{}")
            if via == "rank":
                coord.client.put(coord.report_key(rep), json.dumps(rep.to_dict()))
            else:
                records.setdefault((host, rank // HOST_BLOCK, via), []).append(rep)
        for (host, block, via), reps in records.items():
            mine = {r.rank: r for r in reps}  # one report a rank in a record
            doc = HostReport(1, host, block, min(mine), "agg", tuple(mine[r] for r in sorted(mine)))
            key = coord.host_key(1, block + (1 if via == "misplaced" else 0), host)
            coord.client.put(key, json.dumps(doc.to_dict()))
        full = coordinator_of(coord, coord.read_reports(1), members, LOCAL)
        for upto in sorted({0, 199, *(r[0] for r in rows)}):
            cheap = EtcdCoordination.from_url(url)  # a survivor that never read everything
            try:
                got = lowest_live_reporter(cheap, 1, members, LOCAL, upto, blocks_alone=blocks_alone)
            finally:
                cheap.close()
            assert (got == upto) == (full == upto), (upto, got, full)
            if full is not None and full <= upto:
                assert got == full
    finally:
        coord.client.delete(coord.prefix + "/", prefix=True)
        coord.close()
