"""The structured payloads some Xid lines carry, decoded: Xid 154's recovery action (the driver's
own, authoritative word on what the GPU needs) and the NVLink5 unit errors of Xid 144-150. Pure:
one driver message in, its fields out; `xid_catalog` judges them with the rest of a GPU's Xids."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# nvmlDeviceGpuRecoveryAction_t; Xid 154 prints these values.
RECOVERY_ACTIONS: Mapping[int, tuple[str, str]] = {
    0: ("none", "info"),
    1: ("gpu_reset", "reset"),
    2: ("node_reboot", "drain"),
    3: ("drain_p2p", "drain"),  # "drain": take the work off the GPU first (NVIDIA's word), then reset
    4: ("drain_and_reset", "drain"),
    5: ("recover_imex_domain", "drain"),
    6: ("bus_reset", "reset"),
    7: ("system_reboot", "drain"),
}
_RECOVERY_TEXT = {
    "none": "No recovery needed: the GPU can be used again by starting a new process.",
    "gpu_reset": "GPU reset required: stop all GPU processes and reset it (nvidia-smi -r -i <id>).",
    "node_reboot": "Node reboot required: the fault may have left the OS inconsistent.",
    "drain_p2p": "Drain: move the work off this node (peer-to-peer NVLink traffic must stop), then reset the GPU.",
    "drain_and_reset": "Drain: let the node's jobs finish or move them, then reset the GPU (nvidia-smi -r -i <id>).",
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
