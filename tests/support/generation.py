"""Helpers shared by the generation tests: members, keys and certificates without boilerplate."""

from __future__ import annotations

import uuid

from gpuguard.generation.certificate import issue
from gpuguard.generation.records import Certificate, Frontier, Incarnation, Member

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def incarnation(host: str = "node-a", pid: int = 100) -> Incarnation:
    return Incarnation(uuid.uuid4().hex, host, pid, 1_700_000_000.25, None)


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
