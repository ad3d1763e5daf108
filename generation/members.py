"""A generation's members, and the content-addressed chunks a certificate binds them by.

An incarnation is one process instance; a member is a logical rank held by one incarnation. A
certificate of schema `/2` does not carry its members: it carries the SHA-256 of each chunk of
its member table (`ChunkRef`), and the chunks are stored beside it, content-addressed
(docs/formats/certificate.md, "Member table"). So the signed bytes stay a few KiB at 100,000
members, every chunk fits in one etcd request, and a generation that keeps most members of its
parent stores only the chunks that changed.

Chunk boundaries are content-defined (after a member whose incarnation id hashes to a boundary)
and ranks inside a chunk are offsets from its first rank: dropping one replica of a 100,000-rank
job and renumbering the rest densely changes one or two chunks, not every chunk after it.

`MemberTable` is the sequence of members a certificate exposes as `.members`. Built from members
it encodes its chunks on first need; read from a ledger it loads and verifies them on first use
(a missing or altered chunk is one `DataError` naming the chunk), so walking a chain reads no
member chunks at all.
"""

from __future__ import annotations

import bisect
import os
import socket
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from gpuguard.foundation.errors import DataError
from gpuguard.foundation.identity import own_start_time
from gpuguard.generation.canonical import canonical_bytes, parse_canonical
from gpuguard.generation.chunks import CHUNK_MAX_BYTES, Blob, ChunkLoader, blob, fetch, is_sha256
from gpuguard.generation.fields import decode_time, encode_time, is_int, need, only

MEMBERS_SCHEMA = "gpuguard.members/1"
CHUNK_MAX_MEMBERS = 4096  # and at most chunks.CHUNK_MAX_BYTES: well under etcd's 1.5 MiB request limit
BOUNDARY_MASK = 0x3FF  # ~1 member in 1024 ends a chunk: chunks of ~1,000 members on average


_INCARNATION_FIELDS = ("id", "host", "pid", "start_time", "gpu_uuid")


@dataclass(frozen=True, slots=True)
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
        # the well-formed case in one step (a restart at 100,000 ranks reads 100,000 of them); any other
        # dict takes the checks below, which accept and refuse exactly what this accepts, and say why
        if len(d) == 5 and "gpu_uuid" in d:
            i, h, p, s, g = d.get("id"), d.get("host"), d.get("pid"), d.get("start_time"), d["gpu_uuid"]
            if (
                type(i) is str
                and type(h) is str
                and type(p) is int
                and type(s) is str
                and (g is None or type(g) is str)
            ):
                return cls(i, h, p, float(s), g)
        return cls.checked_from_dict(d)

    @classmethod
    def checked_from_dict(cls, d: Mapping[str, Any]) -> Incarnation:
        """`from_dict` field by field: every refusal names its field."""
        w = "incarnation"
        only(d, set(_INCARNATION_FIELDS), w)
        gpu = d.get("gpu_uuid")
        if gpu is not None and not isinstance(gpu, str):
            raise ValueError(f"{w}: gpu_uuid must be a string or null")
        return cls(
            need(d, "id", str, w),
            need(d, "host", str, w),
            need(d, "pid", int, w),
            decode_time(need(d, "start_time", str, w)),
            gpu,
        )


@dataclass(frozen=True, slots=True)
class Member:
    """A logical rank held by one incarnation in one generation."""

    rank: int
    incarnation: Incarnation

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.incarnation.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        only(d, {"rank", "incarnation"}, "member")
        return cls(
            need(d, "rank", int, "member"),
            Incarnation.from_dict(need(d, "incarnation", Mapping, "member")),
        )


# ---------------------------------------------------------------------- chunks
@dataclass(frozen=True)
class ChunkRef:
    """What the signed certificate says of one chunk of its member table: its digest, how many
    members it holds, and the rank its offsets count from."""

    sha256: str
    count: int
    first_rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "count": self.count, "first_rank": self.first_rank}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChunkRef:
        w = "member chunk reference"
        only(d, {"sha256", "count", "first_rank"}, w)
        sha, count = need(d, "sha256", str, w), need(d, "count", int, w)
        if not is_sha256(sha):
            raise ValueError(f"{w}: sha256 must be 64 lowercase hex digits")
        if count < 1:
            raise ValueError(f"{w}: count must be at least 1")
        return cls(sha, count, need(d, "first_rank", int, w))


