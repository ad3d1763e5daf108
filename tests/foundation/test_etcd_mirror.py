"""`PrefixMirror` against a real etcd: after any sequence of puts, re-puts, deletes and lease
expiries, each incremental refresh equals one full range read of the prefix at the same revision
(keys, values and revisions), and a refresh after a small change reads only that change. On an
etcd of its own (compaction is server-wide): a refresh after etcd compacted past the mirror's
revision, and one whose pinned re-read finds its revision compacted (the fallback to a full read)."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.etcd import EtcdClient, EtcdRequestFailed, b64, parse_endpoints, prefix_end, range_kvs
from gpuguard.foundation.etcd_mirror import PrefixMirror
from tests.support.etcd_cluster import start_plain_etcd

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]

KEYS = [f"k{i:02d}" for i in range(24)] + ["", "k", "k05x", "zz"]  # "" is the prefix itself

op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.binary(max_size=8)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.just(b"")),
    st.tuples(st.just("delete-range"), st.sampled_from(KEYS), st.sampled_from(KEYS).map(str.encode)),
    st.tuples(st.just("leased"), st.sampled_from(KEYS), st.just(b"")),
    st.tuples(st.just("expire"), st.just(""), st.just(b"")),
)


@pytest.fixture(scope="module")
def client(etcd_url):
    u = urlsplit(etcd_url)
    c = EtcdClient([(u.hostname or "127.0.0.1", u.port or 2379)], timeout=10.0)
    yield c
    c.close()


def full(client: EtcdClient, prefix: str, revision: int, keys_only: bool) -> dict[bytes, tuple]:
    """What one range read of the whole prefix answers at `revision`."""
    body: dict[str, object] = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "revision": str(revision)}
    if keys_only:
        body["keys_only"] = True
    kvs = range_kvs(client.call("kv/range", body, "test full read", idempotent=True))
    return {kv.key: (kv.value, kv.mod_revision, kv.create_revision, kv.version) for kv in kvs}


def apply(client: EtcdClient, prefix: str, steps: list[tuple[str, str, bytes]], leases: list[int]) -> None:
    for kind, key, arg in steps:
        if kind == "put":
            client.put(prefix + key, arg)
        elif kind == "delete":
            client.delete(prefix + key)
        elif kind == "delete-range":
            lo, hi = sorted([prefix + key, prefix + arg.decode()])
            if lo != hi:
                client.delete(lo, range_end=hi)
        elif kind == "leased":
            lease = client.grant(60)
            leases.append(lease)
            client.put(prefix + key, b"leased", lease=lease)
        elif leases:  # expire: what etcd does when a host's lease runs out (its keys go at once)
            client.revoke(leases.pop(0))


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.lists(st.lists(op, max_size=6), min_size=1, max_size=5),
    buckets=st.integers(1, 5),
    max_reread=st.integers(0, 3),
    keys_only=st.booleans(),
)
def test_every_refresh_equals_a_full_read_at_its_revision(client, rounds, buckets, max_reread, keys_only):
    prefix = f"mirror-{uuid.uuid4().hex}/"
    client.put(prefix + "k03", b"first")
    client.put(prefix[:-1] + "0", b"outside: just past the prefix")  # never part of it
    mirror = PrefixMirror(client, prefix, "test", keys_only=keys_only, buckets=buckets, max_reread=max_reread)
    leases: list[int] = []
    try:
        for steps in [[], *rounds]:
            apply(client, prefix, steps, leases)
            got = mirror.refresh()
            assert held(mirror) == full(client, prefix, mirror.revision, keys_only)
            assert list(got) == sorted(got)  # in key order, as a range answers
    finally:
        for lease in leases:
            client.revoke(lease)
        client.delete(prefix, prefix=True)
        client.delete(prefix[:-1] + "0")


def test_a_later_refresh_reads_only_what_changed(client):
    prefix = f"mirror-{uuid.uuid4().hex}/"
    try:
        for i in range(300):
            client.put(f"{prefix}{i:04d}", b"v")
        mirror = PrefixMirror(client, prefix, "test")
        assert len(mirror.refresh()) == 300 and mirror.last.full and mirror.last.keys == 300
        version = mirror.version
        mirror.refresh()
        assert (mirror.last.full, mirror.last.keys, mirror.version) == (False, 0, version)  # nothing changed
        client.put(f"{prefix}0007", b"w")
        client.delete(f"{prefix}0100")
        got = mirror.refresh()
        assert not mirror.last.full and mirror.last.buckets_reread == 1 and mirror.last.keys <= 1 + 300 // 100
        assert got[f"{prefix}0007".encode()].value == b"w" and f"{prefix}0100".encode() not in got
        assert len(got) == 299 and mirror.version == version + 1
    finally:
        client.delete(prefix, prefix=True)


@pytest.fixture(scope="module")
def own_etcd(tmp_path_factory):
    """An etcd of this module's own: a compaction is server-wide, and the shared test etcd's other
    users (watches, pinned reads) would find their revisions gone."""
    srv = start_plain_etcd(tmp_path_factory.mktemp("etcd-compact"))
    yield srv
    srv.stop()


def compact(client: EtcdClient, revision: int) -> None:
    """etcd's compaction, as an operator's `etcdctl compact` (the old revisions are gone at once)."""
    client.call("kv/compaction", {"revision": str(revision), "physical": True}, "test compaction")


def held(mirror: PrefixMirror) -> dict[bytes, tuple]:
    """The mirror's keys as `full` gives them."""
    return {k: (kv.value, kv.mod_revision, kv.create_revision, kv.version) for k, kv in mirror.kvs.items()}


