"""Read a DCP checkpoint's `.metadata` (a pickle) without trusting it.

The restricted unpickler admits only the DCP metadata classes, `torch.Size`, dtypes, layouts,
memory formats, paths and plain containers: a crafted `.metadata` cannot name `os.system` or any
other callable. The bytes come through the bounded reader (no link, no FIFO, at most
`DCP_METADATA_BYTES`), their BLAKE3 digest is what a manifest binds (`gpuguard.manifest/2`,
`generation.manifest.MetadataBinding`), and a load of an untrusted one (`load_metadata(...,
digest=...)`, every restore) checks that digest first and decodes in a forked worker killed at its
deadline (`foundation.workers.restricted_loads_within`: a shared-reference dict key is hashed
without end inside the C unpickler, where nothing in the process can stop it). torch is imported
only when this module's functions run.

Lazy imports (start-up time): torch (optional: `gpuguard[runtime]`), only when a DCP checkpoint is read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import blake3

from gpuguard.foundation.boundedread import DCP_METADATA_BYTES, read_bytes
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.foundation.optional import check_torch, require_torch
from gpuguard.foundation.unpickle import restricted_loads
from gpuguard.foundation.workers import restricted_loads_within

METADATA_FILE = ".metadata"

_DCP_METADATA = {
    "Metadata",
    "TensorStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": _DCP_METADATA,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}


def _resolve(module: str, name: str) -> Any:
    """The DCP metadata classes, torch.Size and torch's dtype/layout/memory-format constants only."""
    import importlib

    if name in _ALLOWED.get(module, ()):
        return getattr(importlib.import_module(module), name)
    if module == "torch":
        import torch

        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    return None


def read_metadata_bytes(checkpoint_dir: str | Path) -> bytes:
    """The raw bytes of a checkpoint's `.metadata`, bounded (no link, no FIFO, at most `DCP_METADATA_BYTES`)."""
    path = Path(checkpoint_dir) / METADATA_FILE
    try:
        return read_bytes(path, max_bytes=DCP_METADATA_BYTES, what="DCP metadata", follow_links=False)
    except NoInputError:
        raise NoInputError(f"{path}: not a DCP checkpoint (no {METADATA_FILE})") from None


def metadata_digest(data: bytes) -> str:
    """BLAKE3 of `.metadata`'s bytes, hex: what a manifest binds (the entries' digest style)."""
    return blake3.blake3(data).hexdigest()


def load_metadata(checkpoint_dir: str | Path, *, digest: str | None = None, forked: bool = True) -> Any:
    """The DCP `Metadata` object of a checkpoint directory (restricted unpickling).

    `digest`: the BLAKE3 the manifest binds; bytes with another digest are refused (DataError naming
    `.metadata`) before anything decodes them. `forked`: decode in a worker process killed at
    `unpickle.load_deadline` (every untrusted read); False only for the bytes a writer has just
    written itself (a fork of a training process per snapshot costs its page tables)."""
    check_torch("reading DCP checkpoint metadata")  # its classes live in torch.distributed.checkpoint
    path = Path(checkpoint_dir) / METADATA_FILE
    data = read_metadata_bytes(checkpoint_dir)
    if digest is not None:
        got = metadata_digest(data)
        if got != digest:
            raise DataError(f"{path}: BLAKE3 {got[:16]}… is not the manifest's {digest[:16]}…: replaced or corrupted")
    return decode_metadata(data, path, forked=forked)


def decode_metadata(data: bytes, path: str | Path, *, forked: bool = True) -> Any:
    """`.metadata`'s bytes as a DCP `Metadata` (see `load_metadata`); DataError naming `path` if not one."""
    loads = restricted_loads_within if forked else restricted_loads
    try:
        meta = loads(data, _resolve, what="DCP metadata")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is bad input
        raise DataError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from None
    if type(meta).__name__ != "Metadata" or not hasattr(meta, "storage_data"):
        raise DataError(f"{path}: not DCP metadata")
    return meta


def load_scalar(data: bytes) -> Any:
    """A non-tensor DCP object (torch.save'd) as a JSON scalar, or None when it is not one.

    `torch.load(weights_only=True)`: plain values only, never arbitrary classes.
    """
    torch = require_torch("reading DCP checkpoint values")

    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001 - not a plain value: listed without a value
        return None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if (
        isinstance(value, (list, tuple))
        and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value)
        and len(value) <= 64
    ):
        return list(value)
    return None
