"""etcd v3 over its JSON gateway, torch-free: the transport of the `gpuguard` rendezvous backend.

Why a module of its own: `etcd_store` (the agents' `torch.distributed.Store`) and `rdzv_etcd` (the
backend) need torch, but `gpu-recover rendezvous` and the workers' attempt token read and write the
same keys without paying for `import torch`. Everything that talks to etcd lives here; `etcd_store`
subclasses `EtcdConnection` so that its errors are also torch's `DistNetworkError`/`DistError`.

Transport: etcd's v3 JSON gateway (`/v3/`, etcd >= 3.4) through `etcd3gw`'s client and its
`requests` session (TLS through the session), every request with a timeout, each thread its own
session. Several endpoints (a cluster) are tried in turn on a connection failure.

Lazy imports (start-up time): etcd3gw and requests, only when a request is made (`gpu-recover`
imports this module for every command).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote

from gpuguard.foundation.errors import EXIT_TEMPFAIL, GpuguardError, UnavailableError
from gpuguard.foundation.etcd_url import split_endpoints

API_PATH = "/v3/"
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_T = TypeVar("_T")


class EtcdUnavailable(UnavailableError):
    """etcd did not answer (refused, timed out, no leader): the message says which and within what."""


class EtcdRequestFailed(GpuguardError):
    """etcd answered with an error (a malformed request, a lease that no longer exists)."""

    exit_code = EXIT_TEMPFAIL

    def __init__(self, message: str, *, lease_missing: bool = False) -> None:
        super().__init__(message)
        self.lease_missing = lease_missing


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class KV:
    """One key as etcd returned it: the bytes and the revisions the compare-and-sets use."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def run_prefix(key_prefix: str, run_id: str) -> bytes:
    """`<prefix>/<run id>/`: the run id %-quoted (`/` and `%` too), so two run ids never share a key."""
    if not run_id:
        raise ValueError("the run id must be a non-empty string")
    p = "/" + key_prefix.strip("/") if key_prefix.strip("/") else ""
    return f"{p}/{quote(run_id, safe='')}/".encode()


def _kv(item: dict[str, Any]) -> KV:
    return KV(
        key=base64.b64decode(item["key"]),
        value=base64.b64decode(item.get("value", "")),
        mod_revision=int(item.get("mod_revision", 0)),
        create_revision=int(item.get("create_revision", 0)),
        lease=int(item.get("lease", 0)),
    )


def range_op(key: bytes, *, count_only: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"key": b64(key)}
    if count_only:
        op["count_only"] = True
    return {"request_range": op}


def put_op(key: bytes, value: bytes, lease: int | None) -> dict[str, Any]:
    op: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def range_kvs(response: dict[str, Any]) -> list[KV]:
    """The keys of one `response_range` of a transaction (or of a plain range reply)."""
    body = response.get("response_range", response)
    return [_kv(item) for item in body.get("kvs", [])]


class EtcdConnection:
    """etcd's v3 gateway over `etcd3gw`: one session per thread, endpoints in turn, a timeout everywhere.

    The errors it raises are the two class attributes (`etcd_store` puts torch's subclasses there).
    """

    unavailable_error: ClassVar[type[EtcdUnavailable]] = EtcdUnavailable
    request_error: ClassVar[type[EtcdRequestFailed]] = EtcdRequestFailed

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        timeout: float = 10.0,
        protocol: str = "http",
        ca_cert: str | None = None,
        cert: str | None = None,
        cert_key: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if timeout <= 0:
            raise ValueError("the etcd request timeout must be positive")
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol must be http or https, not {protocol!r}")
        self.endpoints = tuple(endpoints)
        self.timeout = float(timeout)
        self._tls = {"protocol": protocol, "ca_cert": ca_cert, "cert_cert": cert, "cert_key": cert_key}
        self._local = threading.local()
        self._active = 0  # the endpoint that answered last: tried first

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def _client(self, i: int) -> Any:
        clients: dict[int, Any] = self._local.__dict__.setdefault("clients", {})
        c = clients.get(i)
        if c is None:
            import etcd3gw

            ep = self.endpoints[i]
            c = etcd3gw.Etcd3Client(host=ep.host, port=ep.port, timeout=self.timeout, api_path=API_PATH, **self._tls)
            c.session.trust_env = False  # never route the rendezvous through an HTTP proxy
            clients[i] = c
        return c

    def close(self) -> None:
        """Close this thread's sessions (other threads' close with their thread)."""
        for c in self._local.__dict__.pop("clients", {}).values():
            c.session.close()

    def call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST one request; the next endpoint on a connection failure, `unavailable_error` when none answers."""
        from etcd3gw import exceptions as etcd_ex

        failures: list[str] = []
        n = len(self.endpoints)
        start = self._active
        for k in range(n):
            i = (start + k) % n
            client = self._client(i)
            try:
                out: dict[str, Any] = client.post(client.get_url(path), json=body)
            except (etcd_ex.ConnectionFailedError, etcd_ex.ConnectionTimeoutError) as exc:
                failures.append(f"{self.endpoints[i]}: {_why(exc)}")
                continue
            except etcd_ex.Etcd3Exception as exc:
                detail = _detail(exc)
                raise self.request_error(
                    f"etcd {self.endpoints[i]} refused {what}: {detail}", lease_missing="lease not found" in detail
                ) from exc
            self._active = i
            return out
        raise self.unavailable_error(
            f"etcd {self.describe()} unreachable or not answering within {self.timeout:g} s ({what}): "
            + "; ".join(failures)
        )

    # -- the few requests the store and the backend need --------------------------------------
    def range(self, key: bytes, what: str, *, prefix: bool = False, count_only: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        if count_only:
            body["count_only"] = True
        return self.call("kv/range", body, what)

    def txn(
        self,
        what: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []}, what)

    def delete(self, key: bytes, what: str, *, prefix: bool = False) -> int:
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        return int(self.call("kv/deleterange", body, what).get("deleted", 0))

    def grant(self, ttl: int, what: str) -> int:
        return int(self.call("lease/grant", {"TTL": int(ttl), "ID": 0}, what)["ID"])

    def keepalive(self, lease: int, what: str) -> int:
        """The lease's TTL after the refresh, or -1 when it has expired."""
        out = self.call("lease/keepalive", {"ID": str(lease)}, what)
        return int(out.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int, what: str) -> bool:
        try:
            self.call("kv/lease/revoke", {"ID": str(lease)}, what)
        except EtcdRequestFailed as exc:
            if exc.lease_missing:
                return False
            raise
        return True

    def watch_once(self, key: bytes, start_revision: int, timeout: float) -> bool:
        """Block until `key` changes at or after `start_revision`, at most `timeout` s: True on a change.

        Our own stream request, not `etcd3gw`'s watcher (whose request has no timeout): the socket
        timeout is the time left, so a silent or dead etcd costs at most `timeout`. False on a
        timeout or a broken stream; the caller re-reads, which raises if etcd is really gone.
        """
        import requests

        if timeout <= 0:
            return False
        client = self._client(self._active)
        deadline = time.monotonic() + timeout
        body = {"create_request": {"key": b64(key), "start_revision": int(start_revision)}}
        try:
            resp = client.session.post(
                client.get_url("watch"), json=body, stream=True, timeout=(min(timeout, self.timeout), timeout)
            )
        except requests.RequestException:
            return False
        try:
            if resp.status_code != 200:
                return False
            buf = b""
            for chunk in resp.iter_content(chunk_size=None):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("events") or result.get("canceled") or result.get("compact_revision"):
                        return True  # a change, or the revision was compacted: re-read either way
                if time.monotonic() >= deadline:
                    return False
            return False
        except (requests.RequestException, ValueError):
            return False
        finally:
            resp.close()