def _encode(members: Sequence[Member], max_bytes: int) -> list[tuple[ChunkRef, Blob]]:
    """One chunk, or halves when its bytes are over `max_bytes` (only with very long names)."""
    first = members[0].rank
    entries = [
        [m.rank - first, i.id, i.host, i.pid, encode_time(i.start_time), i.gpu_uuid]
        for m in members
        for i in (m.incarnation,)
    ]
    b = blob(canonical_bytes({"schema": MEMBERS_SCHEMA, "members": entries}))
    if len(b.data) > max_bytes and len(members) > 1:
        half = len(members) // 2
        return _encode(members[:half], max_bytes) + _encode(members[half:], max_bytes)
    return [(ChunkRef(b.sha256, len(members), first), b)]


def ends_chunk(incarnation_id: str, mask: int = BOUNDARY_MASK) -> bool:
    """The content-defined boundary: a chunk ends after an incarnation whose id's CRC-32 has the
    `mask` bits zero (the writer's rule, not checked by readers; CRC-32: a fast, fixed function,
    where Python's own string hash differs from process to process)."""
    return zlib.crc32(incarnation_id.encode("utf-8", "surrogatepass")) & mask == 0


def split_members(
    members: Sequence[Member],
    *,
    max_members: int = CHUNK_MAX_MEMBERS,
    max_bytes: int = CHUNK_MAX_BYTES,
    mask: int = BOUNDARY_MASK,
) -> list[tuple[ChunkRef, Blob]]:
    """The member table as chunks, in table order: a chunk ends after a boundary member, and always
    at `max_members` or `max_bytes`. No minimum size: a minimum makes where a chunk ends depend on
    where it started, and one dropped member would then move the boundaries after it."""
    chunks: list[tuple[ChunkRef, Blob]] = []
    start = 0
    for i, m in enumerate(members):
        if i + 1 - start >= max_members or ends_chunk(m.incarnation.id, mask):
            chunks += _encode(members[start : i + 1], max_bytes)
            start = i + 1
    if start < len(members):
        chunks += _encode(members[start:], max_bytes)
    return chunks


def decode_chunk(ref: ChunkRef, data: bytes) -> tuple[Member, ...]:
    """The members of one chunk (already checked against its digest); ValueError when it is not a
    member chunk holding `ref.count` members."""
    doc = parse_canonical(data)
    w = "member chunk"
    if not isinstance(doc, dict):
        raise ValueError(f"{w}: not a JSON object")
    only(doc, {"schema", "members"}, w)
    if doc["schema"] != MEMBERS_SCHEMA:
        raise ValueError(f"{w}: schema is {doc['schema']!r}, expected {MEMBERS_SCHEMA!r}")
    entries = need(doc, "members", list, w)
    if len(entries) != ref.count:
        raise ValueError(f"{w}: holds {len(entries)} members, the certificate says {ref.count}")
    out = []
    for e in entries:
        if not (
            isinstance(e, list)
            and len(e) == 6
            and is_int(e[0])
            and isinstance(e[1], str)
            and isinstance(e[2], str)
            and is_int(e[3])
            and isinstance(e[4], str)
            and (e[5] is None or isinstance(e[5], str))
        ):
            raise ValueError(f"{w}: an entry is not [offset, id, host, pid, start_time, gpu_uuid]")
        out.append(Member(ref.first_rank + e[0], Incarnation(e[1], e[2], e[3], decode_time(e[4]), e[5])))
    return tuple(out)


