"""One sweep of a node: read the kernel log from the saved cursor, retain, judge, save, publish, drain.

Why a service of its own: `gpu-doctor sweep` (from cron) runs it once, and the watcher runs the same
steps after every new piece of evidence; the CLI only parses options and renders the document. The
state is saved before the outputs run, so a crashing notifier never loses the cursor. One sweep per
state directory at a time (`doctor.sweep.SweepLock`). Every event it keeps carries the boot and the GPU
(UUID, serial) it was seen with, so evidence of an earlier boot or of a GPU replaced since is stale and
never drives a drain (`diagnostics.node_identity`); the drain's reason carries the same identity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.collectors.kernel_log import boot_id
from gpuguard.diagnostics.node_identity import gpu_identities, seen_with
from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.doctor import sweep as state_store
from gpuguard.doctor.drain import drain_reason, drain_record, local_node_name
from gpuguard.doctor.node_diagnosis import Warn, build_document, nvml_snapshot, read_kernel_log
from gpuguard.doctor.publish import PublishOptions, publish


def _quiet(_message: str) -> None:
    return None


@dataclass(frozen=True)
class SweepOptions:
    """`gpu-doctor sweep`'s options, checked and parsed: what one sweep reads, keeps and delivers."""

    state_dir: Path
    kernel_log: str | None = None
    nvml_snapshot: str | None = None
    retain_s: float = 86400.0
    publish: PublishOptions = field(default_factory=PublishOptions)
    drain: bool = False  # put the drain command in the document on a drain verdict
    run_drain: bool = False  # run it
    drain_via: str = "slurm"  # slurm (scontrol) | kubernetes (kubectl taint + annotate)
    node: str | None = None  # the Slurm / Kubernetes node name; None: this host's short name
    nvml_timeout: float = 10.0
    timeout: float = 10.0
    create_parents: bool = False  # the default state directory may be created with its parents


def sweep(options: SweepOptions, thresholds: Thresholds, *, started: float, warn: Warn = _quiet) -> dict[str, Any]:
    """One sweep under the state directory's lock (waits up to 10 s, or the output budget if shorter)."""
    lock = state_store.SweepLock(
        options.state_dir, wait=min(10.0, options.publish.budget), create_parents=options.create_parents
    )
    with lock:
        return sweep_locked(options, thresholds, started=started, warn=warn)


def sweep_locked(
    options: SweepOptions, thresholds: Thresholds, *, started: float, warn: Warn = _quiet
) -> dict[str, Any]:
    """One sweep, the lock held: read, retain, judge, save, publish, drain. Returns the document."""
    state_file = options.state_dir / state_store.STATE_FILE
    state, notes = state_store.load_state(state_file)
    for note in notes:
        warn(note)
    log = read_kernel_log(options.kernel_log, cursor=state["cursor"], timeout=options.timeout)
    if log.status != "ok":
        warn(f"kernel log not read: {log.reason}")
    snapshot, nvml_source = nvml_snapshot(options.nvml_snapshot, options.nvml_timeout, warn)
    boot = boot_id() or None
    gpus = gpu_identities(snapshot)
    kept = state_store.retain(
        state,
        log.events,
        cursor=log.cursor,
        now=time.time(),
        retain_s=options.retain_s,
        identity=lambda e: seen_with(e, boot, gpus),
    )
    extra = {
        "state": {
            "status": "ok",
            "path": str(state_file),
            "retained_events": len(kept.events),
            "new_events": kept.new_events,
        }
    }
    doc, verdict = build_document(
        snapshot,
        nvml_source,
        log,
        list(kept.events),
        thresholds,
        None,
        started,
        extra_sections=extra,
        mode="replay" if options.nvml_snapshot is not None else "live",
        boot_id=boot,
    )
    doc["xid_totals"] = dict(kept.state["xid_totals"])
    previous = kept.state["last_verdict"]
    # saved before the outputs: a crashing notifier never loses the cursor
    state_store.save_state(
        state_file, {**kept.state, "last_verdict": verdict.verdict, "last_identity": dict(verdict.identity)}
    )
    results = publish(doc, previous, options.publish)
    doc["outputs"] = [r.to_json() for r in results]
    for r in results:
        if r.status != "ok":
            warn(f"output {r.name} failed: {r.message}")
    if (options.drain or options.run_drain) and verdict.verdict == "drain":
        node = options.node or local_node_name()
        doc["drain"] = drain_record(node, drain_reason(verdict), run=options.run_drain, via=options.drain_via)
    doc["duration_s"] = round(time.monotonic() - started, 4)
    return doc
