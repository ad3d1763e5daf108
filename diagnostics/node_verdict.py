"""The node verdict: NVML snapshot + kernel-log events + thresholds -> one verdict per GPU and the node.

Pure: data in, data out, no I/O. Verdicts, best to worst: `healthy < degraded < reset < drain`;
`unknown` means the evidence is missing (no driver, hung probe), never "probably fine". Every verdict
carries the findings that produced it and the action that follows, so an on-call engineer can check
the reasoning instead of trusting it.

Two modes. `live`: the judge runs on the node, and a driver that should answer and does not is a
finding (`unknown`). `replay`: the node's state comes from files (a kernel log, training logs, a recorded
NVML snapshot) read on another machine; NVML missing *there* says nothing about the node, so the
verdict comes from the evidence given and the NVML dimension is reported as not examined. "healthy"
then means "no evidence of a fault in what was given", never proof of health.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpuguard.diagnostics.node_findings import (
    ACTIONS,
    LOG_FAULT_KINDS,
    ORDER,
    Finding,
    fault_findings,
    implied_fault,
    nvml_findings,
    worst,
    xid_findings,
)
from gpuguard.diagnostics.node_identity import evidence_range, gpu_identities, iso, stale_reason
from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.foundation.events import Event

__all__ = [
    "ACTIONS",
    "ORDER",
    "SCHEMA",
    "Finding",
    "GpuVerdict",
    "NodeVerdict",
    "fault_findings",
    "implied_fault",
    "judge",
    "nvml_findings",
    "summarize",
    "worst",
    "xid_findings",
]

SCHEMA = "gpuguard.node/1"
KERNEL_KINDS = ("xid", "gpu_lost")
# What a job's own logs report (collectives, CUDA in the application, the launcher, the NIC): not node
# evidence unless the line names a hardware cause (`fault`), but counted and pointed to, so that a
# node verdict of "no fault" never hides them.
JOB_KINDS = frozenset(
    {
        "nccl_warn",
        "nccl_error",
        "watchdog_timeout",
        "watchdog_failure",
        "watchdog_hang",
        "watchdog_abort",
        "gloo_error",
        "cuda_error",
        "cuda_assert",
        "nic_error",
        "worker_failure",
        "worker_group_failed",
        "rendezvous_error",
        "config_error",
    }
)
MODES = ("live", "replay")
_PORT_SPAN = 12  # lines between a PCIe port's AER line and the GPU's own line that names it


@dataclass(frozen=True)
class GpuVerdict:
    pci_bus_id: str | None
    verdict: str
    evidence: tuple[Finding, ...]
    action: str
    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    serial: str | None = None  # the board serial, when NVML or a pasted report gives it (identity for RMA)

    def to_json(self) -> dict[str, Any]:
        doc = {
            "index": self.index,
            "pci_bus_id": self.pci_bus_id,
            "uuid": self.uuid,
            "name": self.name,
            "verdict": self.verdict,
            "action": self.action,
            "evidence": [f.to_json() for f in self.evidence],
        }
        if self.serial is not None:
            doc["serial"] = self.serial
        return doc


@dataclass(frozen=True)
class NodeVerdict:
    verdict: str
    gpus: tuple[GpuVerdict, ...]
    evidence: tuple[Finding, ...]  # node-level findings (not tied to one GPU)
    action: str
    summary: str
    counts: Mapping[str, int] = field(default_factory=dict)
    mode: str = "live"
    # whose verdict it is: the node's boot (None: not known, a replay) and the time range of the evidence
    identity: Mapping[str, str | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "verdict": self.verdict,
            "summary": self.summary,
            "action": self.action,
            "gpus": [g.to_json() for g in self.gpus],
            "evidence": [f.to_json() for f in self.evidence],
            "counts": dict(self.counts),
            "identity": dict(self.identity),
        }


class Placement(NamedTuple):
    """Where each event of the window belongs: on a GPU (by PCI address), on the node, or nowhere (a
    NamedTuple: cheaper to create at import than a dataclass, on the path of every `diagnose node`)."""

    gpu_events: Mapping[str, tuple[Event, ...]]  # Xid / GPU-lost lines per GPU
    gpu_faults: Mapping[str, tuple[Event, ...]]  # faults without an Xid per GPU
    unplaced: tuple[Event, ...]  # Xid lines without a readable address (`PCI:...`): the node's
    node_faults: tuple[Event, ...]  # faults that name no GPU (training logs, host errors, a port alone)
    sxids: tuple[Event, ...]  # NVSwitch errors: the node's
    identities: Mapping[str, str]  # PCI address -> GPU UUID from the log
    indices: Mapping[str, int]  # PCI address -> GPU index a line names with it


def event_window(events: Sequence[Event], since: float | None) -> tuple[list[Event], dict[str, int]]:
    """The events at or after `since` (untimed ones kept: their time is unknown) and the counts of
    all, those in the window and the untimed ones."""
    counts = {"events": 0, "events_in_window": 0, "events_untimed": 0}
    window: list[Event] = []
    for ev in events:
        counts["events"] += 1
        if since is not None and ev.timestamp is not None and ev.timestamp < since:
            continue
        counts["events_in_window"] += 1
        if ev.timestamp is None:
            counts["events_untimed"] += 1
        window.append(ev)
    return window, counts


def split_stale(
    window: Sequence[Event], boot_id: str | None, snapshot: Mapping[str, Any] | None
) -> tuple[list[Event], list[Finding]]:
    """The window without the evidence that no longer speaks for the node (another boot, a replaced
    GPU: `node_identity.stale_reason`), and one finding per stale event saying so (never counted)."""
    gpus = gpu_identities(snapshot)
    fresh: list[Event] = []
    stale: list[Finding] = []
    for ev in window:
        why = stale_reason(ev, boot_id, gpus)
        if why is None:
            fresh.append(ev)
            continue
        f = ev.fields
        what = f"Xid {f.get('xid')}" if ev.kind == "xid" else str(f.get("fault") or ev.kind)
        where = f" on {f['pci_bus_id']}" if f.get("pci_bus_id") else ""
        stale.append(Finding("healthy", "kernel_log", "stale", f"stale: {what}{where} {why}: not counted", "", ev.line))
    return fresh, stale


def job_events(window: Sequence[Event]) -> int:
    """How many of the window's events are the job's own (warnings and worse, naming no hardware cause)."""
    return sum(1 for e in window if e.kind in JOB_KINDS and not e.fields.get("fault") and e.severity != "info")


def gpu_addresses(window: Sequence[Event], known: Iterable[str]) -> set[str]:
    """Every GPU the evidence names: NVML's and those a kernel line or a GPU's own fault line names."""
    return set(known) | {
        str(e.fields["pci_bus_id"])
        for e in window
        if e.fields.get("pci_bus_id")
        and (e.kind in (*KERNEL_KINDS, "gpu_identity") or (e.kind == "gpu_fault" and e.fields.get("device") != "port"))
    }


def place_events(
    window: Sequence[Event], known_gpus: Iterable[str], by_index: Mapping[int, str] | None = None
) -> Placement:
    """Put each event where it belongs. A PCIe port's AER error goes to the GPU below it when the log
    says which (`_gpu_below`), else to the node; a training-log hardware error names a rank, not an
    address, so it is the node's. A GPU fault that names its GPU by index only (the driver's GSP lines,
    `NVRM: GPU6 ...`) goes to the GPU NVML knows by that index (`by_index`), else to `index:<n>`."""
    gpu_events: dict[str, list[Event]] = {}
    gpu_faults: dict[str, list[Event]] = {}
    unplaced: list[Event] = []
    node_faults: list[Event] = []
    port_faults: list[Event] = []
    sxids: list[Event] = []
    identities: dict[str, str] = {}
    indices: dict[str, int] = {}
    for ev in window:
        fields = ev.fields if isinstance(ev.fields, Mapping) else {}
        pci = fields.get("pci_bus_id")
        if ev.kind == "sxid":
            sxids.append(ev)
        elif ev.kind == "gpu_identity" and pci and fields.get("uuid"):
            identities[pci] = str(fields["uuid"])  # `NVRM: GPU at PCI:...: GPU-<uuid>`: names a lost GPU too
        elif ev.kind == "gpu_fault":
            if fields.get("device") == "port":
                port_faults.append(ev)
            elif pci:
                gpu_faults.setdefault(str(pci), []).append(ev)
                if isinstance(fields.get("gpu_index"), int):  # nvidia-smi's table names both
                    indices[str(pci)] = fields["gpu_index"]
            elif isinstance(fields.get("gpu_index"), int):
                index = fields["gpu_index"]
                gpu_faults.setdefault((by_index or {}).get(index, f"index:{index}"), []).append(ev)
            else:
                node_faults.append(ev)
        elif (ev.kind in LOG_FAULT_KINDS and fields.get("fault")) or implied_fault(ev) is not None:
            node_faults.append(ev)
        elif ev.kind in KERNEL_KINDS:
            if pci:
                gpu_events.setdefault(str(pci), []).append(ev)
            else:
                unplaced.append(ev)
    addrs = gpu_addresses(window, known_gpus)
    own_lines = [e for e in window if e.kind == "gpu_fault" and e.fields.get("device") == "gpu"]
    for ev in port_faults:
        target = _gpu_below(ev, addrs, own_lines)
        if target is not None:
            gpu_faults.setdefault(target, []).append(ev)
        else:
            node_faults.append(ev)
    return Placement(
        {k: tuple(v) for k, v in gpu_events.items()},
        {k: tuple(v) for k, v in gpu_faults.items()},
        tuple(unplaced),
        tuple(node_faults),
        tuple(sxids),
        identities,
        indices,
    )


def sxid_findings(sxids: Sequence[Event]) -> list[Finding]:
    """One finding per NVSwitch SXid line: `drain` when the line says fatal, else `degraded`."""
    out = []
    for ev in sxids:
        text = (ev.text or "").lower()
        fatal = "fatal" in text and "nonfatal" not in text and "non-fatal" not in text
        out.append(
            Finding(
                "drain" if fatal else "degraded",
                "kernel_log",
                f"sxid.{ev.fields.get('sxid')}",
                f"NVSwitch SXid {ev.fields.get('sxid')}{' (fatal)' if fatal else ''}",
                "check the NVSwitch fabric (Fabric Manager log)",
                ev.line,
            )
        )
    return out


def nvml_node_findings(snapshot: Mapping[str, Any] | None, t: Thresholds) -> list[Finding]:
    """What NVML says about the node as a whole: a driver upgraded without a reboot, GPUs missing."""
    out: list[Finding] = []
    if snapshot is None:
        return out
    status = snapshot.get("status", "ok")
    if status == "failed" and snapshot.get("nvml_error") == "NVMLError_LibRmVersionMismatch":
        out.append(
            Finding(
                "drain",
                "nvml",
                "nvml.version_mismatch",
                f"{snapshot.get('reason')}: driver upgraded without reboot",
                "reboot the node to load the matching kernel module",
            )
        )
    expected = t.get("node", "expected_gpus")
    seen = len(snapshot.get("gpus") or [])
    if status == "ok" and expected is not None and seen < expected:
        verdict = t.get("node", "missing_gpu")
        out.append(
            Finding(
                verdict, "nvml", "node.expected_gpus", f"NVML sees {seen} GPUs, expected {expected}", ACTIONS[verdict]
            )
        )
    return out


def unread_finding(unread_lines: Sequence[int]) -> Finding:
    """Lines that look like GPU errors but that no rule could read: a warning, never a silent all clear."""
    return Finding(
        "degraded",
        "kernel_log",
        "kernel_log.unread",
        f"{len(unread_lines)} line(s) look like GPU errors (Xid) but could not be read: no evidence of a "
        "fault is not the same as evidence of health here",
        "read those lines yourself (gpu-doctor logs FILE shows what was parsed)",
        unread_lines[0],
    )


def gpu_verdict(
    key: str,
    meta: Mapping[str, Any],
    nvml_found: Sequence[Finding],
    events: Sequence[Event],
    faults: Sequence[Event],
    t: Thresholds,
    *,
    nvml_silent: str | None = None,
) -> GpuVerdict:
    """One GPU's verdict from its NVML findings, its Xid lines and its faults. `nvml_silent`: why NVML did
    not report on a GPU it should have (then a GPU with no other evidence is `unknown`, not healthy)."""
    xid_level, found = xid_findings(events, t)
    fault_found = fault_findings(faults, t)
    evidence = [*nvml_found, *found, *fault_found]
    verdict = worst([f.verdict for f in nvml_found] + [xid_level] + [f.verdict for f in fault_found])
    if verdict == "healthy" and nvml_silent is not None:
        verdict = "unknown"
        evidence.append(
            Finding(
                "unknown", "nvml", "nvml.status", "NVML did not report on this GPU: " + nvml_silent, ACTIONS["unknown"]
            )
        )
    action = _action([f.action for f in evidence if f.verdict == verdict], verdict)
    return GpuVerdict(
        meta.get("pci_bus_id") or key,
        verdict,
        tuple(evidence),
        action,
        meta.get("index"),
        meta.get("uuid"),
        meta.get("name"),
        meta.get("serial"),
    )


def node_level(
    gpus: Sequence[GpuVerdict],
    node_findings: Sequence[Finding],
    snapshot: Mapping[str, Any] | None,
    *,
    examined: bool,
    expected_gpus: int | None,
) -> tuple[str, list[Finding]]:
    """The node's verdict, the worst of its GPUs' and its own findings, and the findings that explain an
    all clear that is not one: NVML not examined (replay), not answering, or seeing no GPU (`unknown`)."""
    level = worst([g.verdict for g in gpus] + [f.verdict for f in node_findings])
    status = snapshot.get("status", "ok") if snapshot is not None else "missing"
    if not examined:
        return level, [
            Finding(
                "healthy",
                "nvml",
                "nvml.not_examined",
                "NVML not examined: replaying files, and the replaying machine's NVML says nothing about the node",
            )
        ]
    if level != "healthy":
        return level, []
    if status != "ok":
        return "unknown", [Finding("unknown", "nvml", "nvml.status", _nvml_reason(snapshot), ACTIONS["unknown"])]
    if not gpus and expected_gpus is None:
        return "unknown", [Finding("unknown", "nvml", "nvml.no_gpus", "NVML reports no GPUs", ACTIONS["unknown"])]
    if any(g.verdict == "unknown" for g in gpus):
        return "unknown", []
    return level, []


def _meta_of_key(key: str) -> dict[str, Any]:
    """A GPU only the evidence names: by its PCI address, or by its index (`index:<n>`)."""
    if key.startswith("index:") and key[6:].isdigit():
        return {"pci_bus_id": key, "index": int(key[6:])}
    return {"pci_bus_id": key}


def _snapshot_gpus(
    snapshot: Mapping[str, Any] | None, t: Thresholds
) -> dict[str, tuple[dict[str, Any], list[Finding]]]:
    """NVML's GPUs by key (PCI address, else `index:<n>`): their identity and their counters' findings."""
    out: dict[str, tuple[dict[str, Any], list[Finding]]] = {}
    for gpu in (snapshot or {}).get("gpus") or []:
        key = gpu.get("pci_bus_id") or f"index:{gpu.get('index')}"
        meta = {k: gpu.get(k) for k in ("index", "uuid", "name", "pci_bus_id", "serial")}
        out[key] = (meta, nvml_findings(gpu, t))
    return out


def judge(
    snapshot: Mapping[str, Any] | None,
    events: Sequence[Event],
    thresholds: Thresholds,
    *,
    since: float | None = None,
    kernel_log_status: str = "ok",
    mode: str = "live",
    unread_lines: Sequence[int] = (),
    boot_id: str | None = None,
) -> NodeVerdict:
    """One verdict per GPU and for the node.

    snapshot: a `gpuguard.nvml/1` document (None = not collected). events: kernel-log events (and, for
    `diagnose node --log`, training-log events) in file order; with `since`, events stamped earlier are
    dropped (untimed events are kept: their time is unknown, and a cron sweep's cursor already limits
    them to what is new). mode: `live` or `replay` (see the module docstring): in replay a missing
    snapshot is "not examined", not `unknown`. unread_lines: lines that look like GPU errors (an Xid)
    but that no rule could read: a warning (`degraded`), never a silent all clear. boot_id: the node's
    boot now; evidence seen in another boot, or about a GPU replaced since, is stale (`split_stale`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t = thresholds
    nvml_gpus = _snapshot_gpus(snapshot, t)
    nvml_ok = snapshot is not None and snapshot.get("status", "ok") == "ok"
    # a pasted excerpt of an `nvidia-smi -q` report (`complete: false`) says nothing about the GPUs it omits
    partial = snapshot is not None and snapshot.get("complete") is False
    window, counts = event_window(events, since)
    window, stale = split_stale(window, boot_id, snapshot)
    counts["stale_events"] = len(stale)
    counts["job_events"] = job_events(window)
    by_index = {meta["index"]: key for key, (meta, _) in nvml_gpus.items() if isinstance(meta.get("index"), int)}
    placed = place_events(window, nvml_gpus, by_index)
    node_findings = [*nvml_node_findings(snapshot, t), *sxid_findings(placed.sxids), *stale]
    if placed.unplaced:  # e.g. a redacted `PCI:...` address: the node still owns the finding
        node_findings.extend(xid_findings(placed.unplaced, t)[1])
    node_findings.extend(fault_findings(placed.node_faults, t))
    if unread_lines:
        node_findings.append(unread_finding(unread_lines))
    keys = list(dict.fromkeys([*nvml_gpus, *placed.gpu_events, *placed.gpu_faults]))
    results = []
    for key in keys:
        meta, found = nvml_gpus.get(key, (_meta_of_key(key), []))
        meta = {**meta, "uuid": meta.get("uuid") or placed.identities.get(key)}
        if meta.get("index") is None and key in placed.indices:
            meta["index"] = placed.indices[key]
        reported = nvml_ok and (key in nvml_gpus or partial)  # NVML answered, and about this GPU
        silent = _nvml_reason(snapshot) if snapshot is not None and not reported else None
        events_of, faults_of = placed.gpu_events.get(key, ()), placed.gpu_faults.get(key, ())
        results.append(gpu_verdict(key, meta, found, events_of, faults_of, t, nvml_silent=silent))
    results.sort(key=lambda g: (g.index is None, g.index if g.index is not None else 0, g.pci_bus_id or ""))
    examined = snapshot is not None or mode == "live"
    level, why = node_level(
        results, node_findings, snapshot, examined=examined, expected_gpus=t.get("node", "expected_gpus")
    )
    node_findings.extend(why)
    if kernel_log_status != "ok":
        node_findings.append(
            Finding("healthy", "kernel_log", "kernel_log.status", f"kernel log not read: {kernel_log_status}")
        )
    every = [*node_findings, *[e for g in results for e in g.evidence]]
    node_action = _action([f.action for f in every if f.verdict == level], level)
    summary = summarize(level, results, node_findings)
    if level == "healthy" and not examined:
        summary = "no evidence of a fault in the given files (not proof of health)"
    if level == "healthy" and counts["job_events"]:
        n = counts["job_events"]
        if not examined:
            summary = "no node/GPU fault in the given files (not proof of health)"
        summary += f"; {n} job-level event{'s' if n != 1 else ''}, see `gpu-doctor logs`"
    first, last = evidence_range(e for e in window if e.kind not in JOB_KINDS and e.kind != "gpu_identity")
    identity = {"boot_id": boot_id, "evidence_from": iso(first), "evidence_to": iso(last)}
    return NodeVerdict(level, tuple(results), tuple(node_findings), node_action, summary, counts, mode, identity)


def _gpu_below(ev: Event, gpu_addrs: set[str], gpu_faults: Sequence[Event]) -> str | None:
    """The GPU a PCIe port's AER line is about: the source it names, else the one GPU on the buses below
    the port (boot-time `PCI bridge to [bus ..]` lines), else the one GPU whose own AER line is next to
    it (same source, within `_PORT_SPAN` lines). None when the log does not say."""
    src = ev.fields.get("error_source")
    if src and src != ev.fields.get("pci_bus_id") and src in gpu_addrs:
        return str(src)
    buses = ev.fields.get("buses_below")
    if isinstance(buses, (list, tuple)) and len(buses) == 2:
        below = {a for a in gpu_addrs if _bus(a) is not None and buses[0] <= (_bus(a) or 0) <= buses[1]}
        if len(below) == 1:
            return below.pop()
    near = {
        str(g.fields["pci_bus_id"])
        for g in gpu_faults
        if g.source == ev.source and abs(g.line - ev.line) <= _PORT_SPAN and g.fields.get("pci_bus_id")
    }
    return near.pop() if len(near) == 1 else None


def _bus(pci: str) -> int | None:
    """The bus number of `dddd:bb:dd.f`."""
    parts = pci.split(":")
    try:
        return int(parts[1], 16) if len(parts) == 3 else None
    except ValueError:
        return None


def _action(actions: Sequence[str], verdict: str) -> str:
    """The distinct actions, the specific (catalog) ones preferred over the generic one."""
    distinct = list(dict.fromkeys(a for a in actions if a))
    if len(distinct) > 1 and ACTIONS[verdict] in distinct:
        distinct.remove(ACTIONS[verdict])
    return "; ".join(distinct) or ACTIONS[verdict]


def _nvml_reason(snapshot: Mapping[str, Any] | None) -> str:
    if snapshot is None:
        return "NVML not collected"
    return snapshot.get("reason") or f"NVML status {snapshot.get('status')}"


def summarize(level: str, gpus: Sequence[GpuVerdict], node_findings: Sequence[Finding]) -> str:
    """A short, stable one-line reason (node-problem-detector keeps 80 characters)."""
    if level == "healthy":
        return f"{len(gpus)} GPUs healthy"
    if level == "unknown":
        for f in node_findings:
            if f.verdict == "unknown":
                return f"unknown: {f.message}"
        return "unknown"
    parts: list[str] = []
    for g in gpus:
        if g.verdict == level:
            top = next((f for f in g.evidence if f.verdict == level), None)
            label = f"GPU{g.index}" if g.index is not None else (g.pci_bus_id or "GPU?")
            parts.append(f"{label} {top.check if top else level}")
    parts.extend(f.check for f in node_findings if f.verdict == level)
    return f"{level}: " + ", ".join(dict.fromkeys(parts))
