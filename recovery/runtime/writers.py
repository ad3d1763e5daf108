"""The replicated snapshot writer, and what every snapshot's outcome does (counters, checkpoints, pruning).

Replicated state is the same on every rank, so rank 0 alone writes it, in a background thread:
training never waits for the disk, and back-pressure keeps every due step's snapshot (the RPO) as
long as the writer keeps up. Sharded state is written by every rank together
(`recovery.snapshots.sharded_writer.ShardedSnapshotter`); both report each snapshot to one
`SnapshotOutcomes`, which counts it and, on the publishing rank, copies a due checkpoint and
prunes old snapshots (never the generation's certified frontier).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.latest_slot import LatestSlot
from gpuguard.recovery.snapshots.soundness import Expect, Policy
from gpuguard.recovery.snapshots.store import SnapshotInfo, copy_to_checkpoint, prune, save_snapshot


class SnapshotOutcomes:
    """What happens after each snapshot, written or not (the writer threads call it)."""

    def __init__(self, ctx: Context, *, checkpoint_every: int, keep_snapshots: int) -> None:
        self.ctx, self.checkpoint_every, self.keep = ctx, max(0, checkpoint_every), max(1, keep_snapshots)
        self.on_unsound: Callable[[int, str], None] | None = None  # the rank state's (it stops the job)
        self.newest_sound: int | None = None  # never pruned: unsound snapshots must not push it out

    def __call__(self, step: int, info: SnapshotInfo | None, error: str | None, publisher: bool = True) -> None:
        """Count one snapshot (an error; fenced: no info; or written); the publisher (the replicated
        writer; rank 0 of a sharded save) copies a due checkpoint and prunes."""
        counters = self.ctx.counters
        if error is not None:
            counters.snapshot_errors += 1
            self.ctx.log(f"snapshot of step {step} failed: {error}")
            return
        if info is None:
            counters.fenced_snapshots += 1
            self.ctx.log(f"snapshot of step {step} dropped: generation {self.ctx.generation} is no longer active")
            return
        counters.snapshots += 1
        if info.unsound is not None:
            if publisher:
                self.ctx.log(f"snapshot of step {step} is unsound (never restored): {info.unsound}")
            if self.on_unsound is not None:
                self.on_unsound(step, info.unsound)
        else:
            self.newest_sound = step
        if publisher:
            if self.checkpoint_every and step % self.checkpoint_every == 0 and info.unsound is None:
                copy_to_checkpoint(self.ctx.snapshot_root, info)
            keep = {self.ctx.frontier_step} | ({self.newest_sound} if self.newest_sound is not None else set())
            prune(self.ctx.snapshot_root, self.keep, protect=frozenset(keep))


class ReplicatedWriter:
    """One background writer of replicated snapshots; the newest request replaces a pending one only
    after `max_wait` (training never waits longer)."""

    def __init__(
        self, ctx: Context, outcomes: SnapshotOutcomes, policy: Policy | None = None, expect: Expect | None = None
    ) -> None:
        self.ctx, self.outcomes = ctx, outcomes
        self.policy, self.expect = policy, expect  # the soundness checks of each snapshot (`save_snapshot`)
        self.skipped = 0
        self._slot: LatestSlot[tuple[int, dict[str, Any]]] = LatestSlot("gpuguard-snapshot", lambda r: self.write(*r))

    def submit(self, step: int, state: dict[str, Any], max_wait: float = 30.0) -> None:
        """Queue `state` (a detached copy); if one is still pending, wait for the writer first
        (back-pressure keeps every committed step's snapshot: the RPO). After `max_wait` the pending
        one is replaced."""
        if self._slot.offer((step, state), max_wait):
            self.skipped += 1

    def write(self, step: int, state: dict[str, Any]) -> None:
        """Write one snapshot now, on this thread (the writer thread calls it; so can a test)."""
        t0 = time.thread_time()
        hook = self.ctx.fault_hook
        try:
            info = save_snapshot(
                self.ctx.snapshot_root,
                step,
                state,
                generation=int(self.ctx.generation or 0),  # read when it writes: a switch may have moved on
                owner=f"rank{self.ctx.rank}/{self.ctx.incarnation.id}",
                still_current=self.ctx.still_current,
                before_publish=(lambda _p: hook("snapshot", step)) if hook else None,
                policy=self.policy,
                expect=self.expect,
            )
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not kill training
            self.outcomes(step, None, f"{type(exc).__name__}: {exc}")
            return
        finally:
            self.ctx.counters.snapshot_cpu_s += time.thread_time() - t0
        self.outcomes(step, info, None)

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        return self._slot.flush(timeout)

    def close(self, timeout: float) -> bool:
        ok = self.flush(timeout)
        self._slot.stop()
        return ok

    def abandon(self) -> None:
        """Keep writing what is queued (a replicated snapshot needs no group): nothing to give up."""
