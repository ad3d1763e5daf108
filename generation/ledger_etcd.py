"""etcd ledger backend (`etcd://[user:password@]host:port[,host:port...]/prefix`): the ledger for jobs that span machines.

Talks to etcd through `foundation.etcd.EtcdClient`: every call has a total deadline (`timeout`:
a trickling or stalling etcd cannot reset it), goes to the next member only when it provably
never reached one, and is never re-sent once it may have been applied. An unreachable or slow
etcd is `UnavailableError` (exit 75); a write whose answer was lost is `EtcdOutcomeUnknown` (also
75: each write is one etcd transaction, all or nothing, and a re-read tells which). TLS and
user/password auth come with the URL (docs/formats/ledger.md); the URL is only ever shown redacted.

Keys under the prefix P:
  P/gen/<N, 12 digits>   the canonical certificate bytes of generation N
  P/active               "N", the active generation
  P/frontier/<G, 12 digits>  the frontier record of generation G (one key, raised in place)
  P/log/<log>/<time_ns>-<uuid>   append-only records (commits-<G> of older runtimes, fenced, refusals)
  P/chunks/<sha256>      a chunk of a certificate's member table or body, named by its SHA-256

Activation of N is its chunks (one put each, before), then one transaction: compare `P/gen/N`'s
create revision with 0 and `P/active` with "N-1" (its create revision with 0 for the genesis),
then put both. Exactly one racer's transaction succeeds. A request over etcd's size limit is
`EtcdRequestTooLarge` (exit 65), which names the limit and the size (`foundation.etcd`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from gpuguard.foundation.etcd import (
    DEFAULT_PREFIX,
    KV,
    Endpoint,
    EtcdClient,
    EtcdUrl,
    b64,
    compare,
    parse_etcd_url,
    prefix_end,
    put_op,
    range_kvs,
)
from gpuguard.generation.chunks import Blob
from gpuguard.generation.ledger import Ledger, dumps_record


class EtcdLedger(Ledger):
    def __init__(self, host: str, port: int, prefix: str, *, key: bytes | None = None, timeout: float = 5.0) -> None:
        self._open(
            EtcdUrl((Endpoint(host, port),), "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX),
            key,
            timeout,
        )

    def _open(self, where: EtcdUrl, key: bytes | None, timeout: float) -> None:
        super().__init__(key)
        self.prefix = where.prefix
        self.url = str(where)  # redacted: what every output shows
        self.timeout = timeout
        self.client = EtcdClient.from_url(where, timeout=timeout)

    @classmethod
    def from_url(cls, url: str, *, key: bytes | None = None, timeout: float = 5.0) -> EtcdLedger:
        ledger = cls.__new__(cls)
        ledger._open(parse_etcd_url(url), key, timeout)  # noqa: SLF001 - its own class, built without __init__
        return ledger

    def close(self) -> None:
        self.client.close()

    # -- keys -----------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def _gen_key(self, generation: int) -> str:
        return self._key("gen", f"{generation:012d}")

    def _log_key(self, log: str) -> str:
        return self._key("log", log, f"{time.time_ns():020d}-{uuid.uuid4().hex}")

    def record_name(self, generation: int) -> str:
        return f"{self.url} key {self._gen_key(generation)}"

    def _range(self, start: str, what: str, *, end: bytes | None = None, keys_only: bool = False) -> list[KV]:
        """Every key from `start` (to `end`, default: every key with the prefix `start`), by key."""
        return range_kvs(
            self.client.range(
                start, what, range_end=prefix_end(start) if end is None else end, keys_only=keys_only, sort=True
            )
        )

    def lease_time_left(self, incarnation_ids: Sequence[str]) -> dict[str, int] | None:
        """One keys-only range of `P/lease/`, then one time-to-live per distinct lease among the asked
        ids (a host's ranks share one): bounded by the hosts asked about, not the job's size."""
        wanted = set(incarnation_ids)
        if not wanted:
            return {}
        base = self._key("lease", "")
        lease_of = {
            kv.key.decode(errors="replace")[len(base) :]: kv.lease
            for kv in self._range(base, "lease list", keys_only=True)
        }
        ttl: dict[int, int] = {}
        out: dict[str, int] = {}
        for inc in sorted(wanted & lease_of.keys()):
            lease = lease_of[inc]
            if lease not in ttl:
                ttl[lease] = self.client.time_to_live(lease) if lease else -1
            if ttl[lease] >= 0:
                out[inc] = ttl[lease]
        return out

    # -- primitives -----------------------------------------------------------------------
    def _read(self, generation: int) -> bytes | None:
        kv = self.client.get(self._gen_key(generation), "certificate read")
        return None if kv is None else kv.value

    def _read_from(self, generation: int) -> Iterator[bytes]:
        """One range read from `gen/<generation>` on, consecutive numbers only."""
        end = prefix_end(self._key("gen", ""))
        for kv in self._range(self._gen_key(generation), "certificate range", end=end):
            if kv.key.decode(errors="replace") != self._gen_key(generation):
                return
            yield kv.value
            generation += 1

    def _generations(self) -> list[int]:
        out = []
        for kv in self._range(self._key("gen", ""), "generation list", keys_only=True):
            tail = kv.key.decode(errors="replace").rsplit("/", 1)[-1]
            if tail.isdigit():
                out.append(int(tail))
        return out

    def _create(self, generation: int, data: bytes, refusal: dict[str, Any] | None = None) -> bool:
        """One transaction: `gen/N` does not exist yet and `active` still says N-1 (absent for N=0).

        `active` only ever moves forward, so comparing its value is as strong as comparing its
        mod revision, and saves the round trip that would read the revision first.
        """
        active, gen = self._key("active"), self._gen_key(generation)
        result = self.client.txn(
            f"activation of generation {generation}",
            [
                compare(gen, "CREATE", 0),
                compare(active, "CREATE", 0) if generation == 0 else compare(active, "VALUE", str(generation - 1)),
            ],
            [put_op(gen, data), put_op(active, str(generation))],
            [] if refusal is None else [put_op(self._log_key("refusals"), dumps_record(refusal))],
        )
        return bool(result.get("succeeded", False))

    # -- chunks: P/chunks/<sha256> ---------------------------------------------------------
    def _chunk_key(self, sha256: str) -> str:
        return self._key("chunks", sha256)

    def _read_chunk(self, sha256: str) -> bytes | None:
        kv = self.client.get(self._chunk_key(sha256), "chunk read")
        return None if kv is None else kv.value

    def _write_chunks(self, chunks: Sequence[Blob]) -> None:
        """One put per chunk (each well under etcd's request limit), all before the activation's
        transaction. A put of a chunk that exists writes the same bytes (the same digest) and
        renews its mod revision, which keeps it from `prune_chunks`."""
        for chunk in chunks:
            self.client.put(self._chunk_key(chunk.sha256), chunk.data, "chunk put")

    def _chunk_stamps(self) -> dict[str, int]:
        kvs = self._range(self._key("chunks", ""), "chunk list", keys_only=True)
        return {kv.key.decode(errors="replace").rsplit("/", 1)[-1]: kv.mod_revision for kv in kvs}

    def _gen_stamp(self, generation: int) -> int | None:
        kv = self.client.get(self._gen_key(generation), "certificate read")
        return None if kv is None else kv.create_revision

    def _delete_chunk(self, sha256: str, stamp: int) -> bool:
        """One transaction: delete only while its mod revision is still `stamp` (not re-written)."""
        key = self._chunk_key(sha256)
        result = self.client.txn(
            "chunk prune", [compare(key, "MOD", stamp)], [{"request_delete_range": {"key": b64(key)}}]
        )
        return bool(result.get("succeeded", False))

    def _append(self, log: str, record: dict[str, Any]) -> None:
        self.client.put(self._log_key(log), dumps_record(record), f"append to {log}")

    def _append_if_active(self, generation: int, log: str, record: dict[str, Any]) -> bool:
        """Append only while `generation` is still active, in the same transaction (no window)."""
        result = self.client.txn(
            f"append to {log}",
            [compare(self._key("active"), "VALUE", str(generation))],
            [put_op(self._log_key(log), dumps_record(record))],
        )
        return bool(result.get("succeeded", False))

    def _frontier_key(self, generation: int) -> str:
        return self._key("frontier", f"{generation:012d}")

    def _read_frontier(self, generation: int) -> tuple[bytes | None, Any]:
        kv = self.client.get(self._frontier_key(generation), "frontier read")
        return (None, 0) if kv is None else (kv.value, kv.mod_revision)

    def _write_frontier(self, generation: int, data: bytes, token: Any) -> bool:
        """One transaction: `active` still says `generation`, and the record is the one read (its mod
        revision; 0: it did not exist). The key is replaced, never added to: one key per generation."""
        key = self._frontier_key(generation)
        result = self.client.txn(
            f"frontier of generation {generation}",
            [
                compare(self._key("active"), "VALUE", str(generation)),
                compare(key, "CREATE", 0) if not token else compare(key, "MOD", int(token)),
            ],
            [put_op(key, data)],
        )
        return bool(result.get("succeeded", False))

    def _read_log(self, log: str) -> bytes:
        return b"".join(kv.value for kv in self._range(self._key("log", log, ""), f"read of {log}"))
