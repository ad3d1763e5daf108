"""Certificates of schema /2: a small signed header, the member table and the body in content-addressed
chunks beside it (docs/formats/certificate.md). Round trips on both ledgers, the chunking as a property,
sharing between generations, a missing or altered chunk refused by name, old /1 certificates still read."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.errors import DataError
from gpuguard.foundation.etcd import EtcdRequestTooLarge
from gpuguard.generation.canonical import parse_canonical
from gpuguard.generation.certificate import issue
from gpuguard.generation.chunks import CHUNK_MAX_BYTES
from gpuguard.generation.keys import sign
from gpuguard.generation.ledger import encode_certificate
from gpuguard.generation.ledger_dir import DirectoryLedger
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.members import MemberTable, decode_chunk, split_members
from gpuguard.generation.records import (
    CERTIFICATE_SCHEMA,
    INLINE_SCHEMA,
    Certificate,
    Frontier,
    Incarnation,
    Member,
)
from gpuguard.generation.verify import verify_ledger
from tests.generation.test_ledger_etcd import etcd_ledger_url
from tests.support.generation import KEY, child, chunk_store, genesis, members


def many(n: int, start: int = 0) -> list[Member]:
    """`n` members on 8 ranks a host, ids as random as a real job's, host names as long as a cluster's."""
    return [
        Member(
            r, Incarnation(uuid.uuid4().hex, f"gpu-{r // 8:05d}.rack{r // 256:03d}.example", 1000 + r, 1.7e9 + r / 8)
        )
        for r in range(start, n)
    ]


def renumbered(kept: list[Member]) -> list[Member]:
    return [Member(i, m.incarnation) for i, m in enumerate(kept)]


@pytest.fixture
def dir_ledger(tmp_path) -> DirectoryLedger:
    led = open_ledger(tmp_path, key=KEY)
    assert isinstance(led, DirectoryLedger)
    led.initialize(genesis())
    return led


# ---------------------------------------------------------------------- the format
def test_the_signed_header_stays_small_and_binds_every_part():
    big = many(10_240)
    evidence = [f"rank {m.rank} incarnation {m.incarnation.id}: pid {m.incarnation.pid} gone" for m in big]
    g1 = issue(
        parent=genesis(),
        job_id="job",
        members=big,
        reason="start",
        frontier=Frontier(0),
        quiescence="proved",
        quiescence_evidence=evidence,
        issued_by="test",
        key=KEY,
        extra={"quiescence_by": {m.incarnation.id: "process gone" for m in big}},
    )
    header = encode_certificate(g1)
    assert len(header) < 8 << 10, len(header)  # 10,240 members, 1.6 MB of evidence and proofs: a few KiB
    doc = parse_canonical(header.rstrip(b"\n"))
    assert doc["schema"] == CERTIFICATE_SCHEMA and not {"members", "extra", "admitted"} & set(doc)
    assert sum(c["count"] for c in doc["member_chunks"]) == 10_240 and len(doc["body_chunks"]) >= 3
    assert all(len(b.data) <= CHUNK_MAX_BYTES for b in g1.chunks())
    # every part is bound by the signature: one changed line of evidence, one changed member
    assert replace(g1, quiescence_evidence=[*evidence[:-1], "x"]).signing_bytes() != g1.signing_bytes()
    moved = [*big[:-1], Member(10_239, replace(big[-1].incarnation, pid=1))]
    assert replace(g1, members=moved).signing_bytes() != g1.signing_bytes()


def test_round_trip_through_the_chunks_keeps_every_field(dir_ledger):
    g1 = child(
        dir_ledger.require_active(),
        members(5),
        extra={"switch": "in-place", "rank_map": {"3": 2}, "phases": {"abort_s": 0.25}},
    )
    dir_ledger.activate(g1)
    back = open_ledger(dir_ledger.root.parent, key=KEY).require_active()
    assert not back.member_table.loaded  # walking the chain read no member chunk
    assert back == g1 and back.digest() == g1.digest()
    assert tuple(back.members) == tuple(g1.members) and back.ranks == g1.ranks
    assert back.admitted == g1.admitted and back.quiescence_evidence == g1.quiescence_evidence
    assert dict(back.extra) == dict(g1.extra) and back.extra["phases"]["abort_s"] == 0.25
    assert back.expanded_dict() == g1.expanded_dict()


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(0, 300),
    max_members=st.integers(1, 64),
    mask=st.sampled_from([0, 1, 3, 7, 31]),
    max_bytes=st.integers(60, 4000),
    host=st.text(min_size=1, max_size=40),
    gaps=st.lists(st.integers(-3, 5), max_size=300),
)
def test_chunking_round_trips_within_its_limits(n, max_members, mask, max_bytes, host, gaps):
    """Any table (unsorted, duplicate or negative ranks included: the rules refuse those, the format
    must still carry them), any limits: the chunks decode to exactly the table, in order."""
    rank, table = 0, []
    for i in range(n):
        rank += gaps[i] if i < len(gaps) else 1
        table.append(Member(rank, Incarnation(f"id{i}", host, i, 1.0 + i / 3, None if i % 2 else "GPU-x")))
    chunks = split_members(table, max_members=max_members, max_bytes=max_bytes, mask=mask)
    back = [m for ref, b in chunks for m in decode_chunk(ref, b.data)]
    assert back == table
    for ref, b in chunks:
        assert 1 <= ref.count <= max_members and (len(b.data) <= max_bytes or ref.count == 1)
    stored = MemberTable.stored([r for r, _ in chunks], {b.sha256: b.data for _, b in chunks}.get, "test")
    assert len(stored) == n and tuple(stored) == tuple(table)


@settings(max_examples=40, deadline=None)
@given(replica=st.integers(0, 4999 // 8 - 1), seed=st.integers(0, 2**32))
def test_dropping_one_replica_rewrites_one_or_two_chunks(replica, seed):
    """Content-defined boundaries and ranks as offsets: an in-place switch that drops one replica and
    renumbers the rest densely shares every chunk but the one around the hole (two when the replica
    straddles a boundary)."""
    ids = uuid.UUID(int=seed).hex
    table = [Member(r, Incarnation(f"{ids}-{r}", f"n{r // 8}", r, 1.0)) for r in range(5000)]
    limits = {"max_members": 512, "mask": 63}
    before = {b.sha256 for _, b in split_members(table, **limits)}
    kept = renumbered(table[: replica * 8] + table[replica * 8 + 8 :])
    after = [b.sha256 for _, b in split_members(kept, **limits)]
    assert len([d for d in after if d not in before]) <= 2


def test_a_switch_at_100000_members_shares_all_but_one_or_two_chunks():
    g0 = genesis()
    table = many(100_000)
    g1 = child(g0, table)
    g2 = child(g1, renumbered(table[:40_000] + table[40_008:]))
    new = set(r.sha256 for r in g2.member_table.refs) - set(r.sha256 for r in g1.member_table.refs)
    assert len(g1.member_table.refs) >= 25 and len(new) <= 2


# ---------------------------------------------------------------------- damage
def _member_chunk(ledger: DirectoryLedger, generation: int) -> Path:
    cert = open_ledger(ledger.root.parent, key=KEY).get(generation)
    return ledger.chunk_path(cert.member_table.refs[0].sha256)


@pytest.mark.parametrize("damage", ["flip", "delete", "swap"])
def test_a_missing_or_altered_chunk_is_one_clear_error_and_a_verify_finding(dir_ledger, damage):
    g1 = child(dir_ledger.require_active(), members(3))
    dir_ledger.activate(g1)
    path = _member_chunk(dir_ledger, 1)
    sha = path.name
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "delete":
        path.unlink()
    else:  # another chunk's bytes under this name
        path.write_bytes(dir_ledger.chunk_path(g1.body_refs[0]).read_bytes())
    fresh = open_ledger(dir_ledger.root.parent, key=KEY)
    cert = fresh.require_active()  # the header verifies: the chain walk reads no chunk
    with pytest.raises(DataError, match=f"chunk {sha} (is missing|does not match its digest)") as err:
        list(cert.members)
    assert "gen-1.json" in str(err.value)
    rep = verify_ledger(fresh, KEY)
    assert not rep.ok
    bad = [f for f in rep.findings if f.rule == "encoding"]
    assert bad and sha in bad[0].message and bad[0].record.endswith("gen-1.json"), rep.findings


def test_every_single_byte_flip_of_a_member_chunk_is_caught(dir_ledger):
    dir_ledger.activate(child(dir_ledger.require_active(), members(2)))
    path = _member_chunk(dir_ledger, 1)
    orig = path.read_bytes()
    for i in range(0, len(orig), 3):
        data = bytearray(orig)
        data[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(data))
        assert not verify_ledger(open_ledger(dir_ledger.root.parent, key=KEY), KEY).ok, i
    path.write_bytes(orig)
    assert verify_ledger(open_ledger(dir_ledger.root.parent, key=KEY), KEY).ok


def test_activation_after_a_parent_whose_chunk_is_gone_is_refused_clearly(dir_ledger):
    g1 = child(dir_ledger.require_active(), members(2))
    dir_ledger.activate(g1)
    _member_chunk(dir_ledger, 1).unlink()
    fresh = open_ledger(dir_ledger.root.parent, key=KEY)
    with pytest.raises(DataError, match="is missing"):
        fresh.activate(child(fresh.require_active(), members(2)))
    assert fresh.generations() == [0, 1]


# ---------------------------------------------------------------------- old certificates
def test_old_inline_certificates_still_read_verify_and_parent_new_ones(dir_ledger):
    """A chain written before /2: generation 1 as /1 (members inline), then a /2 child."""
    g0 = dir_ledger.require_active()
    old = replace(child(g0, members(3)), schema=INLINE_SCHEMA)
    old = old.with_signature(sign(KEY, old.signing_bytes()))
    assert dir_ledger._create(1, encode_certificate(old))
    raw = (dir_ledger.root / "gen-1.json").read_bytes()
    assert b'"members":[{' in raw and b"member_chunks" not in raw
    fresh = open_ledger(dir_ledger.root.parent, key=KEY)
    assert fresh.require_active() == old and tuple(fresh.require_active().members) == tuple(old.members)
    new = child(fresh.require_active(), fresh.require_active().members)  # same members: none admitted
    fresh.activate(new)
    assert new.schema == CERTIFICATE_SCHEMA and new.admitted == ()
    assert verify_ledger(open_ledger(dir_ledger.root.parent, key=KEY), KEY).ok


def test_a_header_naming_chunks_of_the_wrong_shape_is_refused():
    d = child(genesis(), members(1)).to_dict()
    for bad in (
        {**d, "member_chunks": [{"sha256": "x" * 64, "count": 1, "first_rank": 0}]},
        {**d, "member_chunks": [{"sha256": "a" * 64, "count": 0, "first_rank": 0}]},
        {**d, "member_chunks": ["a" * 64]},
        {**d, "body_chunks": []},
        {**d, "body_chunks": ["A" * 64]},
        {**d, "members": []},
    ):
        with pytest.raises(ValueError):
            Certificate.from_dict(bad)
    assert Certificate.from_dict(d, load=chunk_store(child(genesis(), members(1)))).generation == 1


# ---------------------------------------------------------------------- real etcd, large
@pytest.mark.etcd
def test_10240_members_activate_on_etcd_and_read_back(tmp_path, etcd_url):
    """The inline certificate of 10,240 members (1.9 MB) was refused by etcd as `Bad Request`."""
    url = etcd_ledger_url(etcd_url)
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    table = many(10_240)
    g1 = child(led.require_active(), table, reason="start")
    led.activate(g1)
    fresh = open_ledger(tmp_path, url, key=KEY)
    back = fresh.require_active()
    assert back.generation == 1 and len(back.members) == 10_240 and tuple(back.members) == tuple(table)
    g2 = child(back, renumbered(table[:5000] + table[5008:]), reason="scale-down")
    fresh.activate(g2)
    assert verify_ledger(open_ledger(tmp_path, url, key=KEY), KEY).ok
    inline = replace(g1, schema=INLINE_SCHEMA)
    assert len(encode_certificate(inline)) > 1_572_864  # what used to be sent: over etcd's request limit
    with pytest.raises(EtcdRequestTooLarge, match="request limit"):
        fresh._create(3, encode_certificate(inline))


@pytest.mark.etcd
def test_a_request_too_large_for_etcd_is_one_clear_error_naming_the_limit(tmp_path, etcd_url):
    led = open_ledger(tmp_path, etcd_ledger_url(etcd_url), key=KEY)
    led.initialize(genesis())
    huge = replace(child(led.require_active(), members(1)), issued_by="x" * 1_600_000)
    with pytest.raises(EtcdRequestTooLarge, match=r"request limit of 1,572,864 bytes \(--max-request-bytes") as err:
        led.activate(huge.with_signature(sign(KEY, huge.signing_bytes())))
    assert err.value.exit_code == 65 and "\n" not in str(err.value)
    assert led.generations() == [0]


# ---------------------------------------------------------------------- pruning
@pytest.mark.parametrize("backend", ["dir", pytest.param("etcd", marks=pytest.mark.etcd)])
def test_chunks_no_certificate_names_are_pruned_and_nothing_else(tmp_path, request, backend):
    url = etcd_ledger_url(request.getfixturevalue("etcd_url")) if backend == "etcd" else None
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    g1 = child(led.require_active(), members(3))
    led.activate(g1)
    lost = child(g1, members(2), extra={"lost": True})  # its activation died between chunks and txn
    led._write_chunks(list(lost.chunks()))
    orphans = set(lost.chunk_refs()) - set(g1.chunk_refs())
    g2 = child(g1, g1.members, extra={"keep": 1})
    led.activate(g2)
    assert set(led.unreferenced_chunks()) == orphans
    in_flight = child(g2, members(2), extra={"under way": True})  # written after the active certificate
    led._write_chunks(list(in_flight.chunks()))
    listed = led.unreferenced_chunks()
    assert set(listed) == orphans
    renewed = next(iter(orphans))
    time.sleep(0.01)
    led._write_chunks([b for b in lost.chunks() if b.sha256 == renewed])  # an activator reuses it now
    assert not led._delete_chunk(renewed, listed[renewed])  # re-written since listed: kept
    assert set(led.prune_chunks()) == orphans - {renewed}
    fresh = open_ledger(tmp_path, url, key=KEY)
    assert verify_ledger(fresh, KEY).ok and tuple(fresh.require_active().members) == tuple(g2.members)
    assert all(led._read_chunk(sha) is not None for sha in in_flight.chunk_refs())
