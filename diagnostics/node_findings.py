"""The node verdict's findings: what NVML counters, Xid lines and GPU faults without an Xid each say.

Pure: data in, data out, no I/O. `nvml_findings` judges one GPU's NVML counters (live, recorded, or
read from pasted `nvidia-smi -q` text), `xid_findings` one GPU's Xid / GPU-lost events against NVIDIA's
Xid catalog and the thresholds, and `fault_findings` the faults that carry no Xid (init failures, PCIe
AER, fabric, GSP, training-log hardware errors). `diagnostics.node_verdict` places the evidence on GPUs
and combines these into one verdict per GPU and for the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.diagnostics.node_thresholds import Thresholds
from gpuguard.foundation import gpu_faults
from gpuguard.foundation import xid_catalog as catalog
from gpuguard.foundation.events import Event
from gpuguard.foundation.xid_catalog import recovery_action

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
# Application-side kinds that count as node evidence when they name a hardware fault (`fault` field).
LOG_FAULT_KINDS = ("cuda_error", "nccl_warn", "nccl_error", "watchdog_abort", "watchdog_failure", "watchdog_hang")


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
    if gpu.get("reset_required"):  # NVML_ERROR_RESET_REQUIRED on a call, or `GPU requires reset` in nvidia-smi
        add("reset", "reset_required", "the driver says the GPU requires a reset (GPU requires reset)")
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
    findings: list[Finding] = [_unreadable_finding(unread, t)] if unread else []
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
    forced = [key for key in (_forced(79 if e.kind == "gpu_lost" else e.fields["xid"], t) for e in after) if key]
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
    below_repeat = repeat is None or incidents < repeat
    findings.extend(
        _code_finding(code, group, echo.get(code), below_repeat, t) for code, group in by_code.items() if code != 154
    )
    return verdict, findings


def _unreadable_finding(unread: Sequence[Event], t: Thresholds) -> Finding:
    """Xid codes no rule can read (7+ digits, hex, a sign, non-ASCII digits): reported, never dropped."""
    raw = sorted({str(e.fields.get("xid_raw")) for e in unread})
    return Finding(
        t.get("xid", "unknown_code"),
        "kernel_log",
        "xid.unreadable",
        f"Xid code {', '.join(raw)} is not a code gpuguard can read: needs review",
        "look at the line and the driver version; report the code if it is new",
        unread[0].line,
    )


def _forced(code: int, t: Thresholds) -> str | None:
    """The verdict the thresholds force on an Xid code (`xid: drain / reset / degraded` lists), if any."""
    return next((key for key in ("drain", "reset", "degraded") if code in t.get("xid", key)), None)


def _code_finding(code: int, group: Sequence[Event], echo_of: int | None, below_repeat: bool, t: Thresholds) -> Finding:
    """One finding per Xid code of a GPU: how often, how many incidents, what it means and what to do.
    A sympathetic code (`echo_of`: the primary it echoes) is evidence only; an application-level code
    below the repeat threshold too."""
    info = catalog.lookup(code)
    n_inc = catalog.count_incidents(group)
    times = f" x{len(group)}" if len(group) > 1 else ""
    if len(group) > 1:
        times += f" ({n_inc} incident{'s' if n_inc != 1 else ''})"
    if echo_of is not None:
        message = f"Xid {code}{times}: {info.name} (sympathetic to Xid {echo_of})"
        return Finding("healthy", "kernel_log", f"xid.{code}", message, "", group[0].line)
    label = "GPU has fallen off the bus" if group[0].kind == "gpu_lost" and code == 79 else info.name
    sev = catalog.xid_severity(code, group[-1].fields if group[-1].kind == "xid" else {})
    code_verdict = _verdict_of(sev, t)
    if sev == "warning" and below_repeat:
        code_verdict = "healthy"  # below the repeat threshold: evidence only
    forced = _forced(code, t)
    if forced is not None:
        code_verdict = worst([code_verdict, forced])
    return Finding(code_verdict, "kernel_log", f"xid.{code}", f"Xid {code}{times}: {label}", info.action, group[0].line)


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
        info = gpu_faults.fault(str(name))
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
