"""The one etcd client: addresses, TLS and auth, one failover policy, a total deadline on every call.

    etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/PREFIX[?cacert=F&cert=F&key=F]   the ledger (+ coordination)
    HOST[:PORT][,HOST[:PORT]...]                                                     a rendezvous endpoint

Why one client: the ledger, the in-place coordination, the leases and the rendezvous all talk to
the same etcd cluster, and two clients had two failover policies (one of them re-sent a
compare-and-swap whose answer was lost, so it could be applied twice).

Transport: etcd's v3 JSON gateway (`/v3/kv/range|put|deleterange|txn`, `/v3/lease/...`,
`/v3/auth/authenticate`, `/v3/watch`; etcd >= 3.4), keys and values base64, over our own HTTP/1.1
(`foundation.etcd_http`: stdlib only, never through an HTTP proxy, one persistent connection per
member and thread).

**Failover, one policy.** A call goes to the member that answered last, then to the next ones,
only while it provably never reached a member: resolution or connect failed, the TLS handshake
failed, the send did not complete, or etcd rejected it before acting on it ("no leader", an
expired auth token: re-authenticated once and re-sent). A request that was sent and whose answer
did not come (a read timeout, a reset, a cut answer, etcd's own "request timed out") is *outcome
unknown*: a write raises `EtcdOutcomeUnknown` and is never re-sent; only idempotent calls (range,
a transaction of ranges only, lease keep-alive, authenticate) are retried on another member.

**A total deadline per call** (`timeout`, all members and retries together): every socket
operation waits at most the time left, so a silent or trickling member ends the call by its
deadline. A member's connect gets its share of the time left (time left / members left to try).

**Watch** (`watch`, `watch_once`): one bounded long-poll of one key from a given revision, a
streamed `/v3/watch` answer on a connection of its own that is closed when it returns (no thread,
no background watcher). It returns by its timeout whatever etcd does; a failed watch is "nothing
changed", never an error: the caller's next read is what fails if etcd is gone. Users: the
rendezvous store's blocking `get`/`wait`, and the rendezvous agents' wait between state polls.

**Sizes.** A request whose keys and values exceed etcd's request limit (`--max-request-bytes`,
1.5 MiB by default; `max_request_bytes` here) is refused before it is sent, and etcd's own
refusal ("request is too large", "received message larger than max") is the same clear error,
naming the limit and the size: `EtcdRequestTooLarge`. An answer over `max_answer_bytes` (128 MiB)
is refused before it is read.

**Addresses** (URLs, endpoint lists, TLS files, credentials never printed) are `foundation.etcd_address`,
re-exported here.

Lazy imports (start-up time): the transport (`http.client`, `ssl`), only when a client is built.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from gpuguard.foundation.errors import EXIT_DATAERR, EXIT_NOPERM, EXIT_TEMPFAIL, GpuguardError, UnavailableError
from gpuguard.foundation.etcd_address import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    Endpoint,
    EtcdUrl,
    TlsFiles,
    etcd_ports,
    is_etcd_url,
    parse_endpoints,
    parse_etcd_url,
    redact,
    split_endpoints,
)

if TYPE_CHECKING:
    from gpuguard.foundation.etcd_http import Answer, Budget, Connection

__all__ = [  # the addresses are re-exported: one import for every etcd user
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "KV",
    "MAX_TXN_OPS",
    "Endpoint",
    "EtcdClient",
    "EtcdOutcomeUnknown",
    "EtcdRequestFailed",
    "EtcdRequestTooLarge",
    "EtcdUnavailable",
    "EtcdUrl",
    "TlsFiles",
    "WatchEnd",
    "b64",
    "compare",
    "etcd_ports",
    "is_etcd_url",
    "parse_endpoints",
    "parse_etcd_url",
    "prefix_end",
    "put_op",
    "range_kvs",
    "range_op",
    "redact",
    "request_bytes",
    "split_endpoints",
]

API_PATH = "/v3/"
DEFAULT_MAX_ANSWER_BYTES = 128 << 20
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
WatchEnd = Literal["changed", "ended", "nothing"]  # how `EtcdClient.watch` returned


# -- errors ----------------------------------------------------------------------------------------


class EtcdUnavailable(UnavailableError):
    """No member answered within the deadline (refused, silent, no leader): the message says which."""


class EtcdOutcomeUnknown(EtcdUnavailable):
    """A write reached a member and its answer was lost: it may or may not have been applied.

    Never re-sent by the client; the caller reads the key to learn what happened."""


class EtcdRequestFailed(GpuguardError):
    """etcd answered with an error (a malformed request, a lease that no longer exists, ...)."""

    exit_code = EXIT_TEMPFAIL

    def __init__(self, message: str, *, lease_missing: bool = False, exit_code: int | None = None) -> None:
        super().__init__(message, exit_code=exit_code)
        self.lease_missing = lease_missing


class EtcdRequestTooLarge(EtcdRequestFailed):
    """The request is larger than etcd accepts: it will never succeed as it is."""

    exit_code = EXIT_DATAERR


# -- keys, values and request parts (shared by every user) -----------------------------------------


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def b64(data: str | bytes) -> str:
    return base64.b64encode(_bytes(data)).decode()


def prefix_end(prefix: str | bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    b = bytearray(_bytes(prefix))
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KV:
    """One key as etcd returned it: the bytes and the revisions the compare-and-sets use."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


