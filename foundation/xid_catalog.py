"""The Xid catalog: what each NVIDIA Xid code means and what an operator should do about it.

Why a catalog and not a list of "bad" codes: the same driver line can mean "restart your app"
(Xid 13), "reset this GPU" (Xid 119) or "pull the node" (Xid 79), and some codes only echo another
one (Xid 45 "caused by previous Xid 149", Xid 171/172 detailing a 48). The node verdict needs the
operator action, not just a count.

Data: `data/xid_catalog.csv`, transcribed from NVIDIA's public Ampere+ Xid catalog (meaning,
Immediate and Investigatory resolution buckets), NVIDIA NVSentinel's FATAL/NONFATAL mapping and the
legacy cause matrix (sources and links: docs/log-formats.md, "The Xid catalog"). Codes NVIDIA marks
"Unused" on Ampere+ carry their legacy meaning and the bucket CONTACT_SUPPORT.

gpuguard severity scale (ordered, see `SEVERITIES`):

| severity | meaning | node verdict |
| --- | --- | --- |
| `info`    | nothing to do (informational, sympathetic, corrected by design) | healthy |
| `warning` | the application failed or must restart; the GPU stays usable | degraded |
| `review`  | unknown or legacy-only code: a human must look (never silently healthy) | degraded |
| `reset`   | GPU reset required (`nvidia-smi -r`) before the GPU is used again | reset |
| `drain`   | take the node out: reboot, mechanical check, or RMA | drain |

Pure data and functions: no I/O beyond reading the packaged CSV once. The payloads of Xid 154 and
144-150 are decoded in `xid_payloads`; faults without an Xid code are in `gpu_faults`.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from gpuguard.foundation.events import Event
from gpuguard.foundation.xid_payloads import (
    RECOVERY_ACTIONS,
    RecoveryAction,
    decode_nvlink5,
    parse_xid154,
    recovery_action,
)

# The Xid payload decoders are part of the catalog's vocabulary; callers find them here too.
__all__ = [
    "CATALOG_SOURCE",
    "INCIDENT_WINDOW_S",
    "RECOVERY_ACTIONS",
    "RESOLUTIONS",
    "SEVERITIES",
    "SEVERITY_ACTION",
    "SYMPATHETIC_TO",
    "RecoveryAction",
    "Resolution",
    "XidInfo",
    "all_codes",
    "count_incidents",
    "decode_nvlink5",
    "event_severity",
    "incident_key",
    "lookup",
    "parse_xid154",
    "recovery_action",
    "resolution_for",
    "severity_rank",
    "worst",
    "xid_severity",
]

SEVERITIES = ("info", "warning", "review", "reset", "drain")
_RANK = {name: i for i, name in enumerate(SEVERITIES)}

# Immediate-action bucket -> gpuguard severity.
_BUCKET_SEVERITY = {
    "IGNORE": "info",
    "XID_154": "info",  # the action is in the line itself (see recovery_action)
    "RESTART_APP": "warning",
    "CHECK_APP/CUDA": "warning",
    "CHECK_UVM": "warning",
    "WORKFLOW_XID_13": "warning",
    "WORKFLOW_XID_31": "warning",
    "WORKFLOW_XID_45": "warning",
    "RESET_GPU": "reset",
    "WORKFLOW_NVLINK_ERR": "reset",
    "WORKFLOW_NVLINK5_ERR": "reset",  # refined per line by the Fatal/Nonfatal field and the unit
    "RESTART_BM": "drain",
    "RESTART_VM": "drain",
    "CHECK_MECHANICALS": "drain",
    "UPDATE_SWFW": "drain",
    "WORKFLOW_XID_48": "drain",
    "CONTACT_SUPPORT": "drain",
}

# Codes whose catalog buckets are blank (newest codes) or which NVIDIA marks "Unused" on Ampere+:
# gpuguard's own call, with the reason.
_SEVERITY_OVERRIDES = {
    162: "info",  # power-smoothing circuitry re-engaged
    163: "warning",  # power smoothing disengaged: power transients no longer smoothed
    164: "warning",  # power-smoothing circuitry low lifetime
    165: "review",  # power-smoothing circuitry lifetime exhausted
    167: "drain",  # PCIe fatal timeout: the GPU is gone from the bus, like Xid 79
    168: "drain",  # reduced GPU memory capacity (errors in the write-protected region)
    169: "reset",  # SEC2 micro-controller halt, like Xid 62 PMU halt
    171: "drain",  # detail of Xid 48 (uncorrectable DRAM)
    172: "drain",  # detail of Xid 48 (uncorrectable SRAM)
}

_OVERRIDE_REASON = {
    162: "power smoothing re-engaged",
    163: "power transients no longer smoothed",
    164: "power-smoothing circuitry near end of life",
    165: "power-smoothing circuitry lifetime exhausted",
    167: "PCIe fatal timeout, like Xid 79",
    168: "reduced memory capacity",
    169: "SEC2 halt, like Xid 62",
    171: "detail of Xid 48 (DRAM)",
    172: "detail of Xid 48 (SRAM)",
}
_OVERRIDE_RESOLUTION = {
    "info": "ignore",
    "warning": "restart_app",
    "review": "contact_support",
    "reset": "reset_gpu",
    "drain": "reboot_node",
}

# Codes that only echo a primary Xid: (primary codes, or () for "any other Xid on this GPU").
SYMPATHETIC_TO: Mapping[int, tuple[int, ...]] = {
    45: (),  # preemptive channel cleanup after another error; newer drivers name it
    154: (),  # recovery action changed: informational about another Xid
    171: (48,),
    172: (48,),
    63: (48, 94, 95),  # the remap recorded for an uncorrectable error
    43: (13, 31, 69),  # channel reset verification after an app fault
}

_ACTION_TEXT = {
    "IGNORE": "No action needed.",
    "XID_154": "Follow the recovery action printed in the line.",
    "RESTART_APP": "Restart the application; the GPU stays usable. If it repeats on the same GPU, run DCGM diagnostics.",
    "CHECK_APP/CUDA": "Check the application / CUDA usage; restart it.",
    "CHECK_UVM": "Check the unified-memory (UVM) path of the application.",
    "WORKFLOW_XID_13": "Restart the application; if it repeats on the same GPC/TPC with different SMs, run DCGM diagnostics (possible hardware).",
    "WORKFLOW_XID_31": "Restart the application; repeated MMU faults on the same GPU: run DCGM diagnostics (possible hardware).",
    "WORKFLOW_XID_45": "Follow the Xid that caused it; alone, restart the application (and fabric manager on NVSwitch systems).",
    "RESET_GPU": "Stop the GPU's processes and reset it (nvidia-smi -r -i <id>) or reboot the node.",
    "WORKFLOW_NVLINK_ERR": "Reset the GPU; repeated errors on the same link: check/reseat the link and run diagnostics.",
    "WORKFLOW_NVLINK5_ERR": "Decode the NVLink5 unit: fatal errors need a GPU reset; check link signal integrity, cables and the peer device.",
    "RESTART_BM": "Drain the node and reboot it; if it repeats, check power, seating, cooling and SBIOS, then RMA.",
    "RESTART_VM": "Drain and restart the VM.",
    "CHECK_MECHANICALS": "Drain the node: check the GPU's auxiliary power connection.",
    "UPDATE_SWFW": "Drain: update the driver / firmware (vGPU).",
    "WORKFLOW_XID_48": "Drain: uncorrectable ECC error. Check remapped rows / retired pages; reset to activate a pending remap; a remap failure or repeats after reset mean RMA.",
    "CONTACT_SUPPORT": "Drain the node and contact NVIDIA support (code should not occur on this GPU generation).",
}

SEVERITY_ACTION = {
    "info": "No action needed.",
    "warning": "Restart the application; watch for repeats.",
    "review": "Needs review by an operator: code not in gpuguard's catalog or without a documented action.",
    "reset": "Stop the GPU's processes and reset the GPU (nvidia-smi -r -i <id>) or reboot.",
    "drain": "Drain the node: reboot, check hardware, RMA if it repeats.",
}


# NVIDIA's published resolution buckets, collapsed to the five operator actions (source of each code's
# bucket: the catalog's "Resolution Bucket (Immediate Action)" column, data/xid_catalog.csv).
RESOLUTIONS = ("ignore", "restart_app", "reset_gpu", "reboot_node", "contact_support")
_BUCKET_RESOLUTION = {
    "IGNORE": "ignore",
    "XID_154": "ignore",  # informational about another Xid; the line's own action decides
    "RESTART_APP": "restart_app",
    "CHECK_APP/CUDA": "restart_app",
    "CHECK_UVM": "restart_app",
    "WORKFLOW_XID_13": "restart_app",
    "WORKFLOW_XID_31": "restart_app",
    "WORKFLOW_XID_45": "restart_app",
    "RESET_GPU": "reset_gpu",
    "WORKFLOW_NVLINK_ERR": "reset_gpu",
    "WORKFLOW_NVLINK5_ERR": "reset_gpu",
    "RESTART_BM": "reboot_node",
    "RESTART_VM": "reboot_node",
    "CHECK_MECHANICALS": "reboot_node",
    "UPDATE_SWFW": "reboot_node",
    "WORKFLOW_XID_48": "reboot_node",
    "CONTACT_SUPPORT": "contact_support",
}
CATALOG_SOURCE = "NVIDIA Xid catalog (Ampere+), Resolution Bucket (Immediate Action)"
# Per-code actions where the bucket's generic text is not enough (NVIDIA's memory-error guidance).
_CODE_ACTION = {
    43: "The application hit a software-induced fault and its channel was stopped: restart the application; the "
    "GPU stays healthy. If it repeats on this GPU with other applications, run DCGM diagnostics.",
    63: "Row remap recorded. If the line says 'reset gpu to activate' (or 'reload the driver'), the remap is "
    "pending: reset the GPU at a convenient time (nvidia-smi -r -i <id>); check `nvidia-smi -q -d ROW_REMAPPER`.",
    64: "Row remap / page retirement FAILED: reset the GPU; check `nvidia-smi -q -d ROW_REMAPPER`; a remap failure "
    "or a repeat after reset means RMA.",
    94: "Contained ECC error: only the faulting application must restart; other work keeps running. Reset the GPU "
    "at a convenient time so the row remap takes effect (`nvidia-smi -q -d ECC,ROW_REMAPPER`).",
    95: "Uncontained ECC error: stop the GPU's processes and reset it (nvidia-smi -r -i <id>); check "
    "`nvidia-smi -q -d ECC,ROW_REMAPPER`; repeats after reset mean RMA.",
}


@dataclass(frozen=True)
class XidInfo:
    """One catalog entry. `known` is False for codes NVIDIA never documented (severity `review`)."""

    code: int
    name: str
    meaning: str
    category: str
    immediate: str
    investigatory: str
    severity: str
    action: str
    known: bool = True
    nvsentinel: str = "-"
    legacy_causes: str = "-"
    sympathetic_to: tuple[int, ...] | None = None  # None: a primary code; (): any other Xid
    resolution: str = "contact_support"  # one of RESOLUTIONS
    source: str = CATALOG_SOURCE

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "name": self.name,
            "meaning": self.meaning,
            "category": self.category,
            "immediate": self.immediate,
            "investigatory": self.investigatory,
            "severity": self.severity,
            "action": self.action,
            "known": self.known,
            "resolution": self.resolution,
            "source": self.source,
        }


@lru_cache(maxsize=1)
def _table() -> dict[int, XidInfo]:
    text = resources.files("gpuguard.foundation").joinpath("data/xid_catalog.csv").read_text("utf-8")
    table: dict[int, XidInfo] = {}
    for row in csv.DictReader(text.splitlines()):
        code = int(row["code"])
        bucket = row["immediate"].strip()
        unused = row["mnemonic"] == "UNUSED"
        severity = "review" if unused else (_SEVERITY_OVERRIDES.get(code) or _BUCKET_SEVERITY.get(bucket, "review"))
        action = _CODE_ACTION.get(code) or _ACTION_TEXT.get(bucket) or SEVERITY_ACTION[severity]
        if unused:  # legacy meaning on older GPUs; "should not happen" on Ampere and newer
            action = (
                "Legacy code, unused on Ampere and newer: on older GPUs review the application and driver; "
                "on Ampere or newer contact NVIDIA support."
            )
        table[code] = XidInfo(
            code=code,
            name=row["mnemonic"],
            meaning=row["description"],
            category=row["category"],
            immediate=bucket,
            investigatory=row["investigatory"].strip(),
            severity=severity,
            action=action,
            known=True,
            nvsentinel=row["nvsentinel"],
            legacy_causes=row["legacy_causes"],
            sympathetic_to=SYMPATHETIC_TO.get(code),
            resolution="contact_support" if unused else _BUCKET_RESOLUTION.get(bucket, _OVERRIDE_RESOLUTION[severity]),
            source=CATALOG_SOURCE
            if bucket in _BUCKET_RESOLUTION and code not in _SEVERITY_OVERRIDES
            else "gpuguard (catalog bucket blank for this code): " + _OVERRIDE_REASON.get(code, "needs review"),
        )
    return table


def lookup(code: int) -> XidInfo:
    """The catalog entry for `code`; an unknown code is `review` ("needs review"), never healthy."""
    info = _table().get(code)
    if info is not None:
        return info
    return XidInfo(
        code=code,
        name="UNKNOWN",
        meaning=f"Xid {code} is not in gpuguard's catalog",
        category="unknown",
        immediate="-",
        investigatory="-",
        severity="review",
        action=SEVERITY_ACTION["review"],
        known=False,
    )


def all_codes() -> tuple[int, ...]:
    return tuple(sorted(_table()))


def severity_rank(severity: str) -> int:
    """Position on the scale; unknown names rank as `review`."""
    return _RANK.get(severity, _RANK["review"])


def worst(severities: Iterable[str]) -> str:
    return max(severities, key=severity_rank, default="info")


def event_severity(severity: str) -> str:
    """Map the catalog scale onto `Event.severity` (info | warning | critical)."""
    return {"info": "info", "warning": "warning", "review": "warning"}.get(severity, "critical")


# --- Judging the Xids of one GPU --------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """What to do about one GPU given its Xid / GPU-lost events, with the reason."""

    severity: str
    action: str
    reason: str
    primary: tuple[int, ...] = ()
    sympathetic: tuple[tuple[int, int | None], ...] = field(default=())  # (code, primary or None)
    recovery_action: str | None = None  # the authoritative Xid 154 action name, when one was logged
    inferred: tuple[int, ...] = ()  # primaries named by a sympathetic code (Xid 45 "caused by previous Xid N")

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "action": self.action,
            "reason": self.reason,
            "primary": list(self.primary),
            "sympathetic": [list(s) for s in self.sympathetic],
            "recovery_action": self.recovery_action,
            "inferred": list(self.inferred),
        }


def _fields_of(ev: Event | Mapping[str, Any]) -> Mapping[str, Any]:
    return ev if isinstance(ev, Mapping) else ev.fields


def _code_of(ev: Event | Mapping[str, Any]) -> int | None:
    fields = _fields_of(ev)
    kind = fields.get("kind") if isinstance(ev, Mapping) else ev.kind
    if kind == "gpu_lost":
        return 79
    if kind == "xid":
        code: int | None = fields.get("xid")
        return code
    return None


def xid_severity(code: int, fields: Mapping[str, Any] | None = None) -> str:
    """Severity of one Xid line: the catalog's, refined by what the line itself says."""
    fields = fields or {}
    if code == 154:
        to = fields.get("recovery_action_to")
        return RECOVERY_ACTIONS.get(to, ("", "review"))[1] if to is not None else "review"
    if code == 45 and fields.get("caused_by") is not None:
        return "info"
    if code in (63, 64) and fields.get("remap_pending"):
        return "reset"  # "reset gpu to activate" / "reload the driver to activate": the remap waits for a reset
    if 144 <= code <= 150 and fields.get("nvlink_severity"):
        return str(fields["nvlink_severity"])
    return lookup(code).severity


