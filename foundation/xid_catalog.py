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

Pure data and functions: no I/O beyond reading the packaged CSV once.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from gpuguard.foundation.events import Event

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

_SEVERITY_ACTION = {
    "info": "No action needed.",
    "warning": "Restart the application; watch for repeats.",
    "review": "Needs review by an operator: code not in gpuguard's catalog or without a documented action.",
    "reset": "Stop the GPU's processes and reset the GPU (nvidia-smi -r -i <id>) or reboot.",
    "drain": "Drain the node: reboot, check hardware, RMA if it repeats.",
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
        action = _ACTION_TEXT.get(bucket) or _SEVERITY_ACTION[severity]
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
        action=_SEVERITY_ACTION["review"],
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


# --- Xid 154: the driver's own recovery action (authoritative) -------------------------------------

# nvmlDeviceGpuRecoveryAction_t; Xid 154 prints these values.
RECOVERY_ACTIONS: Mapping[int, tuple[str, str]] = {
    0: ("none", "info"),
    1: ("gpu_reset", "reset"),
    2: ("node_reboot", "drain"),
    3: ("drain_p2p", "reset"),
    4: ("drain_and_reset", "reset"),
    5: ("recover_imex_domain", "drain"),
    6: ("bus_reset", "reset"),
    7: ("system_reboot", "drain"),
}
_RECOVERY_TEXT = {
    "none": "No recovery needed: the GPU can be used again by starting a new process.",
    "gpu_reset": "GPU reset required: stop all GPU processes and reset it (nvidia-smi -r -i <id>).",
    "node_reboot": "Node reboot required: the fault may have left the OS inconsistent.",
    "drain_p2p": "Drain peer-to-peer (NVLink) traffic from this GPU, then reset it.",
    "drain_and_reset": "Drain the GPU's work, then reset the GPU.",
    "recover_imex_domain": "Recover the IMEX domain (multi-node NVLink); drain the node.",
    "bus_reset": "PCIe bus reset required.",
    "system_reboot": "System reboot required.",
}
_XID154_RE = re.compile(
    r"recovery action changed from (0x[0-9a-fA-F]+|\d+)\s*(?:\(([^)]*)\))?\s*to (0x[0-9a-fA-F]+|\d+)\s*(?:\(([^)]*)\))?"
)


@dataclass(frozen=True)
class RecoveryAction:
    """A recovery action as Xid 154 prints it: the NVML enum value, its name and severity."""

    code: int
    name: str
    printed: str
    severity: str

    @property
    def action(self) -> str:
        return _RECOVERY_TEXT.get(self.name, f"Unknown recovery action {self.code}: needs review.")


def recovery_action(code: int, printed: str = "") -> RecoveryAction:
    name, severity = RECOVERY_ACTIONS.get(code, (f"unknown_{code}", "review"))
    return RecoveryAction(code=code, name=name, printed=printed or name, severity=severity)


def parse_xid154(message: str) -> tuple[RecoveryAction, RecoveryAction] | None:
    """`GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)` -> (from, to)."""
    m = _XID154_RE.search(message)
    if m is None:
        return None
    return (
        recovery_action(int(m.group(1), 0), m.group(2) or ""),
        recovery_action(int(m.group(3), 0), m.group(4) or ""),
    )


# --- NVLink5 (Xid 144-150) --------------------------------------------------------------------------

_NVLINK5_RE = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*(?:/[A-Z0-9_]+)?)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\s+(?P<xc>XC\d)\s+(?P<inj>i\d+)\s+"
    r"Link\s+(?P<link>-?\d+)(?:\s+\((?P<intr>0x[0-9a-fA-F]+)\s+(?P<status>0x[0-9a-fA-F]+))?"
)
# Units whose errors the catalog's decode sheet says to ignore (investigate only if they persist).
_NVLINK5_BENIGN_UNITS = ("NETIR_BER_EVENT", "RLW_RXPIPE")


def decode_nvlink5(message: str) -> dict[str, Any] | None:
    """Decode the structured payload of Xid 144-150 (`<unit> Fatal|Nonfatal XC0 i0 Link nn (IntrInfo ErrorStatus ...)`).

    Returns unit, fatal, link, intr_info, error_status and gpuguard's severity: a fatal unit error needs
    a GPU reset (catalog RESET_GPU for link-down, MFDE, SAW, MSE); non-fatal BER / RXPIPE events are
    informational, other non-fatal ones a warning. Subcodes: V1 (driver < R575) = IntrInfo[9:5],
    V2 (>= R575) = IntrInfo[6:0]; both are given because the driver version is not in the line.
    """
    m = _NVLINK5_RE.search(message)
    if m is None:
        return None
    fatal = m.group("sev") == "Fatal"
    unit = m.group("unit")
    out: dict[str, Any] = {"unit": unit, "fatal": fatal, "link": int(m.group("link"))}
    if m.group("intr"):
        intr = int(m.group("intr"), 16)
        out.update(
            intr_info=m.group("intr"),
            error_status=m.group("status"),
            subcode_v1=(intr >> 5) & 0x1F,
            subcode_v2=intr & 0x7F,
        )
    if fatal:
        out["severity"] = "reset"
    elif unit.startswith(_NVLINK5_BENIGN_UNITS):
        out["severity"] = "info"
    else:
        out["severity"] = "warning"
    return out


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

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "action": self.action,
            "reason": self.reason,
            "primary": list(self.primary),
            "sympathetic": [list(s) for s in self.sympathetic],
            "recovery_action": self.recovery_action,
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
    items = [(c, _fields_of(ev)) for ev in events if (c := _code_of(ev)) is not None]
    if not items:
        return Resolution("info", _SEVERITY_ACTION["info"], "no Xid events")
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
    lost = False
    for i, (code, fields) in enumerate(items):
        if code == 154:
            continue
        echo_of: int | None = None
        if lost and code != 79:
            echo_of = 79
        elif code == 45 and fields.get("caused_by") is not None:
            echo_of = int(fields["caused_by"])
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
    sev = worst(severities) if severities else "info"
    if primary:
        reasons.append("primary Xid " + ", ".join(map(str, primary)))
    if sympathetic:
        reasons.append("sympathetic " + ", ".join(f"{c}->{p}" for c, p in sympathetic))
    if to is not None and sev == RECOVERY_ACTIONS.get(to, ("", ""))[1]:
        action = recovery_action(to).action
    else:
        worst_primary = [c for c in primary if xid_severity(c) == sev]
        action = lookup(worst_primary[0]).action if worst_primary else _SEVERITY_ACTION[sev]
    return Resolution(sev, action, "; ".join(reasons), tuple(primary), tuple(sympathetic), recovery)
