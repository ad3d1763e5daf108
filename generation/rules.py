"""The certificate rules, one pure function each. Each returns the violations it finds (empty = holds).

They take data (the certificate, its parent, what the ledger knows) and return data; the ledger
and the CLI decide what a violation means (refuse activation, fail verification).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from gpuguard.generation.keys import signature_ok
from gpuguard.generation.records import QUIESCENCE, Certificate, Violation


def unique_incarnations(cert: Certificate) -> list[Violation]:
    """An incarnation is one process: it can hold at most one rank."""
    counts = Counter(m.incarnation.id for m in cert.members)
    return [
        Violation(
            "unique-incarnations", f"incarnation {m.incarnation.id} appears {counts[m.incarnation.id]} times", m.rank
        )
        for m in cert.members
        if counts[m.incarnation.id] > 1
    ]


def unique_ranks(cert: Certificate) -> list[Violation]:
    """A logical rank is held by exactly one member."""
    counts = Counter(m.rank for m in cert.members)
    out = [Violation("unique-ranks", f"rank {r} appears {n} times", r) for r, n in sorted(counts.items()) if n > 1]
    out += [Violation("unique-ranks", f"rank {m.rank} is negative", m.rank) for m in cert.members if m.rank < 0]
    return out


def chain_continuity(cert: Certificate, parent: Certificate | None) -> list[Violation]:
    """Generation = parent + 1, the parent digest links, same job; genesis is generation 0."""
    rule = "chain-continuity"
    if parent is None:
        out = []
        if cert.generation != 0 or cert.parent_generation is not None or cert.parent_certificate_digest:
            out.append(
                Violation(
                    rule, f"generation {cert.generation} has no parent certificate (only generation 0 may be genesis)"
                )
            )
        return out
    out = []
    if cert.job_id != parent.job_id:
        out.append(Violation(rule, f"job id {cert.job_id!r} differs from the parent's {parent.job_id!r}"))
    if cert.parent_generation != parent.generation:
        out.append(
            Violation(
                rule, f"parent_generation is {cert.parent_generation}, the parent is generation {parent.generation}"
            )
        )
    if cert.generation != parent.generation + 1:
        out.append(
            Violation(rule, f"generation {cert.generation} does not follow parent generation {parent.generation}")
        )
    if cert.parent_certificate_digest != parent.digest():
        out.append(Violation(rule, "parent_certificate_digest does not match the parent certificate"))
    return out


def signature(cert: Certificate, key: bytes) -> list[Violation]:
    """HMAC-SHA256 over the canonical encoding with the job key."""
    if not signature_ok(key, cert.signing_bytes(), cert.signature):
        return [Violation("signature", "HMAC signature does not match (tampered, or signed with another key)")]
    return []


def quiescence(cert: Certificate) -> list[Violation]:
    """The old generation must be proved quiet or rolled back; `unknown` only when forced (and it says so)."""
    if cert.quiescence not in QUIESCENCE:
        return [Violation("quiescence", f"quiescence {cert.quiescence!r} is not one of {', '.join(QUIESCENCE)}")]
    if cert.quiescence == "unknown" and not cert.forced:
        return [Violation("quiescence", "old generation quiescence is unknown and the certificate is not forced")]
    return []


PROOF_GONE = "process gone"  # pid + start time no longer a live process, seen on its own host
PROOF_KILLED = "killed, process gone"  # SIGKILLed by the coordinator on its host, then seen gone
# its lease key is gone: its host's lease expired (it fenced itself before), or its host's renewer saw
# its process gone or not running for the fence margin (it fences before its next write; docs/formats/
# leases.md, "The host lease"); the string is kept: certificates carry it
PROOF_LEASE = "lease expired, self-fenced"
PROOF_REPORTED = "reported, left its group"  # a survivor: it tore the old group down and joins the new one
# every place it could write to refuses its generation (docs/fencing.md): it may still run, nothing it does is seen
PROOF_FENCED = "fenced: every sink compares the generation"
PROOFS = (PROOF_GONE, PROOF_KILLED, PROOF_LEASE, PROOF_REPORTED, PROOF_FENCED)


def quiescence_proofs(cert: Certificate, parent: Certificate | None) -> list[Violation]:
    """When a certificate says how each old incarnation was proved quiet (`extra.quiescence_by`),
    every parent member needs one accepted proof: a lease that expired is one (its holder fenced
    itself first), and so is fencing (every sink it could write to compares the generation and
    refuses it: docs/fencing.md); a member nobody could account for is not."""
    by = cert.extra.get("quiescence_by")
    if by is None or parent is None:
        return []
    rule = "quiescence"
    if cert.quiescence != "proved":
        return [Violation(rule, f"quiescence_by is given but quiescence is {cert.quiescence!r}")]
    out = []
    for m in parent.members:
        kind = by.get(m.incarnation.id)
        if kind is None:
            out.append(
                Violation(rule, f"old rank {m.rank} incarnation {m.incarnation.id}: no quiescence proof", m.rank)
            )
        elif kind not in PROOFS:
            out.append(
                Violation(
                    rule,
                    f"old rank {m.rank} incarnation {m.incarnation.id}: {kind!r} is not a proof "
                    f"(accepted: {', '.join(PROOFS)})",
                    m.rank,
                )
            )
    return out


def frontier_committed(cert: Certificate, parent: Certificate | None, committed_by_all: int | None) -> list[Violation]:
    """The frontier never passes the last step committed by *all* parent members.

    With no commit records the frontier cannot advance past the parent's own frontier.
    """
    rule = "frontier-committed"
    if parent is None:
        return []
    # the parent's own certified frontier always stays reachable (rolling back to it is safe)
    limit = max(parent.frontier.step, committed_by_all if committed_by_all is not None else -1)
    if cert.frontier.step > limit:
        what = (
            f"the last step committed by all members of generation {parent.generation} is {committed_by_all}"
            if committed_by_all is not None
            else f"no commit records for generation {parent.generation}; its frontier is step {parent.frontier.step}"
        )
        return [Violation(rule, f"frontier step {cert.frontier.step} is past the commit record: {what}")]
    return []


def frontier_state_verified(cert: Certificate, manifest_ok: bool | None) -> list[Violation]:
    """The frontier's state must be complete and verified (manifest_ok False = it is not).

    `None` means the caller did not check the state here (`verify --deep` checks it later).
    """
    if manifest_ok is False:
        return [
            Violation(
                "frontier-state",
                f"state {cert.frontier.state_manifest_digest or '(none)'} of frontier step "
                f"{cert.frontier.step} is incomplete or does not verify",
            )
        ]
    return []


def sound_frontier(cert: Certificate) -> list[Violation]:
    """A certificate never names a state its soundness record calls unsound (`extra.soundness`, the
    frontier snapshot's record: finite tensors, agreeing replicas, non-tensor state; written by the
    runtime's coordinator from the snapshot's manifest, docs/formats/certificate.md). A record of
    another step, or one that does not say `sound: true` or `false`, is a violation too."""
    record = cert.extra.get("soundness")
    if record is None:
        return []
    rule = "soundness"
    if not isinstance(record, Mapping) or not isinstance(record.get("sound"), bool):
        return [Violation(rule, "extra.soundness is not a soundness record (no true/false `sound`)")]
    if record.get("step") != cert.frontier.step:
        return [
            Violation(rule, f"extra.soundness is of step {record.get('step')}, the frontier is {cert.frontier.step}")
        ]
    if not record["sound"]:
        problems = record.get("problems")  # a list, or a tuple in a stored (frozen) certificate
        first = (
            problems[0] if isinstance(problems, (list, tuple)) and problems and isinstance(problems[0], str) else "?"
        )
        return [Violation(rule, f"the state of frontier step {cert.frontier.step} is not sound: {first}")]
    return []


def members_admitted(cert: Certificate, parent: Certificate | None) -> list[Violation]:
    """A rank whose incarnation changed is a new member and must be listed in `admitted`.

    Also: an incarnation id that the parent knew must keep its identity (host, pid, start time):
    a member claiming an old id with another process behind it is forged.
    """
    rule = "members-admitted"
    old = parent.ranks if parent is not None else {}
    old_by_id = {inc.id: inc for inc in old.values()}
    admitted = set(cert.admitted)
    out: list[Violation] = []
    for m in cert.members:
        prev = old_by_id.get(m.incarnation.id)
        if prev is not None and prev != m.incarnation:
            out.append(
                Violation(
                    rule,
                    f"rank {m.rank} claims incarnation {m.incarnation.id} of the parent generation "
                    f"with a different process identity (forged member)",
                    m.rank,
                )
            )
        is_new = old.get(m.rank) != m.incarnation
        if is_new and m.rank not in admitted:
            was = old.get(m.rank)
            why = (
                f"rank {m.rank} is held by new incarnation {m.incarnation.id}"
                + (f" (was {was.id})" if was is not None else "")
                + " but is not listed as admitted"
            )
            out.append(Violation(rule, why, m.rank))
        if not is_new and m.rank in admitted:
            out.append(Violation(rule, f"rank {m.rank} is listed as admitted but keeps its parent incarnation", m.rank))
    ranks = {m.rank for m in cert.members}
    for r in sorted(admitted - ranks):
        out.append(Violation(rule, f"admitted rank {r} is not a member", r))
    return out
