"""The incarnation's lease and its self-fence: why an expired lease proves a worker can no longer write.

A worker on another host cannot be probed (no shared process table), so the coordinator needs
another proof that it is quiet. Each incarnation's key rides on an etcd lease (TTL `ttl_s`),
renewed every `interval_s` (TTL/3): its host's, shared by the host's ranks and renewed by one of
them (`recovery.runtime.host_lease.HostHeartbeat`, a `Heartbeat` whose `last_ok` is the host's);
this module holds the rule each rank fences by. `last_ok` is taken on this host's monotonic clock *before* the
keepalive that succeeded is sent, so etcd's own countdown started after it. If no keepalive
succeeded for `margin_s` (TTL/2) the worker fences itself (`on_fence`: stop writing, exit) —
strictly before etcd can expire the lease (at the earliest `last_ok + ttl_s`). So once the lease
has expired, the incarnation has already stopped, or is stopped (frozen) and fences on its first
instruction after waking: `require()` before every write, and etcd's transactions compare the
active generation and the lease key, so even a write already in flight lands nowhere.

The clock is CLOCK_BOOTTIME where Linux has it (it keeps counting through a suspended host, which
CLOCK_MONOTONIC does not), else `time.monotonic`. Only rates matter: no clock is compared across
hosts. docs/formats/leases.md has the numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TTL_S = 6.0
WATCH_PERIOD_S = 0.05  # how often the watchdog looks at the age of the last keepalive
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on this host's clock that counts suspended time too (only differences mean anything)."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


@dataclass(frozen=True)
class LeaseTiming:
    """TTL, keepalive interval, fence margin and keepalive timeout, derived from the TTL."""

    ttl_s: float = DEFAULT_TTL_S

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    @property
    def margin_s(self) -> float:
        """Self-fence this long after the last successful keepalive was sent (< TTL)."""
        return self.ttl_s / 2

    @property
    def call_timeout_s(self) -> float:
        """One keepalive's HTTP timeout: a hung call never outlasts the margin by itself."""
        return self.ttl_s / 6

    @property
    def retry_s(self) -> float:
        return self.ttl_s / 12

    def to_dict(self) -> dict[str, float]:
        return {
            "ttl_s": self.ttl_s,
            "interval_s": round(self.interval_s, 6),
            "margin_s": round(self.margin_s, 6),
            "call_timeout_s": round(self.call_timeout_s, 6),
        }


class LeaseFenced(Exception):  # noqa: N818 - a state, not an error to handle
    """This incarnation's lease can no longer be proved alive: it must not write anything."""


class Heartbeat:
    """Keeps one lease alive (a thread) and fences this process when it cannot (a watchdog thread).

    `keepalive()` returns True when etcd confirmed the lease (TTL > 0). `on_fence(why)` must not
    return normally in production (it exits the process); tests pass a recorder.
    """

    def __init__(
        self,
        keepalive: Callable[[], bool],
        timing: LeaseTiming,
        on_fence: Callable[[str], None],
        *,
        clock: Callable[[], float] = now,
        granted_at: float | None = None,
    ) -> None:
        self.keepalive, self.timing, self.on_fence, self.clock = keepalive, timing, on_fence, clock
        # when the grant request was *sent* (etcd's TTL started after it), else now
        self.last_ok = clock() if granted_at is None else granted_at
        self.beats = 0
        self.failures = 0
        self.fenced: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._beat, name="gpuguard-lease", daemon=True),
            threading.Thread(target=self._watch, name="gpuguard-fence", daemon=True),
        ]

    def start(self) -> Heartbeat:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def age(self) -> float:
        return self.clock() - self.last_ok

    def valid(self) -> bool:
        """May this incarnation still write? (its lease is provably alive for a while longer)"""
        return self.fenced is None and self.age() <= self.timing.margin_s

    def require(self, what: str) -> None:
        """Fence before a write when the lease cannot be proved alive; otherwise return at once."""
        if not self.valid():
            self.fence(f"{what}: no lease keepalive for {self.age():.2f} s (margin {self.timing.margin_s:g} s)")

    def fence(self, why: str) -> None:
        with self._lock:
            first = self.fenced is None
            if first:
                self.fenced = why
        self._stop.set()
        if first:
            self.on_fence(why)
        raise LeaseFenced(self.fenced or why)

    def _beat(self) -> None:
        next_at = self.clock()
        while not self._stop.is_set():
            sent = self.clock()
            try:
                ok = bool(self.keepalive())
            except Exception:  # noqa: BLE001 - any failure to renew is a missed beat
                ok = False
            if self._stop.is_set():
                return
            if ok and sent - self.last_ok <= self.timing.margin_s:
                self.last_ok = max(self.last_ok, sent)
                self.beats += 1
                next_at = sent + self.timing.interval_s
            elif ok:  # renewed, but after the margin: too late, this process has fenced (or must)
                self._fence_quietly("lease renewed only after the fence margin")
                return
            else:
                self.failures += 1
                next_at = self.clock() + self.timing.retry_s
            self._stop.wait(max(0.0, next_at - self.clock()))

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            if self.age() > self.timing.margin_s:
                self._fence_quietly(f"no lease keepalive for {self.age():.2f} s (margin {self.timing.margin_s:g} s)")
                return

    def _fence_quietly(self, why: str) -> None:
        try:
            self.fence(why)
        except LeaseFenced:
            pass
