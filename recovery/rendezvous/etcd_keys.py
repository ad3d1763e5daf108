"""The `gpuguard` backend's run on etcd, torch-free: its key prefix, its shared lease, and the
rendezvous keys behind the TCPStore client's interface.

Why torch-free: `etcd_store` (the agents' `torch.distributed.Store`) and `backend` need torch, but
`gpu-recover rendezvous` and the workers' attempt token read and write the same keys without paying
for `import torch`. The transport is the project's one etcd client (`foundation.etcd`).

`recovery.rendezvous.state` reads the state, forces one new round (`trigger_once`) and binds rounds
to generations with three calls of `tcpstore.StoreClient`: `get`, `compare_set`, `set`.
`EtcdRendezvousClient` answers the same three on etcd, so the trigger's protocol is the same code on
both backends. The names it takes map to the keys of the run:

    torch.rendezvous.<run id>            <prefix>/<run id>/state      the signed state (`signed_state`)
    gpuguard/rdzv-trigger/<run id>       <prefix>/<run id>/trigger    the operators' trigger lease
    gpuguard/rdzv-round/<run id>/<R>     <prefix>/<run id>/rounds/<R> round R's generation

On the state key the client speaks torch's c10d format (`base64(pickle)`) and etcd holds it
sealed: `get` verifies the seal (a foreign value is `ForeignState`, exit 65), `compare_set` seals
both sides (the seal is deterministic, so the compare is on the exact stored bytes).

Every write is attached to the run's etcd lease (`RunLease`, shared by the agents), so it goes with
the run: a put without it would detach the key from the lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from gpuguard.foundation.errors import UsageError
from gpuguard.foundation.etcd import (
    EtcdClient,
    EtcdRequestFailed,
    TlsFiles,
    compare,
    parse_endpoints,
    put_op,
    range_kvs,
    range_op,
)
from gpuguard.recovery.rendezvous.signed_state import SECRET_FILE_CONF, require_secret, seal, unseal

DEFAULT_PREFIX = "/gpuguard/rdzv"  # backend.DEFAULTS["key_prefix"] (that module imports torch)
DEFAULT_LEASE_TTL = 600
STATE_KEY = "torch.rendezvous."
TRIGGER_KEY = "gpuguard/rdzv-trigger/"
ROUND_KEY = "gpuguard/rdzv-round/"
_T = TypeVar("_T")


def run_prefix(key_prefix: str, run_id: str) -> bytes:
    """`<prefix>/<run id>/`: the run id %-quoted (`/` and `%` too), so two run ids never share a key."""
    if not run_id:
        raise ValueError("the run id must be a non-empty string")
    p = "/" + key_prefix.strip("/") if key_prefix.strip("/") else ""
    return f"{p}/{quote(run_id, safe='')}/".encode()


def tls_from_conf(conf: Mapping[str, Any]) -> TlsFiles:
    """The TLS files of `--rdzv-conf` (protocol, ca_cert, ssl_cert, ssl_cert_key)."""
    protocol = str(conf.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"--rdzv-conf protocol={protocol!r}: http or https")
    return TlsFiles(
        protocol == "https",
        conf.get("ca_cert") or None,
        conf.get("ssl_cert") or None,
        conf.get("ssl_cert_key") or None,
    )


def parse_conf(text: str | None) -> dict[str, str]:
    """torchrun's `--rdzv-conf k=v,k=v` as a dict (what the agent was started with)."""
    conf: dict[str, str] = {}
    for part in (text or "").split(","):
        key, eq, value = part.partition("=")
        if eq and key.strip():
            conf[key.strip()] = value.strip()
    return conf


