"""The join behind `gpu-doctor diagnose node` (and each sweep): read NVML, the kernel log, training logs
and the process table, judge them with `diagnostics.node_verdict`, assemble the `gpuguard.node/1`
document.

Readers (`collectors`) and judges (`diagnostics`) never import each other, so they meet here; the
clock and the host name are read here too (the judge takes them as data). The CLI only turns options
into a `NodeRequest` and renders the document. It imports nothing heavy: the readers import psutil,
pynvml and the multi-pattern scanner only when they run.

Lazy imports (start-up time): the process-table reader, only when processes are listed; the
`nvidia-smi` report reader, only for a file that may hold a report.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from gpuguard.collectors import kernel_log as kernel_log_reader
from gpuguard.collectors import loghost, logscan, nvml
from gpuguard.collectors.kernel_scan import REPORT_MARKS
from gpuguard.diagnostics import node_verdict
from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.foundation.boundedread import read_bytes
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    EXIT_UNKNOWN,
    EXIT_WARNING,
    DataError,
    GpuguardError,
    NoInputError,
    from_os_error,
)
from gpuguard.foundation.events import Event

EXIT_BY_VERDICT = {
    "healthy": EXIT_OK,
    "degraded": EXIT_WARNING,
    "reset": EXIT_CRITICAL,
    "drain": EXIT_CRITICAL,
    "unknown": EXIT_UNKNOWN,
}
KERNEL_KINDS = ("xid", "sxid", "gpu_lost", "gpu_fault")  # the events the document lists under `events`
MAX_LISTED_EVENTS = 200

Warn = Callable[[str], None]
Progress = Callable[[int, int], Any]  # (bytes to read, 0) -> a per-chunk callback or None (a progress bar)


def _quiet(_message: str) -> None:
    return None


class NodeRequest(NamedTuple):
    """What one `diagnose node` reads: `mode` live (this node) or replay (files from a node).

    The records of this module are NamedTuples, not dataclasses: a frozen dataclass costs about a
    millisecond to create at import, and `diagnose node` runs from cron on every node."""

    mode: str = "live"
    kernel_log: str | None = None  # a file, "-" for stdin; None: the live sources in live mode, nothing in replay
    nvml_snapshot: str | None = None  # a recorded gpuguard.nvml/1 document instead of live NVML
    since: float | None = None  # Unix time: only kernel-log events newer than this
    logs: tuple[str, ...] = ()  # training logs (`--log`)
    processes: bool = False  # list torchrun agents and workers
    nvml_timeout: float = 10.0
    timeout: float = 10.0  # per kernel-log source


class NodeDiagnosis(NamedTuple):
    """The document and the verdict it carries (`snapshot`: what NVML said, for `--dump-nvml`)."""

    document: dict[str, Any]
    verdict: node_verdict.NodeVerdict
    snapshot: dict[str, Any] | None


def nvml_snapshot(path: str | None, timeout: float, warn: Warn = _quiet) -> tuple[dict[str, Any], str]:
    """(snapshot, where it came from): the recorded file (a `gpuguard.nvml/1` document, or the text of
    `nvidia-smi -q`), else live NVML under `timeout`."""
    if path is not None:
        try:
            return nvml.load_snapshot(path), f"file {path}"
        except DataError:
            from gpuguard.collectors import nvidia_smi  # a snapshot that is not JSON: maybe nvidia-smi -q text

            report = nvidia_smi.read_report(path)
            if report is None or report.snapshot is None:
                raise
            return report.snapshot, f"nvidia-smi -q text {path}"
    snap = nvml.collect(timeout)
    if snap.get("timed_out"):
        warn(snap["reason"])
    return snap, "live"


def read_kernel_log(
    spec: str | None,
    *,
    cursor: kernel_log_reader.Cursor | None = None,
    timeout: float,
    progress: Progress | None = None,
) -> kernel_log_reader.KernelLog:
    """The kernel log: `-` stdin, a file (from `cursor`), else the live sources (dmesg, journal, kern.log)."""
    if spec == "-":
        return kernel_log_reader.read_stream(sys.stdin.buffer, "-", timeout=timeout)
    if spec is not None:
        return kernel_log_reader.read_file(spec, cursor=cursor, timeout=timeout, progress=progress)
    return kernel_log_reader.read_live(cursor=cursor, timeout=timeout)


def _corrupt(path: str, exc: BaseException) -> DataError:
    return DataError(f"--log {path}: compressed log is truncated or corrupt ({exc})")


def read_training_logs(paths: Sequence[str]) -> tuple[list[Event], list[dict[str, Any]]]:
    """Events and per-file stats of `--log` files (gzip-compressed ones decompressed, pastes re-joined)."""
    events: list[Event] = []
    stats: list[dict[str, Any]] = []
    for path in paths:
        if Path(path).is_dir():
            raise NoInputError(f"--log {path}: is a directory, not a log file")
        try:
            found, info = logscan.read_log(path)
        except OSError as exc:
            if logscan.is_corrupt_archive(exc):
                raise _corrupt(path, exc) from None
            raise from_os_error(exc, f"--log {path}") from None
        except (EOFError, ValueError) as exc:
            if logscan.is_corrupt_archive(exc) or "zlib" in type(exc).__module__:
                raise _corrupt(path, exc) from None
            raise
        except Exception as exc:
            if logscan.is_corrupt_archive(exc):
                raise _corrupt(path, exc) from None
            raise
        events.extend(found)
        stats.append({"path": path, **info, "events": len(found)})
    return events, stats


def list_processes() -> dict[str, Any]:
    """torchrun agents and workers on this node; a listing problem is `unknown`, never a failed diagnosis."""
    try:
        from gpuguard.collectors import processes  # only when processes are listed: start-up time

        return processes.collect()
    except Exception as exc:  # noqa: BLE001 - a process listing problem must not stop the diagnosis
        return {"schema": "gpuguard.processes/1", "status": "unknown", "reason": f"{type(exc).__name__}: {exc}"}


class Pasted(NamedTuple):
    """`nvidia-smi` output found in the files of a replay: the first `-q` report's snapshot, and the
    table's events per input (the kernel log's, the training logs')."""

    snapshot: dict[str, Any] | None = None
    source: str | None = None
    kernel_events: tuple[Event, ...] = ()
    log_events: tuple[Event, ...] = ()


