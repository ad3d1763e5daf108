"""One pending item and one background thread that handles it: the training thread never waits for I/O.

Both of the runtime's background writers (the replicated snapshot writer, rank 0's frontier record
writer) need the same small machine: a slot holding the newest request, a worker that takes it out
and handles it, and a bounded `flush` that waits until nothing is pending or being handled. They
differ only in what a new request does to a pending one: the frontier writer replaces it at once
(a newer frontier covers the older one), the snapshot writer first waits up to `max_wait` for the
worker (back-pressure keeps every due step's snapshot).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LatestSlot(Generic[T]):
    """The slot and its worker thread (started with the first offer, a daemon: it never holds the
    process open)."""

    def __init__(self, name: str, handle: Callable[[T], None]) -> None:
        self.name, self._handle = name, handle
        self._cv = threading.Condition()
        self._pending: tuple[T] | None = None  # a 1-tuple: an item may itself be falsy
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def offer(self, item: T, max_wait: float = 0.0) -> bool:
        """Queue `item`, after waiting up to `max_wait` for a pending one to be taken; True when a
        pending item was replaced (it will never be handled)."""
        end = time.monotonic() + max_wait
        with self._cv:
            while self._pending is not None and (left := end - time.monotonic()) > 0:
                self._cv.wait(left)
            replaced = self._pending is not None
            self._pending = (item,)
            self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return replaced

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until nothing is pending or being handled; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        """The worker ends once the slot is empty (what is pending is still handled)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._stop:
                    self._cv.wait()
                if self._pending is None:
                    return
                (item,) = self._pending
                self._pending, self._busy = None, True
                self._cv.notify_all()
            try:
                self._handle(item)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
