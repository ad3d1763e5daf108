"""`gpu-doctor watch node`: the sweep as a daemon, re-judging within a second of new evidence.

Why: a cron sweep sees an Xid up to a minute late; NVSentinel, gpud and DCGM's health watches are
daemons. The watcher follows the kernel log (`collectors.kernel_follow`: `/dev/kmsg`, `journalctl -k
-f`, a file, a FIFO or a terminal) and NVML's own events (`collectors.nvml_events`, with a bounded NVML
poll where the driver has none), and on each new piece of evidence runs the sweep's steps: retain with
identity, judge, save the state atomically, publish (textfile, webhook, plugins), drain when asked, and
hands the document to `emit` (the CLI prints one line per judgement: NPD, JSON or human).

It never busy-waits: it sleeps in `select` on the log's descriptor and a wake pipe (a signal, an NVML
event), and a regular file is looked at with one `stat` per `poll_s`. Memory is bounded by the sweep's
retention caps. SIGTERM / SIGINT end it cleanly: the current judgement finishes, the state is saved
(atomically, as always), exit 0. It holds the state directory's lock for its whole life, so a cron sweep
on the same directory waits and reports it (exit 75) instead of reading the same lines twice.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from gpuguard.collectors import kernel_follow
from gpuguard.collectors.kernel_log import boot_id
from gpuguard.collectors.nvml_events import NvmlEventWatch
from gpuguard.diagnostics.node_identity import gpu_identities, seen_with
from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.doctor import sweep as state_store
from gpuguard.doctor.drain import drain_reason, drain_record, local_node_name
from gpuguard.doctor.node_diagnosis import Warn, build_document, nvml_snapshot
from gpuguard.doctor.publish import publish
from gpuguard.doctor.sweeper import SweepOptions
from gpuguard.foundation.events import Event

Emit = Callable[[dict[str, Any]], None]


def _quiet(_message: str) -> None:
    return None


@dataclass(frozen=True)
class WatchOptions:
    """What the watcher follows and how often it looks where it cannot wait."""

    sweep: SweepOptions  # state dir, kernel log, NVML snapshot, retention, outputs, drain: as the sweep's
    poll_s: float = 0.25  # a regular file: one stat per poll (a FIFO, a terminal, /dev/kmsg are waited on)
    nvml_interval_s: float = 60.0  # NVML probed at least this often; at once on an NVML event
    nvml_events: bool = True  # follow NVML's event stream (live NVML only)
    max_judgements: int = 0  # stop after this many (0: until SIGTERM): tests and benchmarks


@dataclass
class WatchStats:
    """What one run did (the document's `watch` section)."""

    judgements: int = 0
    events: int = 0
    nvml_events: int = 0
    nvml_probes: int = 0
    started: float = field(default_factory=time.monotonic)

    def to_json(self) -> dict[str, Any]:
        return {
            "judgements": self.judgements,
            "events": self.events,
            "nvml_events": self.nvml_events,
            "nvml_probes": self.nvml_probes,
            "uptime_s": round(time.monotonic() - self.started, 3),
        }


class Watcher:
    """One watch: `run()` until SIGTERM / SIGINT, the end of a stream, or `max_judgements`."""

    def __init__(self, options: WatchOptions, thresholds: Thresholds, *, emit: Emit, warn: Warn = _quiet) -> None:
        self.options, self.thresholds, self.emit, self.warn = options, thresholds, emit, warn
        self.stats = WatchStats()
        self.stopping = threading.Event()
        self.nvml_due = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.state: state_store.SweepState = state_store.empty_state()  # in memory, saved after each judgement
        self.snapshot: dict[str, Any] | None = None
        self.nvml_source = "not read"
        self.last_probe = 0.0
        self.drained_for: str | None = None
        self.boot = boot_id() or None

    # -- waking --------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: a wake-up is already pending

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping.set()
        self._wake()

    def _on_nvml_event(self, kind: str, index: int | None, data: int) -> None:
        self.stats.nvml_events += 1
        self.nvml_due.set()
        self._wake()

    # -- one judgement -------------------------------------------------------------------------

    def _probe_nvml(self) -> None:
        sw = self.options.sweep
        self.snapshot, self.nvml_source = nvml_snapshot(sw.nvml_snapshot, sw.nvml_timeout, self.warn)
        self.last_probe = time.monotonic()
        self.stats.nvml_probes += 1
        self.nvml_due.clear()

    def judge(self, follower: Any, new: list[Event]) -> dict[str, Any]:
        """Retain the new events with their identity, judge, save the state, publish, drain, emit."""
        sw = self.options.sweep
        state_file = sw.state_dir / state_store.STATE_FILE
        gpus = gpu_identities(self.snapshot)
        kept = state_store.retain(
            self.state,
            new,
            cursor=follower.cursor,
            now=time.time(),
            retain_s=sw.retain_s,
            identity=lambda e: seen_with(e, self.boot, gpus),
        )
        self.stats.judgements += 1
        self.stats.events += len(new)
        extra = {
            "kernel_log": {
                "status": "ok",
                "source": kernel_follow.describe(follower),
                "reason": None,
                "events": len(new),
            },
            "state": {
                "status": "ok",
                "path": str(state_file),
                "retained_events": len(kept.events),
                "new_events": kept.new_events,
            },
            "watch": self.stats.to_json(),
        }
        doc, verdict = build_document(
            self.snapshot,
            self.nvml_source,
            None,
            list(kept.events),
            self.thresholds,
            None,
            time.monotonic(),
            extra_sections=extra,
            mode="replay" if sw.nvml_snapshot is not None else "live",
            boot_id=self.boot,
        )
        doc["xid_totals"] = dict(kept.state["xid_totals"])
        previous = kept.state["last_verdict"]
        self.state = {**kept.state, "last_verdict": verdict.verdict, "last_identity": dict(verdict.identity)}
        state_store.save_state(state_file, self.state)  # atomic: a SIGTERM or a crash leaves the old or the new
        results = publish(doc, previous, sw.publish)
        doc["outputs"] = [r.to_json() for r in results]
        for r in results:
            if r.status != "ok":
                self.warn(f"output {r.name} failed: {r.message}")
        if (sw.drain or sw.run_drain) and verdict.verdict == "drain":
            reason = drain_reason(verdict)
            node = sw.node or local_node_name()
            ran = sw.run_drain and self.drained_for != verdict.summary  # once per drain verdict, not per line
            doc["drain"] = drain_record(node, reason, run=ran, via=sw.drain_via)
            if ran:
                self.drained_for = verdict.summary
        self.emit(doc)
        return doc

    # -- the loop ------------------------------------------------------------------------------

    def _wait(self, follower: Any) -> bool:
        """Sleep until the log has data, a wake-up comes or a timer is due. True when the log may have data."""
        fd = follower.fileno()
        timeout = max(0.0, self.last_probe + self.options.nvml_interval_s - time.monotonic())
        if fd is None:
            timeout = min(timeout, self.options.poll_s)
        readers = [self._wake_r] + ([fd] if fd is not None else [])
        try:
            ready, _, _ = select.select(readers, [], [], timeout)
        except InterruptedError:
            ready = []
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if fd is None:
            return bool(follower.changed())
        return fd in ready

    def run(self) -> int:
        sw = self.options.sweep
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous_wakeup = signal.set_wakeup_fd(self._wake_w)
        nvml_watch: NvmlEventWatch | None = None
        try:
            with state_store.SweepLock(
                sw.state_dir, wait=min(10.0, sw.publish.budget), create_parents=sw.create_parents
            ):
                self.state, notes = state_store.load_state(sw.state_dir / state_store.STATE_FILE)
                for note in notes:
                    self.warn(note)
                follower = kernel_follow.open_follower(sw.kernel_log, self.state["cursor"])
                try:
                    self._probe_nvml()
                    if sw.nvml_snapshot is None and self.options.nvml_events:
                        nvml_watch = NvmlEventWatch(self._on_nvml_event)
                        if not nvml_watch.start():
                            self.warn(
                                f"NVML events not followed ({nvml_watch.reason}): NVML is probed every "
                                f"{self.options.nvml_interval_s:g} s"
                            )
                    self.judge(follower, follower.read_new())
                    self._loop(follower)
                finally:
                    follower.close()
        finally:
            if nvml_watch is not None:
                nvml_watch.stop()
            signal.set_wakeup_fd(previous_wakeup)
            for s, h in handlers.items():
                signal.signal(s, h)
            os.close(self._wake_r)
            os.close(self._wake_w)
        return 0

    def _loop(self, follower: Any) -> None:
        limit = self.options.max_judgements
        while not self.stopping.is_set() and not (limit and self.stats.judgements >= limit):
            has_data = self._wait(follower)
            if self.stopping.is_set():
                break
            new = follower.read_new() if has_data else []
            due = self.nvml_due.is_set() or time.monotonic() >= self.last_probe + self.options.nvml_interval_s
            if due:
                self._probe_nvml()
            if new or due:
                self.judge(follower, new)
            if getattr(follower, "ended", False):
                break  # stdin or a child that ended: nothing more will come