def _may_hold_report(path: str, limit: int = 16 << 20) -> bool:
    """Does a (small, regular) file hold one of the marks every `nvidia-smi` report has? A cheap byte test
    through the one bounded reader, so the report parser is imported only for a file that may be one."""
    try:
        data = read_bytes(path, max_bytes=limit, what="an nvidia-smi report")
    except GpuguardError:
        return False  # bigger than any paste, or not a regular file: the log readers judge it
    return any(m in data for m in REPORT_MARKS)


def pasted_reports(request: NodeRequest) -> Pasted:
    """Look for pasted `nvidia-smi` output in the replayed files (regular files up to
    `nvidia_smi.MAX_BYTES`; stdin is read once, by the kernel-log reader)."""
    snapshot: dict[str, Any] | None = None
    source: str | None = None
    found: dict[str, tuple[Event, ...]] = {"kernel": (), "log": ()}
    inputs = [("kernel", request.kernel_log)] if request.kernel_log not in (None, "-") else []
    inputs += [("log", path) for path in request.logs]
    for role, path in inputs:
        if path is None or not Path(path).is_file() or not _may_hold_report(path):
            continue
        from gpuguard.collectors import nvidia_smi  # only for a file that may hold a report: start-up time

        report = nvidia_smi.read_report(path)
        if report is None:
            continue
        if snapshot is None and report.snapshot is not None:
            snapshot, source = report.snapshot, f"nvidia-smi -q text in {path}"
        found[role] += report.events
    return Pasted(snapshot, source, found["kernel"], found["log"])


def diagnose(
    request: NodeRequest,
    thresholds: Thresholds,
    *,
    started: float,
    warn: Warn = _quiet,
    progress: Progress | None = None,
) -> NodeDiagnosis:
    """Read what `request` names, judge it, and return the `gpuguard.node/1` document."""
    live = request.mode == "live"
    klog = None
    if request.kernel_log is not None or live:
        klog = read_kernel_log(request.kernel_log, timeout=request.timeout, progress=progress)
        if klog.status != "ok":
            warn(f"kernel log not read: {klog.reason}")
    log_events, log_stats = read_training_logs(request.logs) if request.logs else ([], None)
    pasted = pasted_reports(request) if not live else Pasted()
    kernel_events = [*(klog.events if klog is not None else ()), *pasted.kernel_events]
    log_events = [*log_events, *pasted.log_events]
    snapshot: dict[str, Any] | None
    if request.nvml_snapshot is not None or live:
        snapshot, nvml_source = nvml_snapshot(request.nvml_snapshot, request.nvml_timeout, warn)
    elif pasted.snapshot is not None:
        snapshot, nvml_source = pasted.snapshot, str(pasted.source)
    else:
        snapshot, nvml_source = None, "not examined"
    procs = list_processes() if request.processes else None
    node = None if live else loghost.describe(loghost.hosts([*kernel_events, *log_events]))
    doc, verdict = build_document(
        snapshot,
        nvml_source,
        klog,
        kernel_events,
        thresholds,
        request.since,
        started,
        procs,
        mode=request.mode,
        log_events=log_events,
        log_stats=log_stats,
        node=node,
        boot_id=kernel_log_reader.boot_id() or None if live else None,
    )
    return NodeDiagnosis(doc, verdict, snapshot)


