"""A `torch.distributed.Store` on etcd v3: the store of the `gpuguard` torchrun rendezvous backend.

Why etcd and not an agent-hosted TCPStore: etcd is the only stateful part of the job, so losing any
training host (the first agent included) loses no store. The agents use this store for what torch
keeps in the rendezvous store: the workers' MASTER_ADDR/MASTER_PORT, the rank assignment and the
exit barrier. Any process can open one with `EtcdStore.connect` (a worker that wants the agents'
store, a tool).

Transport: the project's one etcd client (`foundation.etcd`), whose errors are here also torch's
(`EtcdConnection`). `wait` and the blocking `get` watch the first missing key with a streaming
request bounded by the time left, so they return by their deadline and never hang.

Keys: `<prefix>/<run id, %-quoted>/store/<key>`. Every key is attached to the run's lease
(`RunLease`): it expires when no process of the run has refreshed the lease for its TTL, and the
backend revokes it when the run ends (`rdzv_etcd`).

Store semantics follow c10d's HashStore/TCPStore: `get` and `wait` block up to the store timeout
and then raise `DistStoreError`; `compare_set` on a missing key sets it only when `expected` is
empty and otherwise returns `expected`; `add` on a non-integer raises `ValueError`. An unreachable
etcd raises `EtcdUnavailableError` (a `DistNetworkError`) within the request timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gpuguard.foundation.etcd import (
    KV,
    MAX_TXN_OPS,
    EtcdClient,
    EtcdOutcomeUnknown,
    EtcdRequestFailed,
    EtcdUnavailable,
    TlsFiles,
    compare,
    parse_endpoints,
    put_op,
    range_kvs,
    range_op,
)
from gpuguard.recovery.rendezvous.etcd_keys import RunLease, run_prefix

log = logging.getLogger(__name__)


class EtcdUnavailableError(dist.DistNetworkError, EtcdUnavailable):
    """etcd did not answer (refused, timed out, no leader): the message says which and within what."""

    def __init__(self, message: str) -> None:
        dist.DistNetworkError.__init__(self, message)
        self.exit_code = EtcdUnavailable.exit_code


class EtcdOutcomeUnknownError(EtcdUnavailableError, EtcdOutcomeUnknown):
    """A write reached etcd and its answer was lost: it may or may not have been applied."""


class EtcdRequestError(dist.DistError, EtcdRequestFailed):
    """etcd answered with an error (a malformed request, a lease that no longer exists)."""

    def __init__(self, message: str, *, lease_missing: bool = False, exit_code: int | None = None) -> None:
        dist.DistError.__init__(self, message)
        self.exit_code = EtcdRequestFailed.exit_code if exit_code is None else exit_code
        self.lease_missing = lease_missing


class EtcdConnection(EtcdClient):
    """`foundation.etcd.EtcdClient` whose errors are also torch's `DistNetworkError` / `DistError`."""

    unavailable_error = EtcdUnavailableError
    unknown_error = EtcdOutcomeUnknownError
    request_error = EtcdRequestError


