"""Issue and check generation certificates (pure: data in, data out)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from gpuguard.generation import rules
from gpuguard.generation.keys import sign
from gpuguard.generation.records import Certificate, Frontier, Member, Violation


def new_members(members: Iterable[Member], parent: Certificate | None) -> tuple[int, ...]:
    """Ranks whose incarnation is not the parent's incarnation on that rank: they are admitted."""
    old = parent.ranks if parent is not None else {}
    return tuple(sorted(m.rank for m in members if old.get(m.rank) != m.incarnation))


def issue(
    *,
    parent: Certificate | None,
    job_id: str,
    members: Iterable[Member],
    reason: str,
    frontier: Frontier,
    quiescence: str,
    quiescence_evidence: Iterable[str] = (),
    forced: bool = False,
    ownership_map_version: int = 0,
    issued_by: str,
    key: bytes,
    extra: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> Certificate:
    """A signed certificate for the generation after `parent` (generation 0 when parent is None).

    Issuing does not check the rules: `check()` (and the ledger at activation) does, so a refused
    certificate can still be recorded and explained.
    """
    members = tuple(sorted(members, key=lambda m: m.rank))
    cert = Certificate(
        job_id=job_id,
        generation=0 if parent is None else parent.generation + 1,
        parent_generation=None if parent is None else parent.generation,
        parent_certificate_digest="" if parent is None else parent.digest(),
        members=members,
        reason=reason,
        frontier=frontier,
        quiescence=quiescence,
        quiescence_evidence=tuple(quiescence_evidence),
        forced=forced,
        ownership_map_version=ownership_map_version,
        activation_time=time.time() if now is None else now,
        issued_by=issued_by,
        extra=dict(extra or {}),
        admitted=new_members(members, parent),
    )
    return cert.with_signature(sign(key, cert.signing_bytes()))


def check(
    cert: Certificate,
    *,
    parent: Certificate | None,
    key: bytes,
    committed_by_all: int | None = None,
    manifest_ok: bool | None = None,
) -> list[Violation]:
    """Every rule against `cert`; empty means it may activate after `parent`."""
    return [
        *rules.signature(cert, key),
        *rules.chain_continuity(cert, parent),
        *rules.unique_ranks(cert),
        *rules.unique_incarnations(cert),
        *rules.members_admitted(cert, parent),
        *rules.quiescence(cert),
        *rules.quiescence_proofs(cert, parent),
        *rules.frontier_committed(cert, parent, committed_by_all),
        *rules.frontier_state_verified(cert, manifest_ok),
        *rules.sound_frontier(cert),
    ]


def check_header(cert: Certificate, *, parent: Certificate | None, key: bytes) -> list[Violation]:
    """The rules a member checks before it follows a stored certificate: those of the signed header
    (which names the member table and the body by digest). They read no member chunk, so 100,000
    members admitting themselves do not each read the whole table; the rules over the table were
    checked by the activator before it signed, and `verify` re-checks them all (`check_stored`)."""
    return [
        *rules.signature(cert, key),
        *rules.chain_continuity(cert, parent),
        *rules.quiescence(cert),
    ]


def check_stored(cert: Certificate, *, parent: Certificate | None, key: bytes) -> list[Violation]:
    """The rules a stored certificate must still satisfy when re-verified later (no commit/state view)."""
    return [
        *rules.signature(cert, key),
        *rules.chain_continuity(cert, parent),
        *rules.unique_ranks(cert),
        *rules.unique_incarnations(cert),
        *rules.members_admitted(cert, parent),
        *rules.quiescence(cert),
        *rules.quiescence_proofs(cert, parent),
        *rules.sound_frontier(cert),
    ]
