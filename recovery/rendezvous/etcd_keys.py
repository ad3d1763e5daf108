"""The `gpuguard` backend's rendezvous keys on etcd, behind the torch-free TCPStore client's interface.

Why: `recovery.rendezvous.state` reads the state, forces one new round (`trigger_once`) and binds rounds to
generations with three calls of `tcpstore.StoreClient`: `get`, `compare_set`, `set`. This client
answers the same three on etcd v3 (`etcd_v3`, no torch), so the trigger's protocol is the same code
on both backends: a compare-and-set on the state value, a lease key for coalescing operators.

The names `rendezvous` uses on a c10d TCPStore map to the keys of the run (`rdzv_etcd`):

    torch.rendezvous.<run id>            <prefix>/<run id>/state      base64(pickle(state)), torch's
    gpuguard/rdzv-trigger/<run id>       <prefix>/<run id>/trigger    the operators' trigger lease
    gpuguard/rdzv-round/<run id>/<R>     <prefix>/<run id>/rounds/<R> round R's generation

Every write is attached to the run's etcd lease (the one the agents share), so it goes with the
run: a put without it would detach the key from the lease.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuguard.foundation.errors import UsageError
from gpuguard.recovery.rendezvous.etcd_v3 import (
    EtcdConnection,
    RunLease,
    b64,
    parse_endpoints,
    put_op,
    range_kvs,
    range_op,
    run_prefix,
)

DEFAULT_PREFIX = "/gpuguard/rdzv"  # rdzv_etcd.DEFAULTS["key_prefix"] (that module imports torch)
DEFAULT_LEASE_TTL = 600
STATE_KEY = "torch.rendezvous."
TRIGGER_KEY = "gpuguard/rdzv-trigger/"
ROUND_KEY = "gpuguard/rdzv-round/"


def parse_conf(text: str | None) -> dict[str, str]:
    """torchrun's `--rdzv-conf k=v,k=v` as a dict (what the agent was started with)."""
    conf: dict[str, str] = {}
    for part in (text or "").split(","):
        key, eq, value = part.partition("=")
        if eq and key.strip():
            conf[key.strip()] = value.strip()
    return conf


class EtcdRendezvousClient:
    """`get` / `compare_set` / `set` of `StoreClient`, on the keys of one gpuguard-backend run."""

    def __init__(self, endpoints: str, run_id: str, conf: Mapping[str, str] | None = None, timeout: float = 5.0):
        conf = dict(conf or {})
        try:
            eps = parse_endpoints(endpoints)
        except ValueError as exc:
            raise UsageError(f"--rdzv-endpoint {endpoints!r}: {exc}") from None
        self.run_id = run_id
        self.conn = EtcdConnection(
            eps,
            timeout=timeout,
            protocol=str(conf.get("protocol", "http")).strip().lower() or "http",
            ca_cert=conf.get("ca_cert") or None,
            cert=conf.get("ssl_cert") or None,
            cert_key=conf.get("ssl_cert_key") or None,
        )
        self.base = run_prefix(str(conf.get("key_prefix", DEFAULT_PREFIX)), run_id)
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
            return self.base + b"state"
        if name == TRIGGER_KEY + self.run_id:
            return self.base + b"trigger"
        if name.startswith(ROUND_KEY + self.run_id + "/"):
            return self.base + b"rounds/" + name.rsplit("/", 1)[1].encode()
        raise KeyError(f"not a rendezvous key of run {self.run_id!r}: {name!r}")

    def get(self, name: str) -> bytes | None:
        kvs = range_kvs(self.conn.range(self.etcd_key(name), "rendezvous read"))
        return kvs[0].value if kvs else None

    def set(self, name: str, value: bytes) -> None:
        key = self.etcd_key(name)
        self.lease.attached(lambda lease: self.conn.txn("rendezvous write", [], [put_op(key, value, lease)]))

    def compare_set(self, name: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare_set: set when the value is `expected` (or the key is missing and
        `expected` is empty); the value afterwards (`desired` when it was set)."""
        key = self.etcd_key(name)
        compares = [{"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(expected)}]
        if not expected:
            compares.append({"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0})
        for compare in compares:
            got = self._cas(key, compare, desired)
            if got.get("succeeded"):
                return desired
            kvs = range_kvs(got["responses"][0]) if got.get("responses") else []
            if kvs:
                return kvs[0].value
        return expected  # missing, and `expected` was not empty: left alone (c10d)

    def _cas(self, key: bytes, compare: dict[str, Any], desired: bytes) -> dict[str, Any]:
        return self.lease.attached(
            lambda lease: self.conn.txn(
                "rendezvous compare-and-set", [compare], [put_op(key, desired, lease)], [range_op(key)]
            )
        )
