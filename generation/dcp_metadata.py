"""Read a DCP checkpoint's `.metadata` (a pickle) without trusting it.

The restricted unpickler admits only the DCP metadata classes, `torch.Size`, dtypes, layouts,
memory formats, paths and plain containers: a crafted `.metadata` cannot name `os.system` or any
other callable. torch is imported only when this module's functions run.

Lazy imports (start-up time): torch (optional: `gpuguard[runtime]`), only when a DCP checkpoint is read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import DataError, NoInputError, from_os_error
from gpuguard.foundation.optional import check_torch, require_torch
from gpuguard.foundation.unpickle import restricted_loads

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


def load_metadata(checkpoint_dir: str | Path) -> Any:
    """The DCP `Metadata` object of a checkpoint directory (restricted unpickling)."""
    check_torch("reading DCP checkpoint metadata")  # its classes live in torch.distributed.checkpoint
    path = Path(checkpoint_dir) / ".metadata"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NoInputError(f"{path}: not a DCP checkpoint (no .metadata)") from None
    except OSError as exc:
        raise from_os_error(exc, str(path)) from None
    try:
        meta = restricted_loads(data, _resolve, what="DCP metadata")
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
