"""The in-place switch's etcd transport: reports, refusals, aborts, leases and the group store address.

Keys under the etcd ledger's prefix P (docs/formats/inplace.md, docs/formats/leases.md):
  P/inplace/g<G>/host/<block>/<host>           one host's reports of ranks block*64.. (HostReport), by
                                               its aggregator (recovery.runtime.host_reports)
  P/inplace/g<G>/report/<rank>-<incarnation>   a survivor's Report (JSON), where nothing aggregates it
  P/inplace/g<G>/refused                       the coordinator's refusal
  P/inplace/g<G>/store                         "host:port" of generation G's group store
  P/inplace/abort                              an operator's abort request
  P/lease/<incarnation>                        attached to its host's lease (recovery.runtime.host_lease)

Bounded: once generation G+1 is active nobody reads generation G-1's keys any more, so the
coordinator that activates G+1 deletes every `P/inplace/g<k>/` with k < G (`prune`): the keyspace
holds at most two generations' reports (about 2 x hosts keys; 2 x ranks where no host aggregates),
whatever the job's length.

Every write a stale incarnation could make is one transaction that compares what makes it
legitimate: a report of G (per rank or aggregated) needs `P/active == G` and the writer's own lease key; a store address
of G needs `P/active == G` and the lease key too; so does a refusal of G. Fenced writes are counted in `fenced_writes`.

The group store. Generation G+1's rank 0 serves a c10d TCPStore on its own address (the one it
reaches etcd from) and publishes it under `P/inplace/g<G+1>/store`; the others read it from etcd
and connect. Chosen by measurement over `recovery.rendezvous.etcd_store.EtcdStore` (`python bench/hosts.py
--faults '' --stores 10`, two namespace hosts, store + init_process_group + one all_reduce):
TCPStore 4 ms p50 / 8 ms p90, EtcdStore 33 ms / 83 ms (every set is a raft write, every wait a
watch). In the switch itself the TCPStore path (publish, read, connect, form) measured 8-26 ms.
What etcd would add, a store that outlives its host, buys nothing here: the store only lives while
G+1's group forms, and its host is a member of G+1, so losing it fails the group either way (the
survivors then switch again, a clean G+2).

Transport: `foundation.etcd.EtcdClient` (the members in turn when one is down, a total deadline on
every call, a write never re-sent once it may have been applied, TLS and auth from the URL).

Lazy imports (start-up time): torch.distributed, only where it is used.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from gpuguard.foundation.errors import GpuguardError, UnavailableError
from gpuguard.foundation.etcd import (
    DEFAULT_PREFIX,
    KV,
    MAX_TXN_OPS,
    Endpoint,
    EtcdClient,
    EtcdRequestFailed,
    EtcdUrl,
    compare,
    parse_etcd_url,
    put_op,
    range_op,
)
from gpuguard.foundation.etcd_mirror import PrefixMirror
from gpuguard.foundation.gcpause import gc_paused
from gpuguard.foundation.identity import own_start_time
from gpuguard.foundation.inplace_files import HOST_BLOCK, HostReport, Report, merge_reports
from gpuguard.recovery.runtime.host_lease import HostDir, HostHeartbeat, Member, join
from gpuguard.recovery.runtime.host_reports import HostReports, aggregator, blocks
from gpuguard.recovery.runtime.lease import Heartbeat, LeaseTiming
from gpuguard.recovery.runtime.lease import now as lease_clock

ABORT_POLL_S = 0.2  # an abort request is read at most this often (not once per step)


def local_address(host: str, port: int) -> str:
    """The address this host reaches `host:port` from (no packet is sent): what peers can dial."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _report(key: bytes, raw: bytes, generation: int) -> Report | None:
    """A per-rank record, or None (malformed: a report not made). Its generation is checked by the merge."""
    try:
        return Report.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None


def _host_report(key: bytes, raw: bytes, generation: int) -> HostReport | None:
    """An aggregated record of generation G, or None (malformed, foreign: a report not made)."""
    try:
        doc = HostReport.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None
    return doc if doc.generation == generation else None