# ---------------------------------------------------------------------- the table
class MemberTable(Sequence[Member]):
    """A certificate's members, in table order, with their chunked encoding (see the module docstring)."""

    __slots__ = ("_blobs", "_load", "_members", "_refs", "_where")

    def __init__(self, members: Iterable[Member] = ()) -> None:
        self._members: tuple[Member, ...] | None = tuple(members)
        self._refs: tuple[ChunkRef, ...] | None = None
        self._blobs: tuple[Blob, ...] | None = None
        self._load: ChunkLoader | None = None
        self._where = ""

    @classmethod
    def stored(cls, refs: Iterable[ChunkRef], load: ChunkLoader | None, where: str) -> MemberTable:
        """A table read from a ledger: `load` fetches a chunk by digest when a member is first used."""
        table = cls()
        table._members, table._refs, table._load, table._where = None, tuple(refs), load, where
        return table

    # -- the encoding --------------------------------------------------------------------
    def _encode(self) -> None:
        pairs = split_members(self.load())
        self._refs = tuple(r for r, _ in pairs)
        self._blobs = tuple(b for _, b in pairs)

    @property
    def refs(self) -> tuple[ChunkRef, ...]:
        """What the certificate binds: one reference per chunk (encodes the members once)."""
        if self._refs is None:
            self._encode()
        assert self._refs is not None
        return self._refs

    def blobs(self) -> tuple[Blob, ...]:
        """The chunks to store: encoded from the members, or (a table read from a ledger) fetched."""
        if self._blobs is None:
            if self._load is None:
                self._encode()
            else:
                self._blobs = tuple(Blob(r.sha256, fetch(self._load, r.sha256, self._where)) for r in self.refs)
        assert self._blobs is not None
        return self._blobs

    def to_list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.refs]

    # -- the members ---------------------------------------------------------------------
    def _chunk(self, ref: ChunkRef) -> tuple[Member, ...]:
        data = fetch(self._load, ref.sha256, self._where)
        try:
            return decode_chunk(ref, data)
        except ValueError as exc:
            where = f"{self._where}: " if self._where else ""
            raise DataError(f"{where}member chunk {ref.sha256}: {exc}") from None

    def load(self) -> tuple[Member, ...]:
        """Every member; a chunk that is missing, altered or malformed is one DataError naming it."""
        if self._members is None:
            out: list[Member] = []
            for ref in self.refs:
                out += self._chunk(ref)
            self._members = tuple(out)
        return self._members

    def at_rank(self, rank: int) -> Member | None:
        """The member on `rank`. In a table sorted by rank (as `certificate.issue` writes it) only the
        chunk that can hold it is read: what one rank of a large job needs at admission."""
        if self._members is None and self._refs:
            i = bisect.bisect_right([r.first_rank for r in self._refs], rank) - 1
            found = next((m for m in self._chunk(self._refs[i]) if m.rank == rank), None) if i >= 0 else None
            if found is not None:
                return found
        return next((m for m in self.load() if m.rank == rank), None)  # unsorted, or not a member

    def first(self, n: int) -> tuple[Member, ...]:
        """The first `n` members in table order, reading only the chunks that hold them."""
        if self._members is not None or self._refs is None:
            return self.load()[:n]
        out: list[Member] = []
        for ref in self._refs:
            if len(out) >= n:
                break
            out += self._chunk(ref)
        return tuple(out[:n])

    def unload(self) -> None:
        """Forget the members of a table read from a ledger (they are read again when used):
        what keeps a walk over many large generations in bounded memory."""
        if self._load is not None and self._refs is not None:
            self._members = None

    @property
    def loaded(self) -> bool:
        return self._members is not None

    def __len__(self) -> int:
        if self._members is not None:
            return len(self._members)
        return sum(r.count for r in self.refs)

    @overload
    def __getitem__(self, i: int) -> Member: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Member, ...]: ...
    def __getitem__(self, i: int | slice) -> Member | tuple[Member, ...]:
        return self.load()[i]

    def __iter__(self) -> Iterator[Member]:
        return iter(self.load())

    def __eq__(self, other: object) -> bool:
        """Two tables whose chunks are known are equal when they bind the same chunks (no chunk is
        read); otherwise the members are compared."""
        if isinstance(other, MemberTable):
            if self._refs is not None and other._refs is not None:
                return self._refs == other._refs
            return self.load() == other.load()
        if isinstance(other, (tuple, list)):
            return self.load() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value

    def __repr__(self) -> str:
        chunks = f" in {len(self._refs)} chunk(s)" if self._refs is not None else ""
        return f"MemberTable({len(self)} members{chunks})"
