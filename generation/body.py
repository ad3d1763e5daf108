"""The body of a `/2` certificate: what grows with the job besides the members.

`admitted` (every rank of a restart), `quiescence_evidence` (a line per old member) and `extra`
(a proof per old incarnation, the rank map of an in-place switch) each hold one entry per member:
about 15 MB at 100,000 members. The signed header names the body by the digests of its byte
chunks (docs/formats/certificate.md, "Body"), the ledger stores them beside it
(`generation.chunks`), and a certificate read from a ledger loads its body on first use, so
walking a chain reads headers only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

from gpuguard.foundation.errors import DataError
from gpuguard.generation.canonical import canonical_bytes, parse_canonical
from gpuguard.generation.chunks import Blob, ChunkLoader, fetch, split_bytes
from gpuguard.generation.fields import freeze, is_int, need, only, thaw

_T = TypeVar("_T")

BodyValue = tuple[tuple[int, ...], tuple[str, ...], Mapping[str, Any]]  # admitted, evidence, extra (frozen)


def body_bytes(admitted: Sequence[int], evidence: Sequence[str], extra: Mapping[str, Any]) -> bytes:
    """The canonical body: `{"admitted": [...], "extra": {...}, "quiescence_evidence": [...]}`."""
    return canonical_bytes({"admitted": list(admitted), "extra": thaw(extra), "quiescence_evidence": list(evidence)})


def encode_body(admitted: Sequence[int], evidence: Sequence[str], extra: Mapping[str, Any]) -> tuple[Blob, ...]:
    return tuple(split_bytes(body_bytes(admitted, evidence, extra)))


def decode_body(data: bytes) -> BodyValue:
    """The body's three fields; ValueError says why the bytes are not a body."""
    doc = parse_canonical(data)
    w = "certificate body"
    if not isinstance(doc, dict):
        raise ValueError(f"{w}: not a JSON object")
    only(doc, {"admitted", "extra", "quiescence_evidence"}, w)
    admitted = need(doc, "admitted", list, w)
    evidence = need(doc, "quiescence_evidence", list, w)
    if not all(is_int(a) for a in admitted):
        raise ValueError(f"{w}: admitted must be integers")
    if not all(isinstance(e, str) for e in evidence):
        raise ValueError(f"{w}: quiescence_evidence must be strings")
    return tuple(admitted), tuple(evidence), freeze(need(doc, "extra", dict, w))


class StoredBody:
    """A body read from a ledger: its chunks are fetched, checked and parsed once, on first use."""

    __slots__ = ("_load", "_value", "refs", "where")

    def __init__(self, refs: Sequence[str], load: ChunkLoader | None, where: str) -> None:
        self.refs = tuple(refs)
        self._load, self.where = load, where
        self._value: BodyValue | None = None

    def blobs(self) -> tuple[Blob, ...]:
        return tuple(Blob(r, fetch(self._load, r, self.where)) for r in self.refs)

    def value(self) -> BodyValue:
        if self._value is None:
            data = b"".join(b.data for b in self.blobs())
            try:
                self._value = decode_body(data)
            except ValueError as exc:
                prefix = f"{self.where}: " if self.where else ""
                raise DataError(f"{prefix}{exc}") from None
        return self._value

    def unload(self) -> None:
        self._value = None

    @property
    def loaded(self) -> bool:
        return self._value is not None


class LazySequence(Sequence[_T], Generic[_T]):
    """`admitted` or `quiescence_evidence` of a stored body: read when first used."""

    __slots__ = ("body", "field")

    def __init__(self, body: StoredBody, field: int) -> None:
        self.body, self.field = body, field

    def _items(self) -> tuple[_T, ...]:
        items: tuple[_T, ...] = self.body.value()[self.field]  # type: ignore[assignment]
        return items

    @overload
    def __getitem__(self, i: int) -> _T: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[_T, ...]: ...
    def __getitem__(self, i: int | slice) -> _T | tuple[_T, ...]:
        return self._items()[i]

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator[_T]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Sequence, LazySequence)) and not isinstance(other, (str, bytes)):
            return self._items() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._items()) if self.body.loaded else f"<not loaded: {len(self.body.refs)} chunk(s)>"


class LazyMapping(Mapping[str, Any]):
    """`extra` of a stored body: read when first used."""

    __slots__ = ("body",)

    def __init__(self, body: StoredBody) -> None:
        self.body = body

    def _map(self) -> Mapping[str, Any]:
        return self.body.value()[2]

    def __getitem__(self, key: str) -> Any:
        return self._map()[key]

    def __len__(self) -> int:
        return len(self._map())

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __repr__(self) -> str:
        return repr(dict(self._map())) if self.body.loaded else f"<not loaded: {len(self.body.refs)} chunk(s)>"


def stored_fields(body: StoredBody) -> tuple[LazySequence[int], LazySequence[str], LazyMapping]:
    """The three certificate fields a stored body backs: admitted, quiescence_evidence, extra."""
    return LazySequence(body, 0), LazySequence(body, 1), LazyMapping(body)
