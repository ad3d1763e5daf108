"""The background writer of sharded snapshots: in lockstep on every member, at an adaptive interval.

Lazy imports (start-up time): none here; the save it runs imports torch (`recovery.snapshots.sharded`).
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuguard.recovery.snapshots.sharded import ShardedInfo, new_snapshot_group, save_sharded, stage
from gpuguard.recovery.snapshots.soundness import Expect, Policy

# the runtime's default snapshot budget: a snapshot's CPU (coordinator) at most 3 % of step time
# (issue 16's overhead target), so the interval is ceil(cost / (0.03 x step))
DEFAULT_BUDGET = 0.03


class SnapshotStuck(RuntimeError):
    """The previous sharded snapshot did not finish in time: the collective is stuck."""


class ShardedSnapshotter:
    """Sharded snapshots in a background thread, in lockstep on every member.

    `submit(step, state)` stages (copies) the state and hands it to the writer thread. Every member
    must submit the same steps (the save is collective), so a snapshot is never skipped or replaced
    on one member alone: when the previous one is still being written, `submit` waits for it (up to
    `max_wait`, then SnapshotStuck). One staged copy at most: bounded staging memory.

    Hooks (all run in the writer thread): `still_current()` and `before_publish(step, staging dir)`
    on the coordinator just before the rename (fencing, fault injection); `on_done(step, info or
    None, error or None)` on every member after each snapshot (counters, pruning on rank 0);
    `ownership_map_version()` is stamped into each manifest. `nice`: the writer thread's nice
    value (Linux, per thread; 0 leaves it), so that on a busy host it takes the CPU the training
    threads leave (off by default: on the 2-core bench host, 0, 10 and 19 were within the noise).

    A save that fails in a collective (a RuntimeError: a peer gone, a timeout) leaves the group
    unusable, members possibly at different collectives of it: the writer takes no snapshot after
    it (`broken`; later submits are counted in `skipped`). The next generation has a new writer.

    The interval (`due(step)`): every `every` steps with `cpu_budget` 0; with a budget (a fraction
    of step time; the runtime's default is 0.03) it adapts: after each snapshot the next one is due
    `interval` steps later, interval = max(`every`, ceil(cost / (cpu_budget x step time))), where
    cost is the coordinator's CPU for the last snapshot (`ShardedInfo.cost_s`: its staging on the
    training thread plus its writer thread up to the publish) and step time is the median step the
    coordinator passed to `submit`. Both come to every member in the snapshot's outcome (the
    coordinator's broadcast), and each member applies the interval at its next `submit`, which
    first waits for that snapshot: every member picks the same steps. A failed snapshot keeps it.
    """

    def __init__(
        self,
        job_dir: str | Path,
        *,
        generation: int,
        incarnation: str,
        group: Any = None,
        still_current: Callable[[], bool] | None = None,
        on_done: Callable[[int, ShardedInfo | None, BaseException | None], None] | None = None,
        max_wait: float = 120.0,
        memory_digest: bool = False,
        policy: Policy | None = None,
        expect: Expect | None = None,
        before_publish: Callable[[int, Path], None] | None = None,
        ownership_map_version: Callable[[], int] | None = None,
        nice: int = 0,
        every: int = 1,
        cpu_budget: float = 0.0,
    ) -> None:
        self.job_dir, self.generation, self.incarnation = Path(job_dir), generation, incarnation
        self.group = group if group is not None else new_snapshot_group()
        self.still_current, self.on_done, self.max_wait = still_current, on_done, max_wait
        self.memory_digest, self.before_publish = memory_digest, before_publish
        self.policy, self.expect = policy, expect  # the soundness checks of each save (`save_sharded`)
        self.ownership_map_version = ownership_map_version
        self.nice = nice
        self.every, self.cpu_budget = max(1, every), max(0.0, cpu_budget)
        self.interval = self.every  # steps from one snapshot to the next (adaptive with a budget)
        self._next_due = 0
        self.written = 0
        self.errors = 0
        self.unpublished = 0
        self.skipped = 0  # submits not saved: the group failed before (`broken`)
        self.broken: str | None = None  # why this writer's group is unusable (a failed collective)
        self.cpu_s = 0.0
        self.wait_s = 0.0  # time the training thread waited for the previous snapshot
        self.last: ShardedInfo | None = None
        self._q: queue.Queue[tuple[int, dict[str, Any], Mapping[str, str] | None, float, float] | None] = queue.Queue(
            maxsize=1
        )
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="gpuguard-sharded-snapshot", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        """Whether `step` gets a snapshot: the same answer on every member (see the class docstring)."""
        if self.cpu_budget <= 0:
            return step % self.every == 0
        return step >= self._next_due

    def submit(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        rng: Mapping[str, str] | None = None,
        step_s: float = 0.0,
    ) -> None:
        """Stage `state` (a callable: called here, its cost counted as staging) and this rank's `rng`
        (see `save_sharded`) for the snapshot of `step`; `step_s`: the recent (median) step time."""
        t0 = time.monotonic()
        if not self._idle.wait(self.max_wait):
            raise SnapshotStuck(
                f"the sharded snapshot before step {step} is still being written after {self.max_wait:.0f} s"
            )
        self.wait_s += time.monotonic() - t0
        if self.broken is not None:  # the group failed: another collective on it could desynchronise
            self.skipped += 1
            return
        c0 = time.thread_time()
        staged = stage(state() if callable(state) else state)  # before the writer is busy: a failed copy leaves it idle
        self._next_due = step + self.interval  # the previous snapshot's interval: the same on every member
        self._idle.clear()
        self._q.put((step, staged, dict(rng) if rng is not None else None, step_s, time.thread_time() - c0))

    def _run(self) -> None:
        if self.nice:  # Linux: a thread's own nice value; training threads keep the CPU when both want it
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError):
                pass
        while True:
            item = self._q.get()
            if item is None:
                self.group = None  # a failed group's sockets close once nothing holds it (peers wake)
                return
            step, state, rng, step_s, submit_s = item
            t0 = time.thread_time()
            info: ShardedInfo | None = None
            error: BaseException | None = None
            try:
                info = save_sharded(
                    self.job_dir,
                    step,
                    state,
                    group=self.group,
                    generation=self.generation,
                    incarnation=self.incarnation,
                    still_current=self.still_current,
                    memory_digest=self.memory_digest,
                    policy=self.policy,
                    expect=self.expect,
                    before_publish=functools.partial(hook, step) if (hook := self.before_publish) else None,
                    ownership_map_version=self.ownership_map_version() if self.ownership_map_version else 0,
                    rng=rng,
                    submit_s=submit_s,
                    step_s=step_s,
                )
                if info is None:
                    self.unpublished += 1
                else:
                    self.written += 1
                    self.last = info
                    self.interval = self._interval(info)
            except Exception as exc:  # noqa: BLE001 - a failed snapshot must not kill training
                self.errors += 1
                error = exc
                if isinstance(exc, RuntimeError):  # gloo: a peer gone or timed out; the group is unusable
                    # members may now stand at different collectives of it: a next save could hand one
                    # member another's message (gloo aborts the process: "Received data size doesn't
                    # match", seen when survivors of an in-place switch saved once more)
                    self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            finally:
                del state
                self.cpu_s += time.thread_time() - t0
                if self.on_done is not None:
                    try:
                        self.on_done(step, info, error)
                    except Exception:  # noqa: BLE001,S110 - a reporting hook must not stop the writer
                        pass
                # the error's traceback holds the save's frames, and with them the group: a failed group
                # kept alive here keeps its sockets open, and a peer blocked on this rank waits its timeout
                error = info = None
                self._idle.set()

    def _interval(self, info: ShardedInfo) -> int:
        """The steps until the next snapshot, from the coordinator's figures (the same on every member)."""
        if self.cpu_budget <= 0 or info.step_s <= 0:
            return self.every if self.cpu_budget <= 0 else self.interval
        # the smallest k with cost / (k x step) <= budget; the tolerance keeps an exact ratio (20.000000000000004
        # in floating point) from costing one more step than it needs (found by hypothesis)
        return max(self.every, math.ceil(info.cost_s / (self.cpu_budget * info.step_s) - 1e-9))

    def flush(self, timeout: float) -> bool:
        """Wait for the snapshot in flight (True when none is left)."""
        return self._idle.wait(timeout)

    def abandon(self) -> None:
        """Stop taking snapshots without waiting: the thread ends after the save in flight (if any)
        fails or finishes (its group failed; a late publish is fenced by `still_current`)."""
        try:
            atexit.unregister(self.flush)  # the runtime's exit flush holds it (and its group) alive
        except Exception:  # noqa: BLE001,S110 - nothing registered
            pass
        try:
            self._q.put_nowait(None)
        except queue.Full:  # a save is queued but not started: the thread takes it, then stops
            threading.Thread(target=self._q.put, args=(None,), daemon=True).start()

    def close(self, timeout: float) -> bool:
        done = self.flush(timeout)
        if done:
            self._q.put(None)
            self._thread.join(timeout)
        return done
