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
from typing import Any

from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.foundation import xid_catalog as catalog
from gpuguard.foundation.events import Event
from gpuguard.foundation.xid_catalog import recovery_action

SCHEMA = "gpuguard.node/1"
ORDER = {"healthy": 0, "degraded": 1, "reset": 2, "drain": 3}

ACTIONS = {
    "healthy": "none",
    "degraded": "investigate at the next opportunity; the GPU stays usable",
    "reset": "stop the GPU's processes and reset it (nvidia-smi -r -i <index>) or reboot the node",
    "drain": "drain the node (let jobs finish elsewhere), reboot; if it recurs, run field diagnostics / RMA",
    "unknown": "state could not be determined: check the driver and rerun",
}
# Catalog severity (gpuguard.foundation.xid_catalog.SEVERITIES) -> verdict; `review` is configurable.
SEVERITY_VERDICT = {"info": "healthy", "warning": "degraded", "reset": "reset", "drain": "drain"}
KERNEL_KINDS = ("xid", "gpu_lost")
MODES = ("live", "replay")
# Application-side kinds that count as node evidence when they name a hardware fault (`fault` field).
LOG_FAULT_KINDS = ("cuda_error", "nccl_warn", "nccl_error", "watchdog_abort", "watchdog_failure", "watchdog_hang")
_PORT_SPAN = 12  # lines between a PCIe port's AER line and the GPU's own line that names it


@dataclass(frozen=True)
class Finding:
    """One piece of evidence: where it came from, what it says, what it implies."""

    verdict: str
    source: str  # nvml | kernel_log | config
    check: str  # e.g. row_remap.pending, xid.79
    message: str
    action: str = ""
    line: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "verdict": self.verdict,
            "source": self.source,
            "check": self.check,
            "message": self.message,
        }
        if self.action:
            doc["action"] = self.action
        if self.line is not None:
            doc["line"] = self.line
        return doc


@dataclass(frozen=True)
class GpuVerdict:
    pci_bus_id: str | None
    verdict: str
    evidence: tuple[Finding, ...]
    action: str
    index: int | None = None
    uuid: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pci_bus_id": self.pci_bus_id,
            "uuid": self.uuid,
            "name": self.name,
            "verdict": self.verdict,
            "action": self.action,
            "evidence": [f.to_json() for f in self.evidence],
        }


@dataclass(frozen=True)
class NodeVerdict:
    verdict: str
    gpus: tuple[GpuVerdict, ...]
    evidence: tuple[Finding, ...]  # node-level findings (not tied to one GPU)
    action: str
    summary: str
    counts: Mapping[str, int] = field(default_factory=dict)
    mode: str = "live"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "verdict": self.verdict,
            "summary": self.summary,
            "action": self.action,
            "gpus": [g.to_json() for g in self.gpus],
            "evidence": [f.to_json() for f in self.evidence],
            "counts": dict(self.counts),
        }


def worst(verdicts: Iterable[str]) -> str:
    """The worst of known verdicts (`healthy` for none)."""
    best = "healthy"
    for v in verdicts:
        if ORDER.get(v, 0) > ORDER[best]:
            best = v
    return best


def _gte(value: Any, limit: Any) -> bool:
    return limit is not None and value is not None and value >= limit


_ECC_RULES = (  # (snapshot key, threshold key, verdict, message)
    ("volatile_uncorrected", "volatile_uncorrected_reset", "reset", "uncorrectable ECC errors since the last reset"),
    (
        "aggregate_uncorrected_sram",
        "aggregate_uncorrected_sram_drain",
        "drain",
        "lifetime uncorrectable SRAM ECC errors",
    ),
    (
        "aggregate_uncorrected_dram",
        "aggregate_uncorrected_dram_drain",
        "drain",
        "lifetime uncorrectable DRAM ECC errors",
    ),
    ("volatile_corrected", "volatile_corrected_degraded", "degraded", "corrected ECC errors since the last reset"),
)