def _bytes(value: str | bytes | bytearray | Iterable[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """c10d's Store interface on etcd v3 (set/get/add/compare_set/wait/check/delete_key/num_keys, multi_*)."""

    def __init__(
        self,
        conn: EtcdConnection,
        prefix: bytes,
        *,
        lease: RunLease | None = None,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self.conn = conn
        self.prefix = prefix if prefix.endswith(b"/") else prefix + b"/"
        self.lease = lease
        self.set_timeout(timeout)

    @classmethod
    def connect(
        cls,
        endpoint: str,
        run_id: str,
        *,
        key_prefix: str = "/gpuguard/rdzv",
        read_timeout: float = 10.0,
        store_timeout: float = 60.0,
        lease_ttl: int = 600,
        tls: TlsFiles | None = None,
    ) -> EtcdStore:
        """The store of run `run_id` at `endpoint` ("host:port[,host:port...]"): what the agents use."""
        conn = EtcdConnection(parse_endpoints(endpoint), timeout=read_timeout, tls=tls)
        base = run_prefix(key_prefix, run_id)
        return cls(
            conn,
            base + b"store/",
            lease=RunLease(conn, base + b"lease", lease_ttl),
            timeout=timedelta(seconds=store_timeout),
        )

    # -- helpers ------------------------------------------------------------------------------
    def _key(self, key: str | bytes) -> bytes:
        return self.prefix + _bytes(key)

    def _deadline(self, timeout: timedelta | None) -> tuple[float, float]:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        return seconds, time.monotonic() + seconds

    def _put(self, ops: list[dict[str, Any]], what: str) -> None:
        def go(lease: int) -> None:
            for k in ops:
                if lease:
                    k["request_put"]["lease"] = str(lease)
            for i in range(0, len(ops), MAX_TXN_OPS):
                self.conn.txn(what, [], ops[i : i + MAX_TXN_OPS])

        if self.lease is None:
            go(0)
        else:
            self.lease.attached(go)

    def _cas(self, key: bytes, compare: dict[str, Any], value: bytes, what: str) -> tuple[bool, KV | None]:
        """One compare-and-put; on failure the key as it is now (None: absent)."""

        def go(lease: int) -> dict[str, Any]:
            return self.conn.txn(what, [compare], [put_op(key, value, lease)], [range_op(key)])

        got = go(0) if self.lease is None else self.lease.attached(go)
        if got.get("succeeded"):
            return True, None
        kvs = range_kvs(got["responses"][0]) if got.get("responses") else []
        return False, kvs[0] if kvs else None

    def _read(self, keys: Sequence[bytes], what: str) -> tuple[dict[bytes, bytes], int]:
        """The keys present now (one request for all) and the revision they were read at."""
        found: dict[bytes, bytes] = {}
        revision = 0
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i : i + MAX_TXN_OPS]
            if len(chunk) == 1:
                got = self.conn.range(chunk[0], what)
                responses = [got]
            else:
                got = self.conn.txn(what, [], [range_op(k) for k in chunk])
                responses = got.get("responses", [])
            revision = max(revision, int(got.get("header", {}).get("revision", 0)))
            for r in responses:
                for kv in range_kvs(r):
                    found[kv.key] = kv.value
        return found, revision

    def _wait_get(self, keys: Sequence[bytes], timeout: timedelta | None, what: str) -> dict[bytes, bytes]:
        seconds, deadline = self._deadline(timeout)
        while True:
            found, revision = self._read(keys, what)
            missing = next((k for k in keys if k not in found), None)
            if missing is None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                shown = ", ".join(k[len(self.prefix) :].decode(errors="replace") for k in keys if k not in found)
                raise dist.DistStoreError(f"wait timeout after {seconds:g} s, keys: {shown}")
            self.conn.watch_once(missing, revision + 1, left)

    # -- the Store interface ------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._put([put_op(self._key(key), _bytes(value), None)], "store set")

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set needs as many values as keys")
        last = {self._key(k): _bytes(v) for k, v in zip(keys, values)}  # a txn may put a key once
        self._put([put_op(k, v, None) for k, v in last.items()], "store multi_set")

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self._wait_get([k], None, "store get")[k]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        ks = [self._key(k) for k in keys]
        found = self._wait_get(ks, None, "store multi_get")
        return [found[k] for k in ks]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_get([self._key(k) for k in keys], timeout, "store wait")

    def check(self, keys: list[str]) -> bool:
        ks = [self._key(k) for k in keys]
        found, _ = self._read(ks, "store check")
        return all(k in found for k in ks)

    def add(self, key: str, amount: int) -> int:
        """Read, then compare-and-put on the read revision until it holds (etcd has no increment)."""
        k = self._key(key)
        _, deadline = self._deadline(None)
        kvs = range_kvs(self.conn.range(k, "store add"))
        cur = kvs[0] if kvs else None
        while True:
            if cur is None:
                cmp = compare(k, "CREATE", 0)
                new = amount
            else:
                cmp = compare(k, "MOD", cur.mod_revision)
                new = _int(cur.value) + amount
            ok, cur = self._cas(k, cmp, b"%d" % new, "store add")
            if ok:
                return new
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"add on {key!r} lost every compare-and-set for {self.timeout}")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        k, exp, want = self._key(key), _bytes(expected), _bytes(desired)
        _, deadline = self._deadline(None)
        while True:
            ok, cur = self._cas(k, compare(k, "VALUE", exp), want, "store compare_set")
            if ok:
                return want
            if cur is not None:
                return cur.value
            if exp:
                return exp  # c10d: a missing key with a non-empty expectation is left alone
            ok, cur = self._cas(k, compare(k, "CREATE", 0), want, "store compare_set")
            if ok:
                return want
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"compare_set on {key!r} raced for {self.timeout}")

    def delete_key(self, key: str) -> bool:
        return self.conn.delete(self._key(key), "store delete_key") > 0

    def num_keys(self) -> int:
        return int(self.conn.range(self.prefix, "store num_keys", prefix=True, count_only=True).get("count", 0))

    def keys(self) -> list[bytes]:
        """Every key of this store (without the prefix): for tools and tests."""
        got = self.conn.range(self.prefix, "store keys", prefix=True, keys_only=True)
        return [kv.key[len(self.prefix) :] for kv in range_kvs(got)]


def _int(value: bytes) -> int:
    if not value:
        return 0  # HashStore's answer for an empty value (TCPStore's server dies of it)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"add on a value that is not an integer: {value[:40]!r}") from None
