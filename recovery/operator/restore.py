"""`gpu-recover restore`: pin the newest complete, verified state at or before the committed frontier.

The pin (`restore.json`, `foundation.jobdir.RestorePin`) bounds the next activation only; it never
moves the frontier forward. The candidates are verified as the runtime will verify them, by the one rule
`gpu-recover status` uses too (`recovery.operator.resume`), so the step it names is the step the job
resumes from.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, GpuguardError, NoInputError, UsageError
from gpuguard.generation.job import open_job_ledger
from gpuguard.recovery.operator.result import ActionResult
from gpuguard.recovery.operator.resume import ResumePoint, resume_point


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
    root = jobdir.snapshot_root(job_dir, snapshot_root)
    if not root.is_dir():
        raise NoInputError(f"{root}: no such snapshot root")
    point = _resume_point(job_dir, step, max_tries, snapshot_root)
    selection, bound, frontier = point.selection, point.bound, point.frontier.limit
    source = point.frontier.source
    details: dict[str, Any] = {
        "frontier": frontier,
        "frontier_source": source,
        "limit": bound,
        "snapshot_root": str(root),
        "resume": point.to_json(),
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
        change += f" (no frontier limit to compare with: none ({source}))"
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


def _resume_point(job_dir: Path, step: int | None, max_tries: int, snapshot_root: Path | None) -> ResumePoint:
    """`resume.resume_point` without the pin on disk (restore chooses the next pin); the ledger wherever
    the job keeps it (the directory or the etcd URL in `ledger.url`)."""
    if not any(p.exists() for p in (jobdir.ledger_dir(job_dir), jobdir.ledger_url_path(job_dir))):
        return resume_point(
            job_dir, None, step=step, honour_pin=False, snapshot_root=snapshot_root, max_tries=max_tries
        )
    with open_job_ledger(job_dir) as ledger:
        return resume_point(
            job_dir, ledger, step=step, honour_pin=False, snapshot_root=snapshot_root, max_tries=max_tries
        )