_WHY = (
    ("refused", "connection refused"),
    ("timed out", "no answer (timed out)"),
    ("resolve", "host name not resolved"),
    ("Name or service", "host name not resolved"),
    ("reset", "connection reset"),
    ("unreachable", "network unreachable"),
)


def _why(exc: Any) -> str:
    """One short reason for a failed connection (requests' messages run to several lines)."""
    from etcd3gw import exceptions as etcd_ex

    text = str(exc.detail_text or exc)
    if isinstance(exc, etcd_ex.ConnectionTimeoutError) and "timed out" not in text:
        return "no answer (timed out)"
    for needle, why in _WHY:
        if needle in text:
            return why
    return text[:120]


def _detail(exc: Any) -> str:
    text = exc.detail_text or str(exc) or type(exc).__name__
    try:
        text = json.loads(text).get("message", text)
    except (ValueError, AttributeError):
        pass
    return str(text)[:200]


class RunLease:
    """The one etcd lease of a rendezvous run: shared by every agent, refreshed by whoever is alive.

    Its id is kept under `<run>/lease` (attached to itself). Each process refreshes it lazily, at
    most once per TTL/3, on the calls the agents already make every few seconds (heartbeats, state
    polls); the keys of the run outlive any one host and expire TTL seconds after the last process
    of the run stopped calling. An expired lease is replaced by a new one on the next call.
    """

    def __init__(self, conn: EtcdConnection, key: bytes, ttl: int) -> None:
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
            if self._id is not None and self.conn.keepalive(self._id, "lease keep-alive") > 0:
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
            kvs = range_kvs(self.conn.range(self.key, "lease lookup"))
            if not kvs:
                return False
            lease = int(kvs[0].value)
        return self.conn.revoke(lease, "lease revoke")

    def _acquire(self) -> int:
        for _ in range(5):
            kvs = range_kvs(self.conn.range(self.key, "lease lookup"))
            if kvs:
                try:
                    lease = int(kvs[0].value)
                except ValueError:
                    lease = 0
                if lease > 0 and self.conn.keepalive(lease, "lease keep-alive") > 0:
                    return lease
            fresh = self.conn.grant(self.ttl, "lease grant")
            got = self.conn.txn(
                "lease publish",
                compare=(
                    [{"key": b64(self.key), "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0].mod_revision}]
                    if kvs
                    else [{"key": b64(self.key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
                ),
                success=[put_op(self.key, str(fresh).encode(), fresh)],
            )
            if got.get("succeeded"):
                return fresh
            self.conn.revoke(fresh, "lease revoke")  # another process published first: use theirs
        raise self.conn.unavailable_error(f"etcd {self.conn.describe()}: the run lease keeps changing under us")

    def attached(self, fn: Callable[[int], _T]) -> _T:
        """Run `fn(lease id)`; once more with a fresh lease if etcd says the lease is gone."""
        try:
            return fn(self.id())
        except EtcdRequestFailed as exc:
            if not exc.lease_missing:
                raise
            self.forget()
            return fn(self.id())


def parse_endpoints(endpoint: str, default_port: int = 2379) -> list[Endpoint]:
    """`host[:port][,host[:port]...]` (IPv6 in brackets): the etcd cluster's client endpoints."""
    try:
        return [Endpoint(host, port) for host, port in split_endpoints(endpoint, default_port)]
    except ValueError as exc:
        if "no etcd host" in str(exc):
            raise ValueError("the rendezvous endpoint names no etcd host (host:port[,host:port...])") from None
        raise
