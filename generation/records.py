"""The records a generation certificate binds: incarnations, members, the frontier, the certificate.

All are frozen dataclasses with `to_dict()` / `from_dict()` for the canonical encoding. A
logical rank is an index; an incarnation is one process instance; a member is the pair. A
restarted rank 3 is a new incarnation, hence a new member.

A certificate is written in one of two schemas (docs/formats/certificate.md): `/2`, which every
issuer writes, signs a small header that names the member table and the body (admitted ranks,
quiescence evidence, extra) by the digests of their chunks, stored beside it
(`generation.members`, `generation.body`); `/1`, the old form with everything inline, is still
read and verified, never written. Either way `cert.members`, `.admitted`, `.extra` and `.ranks`
work the same for every caller: a certificate read from a ledger loads its chunks on first use.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from gpuguard.generation.body import LazyMapping, LazySequence, StoredBody, encode_body, stored_fields
from gpuguard.generation.canonical import canonical_bytes, normalize, sha256_hex
from gpuguard.generation.chunks import Blob, ChunkLoader, is_sha256
from gpuguard.generation.fields import decode_time, encode_time, freeze, is_int, need, only, thaw
from gpuguard.generation.members import ChunkRef, Incarnation, Member, MemberTable

__all__ = [
    "CERTIFICATE_SCHEMA",
    "INLINE_SCHEMA",
    "QUIESCENCE",
    "Certificate",
    "CommitRecord",
    "Frontier",
    "Incarnation",
    "Member",
    "Violation",
    "decode_time",
    "encode_time",
]

CERTIFICATE_SCHEMA = "gpuguard.certificate/2"  # members and body by chunk digest: what every issuer writes
INLINE_SCHEMA = "gpuguard.certificate/1"  # everything inline: read and verified, never written
QUIESCENCE = ("proved", "rolled_back", "unknown")

_COMMON = {
    "schema",
    "job_id",
    "generation",
    "parent_generation",
    "parent_certificate_digest",
    "reason",
    "frontier",
    "quiescence",
    "forced",
    "ownership_map_version",
    "activation_time",
    "issued_by",
    "signature",
}
_INLINE = {"members", "admitted", "quiescence_evidence", "extra"}
_CHUNKED = {"member_chunks", "body_chunks"}


@dataclass(frozen=True)
class Frontier:
    """The last step all members committed, the digest of its state, and the collective frontier."""

    step: int
    state_manifest_digest: str = ""
    collective_seq: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective_seq", freeze(dict(self.collective_seq)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "state_manifest_digest": self.state_manifest_digest,
            "collective_seq": dict(self.collective_seq),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Frontier:
        w = "frontier"
        only(d, {"step", "state_manifest_digest", "collective_seq"}, w)
        seq = need(d, "collective_seq", Mapping, w)
        for k, v in seq.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{w}: collective_seq[{k!r}] must be an integer")
        return cls(need(d, "step", int, w), need(d, "state_manifest_digest", str, w), dict(seq))


@dataclass(frozen=True, eq=False)
class Certificate:
    """A generation certificate: membership + commit frontier + state, bound by one signature.

    `admitted` lists the ranks whose incarnation is new in this generation (a reused rank
    number with a new process is admitted explicitly, never taken for the old member). Two
    certificates are equal when their canonical bytes are.
    """

    job_id: str
    generation: int
    parent_generation: int | None
    parent_certificate_digest: str
    members: Sequence[Member]
    reason: str
    frontier: Frontier
    quiescence: str
    quiescence_evidence: Sequence[str] = ()
    forced: bool = False
    ownership_map_version: int = 0
    activation_time: float = 0.0
    issued_by: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    signature: str = ""
    admitted: Sequence[int] = ()
    schema: str = CERTIFICATE_SCHEMA

    def __post_init__(self) -> None:
        if self.schema not in (CERTIFICATE_SCHEMA, INLINE_SCHEMA):
            raise ValueError(f"certificate: unknown schema {self.schema!r}")
        if not isinstance(self.members, MemberTable):
            object.__setattr__(self, "members", MemberTable(self.members))
        if not isinstance(self.quiescence_evidence, LazySequence):
            object.__setattr__(self, "quiescence_evidence", tuple(self.quiescence_evidence))
        if not isinstance(self.admitted, LazySequence):
            object.__setattr__(self, "admitted", tuple(self.admitted))
        if not isinstance(self.extra, LazyMapping):
            object.__setattr__(self, "extra", freeze(normalize(dict(self.extra))))

    # -- the parts stored beside a /2 certificate ---------------------------------------------
    @property
    def member_table(self) -> MemberTable:
        assert isinstance(self.members, MemberTable)
        return self.members

    def _stored_body(self) -> StoredBody | None:
        """The body this certificate was read with, while none of its three fields was replaced."""
        e, a, q = self.extra, self.admitted, self.quiescence_evidence
        if isinstance(e, LazyMapping) and isinstance(a, LazySequence) and isinstance(q, LazySequence):
            if a.body is e.body and q.body is e.body:
                return e.body
        return None

    @cached_property
    def _encoded_body(self) -> tuple[Blob, ...]:
        return encode_body(self.admitted, self.quiescence_evidence, self.extra)

    @property
    def body_refs(self) -> tuple[str, ...]:
        stored = self._stored_body()
        return stored.refs if stored is not None else tuple(b.sha256 for b in self._encoded_body)

    def unload(self) -> None:
        """Forget the parts read from the ledger (they are read again when used); see `MemberTable.unload`."""
        self.__dict__.pop("ranks", None)
        self.member_table.unload()
        stored = self._stored_body()
        if stored is not None:
            stored.unload()

    def chunk_refs(self) -> tuple[str, ...]:
        """The digest of every chunk this certificate binds (none for `/1`), without reading any."""
        if self.schema == INLINE_SCHEMA:
            return ()
        return (*(r.sha256 for r in self.member_table.refs), *self.body_refs)

    def chunks(self) -> tuple[Blob, ...]:
        """Every chunk to store before this certificate (none for `/1`): member table, then body."""
        if self.schema == INLINE_SCHEMA:
            return ()
        stored = self._stored_body()
        body = stored.blobs() if stored is not None else self._encoded_body
        return (*self.member_table.blobs(), *body)

    # -- encoding --------------------------------------------------------------------------
    def unsigned_dict(self) -> dict[str, Any]:
        """Every field but the signature: what the HMAC covers."""
        d: dict[str, Any] = {
            "schema": self.schema,
            "job_id": self.job_id,
            "generation": self.generation,
            "parent_generation": self.parent_generation,
            "parent_certificate_digest": self.parent_certificate_digest,
            "reason": self.reason,
            "frontier": self.frontier.to_dict(),
            "quiescence": self.quiescence,
            "forced": self.forced,
            "ownership_map_version": self.ownership_map_version,
            "activation_time": encode_time(self.activation_time),
            "issued_by": self.issued_by,
        }
        if self.schema == INLINE_SCHEMA:
            d.update(self._inline_parts())
        else:
            d["member_chunks"] = self.member_table.to_list()
            d["body_chunks"] = list(self.body_refs)
        return d

    def _inline_parts(self) -> dict[str, Any]:
        return {
            "members": [m.to_dict() for m in self.members],
            "admitted": list(self.admitted),
            "quiescence_evidence": list(self.quiescence_evidence),
            "extra": thaw(self.extra),
        }

    def to_dict(self) -> dict[str, Any]:
        """The stored form: what the digest covers (a `/2` header names its parts by digest)."""
        return {**self.unsigned_dict(), "signature": self.signature}

    def expanded_dict(self) -> dict[str, Any]:
        """Every field with the parts read in (members, admitted, evidence, extra), for people and
        tools: `gpu-generation show --json`. Not a stored form."""
        return {**self.to_dict(), **self._inline_parts()}

    def signing_bytes(self) -> bytes:
        return canonical_bytes(self.unsigned_dict())

    def canonical(self) -> bytes:
        return canonical_bytes(self.to_dict())

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical bytes, signature included: the hash-chain link."""
        return sha256_hex(self.canonical())

    def with_signature(self, signature: str) -> Certificate:
        """The same certificate signed: a copy that keeps what was encoded (members, body, ranks),
        since the signature is part of none of them."""
        signed = copy.copy(self)
        object.__setattr__(signed, "signature", signature)
        return signed

    @cached_property
    def ranks(self) -> Mapping[int, Incarnation]:
        return MappingProxyType({m.rank: m.incarnation for m in self.members})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Certificate):
            return NotImplemented
        return self is other or self.canonical() == other.canonical()

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, load: ChunkLoader | None = None, where: str = "") -> Certificate:
        """A certificate from its stored form. A `/2` one reads its member table and body through
        `load` (sha256 -> bytes) when they are first used, each chunk checked against its digest."""
        w = "certificate"
        schema = d.get("schema")
        if schema not in (CERTIFICATE_SCHEMA, INLINE_SCHEMA):
            raise ValueError(f"{w}: schema is {schema!r}, expected {CERTIFICATE_SCHEMA!r} or {INLINE_SCHEMA!r}")
        parent = d.get("parent_generation")
        if parent is not None and not is_int(parent):
            raise ValueError(f"{w}: parent_generation must be an integer or null")
        if schema == INLINE_SCHEMA:
            only(d, _COMMON | _INLINE, w)
            evidence, admitted = need(d, "quiescence_evidence", list, w), need(d, "admitted", list, w)
            if not all(isinstance(e, str) for e in evidence):
                raise ValueError(f"{w}: quiescence_evidence must be strings")
            if not all(is_int(a) for a in admitted):
                raise ValueError(f"{w}: admitted must be integers")
            members: Sequence[Member] = tuple(Member.from_dict(m) for m in need(d, "members", list, w))
            parts: dict[str, Any] = {
                "quiescence_evidence": tuple(evidence),
                "admitted": tuple(admitted),
                "extra": dict(need(d, "extra", Mapping, w)),
            }
        else:
            only(d, _COMMON | _CHUNKED, w)
            chunks = need(d, "member_chunks", list, w)
            if not all(isinstance(r, Mapping) for r in chunks):
                raise ValueError(f"{w}: member_chunks must be objects")
            refs = [ChunkRef.from_dict(r) for r in chunks]
            body = need(d, "body_chunks", list, w)
            if not body or not all(is_sha256(b) for b in body):
                raise ValueError(f"{w}: body_chunks must be one or more SHA-256 digests (64 lowercase hex)")
            members = MemberTable.stored(refs, load, where)
            admitted_, evidence_, extra_ = stored_fields(StoredBody(body, load, where))
            parts = {"quiescence_evidence": evidence_, "admitted": admitted_, "extra": extra_}
        return cls(
            job_id=need(d, "job_id", str, w),
            generation=need(d, "generation", int, w),
            parent_generation=parent,
            parent_certificate_digest=need(d, "parent_certificate_digest", str, w),
            members=members,
            reason=need(d, "reason", str, w),
            frontier=Frontier.from_dict(need(d, "frontier", Mapping, w)),
            quiescence=need(d, "quiescence", str, w),
            forced=need(d, "forced", bool, w),
            ownership_map_version=need(d, "ownership_map_version", int, w),
            activation_time=decode_time(need(d, "activation_time", str, w)),
            issued_by=need(d, "issued_by", str, w),
            signature=need(d, "signature", str, w),
            schema=schema,
            **parts,
        )


@dataclass(frozen=True)
class Violation:
    """One broken rule: which rule, why, and (when one is to blame) which member's rank."""

    rule: str
    message: str
    member: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "message": self.message, "member": self.member}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Violation:
        m = d.get("member")
        return cls(str(d.get("rule", "")), str(d.get("message", "")), m if isinstance(m, int) else None)


@dataclass(frozen=True)
class CommitRecord:
    """Rank `rank` (incarnation `incarnation_id`) committed `step` in `generation`."""

    generation: int
    step: int
    rank: int
    incarnation_id: str
    time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "g": self.generation,
            "s": self.step,
            "r": self.rank,
            "i": self.incarnation_id,
            "t": encode_time(self.time),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CommitRecord:
        w = "commit record"
        only(d, {"g", "s", "r", "i", "t"}, w)
        return cls(
            need(d, "g", int, w),
            need(d, "s", int, w),
            need(d, "r", int, w),
            need(d, "i", str, w),
            decode_time(need(d, "t", str, w)),
        )
