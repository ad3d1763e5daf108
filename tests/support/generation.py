"""Helpers shared by the generation and recovery tests: members, keys, certificates and snapshots without boilerplate."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from gpuguard.generation.certificate import issue
from gpuguard.generation.records import Certificate, Frontier, Incarnation, Member
from gpuguard.recovery.snapshots.store import SnapshotInfo

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def incarnation(host: str = "node-a", pid: int = 100) -> Incarnation:
    return Incarnation(uuid.uuid4().hex, host, pid, 1_700_000_000.25, None)


def numbered(i: int, host: str = "h", *, pid: int = 1000, start: float = 1.0) -> Incarnation:
    """Incarnation "inc<i>" on `host`, pid `pid + i`, started at `start + i`: ids, pids and times a test can name."""
    return Incarnation(f"inc{i}", host, pid + i, start + i)


def members(n: int) -> tuple[Member, ...]:
    return tuple(Member(r, incarnation(pid=1000 + r)) for r in range(n))


def genesis(key: bytes = KEY, job_id: str = "job") -> Certificate:
    return issue(
        parent=None,
        job_id=job_id,
        members=(),
        reason="genesis",
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="test",
        key=key,
        now=1_700_000_000.0,
    )


def child(
    parent: Certificate,
    mem,
    *,
    key: bytes = KEY,
    step: int = 0,
    quiescence: str = "proved",
    forced: bool = False,
    digest: str = "",
    reason: str = "rank-failure",
    **kw,
) -> Certificate:
    return issue(
        parent=parent,
        job_id=parent.job_id,
        members=mem,
        reason=reason,
        frontier=Frontier(step, digest, {"default": step}),
        quiescence=quiescence,
        quiescence_evidence=("all workers exited",),
        forced=forced,
        issued_by="test",
        key=key,
        **kw,
    )


def started(
    hosts: int | Sequence[str],
    step: int = 0,
    *,
    digest: str | None = None,
    host: str = "h",
    incarnation: Callable[[int, str], Incarnation] = numbered,
    key: bytes = KEY,
    job_id: str = "job",
) -> Certificate:
    """A started job's current certificate: generation 1 (reason "start") after `genesis`.

    One member per entry of `hosts` (rank = index, `incarnation(rank, its host)`), or `hosts` members
    on `host`; with none, the genesis itself. The frontier is `step` with `digest`, by default "d"
    past step 0 and "" at the initial state.
    """
    root = genesis(key, job_id)
    on = [host] * hosts if isinstance(hosts, int) else list(hosts)
    if not on:
        return root
    return issue(
        parent=root,
        job_id=job_id,
        members=[Member(r, incarnation(r, h)) for r, h in enumerate(on)],
        reason="start",
        frontier=Frontier(step, ("d" if step else "") if digest is None else digest),
        quiescence="proved",
        issued_by="test",
        key=key,
    )


def chunk_store(*certs: Certificate) -> Callable[[str], bytes | None]:
    """The chunks `certs` name, by digest: what a ledger holds beside them (a loader for `from_dict`)."""
    store = {b.sha256: b.data for c in certs for b in c.chunks()}
    return store.get


def snapshot_info(step: int, digest: str | None = "m") -> SnapshotInfo:
    """A snapshot of `step` found on disk (not read: the path need not exist), manifest digest `digest`."""
    return SnapshotInfo(step, Path(f"/x/step-{step}"), "snapshots", 1, "s", digest)
