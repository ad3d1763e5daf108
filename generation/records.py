"""The records a generation certificate binds: incarnations, members, the frontier, the certificate.

All are frozen dataclasses with `to_dict()` / `from_dict()` for the canonical encoding. A
logical rank is an index; an incarnation is one process instance; a member is the pair. A
restarted rank 3 is a new incarnation, hence a new member.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gpuguard.foundation.identity import own_start_time
from gpuguard.generation.canonical import canonical_bytes, normalize, sha256_hex

CERTIFICATE_SCHEMA = "gpuguard.certificate/1"
QUIESCENCE = ("proved", "rolled_back", "unknown")


def encode_time(t: float) -> str:
    """A time as a decimal string: exact round-trip, no float in the canonical bytes."""
    return repr(float(t))


def decode_time(s: Any) -> float:
    if not isinstance(s, str):
        raise ValueError(f"time must be a decimal string, got {type(s).__name__}")
    return float(s)


def _freeze(value: Any) -> Any:
    """Deep-freeze a JSON-like value so a frozen record cannot be mutated through it."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise ValueError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def _only(d: Mapping[str, Any], fields: set[str], where: str) -> None:
    """Refuse unknown or missing fields: a renamed key must not silently become a default."""
    extra, missing = sorted(set(d) - fields), sorted(fields - set(d))
    if extra:
        raise ValueError(f"{where}: unknown field(s) {', '.join(extra)}")
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")


@dataclass(frozen=True)
class Incarnation:
    """One process instance. Two processes never share an id, even on the same rank number."""

    id: str
    host: str
    pid: int
    start_time: float
    gpu_uuid: str | None = None

    @classmethod
    def current(cls, gpu_uuid: str | None = None) -> Incarnation:
        """This process: a fresh random id, hostname, pid and the OS's process start time."""
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(), own_start_time(), gpu_uuid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "start_time": encode_time(self.start_time),
            "gpu_uuid": self.gpu_uuid,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Incarnation:
        w = "incarnation"
        _only(d, {"id", "host", "pid", "start_time", "gpu_uuid"}, w)
        gpu = d.get("gpu_uuid")
        if gpu is not None and not isinstance(gpu, str):
            raise ValueError(f"{w}: gpu_uuid must be a string or null")
        return cls(
            _need(d, "id", str, w),
            _need(d, "host", str, w),
            _need(d, "pid", int, w),
            decode_time(_need(d, "start_time", str, w)),
            gpu,
        )


@dataclass(frozen=True)
class Member:
    """A logical rank held by one incarnation in one generation."""

    rank: int
    incarnation: Incarnation

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.incarnation.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        _only(d, {"rank", "incarnation"}, "member")
        return cls(
            _need(d, "rank", int, "member"),
            Incarnation.from_dict(_need(d, "incarnation", Mapping, "member")),
        )


@dataclass(frozen=True)
class Frontier:
    """The last step all members committed, the digest of its state, and the collective frontier."""

    step: int
    state_manifest_digest: str = ""
    collective_seq: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective_seq", _freeze(dict(self.collective_seq)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "state_manifest_digest": self.state_manifest_digest,
            "collective_seq": dict(self.collective_seq),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Frontier:
        w = "frontier"
        _only(d, {"step", "state_manifest_digest", "collective_seq"}, w)
        seq = _need(d, "collective_seq", Mapping, w)
        for k, v in seq.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{w}: collective_seq[{k!r}] must be an integer")
        return cls(_need(d, "step", int, w), _need(d, "state_manifest_digest", str, w), dict(seq))


