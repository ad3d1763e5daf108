"""The step a job resumes from next, and why: one answer for `gpu-recover status`, `restore` and the JSON.

Before this, `status` printed the active certificate's own frontier (step 0 for the first generation,
however far the job had run since) while `restore` bounded its choice by the steps committed since, so
the two named different steps, and neither was the one the runtime then resumed from. The runtime's
rule on the restart path (`recovery/runtime/restart.py`, docs/formats/activation.md) is: the newest
complete, verified state at or below `frontier_limit(active, committed_by_all)`, never past an
operator's pin, skipping a state a member already failed to load. This module asks the ledger and the
snapshot store the same questions through their public functions (the operator never imports the
runtime), so the step it names is the step the next activation starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError
from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.ledger import Ledger
from gpuguard.recovery.snapshots import store as snapshot
from gpuguard.recovery.snapshots.parts import LAYOUT as SHARDED
from gpuguard.recovery.snapshots.parts import parts_problem
from gpuguard.recovery.snapshots.store import Rejection, Selection, SnapshotInfo

MAX_TRIES = 8  # candidates verified before giving up: the runtime's own bound
MAX_UNRESTORABLE_SKIPS = 8  # states a member failed to load, skipped in a row (the runtime's bound)


@dataclass(frozen=True)
class Frontier:
    """How far the next generation may go, from the ledger alone."""

    limit: int | None  # None: no ledger or no active certificate (bounded by an explicit step only)
    source: str
    generation: int | None = None
    certified: int | None = None  # the active certificate's own frontier step
    committed_by_all: int | None = None


@dataclass(frozen=True)
class ResumePoint:
    """The step the next activation starts from, the state it loads, and the evidence in words."""

    step: int
    source: str
    frontier: Frontier
    bound: int | None  # the limit, lowered by a pin or an explicit --step
    pin: int | None = None
    selection: Selection = field(default_factory=lambda: Selection(None))

    def to_json(self) -> dict[str, Any]:
        chosen = self.selection.chosen
        return {
            "step": self.step,
            "source": self.source,
            "frontier_limit": self.frontier.limit,
            "frontier_source": self.frontier.source,
            "committed_by_all": self.frontier.committed_by_all,
            "pinned_step": self.pin,
            "snapshot": None if chosen is None else str(chosen.path),
            "rejected": [f"step {r.step}: {r.reason}" for r in self.selection.rejected],
        }


def frontier(ledger: Ledger | None) -> Frontier:
    """`frontier_limit` of the active generation (the runtime's own rule), with its evidence."""
    if ledger is None:
        return Frontier(None, "no ledger: bounded by --step only")
    cert = ledger.active()
    if cert is None:
        return Frontier(None, "no active certificate")
    committed = ledger.last_committed_by_all(cert.generation) if cert.members else None
    limit = frontier_limit(cert, committed)
    if committed is not None and committed > cert.frontier.step:
        why = f"step {committed} committed by every member of generation {cert.generation}"
    else:
        why = f"generation {cert.generation}'s certified frontier, step {cert.frontier.step}"
        if cert.members:
            why += " (no later step committed by every member)"
    return Frontier(limit, why, cert.generation, cert.frontier.step, committed)


def runtime_check(info: SnapshotInfo) -> str | None:
    """What the runtime checks beyond the manifest before it loads a state: a sharded snapshot's
    every part present, unaltered and together the manifest (`snapshots.parts.parts_problem`). Without it,
    restore pinned a snapshot with a missing or swapped part, the runtime refused it and resumed a
    step earlier than the pin said."""
    return parts_problem(info) if info.layout == SHARDED else None


def select(root: Path, bound: int | None, *, max_tries: int = MAX_TRIES) -> Selection:
    """The newest verified state at or below `bound`, past the states a member already failed to load
    (their marks are under the snapshot root's `coord/`), as the runtime selects it."""
    selection = snapshot.select_restorable(root, bound, max_tries=max_tries, check=runtime_check)
    for _ in range(MAX_UNRESTORABLE_SKIPS):
        chosen = selection.chosen
        if chosen is None or not jobdir.is_unrestorable(root, chosen.manifest_digest):
            break
        older = snapshot.select_restorable(root, chosen.step - 1, max_tries=max_tries, check=runtime_check)
        skipped = Rejection(chosen.step, chosen.path, "unrestorable: a member failed to load it")
        rejected = (*selection.rejected, skipped, *(r for r in older.rejected if r.step < chosen.step))
        selection = Selection(older.chosen, rejected, bound)
    return selection


def read_pin(job_dir: Path) -> tuple[int | None, str]:
    """The step `gpu-recover restore` pinned (None: no pin), and a note when the pin is unreadable
    (the runtime ignores a malformed pin too, and says so)."""
    try:
        pin = jobdir.read_restore_pin(job_dir)
    except GpuguardError as exc:
        return None, f"{jobdir.RESTORE_PIN} ignored: {exc}"
    return (None, "") if pin is None else (pin.step, "")


def resume_point(
    job_dir: Path,
    ledger: Ledger | None,
    *,
    step: int | None = None,
    honour_pin: bool = True,
    snapshot_root: Path | None = None,
    max_tries: int = MAX_TRIES,
) -> ResumePoint:
    """The step the next activation resumes from.

    `step`: an explicit upper bound (`restore --step`). `honour_pin`: bound by the pin on disk, as the
    runtime is (`restore` chooses a new pin, so it does not). Raises NoInputError when the snapshot root
    does not exist."""
    front = frontier(ledger)
    bounds = [b for b in (front.limit, step) if b is not None]
    pin, pin_note = read_pin(job_dir) if honour_pin else (None, "")
    if pin is not None:
        bounds.append(pin)
    bound = min(bounds) if bounds else None
    root = jobdir.snapshot_root(job_dir, snapshot_root)
    selection = select(root, bound, max_tries=max_tries) if root.is_dir() else Selection(None, (), bound)
    chosen = selection.chosen
    if chosen is not None:
        source = f"{chosen.kind[:-1]} of step {chosen.step}, the newest verified state at or before step {bound}"
    else:
        source = "no verified state on disk: the initial state"
        if bound == 0:
            source = "first start: the initial state"
    if pin is not None and pin == bound:
        source += f" (pinned by `gpu-recover restore` at step {pin})"
    elif step is not None and step == bound:
        source += " (--step)"
    elif front.limit is not None:
        source += f" (frontier limit: {front.source})"
    else:
        source += f" ({front.source})"
    if pin_note:
        source += f"; {pin_note}"
    return ResumePoint(chosen.step if chosen is not None else 0, source, front, bound, pin, selection)
