"""Per-host aggregation of the in-place reports (recovery/runtime/host_reports.py) against a real etcd:
the coordinator reads one key per host, decides exactly what the per-rank keys decide, a stale
aggregator is fenced, a dead one is replaced by its next host-mate, and a report is never taken back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.inplace_files import HOST_BLOCK, HostReport, Report, merge_reports
from gpuguard.generation.records import Incarnation, Member
from gpuguard.recovery.runtime import switch
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.host_reports import blocks
from gpuguard.recovery.runtime.lease import LeaseTiming

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

TIMING = LeaseTiming(3.0)


def _report(rank: int, inc: str, host: str, *, generation: int = 1, pid: int | None = None) -> Report:
    return Report(generation, rank, inc, pid or os.getpid(), host, 7, {7: "d" * 64}, "closed", 1.0 + rank)


def _per_rank_reading(reports: list[Report], generation: int) -> dict[int, Report]:
    """What reading every report on its own key gives (the code before aggregation): keys
    `<rank>-<incarnation>` in key order, the last one under a rank kept."""
    out: dict[int, Report] = {}
    for rep in sorted(reports, key=lambda r: f"{r.rank}-{r.incarnation_id}".encode()):
        if rep.generation == generation:
            out[rep.rank] = rep
    return out


incs = st.text("0123456789abcdef", min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), incs, st.integers(0, 3), st.booleans(), st.integers(1, 2)), max_size=60))
def test_aggregated_and_per_rank_records_merge_to_what_per_rank_keys_read(rows):
    # one process per (rank, incarnation) of a generation: one key, one host
    rows = list({(r, inc, g): (r, inc, h, agg, g) for r, inc, h, agg, g in reversed(rows)}.values())
    reports = [_report(r, inc, f"h{h}", generation=g) for r, inc, h, _, g in rows]
    aggregated = [rep for rep, (*_, agg, _) in zip(reports, rows, strict=True) if agg]
    per_rank = [rep for rep, (*_, agg, _) in zip(reports, rows, strict=True) if not agg]
    host_reports = [
        HostReport(rep[0].generation, host, block, 0, "x", tuple(rep))
        for (host, gen), mine in _by_host_gen(aggregated).items()
        for block, rep in blocks(mine).items()
    ]
    for h in host_reports:
        assert HostReport.from_dict(h.to_dict()) == h  # the wire format round-trips
    assert merge_reports(1, per_rank, host_reports) == _per_rank_reading(reports, 1)


def _by_host_gen(reports: list[Report]) -> dict[tuple[str, int], list[Report]]:
    out: dict[tuple[str, int], list[Report]] = {}
    for r in reports:
        out.setdefault((r.host, r.generation), []).append(r)
    return out


def test_a_host_report_of_another_host_or_block_is_refused():
    good = HostReport(1, "h1", 0, 0, "a", (_report(0, "a", "h1"), _report(3, "b", "h1")))
    assert HostReport.from_dict(good.to_dict()) == good
    for bad in (
        lambda: HostReport(1, "h1", 0, 0, "a", (_report(0, "a", "h2"),)),  # another host's report
        lambda: HostReport(1, "h1", 0, 0, "a", (_report(HOST_BLOCK, "a", "h1"),)),  # another block's
        lambda: HostReport(2, "h1", 0, 0, "a", (_report(0, "a", "h1"),)),  # another generation's
    ):
        with pytest.raises(ValueError):
            bad()
    doc = good.to_dict()
    doc["block"] = 1  # rows of block 0 in a record of block 1
    with pytest.raises(ValueError):
        HostReport.from_dict(doc)


def _mutations(doc):
    """The record with one part of one row, or the string table, broken."""
    for i in range(9):
        for junk in (None, True, -1, "x", [], {}, 1.5, [[0, 99]]):
            row = [*doc["reports"][0]]
            row[i] = junk
            yield {**doc, "reports": [row, *doc["reports"][1:]]}
    yield {**doc, "strings": [1]}
    yield {**doc, "reports": [doc["reports"][0][:8]]}


def test_a_broken_row_is_refused_with_an_error_the_reader_skips():
    """What `coordination_etcd._host_report` catches (a record not made), never another exception."""
    good = HostReport(1, "h1", 0, 0, "a", (_report(0, "a", "h1"), _report(3, "b", "h1")))
    doc = good.to_dict()
    for bad in _mutations(doc):
        try:
            got = HostReport.from_dict(bad)
        except (ValueError, KeyError, TypeError):
            continue
        assert HostReport.from_dict(got.to_dict()) == got  # accepted (a time of -1, say): a record as any other


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, HOST_BLOCK - 1),
            incs,
            st.dictionaries(st.integers(0, 50), st.sampled_from(["d" * 64, "e" * 64]), max_size=3),
            st.one_of(st.none(), st.integers(0, 10**6)),
            st.sampled_from(["", "RuntimeError: Connection closed by peer", "operator abort"]),
            st.lists(st.integers(0, 1000), max_size=3),
        ),
        max_size=HOST_BLOCK,
        unique_by=lambda t: t[0],
    )
)
def test_the_compact_record_round_trips_every_field(rows):
    reps = tuple(
        Report(1, r, inc, 1000 + r, "h", step, digests, failure, 1.5 + r, {}, tuple(sorted(sus)))
        for r, inc, digests, step, failure, sus in sorted(rows)
    )
    h = HostReport(1, "h", 0, 0, "x", reps)
    back = HostReport.from_dict(json.loads(json.dumps(h.to_dict())))
    assert back == h and [r.to_dict() for r in back.reports] == [r.to_dict() for r in reps]


# ---------------------------------------------------------------------- against etcd
@pytest.fixture
def ledger(etcd_url):
    """A fresh prefix with generation 1 active; every coordination opened on it is closed after."""
    u = urlsplit(etcd_url)
    url = f"etcd://{u.hostname}:{u.port}/agg-{uuid.uuid4().hex}"
    opened: list[EtcdCoordination] = []

    def open_one(incarnation: str | None = None) -> EtcdCoordination:
        c = EtcdCoordination.from_url(url)
        opened.append(c)
        if incarnation is not None:  # with a host lease: its reports are aggregated
            c.hold_lease(incarnation, {"rank": 0}, TIMING, lambda why: None)
        return c

    first = open_one()
    first.client.put(first._key("active"), "1")
    yield open_one
    for c in opened:
        c.close()
    first.client.delete(first.prefix, "clean-up", prefix=True)


def _on_host(monkeypatch, tmp_path, name: str) -> None:
    """Simulate a host of its own: its own host-lease directory (host_lease.default_base)."""
    base = tmp_path / name
    base.mkdir(exist_ok=True)
    monkeypatch.setenv("GPUGUARD_HOST_LEASE_DIR", str(base))


def test_one_key_per_host_and_the_same_decision_as_per_rank_keys(ledger, monkeypatch, tmp_path):
    hosts = {"hA": [0, 1, 2], "hB": [3, 4, 5], "hC": [6, 7]}  # hC: no host lease, its ranks write their own keys
    incs = {r: f"inc{r}" for rs in hosts.values() for r in rs}
    aggregated, reader = [], ledger()
    for host, ranks in hosts.items():
        _on_host(monkeypatch, tmp_path, host)
        for r in ranks:
            c = ledger(incs[r]) if host != "hC" else ledger()
            assert c.write_report(_report(r, incs[r], host))
            aggregated.append(c)
    for c in aggregated:
        assert c.aggregate(1)  # each rank's pass of the switch loop
    got = reader.read_reports(1)
    assert reader.keys_read == 2 + 2  # hA's and hB's host keys, hC's two per-rank keys
    expected = [_report(r, incs[r], h) for h, rs in hosts.items() for r in rs]
    assert got == _per_rank_reading(expected, 1)

    # the same reports, every one on its own key (no host lease anywhere), under another prefix
    plain = EtcdCoordination.from_url(reader.url + "-plain")
    try:
        plain.client.put(plain._key("active"), "1")
        for rep in expected:
            assert plain.write_report(rep)
        assert plain.read_reports(1) == got and plain.keys_read == 8
        members = tuple(Member(r, Incarnation(incs[r], h, os.getpid(), 1.0)) for h, rs in hosts.items() for r in rs)
        facts = {
            "generation": 1,
            "members": members + (Member(8, Incarnation("lost", "hD", 1, 1.0)),),
            "host": "elsewhere",
            "status": {},
            "killed_before": {},
            "waited_s": 30.0,
            "grace_s": 10.0,
            "fenced_sinks": True,
        }
        decided = switch.decide_eviction(switch.EvictionFacts(reports=got, **facts))
        assert decided == switch.decide_eviction(switch.EvictionFacts(reports=plain.read_reports(1), **facts))
        assert decided.kept == tuple(range(8)) and decided.dead == (8,)
    finally:
        plain.client.delete(plain.prefix, "clean-up", prefix=True)
        plain.close()


def test_an_aggregator_of_a_generation_no_longer_active_is_fenced(ledger, monkeypatch, tmp_path):
    _on_host(monkeypatch, tmp_path, "hA")
    a, b, reader = ledger("inc0"), ledger("inc1"), ledger()
    assert a.write_report(_report(0, "inc0", "hA"))  # rank 0 aggregates: published at once
    assert list(reader.read_reports(1)) == [0]
    reader.client.put(reader._key("active"), "2")  # generation 2 is certified meanwhile
    assert b.write_report(_report(1, "inc1", "hA"))  # left for rank 0, which is the aggregator
    assert not a.aggregate(1) and a.fenced_writes == 1  # its write compares P/active == 1
    assert list(reader.read_reports(1)) == [0]


def test_the_next_reporter_publishes_when_the_aggregator_is_gone(ledger, monkeypatch, tmp_path):
    _on_host(monkeypatch, tmp_path, "hA")
    a, reader = ledger("inc1"), ledger()
    assert a._hostdir is not None
    gone_pid = _report_then_exit(a._hostdir.path, _report(0, "inc0", "hA"))  # rank 0 reported, then died
    assert a.write_report(_report(1, "inc1", "hA"))  # rank 1 is the lowest reporter that runs
    got = reader.read_reports(1)
    assert sorted(got) == [0, 1] and reader.keys_read == 1
    assert gone_pid != os.getpid()


CHILD = """
import json, os, sys
from pathlib import Path
from gpuguard.foundation.inplace_files import Report
from gpuguard.recovery.runtime.host_lease import HostDir
from gpuguard.recovery.runtime.host_reports import HostReports
HostReports(HostDir(Path(sys.argv[1]))).put(Report.from_dict(json.loads(sys.argv[2])))
print(os.getpid())
"""


def _report_then_exit(hostdir, report: Report) -> int:
    """A real process that leaves its report in the host directory and exits (reaped: gone)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(hostdir), json.dumps(report.to_dict())],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout)


