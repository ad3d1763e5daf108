"""One etcd prefix read again and again, each later read fetching only what changed since the last.

The in-place coordinator reads the survivors' reports and every remote member's lease key on each
pass of its switch loop. At 100,000 ranks a full read of `P/lease/` is 100,000 keys (seconds of
etcd's JSON gateway), and of the reports 12,500 keys / 13 MB; between two passes almost nothing
changes. `PrefixMirror.refresh()` returns exactly what one full range read of the prefix would
return at some revision H, and reads from etcd:

1. the first time (or when the deletions below are too many): the whole prefix, one range;
2. afterwards, one read-only transaction at one revision H: the keys whose `mod_revision` is past
   the previous read's revision R (`min_mod_revision`: every key created, re-created or written
   since), and `count_only` of each of up to 127 buckets (contiguous key ranges that split the
   known keys evenly; `count_only` reads etcd's index, not the values);
3. a bucket whose count is lower than the keys it should hold lost keys since R: that bucket alone
   is read again, pinned at revision H (`revision`; compacted meanwhile: a full read instead).

Why it equals the full read at H: a key present at H either was written after R (step 2 returns
it) or holds the version it held at R (the previous result has it). A key of the previous result
absent at H was deleted; the only change a count cannot show is a deletion, and a bucket with a
deletion counts less than (previous keys ∪ written keys) in it, so it is read again whole.

Bounded: every read goes through `foundation.etcd.EtcdClient` (a total deadline per call, the
answer size capped by `max_answer_bytes`); a later read transfers the changed keys and one count
per bucket.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.etcd import KV, MAX_TXN_OPS, EtcdClient, EtcdRequestFailed, b64, prefix_end, range_kvs

BUCKETS = MAX_TXN_OPS - 1  # the counts and the changed-keys range fit one transaction
MAX_REREAD_BUCKETS = 16  # more buckets lost keys than this: one full read instead


@dataclass(frozen=True)
class ReadStats:
    """What the last refresh read: `full` (the whole prefix), keys transferred, buckets read again."""

    full: bool
    keys: int
    buckets_reread: int


class PrefixMirror:
    """The keys under `prefix` as of the last `refresh()` (see the module docstring)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str | bytes,
        what: str,
        *,
        keys_only: bool = False,
        buckets: int = BUCKETS,
        max_reread: int = MAX_REREAD_BUCKETS,
    ) -> None:
        if not 1 <= buckets <= BUCKETS:
            raise ValueError(f"1..{BUCKETS} buckets (one transaction), not {buckets}")
        self.client, self.what, self.keys_only = client, what, keys_only
        self.buckets, self.max_reread = buckets, max_reread
        self.prefix = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        self.end = prefix_end(self.prefix)
        self.revision = 0  # of the last refresh; 0: never read
        self.kvs: dict[bytes, KV] = {}
        self.version = 0  # +1 whenever `kvs` changed (callers cache what they derive from it)
        self.last = ReadStats(True, 0, 0)
        self._sorted: list[bytes] = []

    def refresh(self) -> dict[bytes, KV]:
        """key -> KV in key order, equal to one full range read of the prefix at the revision
        `revision` now names (do not change it: the next refresh starts from it)."""
        if self.revision == 0:
            return self._full()
        bounds = self._buckets()
        ops = [self._range_op(self.prefix, self.end, min_mod_revision=self.revision + 1)]
        ops += [self._range_op(lo, hi, count_only=True) for lo, hi in bounds]
        answer = self.client.txn(self.what, [], ops)
        responses = answer.get("responses", [])
        if not isinstance(responses, list) or len(responses) != len(ops):
            raise EtcdRequestFailed(f"{self.what}: etcd answered {len(ops)} ranges with a malformed transaction")
        at = _revision(answer)
        changed = range_kvs(responses[0])
        known = self._sorted
        new = sorted(kv.key for kv in changed if kv.key not in self.kvs)
        union = known if not new else sorted([*known, *new])
        short = [
            (lo, hi)
            for (lo, hi), resp in zip(bounds, responses[1:])
            if _count(resp) != _between(union, lo, hi)  # fewer: keys deleted there since the last read
        ]
        if len(short) > self.max_reread:
            return self._full()
        kvs = dict(self.kvs)
        for kv in changed:
            kvs[kv.key] = kv
        reread = 0
        for lo, hi in short:
            try:
                fresh = range_kvs(self._range(lo, hi, revision=at))
            except EtcdRequestFailed as exc:
                if "compacted" not in str(exc):
                    raise
                return self._full()  # revision `at` is gone already: start over
            for key in union[bisect.bisect_left(union, lo) : bisect.bisect_left(union, hi)]:
                kvs.pop(key, None)
            kvs.update((kv.key, kv) for kv in fresh)
            reread += len(fresh)
        if changed or short:
            self._set(kvs)
        self.revision = at
        self.last = ReadStats(False, len(changed) + reread, len(short))
        return self.kvs

    def _full(self) -> dict[bytes, KV]:
        answer = self._range(self.prefix, self.end)
        kvs = range_kvs(answer)
        self._set({kv.key: kv for kv in kvs})
        self.revision = _revision(answer)
        self.last = ReadStats(True, len(kvs), 0)
        return self.kvs

    def _set(self, kvs: dict[bytes, KV]) -> None:
        self._sorted = sorted(kvs)
        self.kvs = {k: kvs[k] for k in self._sorted}  # in key order, as a range answers
        self.version += 1

    def _buckets(self) -> list[tuple[bytes, bytes]]:
        """Up to BUCKETS contiguous key ranges covering the whole prefix, the known keys split evenly."""
        keys = self._sorted
        n = min(self.buckets, max(1, len(keys)))
        starts = [self.prefix] + [keys[i * len(keys) // n] for i in range(1, n)]
        starts = sorted(set(starts))
        return list(zip(starts, [*starts[1:], self.end]))

    def _range_op(self, lo: bytes, hi: bytes, *, min_mod_revision: int = 0, count_only: bool = False) -> dict[str, Any]:
        op: dict[str, Any] = {"key": b64(lo), "range_end": b64(hi)}
        if count_only:
            op["count_only"] = True
        elif self.keys_only:
            op["keys_only"] = True
        if min_mod_revision:
            op["min_mod_revision"] = str(min_mod_revision)
        return {"request_range": op}

    def _range(self, lo: bytes, hi: bytes, *, revision: int = 0) -> dict[str, Any]:
        body = self._range_op(lo, hi)["request_range"]
        if revision:
            body["revision"] = str(revision)
        return self.client.call("kv/range", body, self.what, idempotent=True)


def _between(keys: list[bytes], lo: bytes, hi: bytes) -> int:
    return bisect.bisect_left(keys, hi) - bisect.bisect_left(keys, lo)


def _revision(answer: dict[str, Any]) -> int:
    try:
        rev = int(answer["header"]["revision"])
    except (KeyError, TypeError, ValueError):
        raise EtcdRequestFailed("etcd answered without a revision") from None
    if rev <= 0:
        raise EtcdRequestFailed("etcd answered revision 0")
    return rev


def _count(response: Any) -> int:
    """`count` of one range response of a transaction (the gateway leaves out a count of 0)."""
    body = response.get("response_range", {}) if isinstance(response, dict) else {}
    try:
        return int(body.get("count", 0)) if isinstance(body, dict) else -1
    except (TypeError, ValueError):
        return -1
