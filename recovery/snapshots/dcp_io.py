"""The one way DCP loads a snapshot: its `.metadata` bound and never unpickled by torch.

torch's `FileSystemReader.read_metadata` is a plain `pickle.load` of `.metadata`, and its
`DefaultLoadPlanner.load_bytes` a `torch.load(weights_only=False)` of every non-tensor object: code
from whoever can write the snapshot directory ran in every restoring worker (issue 28, finding 2).
Here `dcp.load` gets a reader (`BoundReader`, a `FileSystemReader`) whose `read_metadata` hands over
what `generation.dcp_metadata.load_metadata` made of the bytes: read bounded (no link, no FIFO, a
size cap), checked against the BLAKE3 the verified manifest binds, decoded by the restricted
unpickler in a worker killed at its deadline. Non-tensor objects are loaded with
`torch.load(weights_only=True)` (`WeightsOnlyPlanner`). The metadata is read before `dcp.load`
starts, so a refusal is one DataError line, not DCP's fallback to per-rank metadata with a logged
traceback.

A manifest of `gpuguard.manifest/1` binds no `.metadata` (written before the binding): its
`.metadata` still goes only through the restricted unpickler and the deadline.

Lazy imports (start-up time): torch and DCP, only where a snapshot is loaded (the operator lists and
verifies snapshots without torch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import DataError
from gpuguard.generation import manifest as m
from gpuguard.generation.dcp_metadata import load_metadata

_CLASSES: dict[str, type] = {}


def bound_metadata_digest(path: Path, manifest_digest: str | None) -> str | None:
    """The `.metadata` BLAKE3 that the snapshot's manifest binds (None: a legacy manifest), the
    manifest being the verified one (`manifest_digest`) when the caller knows it."""
    manifest = m.load_manifest(path)
    if manifest_digest is not None and manifest.digest != manifest_digest:
        raise DataError(f"{path}: manifest {manifest.digest[:16]}… is not the verified {manifest_digest[:16]}…")
    return None if manifest.metadata is None else manifest.metadata.digest


def dcp_load(
    state: dict[str, Any],
    path: str | Path,
    *,
    metadata_digest: str | None = None,
    manifest_digest: str | None = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """`dcp.load(state, ...)` of the snapshot at `path`, in place, through `BoundReader`.

    `metadata_digest`: the BLAKE3 of `.metadata` that the verified manifest binds
    (`SnapshotInfo.metadata_digest`); without it the manifest at `path` says (checked against
    `manifest_digest` when given). DataError naming `.metadata` if it is not the bound one or does
    not decode."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - lazy: torch only where a snapshot loads

    path = Path(path)
    if metadata_digest is None:
        metadata_digest = bound_metadata_digest(path, manifest_digest)
    meta = load_metadata(path, digest=metadata_digest)
    reader = _reader_class()(path, meta)
    planner = _planner_class()()
    quiet_dcp(
        lambda: dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    )


def _reader_class() -> type:
    """`BoundReader`: DCP's file reader whose metadata is the one decoded and checked here."""
    if "reader" not in _CLASSES:
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415 - lazy: torch only where used
        from torch.distributed.checkpoint.metadata import StorageMeta  # noqa: PLC0415 - lazy: torch only where used

        class BoundReader(FileSystemReader):
            """`read_metadata` returns the checked metadata; it takes no `rank` (no per-rank fallback)."""

            def __init__(self, path: Path, metadata: Any) -> None:
                super().__init__(path)
                self._metadata = metadata

            def read_metadata(self) -> Any:
                meta = self._metadata
                if getattr(meta, "storage_meta", None) is None:
                    meta.storage_meta = StorageMeta()
                meta.storage_meta.load_id = self.load_id
                return meta

        _CLASSES["reader"] = BoundReader
    return _CLASSES["reader"]


def _planner_class() -> type:
    """`WeightsOnlyPlanner`: DCP's default load planner, non-tensor objects loaded weights-only."""
    if "planner" not in _CLASSES:
        import torch  # noqa: PLC0415 - lazy: torch only where used
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: PLC0415 - lazy

        class WeightsOnlyPlanner(DefaultLoadPlanner):
            def load_bytes(self, read_item: Any, value: Any) -> None:
                loaded = torch.load(value, weights_only=True)
                if self.flatten_state_dict:
                    from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415 - lazy

                    set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
                else:
                    self.state_dict[read_item.dest_index.fqn] = loaded

        _CLASSES["planner"] = WeightsOnlyPlanner
    return _CLASSES["planner"]


def quiet_dcp(fn: Callable[[], Any]) -> Any:
    """DCP warns 'assuming the intent is to save in a single process' on every no_dist call."""
    import warnings  # noqa: PLC0415 - with torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()