class EtcdCoordination:
    """See the module docstring. One client for coordination, one (short timeout) for the lease."""

    kind = "etcd"

    def __init__(self, host: str, port: int, prefix: str, *, timeout: float = 3.0) -> None:
        self._open(
            EtcdUrl((Endpoint(host, port),), "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX), timeout
        )

    def _open(self, where: EtcdUrl, timeout: float) -> None:
        self.where, self.timeout = where, timeout
        self.host, self.port = where.endpoints[0]
        self.prefix = where.prefix
        self.url = str(where)  # redacted
        self.client = EtcdClient.from_url(where, timeout=timeout)  # the next member if one is down
        self.fenced_writes = 0
        self.heartbeat: Heartbeat | None = None
        self._lease: int | None = None
        self._lease_key: str | None = None
        self._abort_seen: tuple[float, dict[str, Any] | None] = (-1e9, None)
        self._store: Any = None  # the TCPStore this process serves for its generation
        self._beat_client: EtcdClient | None = None
        self._hostdir: HostDir | None = None
        self._incarnation_id = ""
        self._host_reports: HostReports | None = None  # with a host lease: reports are aggregated per host
        self._published: dict[tuple[int, int], frozenset[tuple[int, str]]] = {}  # what this aggregator wrote
        self.keys_read = 0  # keys the last read_reports read from etcd (bench/scale.py)
        # the reports of one generation and the lease keys, each read again incrementally (foundation.etcd_mirror)
        self._report_mirrors: tuple[int, PrefixMirror, PrefixMirror, dict[int, PrefixMirror]] | None = None
        self._parsed_reports: tuple[int, int, dict[int, Report]] = (-1, -1, {})  # (generation, versions, reports)
        self._seen: dict[bytes, tuple[int, Report | HostReport | None]] = {}  # key -> (mod revision, parsed)
        self._leases = PrefixMirror(self.client, self._key("lease", ""), "lease list", keys_only=True)
        self._alive: tuple[int, frozenset[str]] = (-1, frozenset())  # (mirror version, incarnation ids)

    @classmethod
    def from_url(cls, url: str, *, timeout: float = 3.0) -> EtcdCoordination:
        coord = cls.__new__(cls)
        coord._open(parse_etcd_url(url), timeout)  # noqa: SLF001 - its own class, built without __init__
        return coord

    # -- plumbing ---------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def _gkey(self, generation: int, *parts: str) -> str:
        return self._key("inplace", f"g{generation:012d}", *parts)

    def _get(self, key: str) -> bytes | None:
        kv = self.client.get(key, "coordination read")
        return None if kv is None else kv.value

    def _put_if(self, key: str, value: str, compares: list[dict[str, Any]], what: str) -> bool:
        ok = bool(self.client.txn(what, compares, [put_op(key, value)]).get("succeeded", False))
        if not ok:
            self.fenced_writes += 1
        return ok

    def _active_is(self, generation: int) -> dict[str, Any]:
        return compare(self._key("active"), "VALUE", str(generation))

    def _lease_alive(self) -> list[dict[str, Any]]:
        if self._lease_key is None:
            return []
        return [compare(self._lease_key, "CREATE", 0, "GREATER")]

    # -- leases -----------------------------------------------------------------------------
    def hold_lease(self, incarnation_id: str, info: dict[str, Any], timing: LeaseTiming, on_fence: Any) -> Heartbeat:
        """Join this host's lease (`recovery.runtime.host_lease`: granted by its first rank, renewed by
        one rank at a time), attach `P/lease/<id>` to it, start the heartbeat and the self-fence."""
        ttl = max(1, round(timing.ttl_s))
        scope = f"{','.join(f'{h}:{p}' for h, p in self.where.endpoints)}|{self.prefix}|{timing.ttl_s!r}"
        hostdir = HostDir.for_lease(scope)
        lease, renewer_fd = join(hostdir, lambda: self.client.grant(ttl, "lease grant"), timing)
        key = self._key("lease", incarnation_id)
        pid = int(info.get("pid", os.getpid()))
        start = float(info.get("start_time", own_start_time()))
        member = Member(key, pid, start, lease_clock())
        hostdir.register(incarnation_id, member)  # before the key: a dead rank's key is always found
        self.client.put(key, json.dumps({**info, **timing.to_dict()}), "lease key", lease=lease)
        self._lease, self._lease_key, self._hostdir, self._incarnation_id = lease, key, hostdir, incarnation_id
        self._host_reports = HostReports(hostdir)
        # its own client (connections of its own), each keep-alive bounded by the keepalive timeout
        beat = EtcdClient.from_url(self.where, timeout=timing.call_timeout_s)

        def keepalive() -> bool:
            return beat.keepalive(lease) > 0  # -1: etcd says the lease is gone (already expired)

        def forget(dead_key: str) -> None:
            beat.delete(dead_key, "lease key of a rank gone from this host")

        self.heartbeat = HostHeartbeat(
            hostdir,
            lease,
            keepalive,
            timing,
            on_fence,
            renewer_fd=renewer_fd,
            forget=forget,
            member=(incarnation_id, member),
        ).start()
        self._beat_client = beat
        return self.heartbeat

    def expired(self, incarnation_ids: Iterable[str]) -> frozenset[str]:
        """The ids without a key under `P/lease/`. Up to 127 ids: their own keys, counted in one
        transaction (a survivor asks of the one that would coordinate before it). More: one read of
        every lease key the first time, then only what changed since (`foundation.etcd_mirror`).
        Either is the answer of one read of them all."""
        ids = list(incarnation_ids)
        if len(ids) < MAX_TXN_OPS and all(i.isascii() and "/" not in i for i in ids):
            return self._expired_few(ids)
        keys = self._leases.refresh()
        if self._alive[0] != self._leases.version:
            self._alive = (
                self._leases.version,
                frozenset(k.decode(errors="replace").rsplit("/", 1)[-1] for k in keys),
            )
        alive = self._alive[1]
        return frozenset(i for i in ids if i not in alive)

    def _expired_few(self, ids: list[str]) -> frozenset[str]:
        if not ids:
            return frozenset()
        keys = [self._key("lease", i) for i in ids]
        answer = self.client.txn("lease read", [], [range_op(k, count_only=True) for k in keys])
        responses = answer.get("responses", [])
        if not isinstance(responses, list) or len(responses) != len(keys):
            raise EtcdRequestFailed(
                f"{self.url}: lease read: etcd answered {len(keys)} ranges with a malformed transaction"
            )
        try:  # (the gateway leaves out a count of 0)
            counts = [int(r.get("response_range", {}).get("count", 0)) for r in responses]
        except (AttributeError, TypeError, ValueError):
            raise EtcdRequestFailed(f"{self.url}: lease read: etcd answered a malformed count") from None
        return frozenset(i for i, c in zip(ids, counts) if c == 0)

    # -- the switch's records ---------------------------------------------------------------
    def write_report(self, report: Report) -> bool:
        """Into the host directory for the host's aggregator (published at once when this rank is
        it), or on its own key where nothing aggregates (no host lease, a report too large)."""
        if self._host_reports is not None and self._host_reports.put(report):
            return self._aggregate(report.generation, again=True)
        compares = [self._active_is(report.generation), *self._lease_alive()]
        return self._put_if(self.report_key(report), json.dumps(report.to_dict()), compares, "report write")

    def report_key(self, report: Report) -> str:
        """`P/inplace/g<G>/report/<rank>-<incarnation>`: a report on its own key."""
        return self._gkey(report.generation, "report", f"{report.rank}-{report.incarnation_id}")

    def host_key(self, generation: int, block: int, host: str) -> str:
        """`P/inplace/g<G>/host/<block>/<host>`: one host's aggregated reports of one block."""
        return self._gkey(generation, "host", f"{block:06d}", host)

    def aggregate(self, generation: int) -> bool:
        """When this rank is its host's aggregator (`host_reports.aggregator`): publish each block of
        the host's reports of G that changed since, as one `HostReport`. False when fenced.

        Each write keeps what the key already holds (a report is never taken back) and compares its
        mod revision: an aggregator that froze between its read and its write, then woke after
        the next one published, cannot replace a newer set with its older one."""
        return self._aggregate(generation, again=False)

    def _aggregate(self, generation: int, *, again: bool) -> bool:
        """`aggregate`; `again`: publish even what was published (a report written anew must learn
        whether it is fenced)."""
        if self._host_reports is None:
            return True
        local = self._host_reports.read(generation)
        me = next((lr.report for lr in local if lr.report.incarnation_id == self._incarnation_id), None)
        if me is None or aggregator(local) != me.rank:
            return True
        ok = True
        for block, reps in blocks(lr.report for lr in local if lr.report.host == me.host).items():
            seen = frozenset((r.rank, r.incarnation_id) for r in reps)
            if self._published.get((generation, block)) == seen and not again:
                continue
            key = self.host_key(generation, block, me.host)
            kv = self.client.get(key, "host report read")
            have = _host_report(kv.key, kv.value, generation) if kv is not None else None
            merged = merge_reports(generation, reps, [have] if have is not None else [])
            doc = HostReport(generation, me.host, block, me.rank, me.incarnation_id, tuple(merged.values()))
            compares = [
                self._active_is(generation),
                *self._lease_alive(),
                compare(key, "MOD", kv.mod_revision if kv is not None else 0),
            ]
            if self._put_if(key, json.dumps(doc.to_dict()), compares, "host report write"):
                self._published[(generation, block)] = seen
            else:
                ok = False
        return ok

    def read_reports(self, generation: int) -> dict[int, Report]:
        """The per-rank reports and the aggregated ones of G: two prefixes, O(hosts) keys when every
        host aggregates (`foundation.inplace_files.merge_reports`: the same dict either way). Each
        later call of the same generation reads only the keys written since (`foundation.etcd_mirror`)
        and parses only those; the cycle collector waits meanwhile (foundation/gcpause.py)."""
        per_rank, hosts, _ = self._mirrors(generation)
        with gc_paused():
            per_kvs, host_kvs = per_rank.refresh(), hosts.refresh()
            self.keys_read = per_rank.last.keys + hosts.last.keys
            versions = per_rank.version << 32 | hosts.version
            if self._parsed_reports[:2] == (generation, versions):
                return dict(self._parsed_reports[2])
            merged = self._merged(generation, per_kvs, host_kvs)
        self._parsed_reports = (generation, versions, merged)
        return dict(merged)

    def block_reports(self, generation: int, block: int) -> dict[int, Report]:
        """The reports of G of ranks block·HOST_BLOCK .. (block+1)·HOST_BLOCK - 1, exactly as
        `read_reports` has them, from that block's host records and the per-rank keys only: a
        survivor that only needs to know who coordinates reads the lowest blocks, not every host's."""
        per_rank, _, by_block = self._mirrors(generation)
        if block not in by_block:
            by_block[block] = PrefixMirror(
                self.client, self._gkey(generation, "host", f"{block:06d}", ""), "host report read"
            )
        with gc_paused():
            merged = self._merged(generation, per_rank.refresh(), by_block[block].refresh())
        return {r: rep for r, rep in merged.items() if r // HOST_BLOCK == block}

    def _mirrors(self, generation: int) -> tuple[PrefixMirror, PrefixMirror, dict[int, PrefixMirror]]:
        """G's per-rank keys, host keys, and host keys of single blocks (`block_reports`)."""
        if self._report_mirrors is None or self._report_mirrors[0] != generation:
            self._report_mirrors = (
                generation,
                PrefixMirror(self.client, self._gkey(generation, "report", ""), "report read"),
                PrefixMirror(self.client, self._gkey(generation, "host", ""), "host report read"),
                {},
            )
            self._seen = {}
        return self._report_mirrors[1:]

    def _merged(self, generation: int, per_kvs: dict[bytes, KV], host_kvs: dict[bytes, KV]) -> dict[int, Report]:
        reports = [r for r in self._parsed(generation, per_kvs, _report) if isinstance(r, Report)]
        aggregated = [h for h in self._parsed(generation, host_kvs, self._host_record) if isinstance(h, HostReport)]
        return merge_reports(generation, reports, aggregated)

    def _host_record(self, key: bytes, raw: bytes, generation: int) -> HostReport | None:
        """An aggregated record, only under its own key (`host_key` of its block and host): under
        another it is malformed, so one block's keys hold exactly that block's records."""
        doc = _host_report(key, raw, generation)
        return doc if doc is not None and key == self.host_key(generation, doc.block, doc.host).encode() else None

    def _parsed(
        self, generation: int, kvs: dict[bytes, KV], parse: Callable[[bytes, bytes, int], Report | HostReport | None]
    ) -> list[Report | HostReport]:
        """The records, each parsed once per version: the switch loop reads them every pass, and at
        100,000 ranks parsing them again is most of a pass."""
        out: list[Report | HostReport] = []
        for kv in kvs.values():
            rev, parsed = self._seen.get(kv.key, (0, None))
            if rev != kv.mod_revision:  # new, or rewritten since
                parsed = parse(kv.key, kv.value, generation)
                self._seen[kv.key] = (kv.mod_revision, parsed)
            if parsed is not None:
                out.append(parsed)
        return out

    def request_abort(self, generation: int, why: str = "operator") -> None:
        doc = {"generation": generation, "why": why, "time": time.time()}
        self.client.put(self._key("inplace", "abort"), json.dumps(doc), "abort request")

    def abort_requested(self, generation: int) -> bool:
        seen_at, doc = self._abort_seen
        if time.monotonic() - seen_at >= ABORT_POLL_S:
            try:
                raw = self._get(self._key("inplace", "abort"))
                doc = json.loads(raw) if raw else None
            except (UnavailableError, ValueError):
                doc = None  # unreadable now: the next step looks again
            self._abort_seen = (time.monotonic(), doc)
        return isinstance(doc, dict) and doc.get("generation") == generation

    def prune(self, below: int) -> int:
        """Delete the keys of every generation older than `below`; how many went (0 when etcd is
        unreachable: the next activation prunes them)."""
        if below <= 0:
            return 0
        try:
            return self.client.delete(self._gkey(0), "coordination prune", range_end=self._gkey(below).encode())
        except GpuguardError:
            return 0

    def record_refusal(self, generation: int, doc: dict[str, Any]) -> None:
        """Only while `generation` is active and the writer's lease lives: a stale coordinator's refusal
        is fenced like its report (docs/fencing.md)."""
        compares = [self._active_is(generation), *self._lease_alive()]
        self._put_if(self._gkey(generation, "refused"), json.dumps(doc), compares, "refusal write")

    def refusal(self, generation: int) -> dict[str, Any] | None:
        raw = self._get(self._gkey(generation, "refused"))
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return {"reason": "refusal record unreadable"}
        return doc if isinstance(doc, dict) else {"reason": str(doc)}

    # -- the group store --------------------------------------------------------------------
    def group_store(self, generation: int, rank: int, timeout_s: float) -> Any:
        """Rank 0 serves a TCPStore and publishes it (only while `generation` is active); the
        others wait (bounded by `timeout_s`) for the address and connect."""
        import torch.distributed as dist

        key = self._gkey(generation, "store")
        self._store = None
        if rank == 0:
            addr = local_address(self.host, self.port)
            store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            compares = [self._active_is(generation), *self._lease_alive()]
            if not self._put_if(key, f"{addr}:{store.port}", compares, "store address write"):
                raise RuntimeError(f"generation {generation} is no longer active: its store was not published")
            self._store = store
            return store
        deadline = time.monotonic() + timeout_s
        raw = None
        for _ in range(100_000):
            raw = self._get(key)
            if raw is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if raw is None:
            raise RuntimeError(f"no store address for generation {generation} within {timeout_s:g} s")
        host, _, port = raw.decode().rpartition(":")
        left = max(1.0, deadline - time.monotonic())
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=left))

    def close(self) -> None:
        """Leave the host lease: this rank's key goes at once (no TTL wait for anyone); the lease
        stays with its host-mates, or expires a TTL after the last of them stopped renewing."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self._lease_key is not None:
            try:
                self.client.delete(self._lease_key, "lease key")
            except GpuguardError:  # the renewer prunes it, or the lease expires by itself
                pass
        if self._host_reports is not None:
            self._host_reports.close()
            self._host_reports = None
        if self._hostdir is not None:
            self._hostdir.unregister(self._incarnation_id)
            if not isinstance(self.heartbeat, HostHeartbeat) or self.heartbeat.stopped:
                self._hostdir.close()  # (a beat thread still in a keepalive keeps its descriptors)
            self._hostdir = None
        if self._beat_client is not None:
            self._beat_client.close()
        self.client.close()
