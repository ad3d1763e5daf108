"""What the runtime remembers between activations about restoring: states that failed to load, and the operator's pin.

- An unrestorable mark (`<root>/coord/unrestorable-<manifest digest>.json`): a member could not load
  this exact state (a DCP error, a digest that differs after loading), so the next coordinator skips
  it, a bounded number of times, instead of failing the same way forever.
- The restore pin (`<job-dir>/restore.json`), written by `gpu-recover restore`: the newest step the
  next generation may start from; used once, then moved aside (`restore-used-g<G>.json`).

Formats: docs/formats/job-dir.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError
from gpuguard.recovery.snapshots.store import SnapshotInfo

RESTORE_PIN = "restore.json"  # written by `gpu-recover restore` (recovery/operator/actions.py)


def _unrestorable_path(root: Path, manifest_digest: str | None) -> Path:
    return jobdir.coord_dir(root) / f"unrestorable-{str(manifest_digest)[:32]}.json"


def mark_unrestorable(root: Path, info: SnapshotInfo, why: str) -> None:
    """Remember that this exact state (manifest digest) could not be loaded."""
    try:
        jobdir.atomic_write_json(
            _unrestorable_path(root, info.manifest_digest),
            {
                "step": info.step,
                "path": str(info.path),
                "manifest_digest": info.manifest_digest,
                "reason": why[:500],
                "time": time.time(),
            },
        )
    except OSError:
        pass


def is_unrestorable(root: Path, manifest_digest: str | None) -> bool:
    return _unrestorable_path(root, manifest_digest).exists()


def read_restore_pin(job_dir: Path) -> int | None:
    """The step `gpu-recover restore` pinned, if any (malformed: ignored, said)."""
    path = job_dir / RESTORE_PIN
    if not path.exists():
        return None
    try:
        step = jobdir.read_json(path).get("step")
    except GpuguardError as exc:
        print(f"gpuguard: ignoring {path}: {exc}", file=sys.stderr)
        return None
    return step if isinstance(step, int) and step >= 0 else None


def consume_restore_pin(job_dir: Path, generation: int) -> None:
    """The pin was used by `generation`: move it aside, so the next generation is bounded by its commits again."""
    jobdir.coord_dir(job_dir).mkdir(parents=True, exist_ok=True)
    os.replace(job_dir / RESTORE_PIN, jobdir.coord_dir(job_dir) / f"restore-used-g{generation}.json")
