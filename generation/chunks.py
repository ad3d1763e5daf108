"""Content-addressed chunks: the parts of a certificate stored beside it, named by their SHA-256.

A certificate of schema `/2` signs a small header that names its member table and its body by the
digests of their chunks (docs/formats/certificate.md). The ledger stores each chunk once under its
digest (`<ledger>/chunks/<sha256>`, etcd `P/chunks/<sha256>`), so two generations that share a
chunk share its storage. A reader fetches a chunk by digest and uses it only if its bytes hash to
that digest: a missing or altered chunk is one `DataError` that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.foundation.errors import DataError
from gpuguard.generation.canonical import sha256_hex

CHUNK_MAX_BYTES = 512 << 10  # one chunk, one etcd request: well under etcd's 1.5 MiB request limit
CHUNK_READ_BYTES = 2 * CHUNK_MAX_BYTES  # the most a reader takes for one stored chunk

ChunkLoader = Callable[[str], "bytes | None"]  # sha256 -> the stored chunk, None when it is not stored


@dataclass(frozen=True)
class Blob:
    """One chunk to store: its digest and its bytes (stored exactly, nothing added)."""

    sha256: str
    data: bytes


def blob(data: bytes) -> Blob:
    return Blob(sha256_hex(data), data)


def is_sha256(s: object) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def split_bytes(data: bytes, size: int = CHUNK_MAX_BYTES) -> list[Blob]:
    """`data` in chunks of `size` bytes (the last one shorter); one empty chunk for empty data."""
    return [blob(data[i : i + size]) for i in range(0, max(len(data), 1), size)]


def fetch(load: ChunkLoader | None, sha256: str, where: str) -> bytes:
    """The chunk named `sha256`, verified: its bytes must hash to its name."""
    prefix = f"{where}: " if where else ""
    data = None if load is None else load(sha256)
    if data is None:
        raise DataError(f"{prefix}chunk {sha256} is missing")
    if sha256_hex(data) != sha256:
        raise DataError(f"{prefix}chunk {sha256} does not match its digest (altered or corrupt)")
    return data