@dataclass(frozen=True)
class Certificate:
    """A generation certificate: membership + commit frontier + state, bound by one signature.

    `admitted` lists the ranks whose incarnation is new in this generation (a reused rank
    number with a new process is admitted explicitly, never taken for the old member).
    """

    job_id: str
    generation: int
    parent_generation: int | None
    parent_certificate_digest: str
    members: tuple[Member, ...]
    reason: str
    frontier: Frontier
    quiescence: str
    quiescence_evidence: tuple[str, ...] = ()
    forced: bool = False
    ownership_map_version: int = 0
    activation_time: float = 0.0
    issued_by: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    signature: str = ""
    admitted: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "quiescence_evidence", tuple(self.quiescence_evidence))
        object.__setattr__(self, "admitted", tuple(self.admitted))
        object.__setattr__(self, "extra", _freeze(normalize(dict(self.extra))))

    # -- encoding --------------------------------------------------------------------------
    def unsigned_dict(self) -> dict[str, Any]:
        """Every field but the signature: what the HMAC covers."""
        return {
            "schema": CERTIFICATE_SCHEMA,
            "job_id": self.job_id,
            "generation": self.generation,
            "parent_generation": self.parent_generation,
            "parent_certificate_digest": self.parent_certificate_digest,
            "members": [m.to_dict() for m in self.members],
            "admitted": list(self.admitted),
            "reason": self.reason,
            "frontier": self.frontier.to_dict(),
            "quiescence": self.quiescence,
            "quiescence_evidence": list(self.quiescence_evidence),
            "forced": self.forced,
            "ownership_map_version": self.ownership_map_version,
            "activation_time": encode_time(self.activation_time),
            "issued_by": self.issued_by,
            "extra": _thaw(self.extra),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.unsigned_dict(), "signature": self.signature}

    def signing_bytes(self) -> bytes:
        return canonical_bytes(self.unsigned_dict())

    def canonical(self) -> bytes:
        return canonical_bytes(self.to_dict())

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical bytes, signature included: the hash-chain link."""
        return sha256_hex(self.canonical())

    def with_signature(self, signature: str) -> Certificate:
        return replace(self, signature=signature)

    @property
    def ranks(self) -> dict[int, Incarnation]:
        return {m.rank: m.incarnation for m in self.members}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Certificate:
        w = "certificate"
        if d.get("schema") != CERTIFICATE_SCHEMA:
            raise ValueError(f"{w}: schema is {d.get('schema')!r}, expected {CERTIFICATE_SCHEMA!r}")
        parent = d.get("parent_generation")
        if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool)):
            raise ValueError(f"{w}: parent_generation must be an integer or null")
        evidence = _need(d, "quiescence_evidence", list, w)
        admitted = _need(d, "admitted", list, w)
        if not all(isinstance(e, str) for e in evidence):
            raise ValueError(f"{w}: quiescence_evidence must be strings")
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in admitted):
            raise ValueError(f"{w}: admitted must be integers")
        _only(
            d,
            {
                "schema",
                "job_id",
                "generation",
                "parent_generation",
                "parent_certificate_digest",
                "members",
                "admitted",
                "reason",
                "frontier",
                "quiescence",
                "quiescence_evidence",
                "forced",
                "ownership_map_version",
                "activation_time",
                "issued_by",
                "extra",
                "signature",
            },
            w,
        )
        return cls(
            job_id=_need(d, "job_id", str, w),
            generation=_need(d, "generation", int, w),
            parent_generation=parent,
            parent_certificate_digest=_need(d, "parent_certificate_digest", str, w),
            members=tuple(Member.from_dict(m) for m in _need(d, "members", list, w)),
            reason=_need(d, "reason", str, w),
            frontier=Frontier.from_dict(_need(d, "frontier", Mapping, w)),
            quiescence=_need(d, "quiescence", str, w),
            quiescence_evidence=tuple(evidence),
            forced=_need(d, "forced", bool, w),
            ownership_map_version=_need(d, "ownership_map_version", int, w),
            activation_time=decode_time(_need(d, "activation_time", str, w)),
            issued_by=_need(d, "issued_by", str, w),
            extra=dict(_need(d, "extra", Mapping, w)),
            signature=_need(d, "signature", str, w),
            admitted=tuple(admitted),
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
        _only(d, {"g", "s", "r", "i", "t"}, w)
        return cls(
            _need(d, "g", int, w),
            _need(d, "s", int, w),
            _need(d, "r", int, w),
            _need(d, "i", str, w),
            decode_time(_need(d, "t", str, w)),
        )