def nvml_findings(gpu: Mapping[str, Any], t: Thresholds) -> list[Finding]:
    """Judge one GPU's NVML counters against the thresholds."""
    out: list[Finding] = []

    def add(verdict: str, check: str, message: str) -> None:
        if verdict != "healthy":
            out.append(Finding(verdict, "nvml", check, message, ACTIONS[verdict]))

    if gpu.get("lost"):
        add(t.get("node", "gpu_lost"), "gpu_lost", f"NVML: {gpu.get('error') or 'GPU is lost'}")
        return out
    ecc = gpu.get("ecc") or {}
    for key, limit, verdict, text in _ECC_RULES:
        if _gte(ecc.get(key), t.get("ecc", limit)):
            add(verdict, f"ecc.{key}", f"{ecc[key]} {text}")
    rows = gpu.get("remapped_rows") or {}
    if rows.get("failure"):
        add(t.get("row_remap", "failure"), "row_remap.failure", "a row remapping failed (RMA threshold)")
    if rows.get("pending"):
        add(t.get("row_remap", "pending"), "row_remap.pending", "row remapping pending: applied at the next GPU reset")
    if _gte(rows.get("uncorrectable"), t.get("row_remap", "uncorrectable_degraded")):
        add("degraded", "row_remap.uncorrectable", f"{rows['uncorrectable']} rows remapped for uncorrectable errors")
    pages = gpu.get("retired_pages") or {}
    if pages.get("pending"):
        add(t.get("retired_pages", "pending"), "retired_pages.pending", "retired pages pending: reset to apply")
    total = (pages.get("single_bit") or 0) + (pages.get("double_bit") or 0)
    if pages and _gte(total, t.get("retired_pages", "total_drain")):
        add("drain", "retired_pages.total", f"{total} retired pages")
    action = gpu.get("recovery_action")
    if action:
        act = recovery_action(action)
        add(_verdict_of(act.severity, t), "recovery_action", f"driver recovery action: {act.name} ({action})")
    temp, slow = gpu.get("temperature_c"), gpu.get("temperature_slowdown_c")
    if temp is not None:
        limit = slow - t.get("temperature", "slowdown_margin_c") if slow else t.get("temperature", "degraded_c")
        if _gte(temp, limit):
            add("degraded", "temperature", f"{temp:g} °C (slowdown at {slow if slow else '?'} °C)")
    reasons = [r for r in gpu.get("clock_event_reason_names") or [] if r in t.get("clock_events", "degraded")]
    if reasons:
        add("degraded", "clock_events", "clocks reduced: " + ", ".join(reasons))
    pcie = gpu.get("pcie") or {}
    if pcie.get("width") is not None and pcie.get("width_max") and pcie["width"] < pcie["width_max"]:
        add(t.get("pcie", "width_below_max"), "pcie.width", f"PCIe x{pcie['width']} of x{pcie['width_max']}")
    if pcie.get("gen") is not None and pcie.get("gen_max") and pcie["gen"] < pcie["gen_max"]:
        add(t.get("pcie", "gen_below_max"), "pcie.gen", f"PCIe gen {pcie['gen']} of {pcie['gen_max']}")
    if _gte(pcie.get("replay_counter"), t.get("pcie", "replay_degraded")):
        add("degraded", "pcie.replay_counter", f"PCIe replay counter {pcie['replay_counter']}")
    links = gpu.get("nvlink") or []
    inactive = [str(link["link"]) for link in links if link.get("active") is False]
    if inactive:
        add(t.get("nvlink", "inactive"), "nvlink.inactive", "NVLink inactive: link " + ", ".join(inactive))
    for counter, keys in (
        ("crc_degraded", ("crc_flit", "crc_data")),
        ("replay_degraded", ("replay",)),
        ("recovery_degraded", ("recovery",)),
    ):
        total = sum(link.get(k) or 0 for link in links for k in keys)
        if links and _gte(total, t.get("nvlink", counter)):
            add("degraded", f"nvlink.{counter.rsplit('_', 1)[0]}", f"NVLink {'/'.join(keys)} errors: {total}")
    return out


def _verdict_of(severity: str, t: Thresholds) -> str:
    return SEVERITY_VERDICT.get(severity) or t.get("xid", "unknown_code")


