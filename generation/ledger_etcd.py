"""etcd ledger backend (`etcd://host:port[,host:port...]/prefix`): the ledger for jobs that span many machines.

Talks to etcd's v3 JSON gateway through `etcd3gw` (path `/v3/`, etcd >= 3.4), every call with a
total wall-clock deadline (`timeout`, `foundation.deadline`: a trickling or stalling etcd cannot
reset it); an unreachable or slow etcd is `UnavailableError` (exit 75). A write whose answer did
not come in time may or may not have been applied (each is one etcd transaction, all or nothing).

Keys under the prefix P:
  P/gen/<N, 12 digits>   the canonical certificate bytes of generation N
  P/active               "N", the active generation
  P/log/<log>/<time_ns>-<uuid>   append-only records (commits-<G>, fenced, refusals)

Activation of N is one transaction: compare `P/gen/N`'s create revision with 0 and `P/active`
with "N-1" (its create revision with 0 for the genesis), then put both. Exactly one racer's
transaction succeeds.

With several members listed, a call that could not reach one goes to the next
(`foundation.etcd_url.failover_client`): losing one etcd member does not stop the job.

Lazy imports (start-up time): etcd3gw and requests, only when an etcd ledger is opened.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from gpuguard.foundation.deadline import DeadlineExceeded, call_with_deadline
from gpuguard.foundation.errors import UnavailableError
from gpuguard.foundation.etcd_url import EtcdUrl, failover_client, parse_etcd_url
from gpuguard.generation.ledger import Ledger, dumps_record

if TYPE_CHECKING:
    from etcd3gw.types import KeyValue

_T = TypeVar("_T")


def _b64(data: str | bytes) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class EtcdLedger(Ledger):
    def __init__(
        self, host: str, port: int, prefix: str, *, key: bytes | None = None, timeout: float = 5.0, scheme: str = "http"
    ) -> None:
        self._open(
            EtcdUrl(((host, port),), "/" + prefix.strip("/") if prefix.strip("/") else "/gpuguard"), key, timeout
        )

    def _open(self, where: EtcdUrl, key: bytes | None, timeout: float) -> None:
        super().__init__(key)
        self.prefix = where.prefix
        self.url = str(where)
        self.timeout = timeout
        self.client = failover_client(where.endpoints, timeout=timeout)  # never through an HTTP proxy

    @classmethod
    def from_url(cls, url: str, *, key: bytes | None = None, timeout: float = 5.0) -> EtcdLedger:
        ledger = cls.__new__(cls)
        ledger._open(parse_etcd_url(url), key, timeout)
        return ledger

    def close(self) -> None:
        self.client.session.close()

    # -- transport ------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        from etcd3gw import exceptions as ex

        try:
            # `timeout` is per call, wall clock: requests' own timeout is per socket read, and an etcd
            # (or a proxy) that trickles or stalls mid-answer would reset it forever
            return call_with_deadline(lambda: fn(*args, **kw), self.timeout, name="gpuguard-etcd-ledger")
        except DeadlineExceeded:
            raise UnavailableError(
                f"{self.url}: etcd did not answer within {self.timeout:g} s ({what}); nothing is known "
                "about a write that was under way"
            ) from None
        except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as exc:
            raise UnavailableError(
                f"{self.url}: etcd unreachable or not answering within {self.timeout:g} s ({what})"
            ) from exc
        except ex.Etcd3Exception as exc:
            raise UnavailableError(f"{self.url}: etcd error during {what}: {str(exc)[:200]}") from exc

    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def _gen_key(self, generation: int) -> str:
        return self._key("gen", f"{generation:012d}")

    def record_name(self, generation: int) -> str:
        return f"{self.url} key {self._gen_key(generation)}"

    def _range(self, prefix: str, *, keys_only: bool = False) -> list[tuple[bytes, KeyValue]]:
        p = prefix.encode()
        return self._call(
            "range",
            self.client.get,
            p,
            metadata=True,
            range_end=_prefix_end(p),
            sort_order="ascend",
            sort_target="key",
            keys_only=keys_only,
        )

    # -- primitives -----------------------------------------------------------------------
    def _read(self, generation: int) -> bytes | None:
        got = self._call("get", self.client.get, self._gen_key(generation))
        return got[0] if got else None

    def _read_from(self, generation: int) -> Iterator[bytes]:
        """One range read from `gen/<generation>` on, consecutive numbers only."""
        start = self._gen_key(generation).encode()
        end = _prefix_end(self._key("gen", "").encode())
        got: list[tuple[bytes, KeyValue]] = self._call(
            "range", self.client.get, start, metadata=True, range_end=end, sort_order="ascend", sort_target="key"
        )
        for value, meta in got:
            k = meta["key"].decode() if isinstance(meta["key"], bytes) else meta["key"]
            if k != self._gen_key(generation):
                return
            yield value
            generation += 1

    def _generations(self) -> list[int]:
        out = []
        for _, meta in self._range(self._key("gen", ""), keys_only=True):
            k = meta["key"].decode() if isinstance(meta["key"], bytes) else meta["key"]
            tail = k.rsplit("/", 1)[-1]
            if tail.isdigit():
                out.append(int(tail))
        return out

    def _create(self, generation: int, data: bytes, refusal: dict[str, Any] | None = None) -> bool:
        """One transaction: `gen/N` does not exist yet and `active` still says N-1 (absent for N=0).

        `active` only ever moves forward, so comparing its value is as strong as comparing its
        mod revision, and saves the round trip that would read the revision first.
        """
        active_key, gen_key = _b64(self._key("active")), _b64(self._gen_key(generation))
        compare: list[dict[str, Any]] = [
            {"key": gen_key, "result": "EQUAL", "target": "CREATE", "create_revision": 0},
            (
                {"key": active_key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
                if generation == 0
                else {"key": active_key, "result": "EQUAL", "target": "VALUE", "value": _b64(str(generation - 1))}
            ),
        ]
        txn = {
            "compare": compare,
            "success": [
                {"request_put": {"key": gen_key, "value": _b64(data)}},
                {"request_put": {"key": active_key, "value": _b64(str(generation))}},
            ],
            "failure": []
            if refusal is None
            else [{"request_put": {"key": _b64(self._log_key("refusals")), "value": _b64(dumps_record(refusal))}}],
        }
        result = self._call("transaction", self.client.transaction, txn)
        return bool(result.get("succeeded", False))

    def _log_key(self, log: str) -> str:
        return self._key("log", log, f"{time.time_ns():020d}-{uuid.uuid4().hex}")

    def _append(self, log: str, record: dict[str, Any]) -> None:
        key = self._log_key(log)
        self._call("put", self.client.put, key, dumps_record(record))

    def _append_if_active(self, generation: int, log: str, record: dict[str, Any]) -> bool:
        """Append only while `generation` is still active, in the same transaction (no window)."""
        key = self._log_key(log)
        txn = {
            "compare": [
                {"key": _b64(self._key("active")), "result": "EQUAL", "target": "VALUE", "value": _b64(str(generation))}
            ],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(dumps_record(record))}}],
            "failure": [],
        }
        return bool(self._call("transaction", self.client.transaction, txn).get("succeeded", False))

    def _read_log(self, log: str) -> bytes:
        return b"".join(value for value, _ in self._range(self._key("log", log, "")))