def _kv(item: Any) -> KV:
    try:
        return KV(
            key=base64.b64decode(item["key"], validate=True),
            value=base64.b64decode(item.get("value", ""), validate=True),
            mod_revision=int(item.get("mod_revision", 0)),
            create_revision=int(item.get("create_revision", 0)),
            version=int(item.get("version", 0)),
            lease=int(item.get("lease", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError, binascii.Error):
        raise EtcdRequestFailed("etcd answered with a malformed key-value record") from None


def range_kvs(response: Mapping[str, Any]) -> list[KV]:
    """The keys of a range answer, or of one `response_range` of a transaction's responses."""
    body = response.get("response_range", response)
    items = body.get("kvs", []) if isinstance(body, Mapping) else []
    return [_kv(item) for item in (items if isinstance(items, list) else [])]


def range_op(key: str | bytes, *, count_only: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"key": b64(key)}
    if count_only:
        op["count_only"] = True
    return {"request_range": op}


def put_op(key: str | bytes, value: str | bytes, lease: int | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


_TARGET_FIELD = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version", "VALUE": "value"}


def compare(key: str | bytes, target: str, value: int | str | bytes, result: str = "EQUAL") -> dict[str, Any]:
    """One compare of a transaction: `compare(k, "CREATE", 0)` is "k does not exist",
    `compare(k, "VALUE", b"3")` is "k holds 3", `compare(k, "MOD", rev)` is "k unchanged since rev"."""
    arg: int | str = b64(value) if isinstance(value, (str, bytes)) else int(value)
    return {"key": b64(key), "result": result, "target": target, _TARGET_FIELD[target]: arg}


def request_bytes(body: Any) -> int:
    """The bytes of keys and values in a request (base64 decoded): a lower bound of what etcd
    counts against --max-request-bytes, so a refusal here is never wrong."""
    if isinstance(body, Mapping):
        total = 0
        for k, v in body.items():
            if k in ("key", "value", "range_end") and isinstance(v, str):
                total += len(v) * 3 // 4 - v.count("=")
            else:
                total += request_bytes(v)
        return total
    if isinstance(body, list):
        return sum(request_bytes(v) for v in body)
    return 0


# -- the client ---------------------------------------------------------------------------------------


def _clean(text: Any, limit: int = 200) -> str:
    """An etcd message for one line: control characters escaped, cut."""
    s = str(text)[:limit]
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in s)


def _error_of(answer: Answer) -> tuple[int, str]:
    """(gRPC code, message) of an error answer (the gateway's `{"error", "message", "code"}`)."""
    try:
        doc = json.loads(answer.body)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        code = doc.get("code")
        msg = doc.get("message") or doc.get("error") or ""
        return (code if isinstance(code, int) else -1), _clean(msg)
    return -1, f"HTTP {answer.status} {_clean(answer.body[:120].decode(errors='replace'))}".strip()


class EtcdClient:
    """etcd's v3 gateway: one failover policy, one total deadline per call (module docstring).

    Thread-safe: each thread has its own connections. The errors it raises are the class
    attributes (the rendezvous store puts torch's subclasses there)."""

    unavailable_error: ClassVar[type[EtcdUnavailable]] = EtcdUnavailable
    unknown_error: ClassVar[type[EtcdOutcomeUnknown]] = EtcdOutcomeUnknown
    request_error: ClassVar[type[EtcdRequestFailed]] = EtcdRequestFailed

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        timeout: float = 5.0,
        tls: TlsFiles | None = None,
        user: str | None = None,
        password: str | None = None,
        name: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if not timeout > 0:
            raise ValueError("the etcd call timeout must be positive")
        self.endpoints = tuple(Endpoint(str(h), int(p)) for h, p in endpoints)
        self.timeout = float(timeout)
        self.name = name or "etcd " + ",".join(str(e) for e in self.endpoints)
        self.max_request_bytes, self.max_answer_bytes = int(max_request_bytes), int(max_answer_bytes)
        self._user, self._password = user, password
        self._ssl = (tls or TlsFiles()).context()
        self._local = threading.local()
        self._conns: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._tokens: dict[int, str] = {}
        self._active = 0  # the member that answered last: tried first

    @classmethod
    def from_url(cls, url: str | EtcdUrl, *, timeout: float = 5.0) -> EtcdClient:
        where = url if isinstance(url, EtcdUrl) else parse_etcd_url(url)
        return cls(
            where.endpoints,
            timeout=timeout,
            tls=where.tls,
            user=where.user,
            password=where.password,
            name=str(where),
            max_request_bytes=where.max_request_bytes,
        )

    def __repr__(self) -> str:
        return f"EtcdClient({self.name!r}, timeout={self.timeout:g})"

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def close(self) -> None:
        """Close every connection of this client (any thread's)."""
        for c in list(self._conns):
            c.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call --------------------------------------------------------------------------------
    def call(
        self, path: str, body: Mapping[str, Any], what: str, *, idempotent: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST one request (`path` under /v3/) under the failover policy and one total deadline."""
        from gpuguard.foundation.etcd_http import AnswerTooLarge, Budget, NeverSent, NoAnswer

        size = request_bytes(body)
        if size > self.max_request_bytes:
            raise self._too_large(what, size)
        data = json.dumps(body, separators=(",", ":")).encode()
        budget = Budget(self.timeout if timeout is None else timeout)
        failures: list[str] = []
        n, start = len(self.endpoints), self._active
        for k in range(n):
            i = (start + k) % n
            ep = self.endpoints[i]
            if budget.left() <= 0:
                break
            try:
                answer = self._exchange(i, path, data, budget, budget.left() / (n - k))
            except NeverSent as exc:
                failures.append(f"{ep}: {exc}")
                continue
            except NoAnswer as exc:
                reason = f"did not answer within {budget.seconds:g} s" if budget.left() <= 0 else str(exc)
                if idempotent:
                    failures.append(f"{ep}: {reason}")
                    continue
                raise self.unknown_error(
                    f"{self.name}: {what} was sent to {ep} and no whole answer came ({reason}): it may or may "
                    "not have been applied (outcome unknown; not re-sent)"
                ) from None
            except AnswerTooLarge as exc:
                raise self.request_error(f"{self.name}: {what}: refused etcd's {exc}") from None
            out = self._outcome(answer, i, what, size, idempotent)
            if out is None:  # etcd provably did not act on it: the next member may
                failures.append(f"{ep}: {_error_of(answer)[1]}")
                continue
            self._active = i
            return out
        raise self.unavailable_error(
            f"{self.name} unreachable or not answering within {budget.seconds:g} s ({what}): "
            + ("; ".join(failures) or "no member tried")
        )

    def _conn(self, i: int) -> Connection:
        from gpuguard.foundation.etcd_http import Connection

        conns: dict[int, Connection] = self._local.__dict__.setdefault("conns", {})
        c = conns.get(i)
        if c is None:
            ep = self.endpoints[i]
            c = conns[i] = Connection(ep.host, ep.port, self._ssl)
            self._conns.add(c)
        return c

    def _exchange(self, i: int, path: str, data: bytes, budget: Budget, connect_s: float) -> Answer:
        """One exchange with member i, authenticated; a stale token is renewed and the request re-sent
        once (etcd rejected it before acting on it)."""
        conn = self._conn(i)
        headers = {} if self._user is None else {"Authorization": self._token(i, budget, connect_s)}
        answer = conn.exchange(
            API_PATH + path, data, headers, budget, connect_s=connect_s, max_answer=self.max_answer_bytes
        )
        if self._user is not None and _stale_token(answer):
            with self._lock:
                self._tokens.pop(i, None)
            headers["Authorization"] = self._token(i, budget, connect_s)
            answer = conn.exchange(
                API_PATH + path, data, headers, budget, connect_s=connect_s, max_answer=self.max_answer_bytes
            )
        return answer

    def _token(self, i: int, budget: Budget, connect_s: float) -> str:
        """Member i's auth token (simple tokens are per member); its failures count as "never sent"."""
        from gpuguard.foundation.etcd_http import NeverSent, NoAnswer

        with self._lock:
            token = self._tokens.get(i)
        if token is not None:
            return token
        body = json.dumps({"name": self._user, "password": self._password or ""}).encode()
        try:
            answer = self._conn(i).exchange(
                API_PATH + "auth/authenticate", body, {}, budget, connect_s=connect_s, max_answer=1 << 16
            )
        except NoAnswer as exc:
            raise NeverSent(f"authentication: {exc}") from None
        if answer.status != 200:
            code, msg = _error_of(answer)
            if code == 14:
                raise NeverSent(f"authentication: {msg}")
            raise EtcdRequestFailed(
                f"{self.name}: etcd {self.endpoints[i]} refused the credentials of user {self._user!r}: {msg}",
                exit_code=EXIT_NOPERM,
            )
        token = _json(answer.body, self.name).get("token")
        if not isinstance(token, str) or not token:
            raise EtcdRequestFailed(f"{self.name}: etcd {self.endpoints[i]} gave no auth token")
        with self._lock:
            self._tokens[i] = token
        return token

    def _outcome(self, answer: Answer, i: int, what: str, size: int, idempotent: bool) -> dict[str, Any] | None:
        """The answer's JSON, None when etcd provably did not act, or the error it means."""
        if answer.status == 200:
            return _json(answer.body, f"{self.name}: {what}")
        code, msg = _error_of(answer)
        if answer.status == 413 or "request is too large" in msg or "larger than max" in msg:
            raise self._too_large(what, size, msg)
        if code == 14 or answer.status == 503:  # Unavailable
            if "no leader" in msg or "not capable" in msg or idempotent:
                return None
            raise self.unknown_error(
                f"{self.name}: etcd {self.endpoints[i]} answered {what} with {msg!r}: it may or may not have been "
                "applied (outcome unknown; not re-sent)"
            )
        if code == 16 or "user name is empty" in msg or "permission denied" in msg:
            raise EtcdRequestFailed(
                f"{self.name}: etcd {self.endpoints[i]} refused {what}: {msg} (credentials: etcd://user:password@...)",
                exit_code=EXIT_NOPERM,
            )
        raise self.request_error(
            f"{self.name}: etcd {self.endpoints[i]} refused {what}: {msg}", lease_missing="lease not found" in msg
        )

    def _too_large(self, what: str, size: int, said: str = "") -> EtcdRequestTooLarge:
        return EtcdRequestTooLarge(
            f"{self.name}: {what} is too large for etcd: {size:,} bytes of keys and values against its request "
            f"limit of {self.max_request_bytes:,} bytes (--max-request-bytes, 1.5 MiB by default"
            + (f"; etcd said {said!r})" if said else ")")
        )

    # -- the requests gpuguard makes -----------------------------------------------------------
    def range(
        self,
        key: str | bytes,
        what: str,
        *,
        prefix: bool = False,
        range_end: str | bytes | None = None,
        keys_only: bool = False,
        count_only: bool = False,
        sort: bool = False,
    ) -> dict[str, Any]:
        """One range read (idempotent: retried on another member); the raw answer."""
        body: dict[str, Any] = {"key": b64(key)}
        if prefix or range_end is not None:
            body["range_end"] = b64(prefix_end(key) if range_end is None else range_end)
        if keys_only:
            body["keys_only"] = True
        if count_only:
            body["count_only"] = True
        if sort:
            body.update(sort_order="ASCEND", sort_target="KEY")
        return self.call("kv/range", body, what, idempotent=True)

    def get(self, key: str | bytes, what: str = "get") -> KV | None:
        kvs = range_kvs(self.range(key, what))
        return kvs[0] if kvs else None

    def put(self, key: str | bytes, value: str | bytes, what: str = "put", *, lease: int | None = None) -> None:
        body = put_op(key, value, lease)["request_put"]
        self.call("kv/put", body, what)

    def txn(
        self,
        what: str,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One transaction: never re-sent once it may have reached a member, unless it only reads."""
        reads_only = not compare and all("request_range" in op for op in [*success, *(failure or [])])
        body = {"compare": compare, "success": success, "failure": failure or []}
        return self.call("kv/txn", body, what, idempotent=reads_only)

    def delete(
        self, key: str | bytes, what: str = "delete", *, prefix: bool = False, range_end: str | bytes | None = None
    ) -> int:
        """Delete a key (or every key with the prefix `key`, or up to `range_end`); how many went."""
        body: dict[str, Any] = {"key": b64(key)}
        if prefix or range_end is not None:
            body["range_end"] = b64(prefix_end(key) if range_end is None else range_end)
        return int(self.call("kv/deleterange", body, what).get("deleted", 0))

    def grant(self, ttl: int, what: str = "lease grant") -> int:
        return int(self.call("lease/grant", {"TTL": int(ttl), "ID": 0}, what)["ID"])

    def keepalive(self, lease: int, what: str = "lease keep-alive", *, timeout: float | None = None) -> int:
        """The lease's TTL after the refresh, or -1 when it has expired (a refresh is idempotent)."""
        out = self.call("lease/keepalive", {"ID": str(lease)}, what, idempotent=True, timeout=timeout)
        result = out.get("result", {})
        return int(result.get("TTL", -1)) if isinstance(result, dict) else -1

    def time_to_live(self, lease: int, what: str = "lease time-to-live") -> int:
        """Seconds the lease has left, or -1 when etcd no longer has it (expired or revoked)."""
        out = self.call("lease/timetolive", {"ID": str(lease)}, what, idempotent=True)
        return int(out.get("TTL", -1))

    def revoke(self, lease: int, what: str = "lease revoke") -> bool:
        """Revoke a lease; False when etcd no longer has it."""
        try:
            self.call("lease/revoke", {"ID": str(lease)}, what)
        except EtcdRequestFailed as exc:
            if exc.lease_missing:
                return False
            raise
        return True

    def watch_once(self, key: str | bytes, start_revision: int, timeout: float) -> bool:
        """Block until `key` changes at or after `start_revision`, at most `timeout` s: True on a
        change (or a watch etcd ended: re-read either way). False on a timeout or any failure;
        the caller re-reads, which raises if etcd is really gone."""
        return self.watch(key, start_revision, timeout) != "nothing"

    def watch(self, key: str | bytes, start_revision: int, timeout: float) -> WatchEnd:
        """One bounded long-poll of `key` through `/v3/watch` (a streamed answer, one connection of its
        own, closed on return; no thread): it returns by `timeout` whatever etcd does.

        `start_revision` is the first revision whose change counts (the revision last read + 1, so
        a change between the read and the watch is not missed; 0: from now). "changed": an event on
        the key; "ended": etcd ended the watch without one (the start revision was compacted, or it
        canceled the watch): re-read, then watch from the revision read; "nothing": the timeout
        passed or the watch failed (refused, reset, not the gateway): the caller's next read says
        whether etcd is really gone. Only the member that answered last is asked (no failover: a
        failed watch costs the caller its timeout, never a wrong answer)."""
        from gpuguard.foundation.etcd_http import Budget, Connection, NeverSent, NoAnswer

        if timeout <= 0:
            return "nothing"
        budget = Budget(timeout)
        i = self._active
        ep = self.endpoints[i]
        conn = Connection(ep.host, ep.port, self._ssl)
        body = json.dumps({"create_request": {"key": b64(key), "start_revision": int(start_revision)}}).encode()
        try:
            headers = {} if self._user is None else {"Authorization": self._token(i, budget, budget.left())}
            status, read1 = conn.stream(API_PATH + "watch", body, headers, budget, connect_s=budget.left())
            if status != 200:
                return "nothing"
            buf = b""
            while len(buf) <= self.max_answer_bytes:
                chunk = read1(1 << 16)
                if not chunk:
                    return "nothing"
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    result = json.loads(line).get("result", {}) if line.strip() else {}
                    if result.get("events"):
                        return "changed"
                    if result.get("canceled") or result.get("compact_revision"):
                        return "ended"
            return "nothing"
        except (NeverSent, NoAnswer, OSError, ValueError, AttributeError, RecursionError, EtcdRequestFailed):
            return "nothing"
        except Exception as exc:  # http.client's own errors (IncompleteRead, ...): a broken stream
            if type(exc).__module__ == "http.client":
                return "nothing"
            raise
        finally:
            conn.close()


def _stale_token(answer: Answer) -> bool:
    if answer.status == 200:
        return False
    code, msg = _error_of(answer)
    return code == 16 or "invalid auth token" in msg or "auth token" in msg


def _json(body: bytes, what: str) -> dict[str, Any]:
    """An answer's JSON object (the first line of a streamed answer such as keep-alive's)."""
    try:
        doc = json.loads(body)
    except ValueError:
        try:
            doc = json.loads(body.split(b"\n", 1)[0])
        except (ValueError, RecursionError):
            doc = None
    except RecursionError:
        doc = None
    if not isinstance(doc, dict):
        raise EtcdRequestFailed(f"{what}: etcd's answer is not a JSON object")
    return doc