def xid_findings(events: Sequence[Event], t: Thresholds) -> tuple[str, list[Finding]]:
    """Verdict and evidence from the Xid / GPU-lost events of ONE GPU, in log order.

    The catalog's `resolution_for` applies its rules (the last Xid 154 is authoritative, echo codes
    attach to their primary); the thresholds add: ignored codes, codes forced to drain / reset /
    degraded, and application-level Xids that only degrade a GPU when they repeat.
    """

    ignore = set(t.get("xid", "ignore"))
    unread = [e for e in events if e.kind == "xid" and not isinstance(e.fields.get("xid"), int)]
    evs = [
        e
        for e in events
        if e.kind == "gpu_lost"
        or (e.kind == "xid" and isinstance(e.fields.get("xid"), int) and e.fields["xid"] not in ignore)
    ]
    findings: list[Finding] = []
    if unread:  # 7+ digits, hex, a sign, non-ASCII digits: reported, never dropped
        raw = sorted({str(e.fields.get("xid_raw")) for e in unread})
        findings.append(
            Finding(
                t.get("xid", "unknown_code"),
                "kernel_log",
                "xid.unreadable",
                f"Xid code {', '.join(raw)} is not a code gpuguard can read: needs review",
                "look at the line and the driver version; report the code if it is new",
                unread[0].line,
            )
        )
    if not evs:
        return (findings[0].verdict if findings else "healthy"), findings
    res = catalog.resolution_for(evs)
    verdict = _verdict_of(res.severity, t)
    by_code: dict[int, list[Event]] = {}
    for e in evs:
        by_code.setdefault(79 if e.kind == "gpu_lost" else e.fields["xid"], []).append(e)
    echo = {code: primary for code, primary in res.sympathetic}
    last154 = max((i for i, e in enumerate(evs) if e.kind == "xid" and e.fields["xid"] == 154), default=-1)
    after = evs[last154 + 1 :]
    warnings = [
        e
        for e in after
        if e.kind == "xid"
        and e.fields["xid"] not in echo
        and catalog.xid_severity(e.fields["xid"], e.fields) == "warning"
    ]
    repeat = t.get("xid", "repeat_degraded")
    incidents = catalog.count_incidents(warnings)  # per (GPU, code, pid, time window), not per printed line
    if res.severity == "warning" and (repeat is None or incidents < repeat):
        verdict = "healthy"  # an application fault the GPU survived: evidence, not a verdict
    forced = []
    for e in after:
        code = 79 if e.kind == "gpu_lost" else e.fields["xid"]
        for key in ("drain", "reset", "degraded"):
            if code in t.get("xid", key):
                forced.append(key)
                break
    if res.severity == "warning" and repeat is not None and incidents >= repeat:
        codes = sorted({e.fields["xid"] for e in warnings})
        findings.append(
            Finding(
                "degraded",
                "kernel_log",
                "xid.repeat",
                f"{incidents} application-level Xid incidents ({', '.join(map(str, codes))}): "
                "a repeating fault may be hardware",
                res.action,
                warnings[-1].line,
            )
        )
    verdict = worst([verdict, *forced, *(f.verdict for f in findings)])
    for code in res.inferred:
        info = catalog.lookup(code)
        cause = next(e for e in evs if e.fields.get("caused_by") == code)
        findings.append(
            Finding(
                _verdict_of(catalog.xid_severity(code), t),
                "kernel_log",
                f"xid.{code}",
                f"Xid {code} (inferred: named by Xid 45 'caused by previous Xid {code}'; its own line is not in "
                f"the log): {info.name}",
                info.action,
                cause.line,
            )
        )
    if res.recovery_action is not None:
        e = evs[last154]
        findings.append(
            Finding(
                verdict,
                "kernel_log",
                "xid.154",
                f"Xid 154: driver recovery action {res.recovery_action} (authoritative)",
                res.action,
                e.line,
            )
        )
    for code, group in by_code.items():
        if code == 154:
            continue
        info = catalog.lookup(code)
        n_inc = catalog.count_incidents(group)
        times = f" x{len(group)}" if len(group) > 1 else ""
        if len(group) > 1:
            times += f" ({n_inc} incident{'s' if n_inc != 1 else ''})"
        if code in echo:
            findings.append(
                Finding(
                    "healthy",
                    "kernel_log",
                    f"xid.{code}",
                    f"Xid {code}{times}: {info.name} (sympathetic to Xid {echo[code]})",
                    "",
                    group[0].line,
                )
            )
            continue
        label = "GPU has fallen off the bus" if group[0].kind == "gpu_lost" and code == 79 else info.name
        sev = catalog.xid_severity(code, group[-1].fields if group[-1].kind == "xid" else {})
        code_verdict = _verdict_of(sev, t)
        if sev == "warning" and (repeat is None or incidents < repeat):
            code_verdict = "healthy"  # below the repeat threshold: evidence only
        for key in ("drain", "reset", "degraded"):
            if code in t.get("xid", key):
                code_verdict = worst([code_verdict, key])
                break
        findings.append(
            Finding(
                code_verdict, "kernel_log", f"xid.{code}", f"Xid {code}{times}: {label}", info.action, group[0].line
            )
        )
    return verdict, findings