def resolution_for(events: Iterable[Event | Mapping[str, Any]]) -> Resolution:
    """Judge the Xid (`xid`, `gpu_lost`) events of ONE GPU, in log order.

    Rules: the last Xid 154 recovery action is authoritative for everything logged before it (the
    driver knows best); Xids after it still count. A lost GPU (Xid 79 / fallen off the bus) makes
    every later Xid on it sympathetic. Xid 45 with "caused by previous Xid N", 171/172 next to a 48
    and other echo codes attach to their primary instead of raising their own alarm; a solo echo
    code keeps its own catalog severity. Events of other kinds are ignored.
    """
    events = list(events)
    items = [(c, _fields_of(ev)) for ev in events if (c := _code_of(ev)) is not None]
    unread = [str(_fields_of(ev).get("xid_raw")) for ev in events if _is_unread_xid(ev)]
    if not items:
        if unread:
            return Resolution(
                "review", SEVERITY_ACTION["review"], "unreadable Xid code " + ", ".join(sorted(set(unread)))
            )
        return Resolution("info", SEVERITY_ACTION["info"], "no Xid events")
    last154 = max((i for i, (c, _) in enumerate(items) if c == 154), default=None)
    severities: list[str] = []
    reasons: list[str] = []
    recovery: str | None = None
    to = None  # the last Xid 154's recovery action code, when it names one
    start = 0
    if last154 is not None:
        to = items[last154][1].get("recovery_action_to")
        act = recovery_action(to) if to is not None else recovery_action(-1)
        recovery = act.name
        severities.append(act.severity)
        reasons.append(f"Xid 154 recovery action: {act.name}")
        start = last154 + 1
    codes_all = {c for c, _ in items}
    primary: list[int] = []
    sympathetic: list[tuple[int, int | None]] = []
    inferred: list[int] = []
    lost = False
    for i, (code, fields) in enumerate(items):
        if code == 154:
            continue
        echo_of: int | None = None
        if lost and code != 79:
            echo_of = 79
        elif code == 45 and fields.get("caused_by") is not None:
            echo_of = int(fields["caused_by"])
            if echo_of not in codes_all and echo_of not in inferred:
                inferred.append(echo_of)  # the named primary is evidence even when its line is not here
                if i >= start:
                    severities.append(xid_severity(echo_of))
        elif code in SYMPATHETIC_TO:
            targets = SYMPATHETIC_TO[code]
            others = [c for c in codes_all if c != code and c != 154 and (not targets or c in targets)]
            if others:
                echo_of = others[0] if len(others) == 1 else min(others)
        if code == 79:
            lost = True
        if echo_of is not None:
            if (code, echo_of) not in sympathetic:
                sympathetic.append((code, echo_of))
            continue
        if code not in primary:
            primary.append(code)
        if i >= start:
            severities.append(xid_severity(code, fields))
    if unread:
        severities.append("review")
    sev = worst(severities) if severities else "info"
    if primary:
        reasons.append("primary Xid " + ", ".join(map(str, primary)))
    if inferred:
        reasons.append("inferred Xid " + ", ".join(map(str, inferred)) + " (named by Xid 45, line not in the log)")
    if unread:
        reasons.append("unreadable Xid code " + ", ".join(sorted(set(unread))) + " (needs review)")
    if sympathetic:
        reasons.append("sympathetic " + ", ".join(f"{c}->{p}" for c, p in sympathetic))
    if to is not None and sev == RECOVERY_ACTIONS.get(to, ("", ""))[1]:
        action = recovery_action(to).action
    else:
        worst_primary = [c for c in [*primary, *inferred] if xid_severity(c) == sev]
        action = lookup(worst_primary[0]).action if worst_primary else SEVERITY_ACTION[sev]
    return Resolution(sev, action, "; ".join(reasons), tuple(primary), tuple(sympathetic), recovery, tuple(inferred))


