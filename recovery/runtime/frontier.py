"""The commit frontier without a ledger write per rank-step, and a watch that tells a stale incarnation.

A commit is local: the rank's step record (`foundation.steplog`). What a restart needs from the
ledger is only "every member committed through step S" for the steps a snapshot can be taken of,
so that is what goes there, once per snapshot for the whole job:

- Replicated state: at each snapshot step (`step % snapshot_every == 0`, the same steps on every
  member) every member meets once on the generation's control group (a gloo group of its own,
  never interleaved with the training's collectives) right after its commit. When the meeting
  completes, every member has committed the step, and rank 0 raises the generation's frontier
  record to it (`Ledger.record_frontier`, evidence `barrier`) in a background thread. The meeting
  is started without waiting (`recovery.runtime.meeting`): the training thread waits neither for
  the slowest member nor for etcd, and nothing is recorded before the collective's result proves
  it. Cost: one 8-byte all-reduce every k steps, and one ledger write every k steps for the whole job.
- Sharded state: the collective snapshot is the meeting (each member submits step S after committing
  it, and rank 0 publishes only once every member's part is in), so rank 0's snapshot writer raises
  the record after each published snapshot (evidence `snapshot`): no extra collective at all.
- A stale incarnation (its generation superseded) learns it from `GenerationWatch`: one small read
  of the active generation per interval in a background thread, never a round trip per step. Its
  writes are refused where they would become visible anyway (the frontier record's transaction
  compares the active generation; snapshots are fenced at publish and refused at read).

Protocol argument and keyspace: docs/formats/ledger.md ("Frontier records").

Lazy imports (start-up time): torch.distributed, only where the control group is formed and used.
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta
from functools import partial
from typing import Any

from gpuguard.foundation.errors import GpuguardError, one_line
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.latest_slot import LatestSlot
from gpuguard.recovery.runtime.meeting import Meeting

DEFAULT_WATCH_INTERVAL_S = 2.0


class FrontierAgreement:
    """The meeting at snapshot-due steps and rank 0's frontier writer (see the module docstring)."""

    def __init__(self, ctx: Context, timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s
        self.group: Any = None
        self.meetings = 0
        self.recorded = 0  # frontier records rank 0 wrote
        self.fenced = 0
        self.errors = 0
        # (generation, step, evidence): the newest wins, written in a thread with its own ledger handle
        self._slot: LatestSlot[tuple[int, int, str]] = LatestSlot("gpuguard-frontier", self._write)
        self._ledger: Any = None
        self._meeting: Meeting | None = None  # this generation's meetings on the control group
        atexit.register(self._quiesce)

    def form(self, opened: Any) -> None:
        """Collective, once per generation after its world group formed: the control group."""
        import torch.distributed as dist

        self.group = opened.track(lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s)))
        # what a meeting on this group proves is of this generation, recorded by its rank 0
        if self.ctx.rank == 0 and self.ctx.generation is not None:
            self._meeting = Meeting(self.group, partial(self._agreed, self.ctx.generation), self.ctx.log)
        else:
            self._meeting = Meeting(self.group, lambda _step: None, self.ctx.log)

    def record(self, generation: int, step: int, evidence: str = "snapshot") -> None:
        """Rank 0, from any thread: raise the frontier record (in this agreement's writer thread)."""
        if self.ctx.rank == 0:
            self._submit(generation, step, evidence)

    def meet(self, step: int) -> None:
        """Collective on the control group, right after this member's commit of `step`, started
        without waiting (`recovery.runtime.meeting`): rank 0 records the frontier once its result
        proves every member committed `step`. Raises the previous meeting's error (a member gone:
        the step's failure, as any collective's)."""
        if self._meeting is not None:
            self._meeting.start(step)
            self.meetings += 1

    def _agreed(self, generation: int, step: int) -> None:
        """Rank 0: a meeting's result proved every member of `generation` committed `step` (the
        completing thread: no I/O here, the record is queued)."""
        self._submit(generation, step, "barrier")

    def settle(self) -> None:
        """Wait for the meeting in flight (bounded by the group's timeout) and queue what it proved;
        its error (a member gone) is logged, not raised: the steps are committed, only the record
        of the last meeting is missing (close)."""
        if self._meeting is None:
            return
        try:
            self._meeting.settle()
        except RuntimeError as exc:
            self.errors += 1
            self.ctx.log(f"frontier meeting not completed: {one_line(exc)}")

    def _quiesce(self) -> None:
        """At exit (a worker leaving on an exception, without close): let a meeting in flight finish
        its completion first, bounded (its callback runs in gloo's thread and needs the interpreter)."""
        if self._meeting is not None:
            self._meeting.quiesce(2.0)

    def _submit(self, generation: int, step: int, evidence: str) -> None:
        self._slot.offer((generation, step, evidence))

    def _write(self, request: tuple[int, int, str]) -> None:
        generation, step, evidence = request
        try:
            if self._ledger is None:
                self._ledger = open_ledger(self.ctx.job_dir, self.ctx.ledger_url)
            if self.ctx.lease is not None and not self.ctx.lease.valid():
                self.fenced += 1
            elif self._ledger.record_frontier(generation, step, self.ctx.incarnation.id, evidence):
                self.recorded += 1
            else:
                self.fenced += 1
        except GpuguardError as exc:  # etcd unreachable: the next meeting's record covers this step too
            self.errors += 1
            self.ctx.log(f"frontier record of step {step} not written: {one_line(exc)}")

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until the newest frontier record is written; False on timeout."""
        return self._slot.flush(timeout)

    def leave(self) -> None:
        """The generation's groups are gone: drop the control group and a meeting in flight on it
        (the writer thread stays)."""
        if self._meeting is not None:
            self._meeting.drop()
        self.group, self._meeting = None, None


class GenerationWatch:
    """The newest active generation, read in the background every `interval_s` (one small read)."""

    def __init__(self, ctx: Context, interval_s: float = DEFAULT_WATCH_INTERVAL_S) -> None:
        self.ctx, self.interval_s = ctx, max(0.05, interval_s)
        self.active: int | None = None
        self.polls = 0
        self._at = -1.0  # monotonic time of the last poll (-1: never)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ledger: Any = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpuguard-generation-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def newer_than(self, generation: int) -> int | None:
        """The active generation if it is newer than `generation` (stale: fenced), else None. No I/O,
        unless nothing was read for two intervals (a watch not started, or a starved one): then one
        read here, at most once per interval."""
        if time.monotonic() - self._at > 2 * self.interval_s:
            self._poll()
        active = self.active
        return active if active is not None and active > generation else None

    def _loop(self) -> None:
        self._poll()  # at once: else the first commit finds no read yet and makes it on the training thread
        while not self._stop.wait(self.interval_s):
            self._poll()

    def _poll(self) -> None:
        if not self._lock.acquire(blocking=False):  # a poll is under way: the training thread never waits
            return
        try:
            if time.monotonic() - self._at < self.interval_s / 2:
                return
            try:
                if self._ledger is None:
                    self._ledger = open_ledger(self.ctx.job_dir, self.ctx.ledger_url)
                active = self._ledger.active()
                self.active = None if active is None else active.generation
                self.polls += 1
            except GpuguardError:
                pass  # unreachable: the lease decides whether this incarnation may go on
            self._at = time.monotonic()
        finally:
            self._lock.release()