def judge(
    snapshot: Mapping[str, Any] | None,
    events: Sequence[Event],
    thresholds: Thresholds,
    *,
    since: float | None = None,
    kernel_log_status: str = "ok",
    mode: str = "live",
    unread_lines: Sequence[int] = (),
) -> NodeVerdict:
    """One verdict per GPU and for the node.

    snapshot: a `gpuguard.nvml/1` document (None = not collected). events: kernel-log events (and, for
    `diagnose node --log`, training-log events) in file order; with `since`, events stamped earlier are
    dropped (untimed events are kept: their time is unknown, and a cron sweep's cursor already limits
    them to what is new). mode: `live` or `replay` (see the module docstring): in replay a missing
    snapshot is "not examined", not `unknown`. unread_lines: lines that look like GPU errors (an Xid)
    but that no rule could read: a warning (`degraded`), never a silent all clear.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t = thresholds
    gpus: dict[str, dict[str, Any]] = {}
    node_findings: list[Finding] = []
    examined = snapshot is not None or mode == "live"
    nvml_status = snapshot.get("status", "ok") if snapshot is not None else "missing"

    def entry_for(pci: str, nvml_ok: bool = False) -> dict[str, Any]:
        return gpus.setdefault(
            pci, {"meta": {"pci_bus_id": pci}, "findings": [], "events": [], "faults": [], "nvml_ok": nvml_ok}
        )

    for gpu in (snapshot or {}).get("gpus") or []:
        key = gpu.get("pci_bus_id") or f"index:{gpu.get('index')}"
        gpus[key] = {
            "meta": {
                "index": gpu.get("index"),
                "uuid": gpu.get("uuid"),
                "name": gpu.get("name"),
                "pci_bus_id": gpu.get("pci_bus_id"),
            },
            "findings": nvml_findings(gpu, t),
            "events": [],
            "faults": [],
            "nvml_ok": nvml_status == "ok",
        }

    if (
        snapshot is not None
        and nvml_status == "failed"
        and snapshot.get("nvml_error") == "NVMLError_LibRmVersionMismatch"
    ):
        node_findings.append(
            Finding(
                "drain",
                "nvml",
                "nvml.version_mismatch",
                f"{snapshot.get('reason')}: driver upgraded without reboot",
                "reboot the node to load the matching kernel module",
            )
        )
    expected = t.get("node", "expected_gpus")
    seen = len((snapshot or {}).get("gpus") or [])
    if nvml_status == "ok" and expected is not None and seen < expected:
        node_findings.append(
            Finding(
                t.get("node", "missing_gpu"),
                "nvml",
                "node.expected_gpus",
                f"NVML sees {seen} GPUs, expected {expected}",
                ACTIONS[t.get("node", "missing_gpu")],
            )
        )

    counts = {"events": 0, "events_in_window": 0, "events_untimed": 0}
    unplaced: list[Event] = []
    identities: dict[str, str] = {}
    window: list[Event] = []
    for ev in events:
        counts["events"] += 1
        if since is not None and ev.timestamp is not None and ev.timestamp < since:
            continue
        counts["events_in_window"] += 1
        if ev.timestamp is None:
            counts["events_untimed"] += 1
        window.append(ev)
    gpu_addrs = {k for k in gpus} | {
        str(e.fields["pci_bus_id"])
        for e in window
        if e.fields.get("pci_bus_id")
        and (e.kind in (*KERNEL_KINDS, "gpu_identity") or (e.kind == "gpu_fault" and e.fields.get("device") != "port"))
    }
    node_faults: list[Event] = []
    port_faults: list[Event] = []
    for ev in window:
        fields = ev.fields if isinstance(ev.fields, Mapping) else {}
        if ev.kind == "sxid":
            text = (ev.text or "").lower()
            fatal = "fatal" in text and "nonfatal" not in text and "non-fatal" not in text
            node_findings.append(
                Finding(
                    "drain" if fatal else "degraded",
                    "kernel_log",
                    f"sxid.{fields.get('sxid')}",
                    f"NVSwitch SXid {fields.get('sxid')}{' (fatal)' if fatal else ''}",
                    "check the NVSwitch fabric (Fabric Manager log)",
                    ev.line,
                )
            )
            continue
        pci = fields.get("pci_bus_id")
        if ev.kind == "gpu_identity" and pci and fields.get("uuid"):
            # `NVRM: GPU at PCI:...: GPU-<uuid>`: names a GPU even when NVML has lost it
            identities[pci] = str(fields["uuid"])
            continue
        if ev.kind == "gpu_fault":
            if fields.get("device") == "port":
                port_faults.append(ev)
            elif pci:
                entry_for(str(pci))["faults"].append(ev)
            else:
                node_faults.append(ev)
            continue
        if ev.kind in LOG_FAULT_KINDS and fields.get("fault"):
            node_faults.append(ev)  # training-log evidence: names a rank / host, not a PCI address
            continue
        if implied_fault(ev) is not None:
            node_faults.append(ev)
            continue
        if ev.kind not in KERNEL_KINDS:
            continue
        if not pci:
            unplaced.append(ev)
            continue
        entry_for(str(pci))["events"].append(ev)

    gpu_faults = [e for e in window if e.kind == "gpu_fault" and e.fields.get("device") == "gpu"]
    for ev in port_faults:  # a PCIe port's error belongs to the GPU below it, where the log says which
        target = _gpu_below(ev, gpu_addrs, gpu_faults)
        if target is not None:
            entry_for(target)["faults"].append(ev)
        else:
            node_faults.append(ev)

    if unplaced:  # e.g. a redacted `PCI:...` address: the node still owns the finding
        level, found = xid_findings(unplaced, t)
        node_findings.extend(f for f in found)
    node_findings.extend(fault_findings(node_faults, t))
    if unread_lines:
        node_findings.append(
            Finding(
                "degraded",
                "kernel_log",
                "kernel_log.unread",
                f"{len(unread_lines)} line(s) look like GPU errors (Xid) but could not be read: no evidence of a "
                "fault is not the same as evidence of health here",
                "read those lines yourself (gpu-doctor logs FILE shows what was parsed)",
                unread_lines[0],
            )
        )

    results: list[GpuVerdict] = []
    for key, entry in gpus.items():
        xid_level, found = xid_findings(entry["events"], t)
        faults = fault_findings(entry["faults"], t)
        evidence = list(entry["findings"]) + found + faults
        level = worst([f.verdict for f in entry["findings"]] + [xid_level] + [f.verdict for f in faults])
        verdict = level
        if level == "healthy" and snapshot is not None and not entry["nvml_ok"]:
            verdict = "unknown"
            evidence.append(
                Finding(
                    "unknown",
                    "nvml",
                    "nvml.status",
                    "NVML did not report on this GPU: " + _nvml_reason(snapshot),
                    ACTIONS["unknown"],
                )
            )
        action = _action([f.action for f in evidence if f.verdict == verdict], verdict)
        meta = entry["meta"]
        results.append(
            GpuVerdict(
                meta.get("pci_bus_id") or key,
                verdict,
                tuple(evidence),
                action,
                meta.get("index"),
                meta.get("uuid") or identities.get(key),
                meta.get("name"),
            )
        )
    results.sort(key=lambda g: (g.index is None, g.index if g.index is not None else 0, g.pci_bus_id or ""))

    level = worst([g.verdict for g in results] + [f.verdict for f in node_findings])
    if not examined:
        node_findings.append(
            Finding(
                "healthy",
                "nvml",
                "nvml.not_examined",
                "NVML not examined: replaying files, and the replaying machine's NVML says nothing about the node",
            )
        )
    elif level == "healthy":
        if nvml_status != "ok":
            node_findings.append(Finding("unknown", "nvml", "nvml.status", _nvml_reason(snapshot), ACTIONS["unknown"]))
            level = "unknown"
        elif not results and expected is None:
            node_findings.append(Finding("unknown", "nvml", "nvml.no_gpus", "NVML reports no GPUs", ACTIONS["unknown"]))
            level = "unknown"
        elif any(g.verdict == "unknown" for g in results):
            level = "unknown"
    if kernel_log_status != "ok":
        node_findings.append(
            Finding("healthy", "kernel_log", "kernel_log.status", f"kernel log not read: {kernel_log_status}")
        )
    node_action = _action(
        [f.action for f in [*node_findings, *[e for g in results for e in g.evidence]] if f.verdict == level], level
    )
    summary = summarize(level, results, node_findings)
    if level == "healthy" and not examined:
        summary = "no evidence of a fault in the given files (not proof of health)"
    return NodeVerdict(level, tuple(results), tuple(node_findings), node_action, summary, counts, mode)


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


def implied_fault(ev: Event) -> str | None:
    """The catalog fault a line implies without naming one: a driver that needs a GPU reset, a driver /
    library version mismatch, a fatal host hardware error."""
    f = ev.fields
    if f.get("fault"):
        return str(f["fault"])
    if ev.kind == "gpu_reset_required":
        return "reset_required"
    if ev.kind == "driver_error" and "mismatch" in str(f.get("error") or "").lower():
        return "driver_mismatch"
    if ev.kind == "host_hw_error" and f.get("hw_severity") == "fatal":
        return "host_fatal"
    return None


def _bus(pci: str) -> int | None:
    """The bus number of `dddd:bb:dd.f`."""
    parts = pci.split(":")
    try:
        return int(parts[1], 16) if len(parts) == 3 else None
    except ValueError:
        return None


def fault_findings(events: Sequence[Event], t: Thresholds) -> list[Finding]:
    """Findings from GPU faults that carry no Xid (init failures, AER, fabric, training-log hardware errors),
    one per fault (and rank / port), with the catalog's severity and action."""
    groups: dict[tuple[Any, ...], list[Event]] = {}
    for ev in events:
        f = ev.fields
        where = f.get("pci_bus_id") if f.get("device") == "port" else None
        groups.setdefault((implied_fault(ev), f.get("rank"), f.get("host"), where, ev.source), []).append(ev)
    out: list[Finding] = []
    for (name, rank, host, port, source), group in groups.items():
        info = catalog.fault(str(name))
        first = group[0]
        sev = info.severity
        if first.severity == "info" and sev != "info":
            sev = "info"  # the line itself says it is benign (e.g. Fabric Manager: NV_WARN_NOTHING_TO_DO)
        verdict = _verdict_of(sev, t)
        who = []
        if rank is not None:
            who.append(f"rank {rank}")
        if host:
            who.append(f"host {host}")
        if port:
            who.append(f"via PCIe port {port}")
        where = f" ({', '.join(who)})" if who else ""
        times = f" x{len(group)}" if len(group) > 1 else ""
        origin = "log" if first.kind in LOG_FAULT_KINDS else "kernel_log"
        message = f"{info.name}{times}{where}"
        if origin == "log" and source:
            message += f" in {source}"
        out.append(
            Finding(verdict, origin, f"fault.{name}", message, info.action if verdict != "healthy" else "", first.line)
        )
    return out


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