def _nvml_section(snapshot: dict[str, Any] | None, source: str) -> dict[str, Any]:
    if snapshot is None:
        return {"status": "not_examined", "reason": "replay: the node's NVML was not recorded", "source": None}
    return {
        "status": snapshot.get("status"),
        "reason": snapshot.get("reason"),
        "source": source,
        "driver_version": snapshot.get("driver_version"),
        "gpu_count": len(snapshot.get("gpus") or []),
    }


def _tally(events: Sequence[Event], key: Callable[[Event], str | None]) -> dict[str, int]:
    """Counts of the events by `key` (events whose key is None are not counted)."""
    totals: dict[str, int] = {}
    for e in events:
        k = key(e)
        if k is not None:
            totals[k] = totals.get(k, 0) + 1
    return totals


def _xid_key(e: Event) -> str | None:
    if e.kind == "xid" and isinstance(e.fields.get("xid"), int):
        return f"{e.fields.get('pci_bus_id') or ''}|{e.fields['xid']}"
    return None


def _lost_key(e: Event) -> str | None:
    if e.kind == "gpu_lost" or (e.kind == "xid" and e.fields.get("xid") == 79):
        return str(e.fields.get("pci_bus_id") or "")
    return None


def _fault_key(e: Event) -> str | None:
    return f"{e.fields.get('pci_bus_id') or ''}|{e.fields.get('fault')}" if e.kind == "gpu_fault" else None


def xid_totals(events: Sequence[Event]) -> dict[str, int]:
    """`"<pci_bus_id>|<xid>"` -> how many Xid lines of that code on that GPU."""
    return _tally(events, _xid_key)


def build_document(
    snapshot: dict[str, Any] | None,
    nvml_source: str,
    log: kernel_log_reader.KernelLog | None,
    events: list[Event],
    thresholds: Thresholds,
    since: float | None,
    started: float,
    processes: dict[str, Any] | None = None,
    extra_sections: dict[str, Any] | None = None,
    *,
    mode: str = "live",
    log_events: list[Event] | None = None,
    log_stats: list[dict[str, Any]] | None = None,
    node: str | None = None,
    boot_id: str | None = None,
) -> tuple[dict[str, Any], node_verdict.NodeVerdict]:
    """Judge and assemble the `gpuguard.node/1` document.

    snapshot None: NVML not examined (replay without --nvml-snapshot). log None: no kernel log read.
    log_events / log_stats: the `--log` training logs. node: the node the evidence is about (a replay:
    the host its lines name, or "host unknown"); None: this machine. boot_id: the node's boot now (None in
    a replay): evidence of another boot is stale.
    """
    kernel_events = list(events)
    verdict = node_verdict.judge(
        snapshot,
        kernel_events + list(log_events or []),
        thresholds,
        since=since,
        kernel_log_status="ok" if log is None or log.status == "ok" else (log.reason or log.status),
        mode=mode,
        unread_lines=tuple(log.unread_lines) if log is not None else (),
        boot_id=boot_id,
    )
    now = time.time()
    doc: dict[str, Any] = {
        "schema": node_verdict.SCHEMA,
        "node": node if node is not None else socket.gethostname(),
        "generated_at": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "generated_at_unix": round(now, 3),
    }
    doc.update(verdict.to_json())
    doc["exit_code"] = EXIT_BY_VERDICT[verdict.verdict]
    sections: dict[str, Any] = {
        "nvml": _nvml_section(snapshot, nvml_source),
        "kernel_log": log.section()
        if log is not None
        else {"status": "not_examined", "reason": "replay without --kernel-log", "source": None},
        "config": {"status": "ok", "source": thresholds.source},
    }
    if log_stats is not None:
        sections["logs"] = {"status": "ok", "files": log_stats}
    dropped = verdict.counts.get("events", 0) - verdict.counts.get("events_in_window", 0)
    if since is not None:
        sections["kernel_log"]["since"] = datetime.fromtimestamp(since, timezone.utc).isoformat(timespec="seconds")
        sections["kernel_log"]["dropped_by_since"] = dropped
    if processes is not None:
        sections["processes"] = {
            "status": processes.get("status"),
            "reason": processes.get("reason"),
            "count": len(processes.get("processes") or []),
        }
    sections.update(extra_sections or {})
    doc["sections"] = sections
    in_window = [e for e in kernel_events if since is None or e.timestamp is None or e.timestamp >= since]
    doc["events"] = [e.to_json() for e in in_window if e.kind in KERNEL_KINDS][-MAX_LISTED_EVENTS:]
    if log_events:
        doc["log_events"] = [e.to_json() for e in log_events if e.fields.get("fault") or e.kind in KERNEL_KINDS][
            -MAX_LISTED_EVENTS:
        ]
    doc["xid_totals"] = xid_totals(events)
    doc["gpu_lost_totals"] = _tally(events, _lost_key)
    doc["fault_totals"] = _tally(events, _fault_key)
    doc["nvml"] = snapshot
    if processes is not None:
        doc["processes"] = processes.get("processes") or []
    doc["duration_s"] = round(time.monotonic() - started, 4)
    return doc, verdict