def filled(client: EtcdClient, n: int = 300) -> tuple[str, PrefixMirror]:
    prefix = f"mirror-{uuid.uuid4().hex}/"
    for i in range(n):
        client.put(f"{prefix}{i:04d}", b"v")
    mirror = PrefixMirror(client, prefix, "test")
    mirror.refresh()
    assert mirror.last.full and len(mirror.kvs) == n
    return prefix, mirror


def test_a_refresh_after_etcd_compacted_past_its_revision_is_still_incremental_and_exact(own_etcd):
    """The incremental read never reads the past (`min_mod_revision` filters the keys as they are
    now; the counts are of now): a compaction past the mirror's revision costs it nothing."""
    with EtcdClient(parse_endpoints(own_etcd.endpoint), timeout=10.0) as client:
        prefix, mirror = filled(client)
        seen = mirror.revision
        client.put(f"{prefix}0007", b"w")
        client.delete(f"{prefix}0100")
        client.put(f"{prefix}0300", b"new")
        now = int(client.range(b"/", "test revision")["header"]["revision"])
        compact(client, now)
        with pytest.raises(EtcdRequestFailed, match="compacted"):  # the mirror's revision is gone
            full(client, prefix, seen, keys_only=False)
        mirror.refresh()
        got = held(mirror)
        assert got == full(client, prefix, mirror.revision, keys_only=False) and len(got) == 300
        assert not mirror.last.full and mirror.last.buckets_reread == 1  # the deletion's bucket, read at now


class CompactedAfterEachTxn(EtcdClient):
    """A real client on a real etcd whose every transaction is followed at once by someone else's
    write and a compaction past it: what the mirror meets when an operator (or etcd's
    auto-compaction) compacts between its transaction and its pinned re-read of a bucket."""

    compactions = 0

    def txn(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        answer = super().txn(*args, **kwargs)
        self.put(b"elsewhere", b"x")  # one revision past the transaction's
        compact(self, int(answer["header"]["revision"]) + 1)
        self.compactions += 1
        return answer


def test_a_re_read_whose_revision_was_compacted_falls_back_to_one_full_read(own_etcd):
    with CompactedAfterEachTxn(parse_endpoints(own_etcd.endpoint), timeout=10.0) as client:
        prefix, mirror = filled(client)
        client.put(f"{prefix}0007", b"w")
        client.delete(f"{prefix}0100")  # a bucket short: re-read at the transaction's revision
        mirror.refresh()
        assert client.compactions == 1  # the one incremental transaction, then its revision compacted
        got = held(mirror)
        want = full(client, prefix, 0, keys_only=False)  # a fresh full read now (the prefix is as at the txn)
        assert got == want and len(got) == 299
        assert got[f"{prefix}0007".encode()][0] == b"w" and f"{prefix}0100".encode() not in got
        assert mirror.last.full and mirror.last.keys == 299  # the fallback: the whole prefix, once
        mirror.refresh()  # and on from there incrementally
        assert not mirror.last.full and mirror.last.keys == 0 and client.compactions == 2