def test_a_published_report_is_never_taken_back_by_an_aggregator_that_froze(ledger, monkeypatch, tmp_path):
    """Between its read of the host key and its write, another aggregator of the host published
    more (it froze; the next reporter took over): the mod-revision compare refuses the older set,
    and its next pass keeps both."""
    _on_host(monkeypatch, tmp_path, "hA")
    a, reader = ledger("inc0"), ledger()
    key = a.host_key(1, 0, "hA")
    newer = HostReport(1, "hA", 0, 5, "inc5", (_report(5, "inc5", "hA"),))
    real_get = a.client.get

    def get_then_other_publishes(k, what="get"):
        kv = real_get(k, what)
        if k == key and kv is None:
            reader.client.put(key, json.dumps(newer.to_dict()))
        return kv

    monkeypatch.setattr(a.client, "get", get_then_other_publishes)
    assert not a.write_report(_report(0, "inc0", "hA"))  # its read is stale now: refused
    assert sorted(reader.read_reports(1)) == [5]
    assert a.aggregate(1)  # the next pass reads rank 5's report and keeps it
    assert sorted(reader.read_reports(1)) == [0, 5]


def test_a_host_directory_that_cannot_take_the_report_sends_it_on_its_own_key(ledger, monkeypatch, tmp_path):
    _on_host(monkeypatch, tmp_path, "hA")
    a, reader = ledger("inc0"), ledger()
    assert a._host_reports is not None
    os.close(os.open("g1", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=a._host_reports.fd))  # not a directory
    assert a.write_report(_report(0, "inc0", "hA"))
    assert list(reader.read_reports(1)) == [0]
    assert reader.client.get(reader.report_key(_report(0, "inc0", "hA"))) is not None  # the per-rank key
