"""Admission: may this incarnation run in generation G? One check for the restart path and the in-place switch.

Before its first collective in a generation a member proves, from the ledger alone, that the
certificate it is about to follow is the one the coordinator issued (same digest), is signed
with the job's key, chains onto its parent (`generation.certificate.check_header`: the signed
header names the member table by digest, so the rules over the whole table, checked by the
activator before it signed, hold for it), and admits this very incarnation. On the restart path
the caller knows its rank, and only the member-table chunk that holds that rank is read
(`MemberTable.at_rank`): a rank of a 100,000-member job reads one chunk, not the table. Without the signing key nothing can be verified, so a member
without it refuses: a forged ledger entry must never be followed.
"""

from __future__ import annotations

from typing import Any

from gpuguard.generation.certificate import check_header
from gpuguard.generation.records import Certificate
from gpuguard.recovery.runtime.refusals import ActivationRefused


def admitted_certificate(
    ledger: Any,
    generation: int,
    *,
    incarnation_id: str,
    rank: int | None = None,
    digest: str | None = None,
) -> Certificate:
    """The certificate of `generation`, proved to admit `incarnation_id` (on `rank`, if given); the
    one the coordinator published when `digest` is given. ActivationRefused, in one line, if not."""
    if ledger.key is None:
        raise ActivationRefused("no signing key in the job directory: cannot verify the certificate")
    cert = ledger.get(generation)
    if digest is not None and cert.digest() != digest:
        raise ActivationRefused(f"generation {generation} in the ledger is not the certificate the coordinator issued")
    parent = ledger.get(cert.parent_generation) if cert.parent_generation is not None else None
    violations = check_header(cert, parent=parent, key=ledger.key)
    if violations:
        raise ActivationRefused(
            f"certificate of generation {generation} fails rule {violations[0].rule}: {violations[0].message}"
        )
    if rank is not None:
        member = cert.member_table.at_rank(rank)
    else:  # in place: a survivor finds its new rank by its incarnation
        member = next((m for m in cert.members if m.incarnation.id == incarnation_id), None)
    if member is None or member.incarnation.id != incarnation_id or (rank is not None and member.rank != rank):
        where = f" on rank {rank}" if rank is not None else ""
        raise ActivationRefused(f"certificate of generation {generation} does not admit this incarnation{where}")
    return cert
