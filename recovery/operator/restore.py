"""`gpu-recover restore`: pin the newest complete, verified state at or before the committed frontier.

The pin (`restore.json`, `foundation.jobdir.RestorePin`) bounds the next activation only; it never
moves the frontier forward. The candidates are verified as the runtime will verify them
(`recovery.snapshots.store.select_restorable`), so the step it names is the step the job resumes from.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, GpuguardError, NoInputError, UsageError
from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.recovery.operator.result import ActionResult
from gpuguard.recovery.snapshots import store as snapshot
from gpuguard.recovery.snapshots.parts import LAYOUT as SHARDED
from gpuguard.recovery.snapshots.parts import parts_problem
from gpuguard.recovery.snapshots.store import SnapshotInfo


def restore(
    job_dir: Path,
    *,
    step: int | None = None,
    max_tries: int = 3,
    snapshot_root: Path | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Pin the newest complete, verified state at or before the committed frontier (and `step`).

    Corrupt or incomplete candidates are rejected with the reason and the next older one is tried,
    at most `max_tries` times. The choice is written to `<job-dir>/restore.json` for the runtime.
    `snapshot_root`: where the job keeps snapshots/ and checkpoints/ (`jobdir.snapshot_root`: this,
    else $GPUGUARD_SNAPSHOT_ROOT, else the job dir).
    """

    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    if max_tries < 1:
        raise UsageError("--max-tries must be at least 1")
    frontier, source = _frontier(job_dir)
    bound = step if frontier is None else (frontier if step is None else min(step, frontier))
    root = jobdir.snapshot_root(job_dir, snapshot_root)
    if not root.is_dir():
        raise NoInputError(f"{root}: no such snapshot root")
    selection = snapshot.select_restorable(root, bound, max_tries=max_tries, check=runtime_check)
    details: dict[str, Any] = {
        "frontier": frontier,
        "frontier_source": source,
        "limit": bound,
        "snapshot_root": str(root),
        **selection.to_dict(),
    }
    if selection.chosen is None:
        if not selection.rejected:
            raise NoInputError(f"{root}: no snapshot or checkpoint to restore")
        return ActionResult(
            "restore",
            "failed",
            EXIT_CRITICAL,
            f"no complete, verified state at or before step {bound}: {len(selection.rejected)} candidate(s) rejected",
            details,
            dry_run=dry_run,
        )
    chosen = selection.chosen
    pin = jobdir.RestorePin(
        chosen.step,
        str(chosen.path),
        chosen.kind,
        chosen.generation,
        chosen.manifest_digest,
        chosen.state_digest,
        pinned_at=time.time(),
    )
    try:
        current = jobdir.read_restore_pin(job_dir)
    except GpuguardError:
        current = None
    summary = f"step {chosen.step} ({chosen.kind}, manifest {str(chosen.manifest_digest)[:12]})"
    # what the pin changes, in words: the next activation's bound (`activation.restore_bound`)
    change = f"the next generation starts from step {chosen.step}"
    if frontier is None:
        change += f" (no frontier limit to compare with: {source})"
    elif chosen.step < frontier:
        change += f" instead of the frontier limit, step {frontier}"
    else:
        change += " (the frontier limit itself: the pin fixes which copy)"
    details["effect"] = change + " (used by the next activation only; a pin never moves the frontier forward)"
    summary = f"{summary}: {details['effect']}"
    if chosen.warning:  # a legacy manifest: said, not refused (docs/formats/snapshots.md, "Versioning")
        summary = f"{summary}; warning: {chosen.warning}"
    if current is not None and current.choice() == pin.choice():
        return ActionResult("restore", "noop", EXIT_OK, f"already pinned: {summary}", details, dry_run=dry_run)
    if dry_run:
        return ActionResult("restore", "dry-run", EXIT_OK, f"would pin {summary}", details, dry_run=True)
    jobdir.write_restore_pin(job_dir, pin)
    return ActionResult("restore", "done", EXIT_OK, f"pinned {summary}", details)


def _frontier(job_dir: Path) -> tuple[int | None, str]:
    """The newest step the next generation may start from (the runtime's own rule: `frontier_limit`)."""
    if not jobdir.ledger_dir(job_dir).exists():
        return None, "none (no ledger: bounded by --step only)"

    with open_ledger(job_dir) as ledger:
        cert = ledger.active()
        if cert is None:
            return None, "none (no active certificate)"
        committed = ledger.last_committed_by_all(cert.generation) if cert.members else None
    return frontier_limit(cert, committed), f"generation {cert.generation} (committed by all: {committed})"


def runtime_check(info: SnapshotInfo) -> str | None:
    """What the runtime checks beyond the manifest before it loads a state: a sharded snapshot's
    every part present, unaltered and together the manifest (`snapshots.parts.parts_problem`). Without it,
    restore pinned a snapshot with a missing or swapped part, the runtime refused it and resumed a
    step earlier than the pin said."""
    return parts_problem(info) if info.layout == SHARDED else None