class RunLease:
    """The one etcd lease of a rendezvous run: shared by every agent, refreshed by whoever is alive.

    Its id is kept under `<run>/lease` (attached to itself). Each process refreshes it lazily, at
    most once per TTL/3, on the calls the agents already make every few seconds (heartbeats, state
    polls); the keys of the run outlive any one host and expire TTL seconds after the last process
    of the run stopped calling. An expired lease is replaced by a new one on the next call.
    """

    def __init__(self, conn: EtcdClient, key: bytes, ttl: int) -> None:
        if ttl < 1:
            raise ValueError("the lease TTL must be at least 1 s")
        self.conn, self.key, self.ttl = conn, key, int(ttl)
        self._lock = threading.Lock()
        self._id: int | None = None
        self._refreshed = 0.0

    def id(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._id is not None and now - self._refreshed < self.ttl / 3:
                return self._id
            if self._id is not None and self.conn.keepalive(self._id) > 0:
                self._refreshed = now
                return self._id
            self._id = self._acquire()
            self._refreshed = time.monotonic()
            return self._id

    def forget(self) -> None:
        """The lease was reported missing: the next `id()` finds or creates the current one."""
        with self._lock:
            self._id = None

    def revoke(self) -> bool:
        """Revoke the run's lease (every key attached to it goes); False when it was already gone."""
        with self._lock:
            lease, self._id = self._id, None
        if lease is None:
            kv = self.conn.get(self.key, "lease lookup")
            if kv is None:
                return False
            lease = int(kv.value)
        return self.conn.revoke(lease)

    def _acquire(self) -> int:
        for _ in range(5):
            kv = self.conn.get(self.key, "lease lookup")
            if kv is not None:
                try:
                    lease = int(kv.value)
                except ValueError:
                    lease = 0
                if lease > 0 and self.conn.keepalive(lease) > 0:
                    return lease
            fresh = self.conn.grant(self.ttl)
            got = self.conn.txn(
                "lease publish",
                [compare(self.key, "MOD", kv.mod_revision) if kv else compare(self.key, "CREATE", 0)],
                [put_op(self.key, str(fresh), fresh)],
            )
            if got.get("succeeded"):
                return fresh
            self.conn.revoke(fresh)  # another process published first: use theirs
        raise self.conn.unavailable_error(f"{self.conn.name}: the run lease keeps changing under us")

    def attached(self, fn: Callable[[int], _T]) -> _T:
        """Run `fn(lease id)`; once more with a fresh lease if etcd says the lease is gone."""
        try:
            return fn(self.id())
        except EtcdRequestFailed as exc:
            if not exc.lease_missing:
                raise
            self.forget()
            return fn(self.id())


class EtcdRendezvousClient:
    """`get` / `compare_set` / `set` of `StoreClient`, on the keys of one gpuguard-backend run.

    The state key needs the rendezvous secret (`signed_state`): from `conf` (`secret_file`), else
    `job_dir`'s or `$GPUGUARD_JOB_DIR`'s generation.key; without one, reading it is a UsageError."""

    def __init__(
        self,
        endpoints: str,
        run_id: str,
        conf: Mapping[str, str] | None = None,
        timeout: float = 5.0,
        job_dir: str | None = None,
    ) -> None:
        conf = dict(conf or {})
        try:
            eps = parse_endpoints(endpoints)
            tls = tls_from_conf(conf)
        except ValueError as exc:
            raise UsageError(f"--rdzv-endpoint {endpoints!r}: {exc}") from None
        self.run_id = run_id
        self.conn = EtcdClient(eps, timeout=timeout, tls=tls)
        self.base = run_prefix(str(conf.get("key_prefix", DEFAULT_PREFIX)), run_id)
        self.state_key = self.base + b"state"
        self._secret_file, self._job_dir = conf.get(SECRET_FILE_CONF) or None, job_dir
        self._seal_key: bytes | None = None
        try:
            ttl = int(conf.get("lease_ttl", DEFAULT_LEASE_TTL))
        except ValueError:
            ttl = DEFAULT_LEASE_TTL
        self.lease = RunLease(self.conn, self.base + b"lease", max(1, ttl))

    def __enter__(self) -> EtcdRendezvousClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.conn.close()

    def describe(self) -> str:
        return self.conn.describe()

    def etcd_key(self, name: str) -> bytes:
        """The etcd key of a name `recovery.rendezvous.state` uses (see the module docstring)."""
        if name == STATE_KEY + self.run_id:
            return self.state_key
        if name == TRIGGER_KEY + self.run_id:
            return self.base + b"trigger"
        if name.startswith(ROUND_KEY + self.run_id + "/"):
            return self.base + b"rounds/" + name.rsplit("/", 1)[1].encode()
        raise KeyError(f"not a rendezvous key of run {self.run_id!r}: {name!r}")

    # -- the state key: torch's base64(pickle) here, sealed in etcd ----------------------------------
    def _key(self) -> bytes:
        if self._seal_key is None:
            self._seal_key = require_secret(self._secret_file, self._job_dir)
        return self._seal_key

    def _to_etcd(self, key: bytes, value: bytes) -> bytes:
        return seal(self._key(), key, value) if key == self.state_key and value else value

    def _from_etcd(self, key: bytes, value: bytes) -> bytes:
        return unseal(self._key(), key, value) if key == self.state_key and value else value

    # -- StoreClient's interface ---------------------------------------------------------------------
    def get(self, name: str) -> bytes | None:
        key = self.etcd_key(name)
        kv = self.conn.get(key, "rendezvous read")
        return None if kv is None else self._from_etcd(key, kv.value)

    def set(self, name: str, value: bytes) -> None:
        key = self.etcd_key(name)
        stored = self._to_etcd(key, value)
        self.lease.attached(lambda lease: self.conn.txn("rendezvous write", [], [put_op(key, stored, lease)]))

    def compare_set(self, name: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare_set: set when the value is `expected` (or the key is missing and
        `expected` is empty); the value afterwards (`desired` when it was set)."""
        key = self.etcd_key(name)
        want, have = self._to_etcd(key, desired), self._to_etcd(key, expected)
        compares = [compare(key, "VALUE", have)]
        if not expected:
            compares.append(compare(key, "CREATE", 0))
        for cmp in compares:

            def cas(lease: int, cmp: dict[str, Any] = cmp) -> dict[str, Any]:
                return self.conn.txn("rendezvous compare-and-set", [cmp], [put_op(key, want, lease)], [range_op(key)])

            got = self.lease.attached(cas)
            if got.get("succeeded"):
                return desired
            kvs = range_kvs(got["responses"][0]) if got.get("responses") else []
            if kvs:
                return self._from_etcd(key, kvs[0].value)
        return expected  # missing, and `expected` was not empty: left alone (c10d)