def _is_unread_xid(ev: Event | Mapping[str, Any]) -> bool:
    fields = _fields_of(ev)
    kind = fields.get("kind") if isinstance(ev, Mapping) else ev.kind
    return kind == "xid" and not isinstance(fields.get("xid"), int)


# --- Incidents: one fault printed as many lines --------------------------------------------------

INCIDENT_WINDOW_S = 10.0


def incident_key(ev: Event, previous: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """(GPU, code, pid, time window): the driver prints one Xid 13 as several lines (warp, global, ESR).

    With no time on the line, consecutive lines of the same GPU, code and pid are one incident (pass the
    previous event's key as `previous`).
    """
    f = ev.fields
    code = 79 if ev.kind == "gpu_lost" else f.get("xid")
    base = (f.get("pci_bus_id"), code, f.get("pid"))
    when = ev.timestamp if ev.timestamp is not None else f.get("uptime_s")
    if isinstance(when, (int, float)):
        return (*base, int(when // INCIDENT_WINDOW_S))
    if previous is not None and previous[:3] == base:
        return previous
    return (*base, ("line", ev.line))


def count_incidents(events: Iterable[Event]) -> int:
    keys: set[tuple[Any, ...]] = set()
    prev: tuple[Any, ...] | None = None
    for ev in events:
        prev = incident_key(ev, prev)
        keys.add(prev)
    return len(keys)
