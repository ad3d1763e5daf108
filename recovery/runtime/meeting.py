"""The frontier meeting without a wait on the training thread: a non-blocking all-reduce, proved before use.

A meeting at step S is one all-reduce (MIN) of S on the generation's control group, which every
member starts right after its commit of S. Its *result* is the proof: it exists only once every
member has joined, so every member had committed S, and MIN == S says none was at another step.
The training thread only starts it (`async_op=True`: 0.2-0.3 ms measured, where waiting for the slowest
member cost milliseconds a meeting on a loaded host); `on_agreed(S)` is called when the result is
in and equals S, from the thread that completes the collective (it must not block: rank 0 queues
its frontier record). Nothing is ever recorded from a meeting that has not completed.

At most one meeting is in flight: the next one (k steps later, after k steps of world collectives
every member joined, so the previous one has long completed) first settles it on the training
thread, which then raises its error, if any (a member gone): the step's failure, as a blocking
meeting would have raised it at its own step, one meeting later. `close` settles the last one
(bounded by the group's timeout); `drop` forgets it when the group is torn down (in place).

Lazy imports (start-up time): torch.distributed, only when a meeting starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Meeting:
    """The meetings of one member on one control group (see the module docstring)."""

    def __init__(self, group: Any, on_agreed: Callable[[int], None], log: Callable[[str], None]) -> None:
        self.group, self.on_agreed, self.log = group, on_agreed, log
        self.started = 0
        self.agreed = 0  # meetings whose result proved every member at their step
        # (step, the collective's work, set once `_done` has run: the record is queued)
        self._inflight: tuple[int, Any, threading.Event] | None = None

    def start(self, step: int) -> None:
        """Collective on the control group, right after this member's commit of `step`; returns at
        once. Settles the previous meeting first (raises its error: a member is gone)."""
        import torch
        import torch.distributed as dist

        self.settle()
        mine = torch.tensor([step], dtype=torch.int64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        done = threading.Event()
        self._inflight = (step, work, done)
        self.started += 1
        work.get_future().add_done_callback(lambda fut: self._done(step, mine, fut, done))

    def _done(self, step: int, mine: Any, fut: Any, done: threading.Event) -> None:
        """When the collective completes (the completing thread, or the caller if already done)."""
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - the group's error: `settle` raises it on the training thread
            done.set()
            return
        try:
            low = int(mine.item())
            if low != step:  # a member at another step: not the lockstep this proof needs
                self.log(f"frontier meeting at step {step}: a member is at step {low}; not recorded")
                return
            self.agreed += 1
            self.on_agreed(step)
        finally:
            done.set()

    def settle(self, timeout: float = 10.0) -> None:
        """Wait for the meeting in flight (normally long completed: no wait) and raise its error, if
        any; then (bounded) for its `on_agreed`, so that what it proved is queued when this returns."""
        if self._inflight is None:
            return
        _, work, done = self._inflight
        self._inflight = None
        work.wait()
        done.wait(timeout)

    def quiesce(self, timeout: float) -> bool:
        """At exit: wait (bounded, never raising) until the meeting in flight has run its completion,
        so that no collective thread calls back into an interpreter that is finalizing."""
        return self._inflight is None or self._inflight[2].wait(timeout)

    def drop(self) -> None:
        """The group is gone: forget the meeting in flight (its completion, if ever, records nothing new:
        its result would still be a proof, and a superseded generation's record is refused)."""
        self._inflight = None
