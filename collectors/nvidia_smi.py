"""Pasted `nvidia-smi` output: `nvidia-smi -q` reports into an NVML snapshot, table output into events.

Why: the report on-call engineers paste into a ticket is `nvidia-smi -q` (or the plain `nvidia-smi`
table), not a `gpuguard.nvml/1` document. Read into the same snapshot the live probe produces, a
pasted report is judged by the same NVML rules (`diagnostics.node_findings.nvml_findings`), so it gives
the verdict the node would: a pending row remap, uncorrectable ECC counts, retired pages, "GPU requires
reset", the driver's recovery action, thermal slowdown, a narrow PCIe link.

- `parse_query(text)`: every `GPU dddddddd:bb:dd.f` block of `nvidia-smi -q` -> a `gpuguard.nvml/1`
  snapshot (`source: nvidia-smi -q`). `complete` is true only when the report lists as many GPUs as its
  `Attached GPUs` line says (a pasted excerpt of one GPU says nothing about the others), and only then
  are the GPUs given their index (the report's order is NVML's).
- `table_events(text)`: the table's per-GPU rows; `ERR!` in a GPU's fields (nvidia-smi could not read
  them) is a `gpu_fault` event (`smi_err`) on that GPU, with its index and PCI address. One unreadable
  sensor alone is marked benign (transient), two or more mean the driver cannot read the GPU.
- `read_report(path)`: both, from a file of at most `MAX_BYTES`; None when it holds neither.

Formats: docs/log-formats.md, "Pasted nvidia-smi output". Pure parsing apart from `read_report`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.collectors.kernel_scan import REPORT_MARKS
from gpuguard.collectors.logrule import lazy_re
from gpuguard.collectors.nvml import RECOVERY_ACTIONS, SCHEMA, normalize_pci_bus_id
from gpuguard.foundation.boundedread import open_regular
from gpuguard.foundation.errors import DataError
from gpuguard.foundation.events import Event

MAX_BYTES = 16 << 20  # a pasted report is a few hundred KiB; a bigger file is a log, read by the log readers
SOURCE_QUERY = "nvidia-smi -q"
_GPU_HEADER = lazy_re(r"^GPU (?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KEY_VALUE = lazy_re(r"^(?P<key>[^:]+?)\s*:\s?(?P<value>.*)$")
_NUMBER = lazy_re(r"^-?\d+(?:\.\d+)?")
_ATTACHED = lazy_re(r"^Attached GPUs\s*:\s*(?P<n>\d+)\s*$", re.M)
_DRIVER = lazy_re(r"^Driver Version\s*:\s*(?P<v>\S+)\s*$", re.M)
_QUERY_MARKERS = ("NVSMI LOG", "Attached GPUs", "Remapped Rows", "Retired Pages", "ECC Errors", "Product Name")
RESET_REQUIRED_TEXT = "GPU requires reset"  # NVML_ERROR_RESET_REQUIRED, as nvidia-smi prints it in a field
# nvidia-smi's names of the clock-event (throttle) reasons -> NVML's (`collectors.nvml.CLOCK_EVENT_REASONS`)
CLOCK_REASONS = {
    "Idle": "GpuIdle",
    "Applications Clocks Setting": "ApplicationsClocksSetting",
    "SW Power Cap": "SwPowerCap",
    "HW Slowdown": "HwSlowdown",
    "Sync Boost": "SyncBoost",
    "SW Thermal Slowdown": "SwThermalSlowdown",
    "HW Thermal Slowdown": "HwThermalSlowdown",
    "HW Power Brake Slowdown": "HwPowerBrakeSlowdown",
    "Display Clock Setting": "DisplayClockSetting",
}
_ACTION_CODES = {name.replace("_", " "): code for code, name in RECOVERY_ACTIONS.items()}
_ACTION_CODES.update({"gpu reset": 1, "reset": 1, "reboot": 2, "drain p2p": 3, "drain and reset": 4})


# --------------------------------------------------------------------------------------------------
# nvidia-smi -q


def looks_like_query(text: str) -> bool:
    """Does the text hold an `nvidia-smi -q` report (or a pasted GPU block of one)?"""
    if "NVSMI LOG" in text or _ATTACHED.search(text):
        return True
    return any(_GPU_HEADER.match(line.strip()) for line in text.splitlines()) and any(
        m in text for m in _QUERY_MARKERS[2:]
    )


def _blocks(text: str) -> Iterator[tuple[str, int, list[tuple[int, str]]]]:
    """(PCI address, line number of the header, [(indent, line)]) for each GPU block."""
    current: tuple[str, int, list[tuple[int, str]]] | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        header = _GPU_HEADER.match(stripped)
        if header is not None and indent <= 1:
            if current is not None:
                yield current
            current = (header["pci"], n, [])
            continue
        if current is None or not stripped:
            continue
        if indent == 0 and not stripped.startswith("["):  # back at the top level: the block ended
            yield current
            current = None
            continue
        current[2].append((indent, stripped))
    if current is not None:
        yield current


def block_fields(lines: list[tuple[int, str]]) -> dict[tuple[str, ...], str]:
    """The block's `Key : Value` lines by path: the section headers above them, then the key.

    A line without a colon is a section header; deeper-indented lines belong to it. `[...]` elision
    lines of a paste are skipped."""
    out: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    for indent, text in lines:
        if text.startswith("[") and text.endswith("]"):
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        m = _KEY_VALUE.match(text)
        if m is None:
            stack.append((indent, text.strip()))
            continue
        key, value = m["key"].strip(), m["value"].strip()
        path = (*(name for _, name in stack), key)  # a name: mypy misreads d[(*a, b)] as 3.11's d[*a, b]
        out[path] = value
        if not value:  # "Key :" with nothing after it opens a section too
            stack.append((indent, key))
    return out


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = _NUMBER.match(value.strip())
    return int(float(m.group(0))) if m else None


def _yes(value: str | None) -> bool | None:
    if value is None:
        return None
    low = value.strip().lower()
    if low in ("yes", "active", "enabled", "true"):
        return True
    if low in ("no", "not active", "disabled", "false", "none"):
        return False
    return None


def _sum(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _ecc(f: Mapping[tuple[str, ...], str]) -> dict[str, int | None] | None:
    """ECC counters as NVML names them: Ampere+ SRAM/DRAM, or the older Single/Double Bit totals."""
    ecc: dict[str, int | None] = {}
    for scope, name in (("Volatile", "volatile"), ("Aggregate", "aggregate")):
        base = ("ECC Errors", scope)

        def get(*key: str, base: tuple[str, ...] = base) -> int | None:
            return _int(f.get((*base, *key)))

        sram_unc = _sum(get("SRAM Uncorrectable"), get("SRAM Uncorrectable Parity"), get("SRAM Uncorrectable SEC-DED"))
        dram_unc = get("DRAM Uncorrectable")
        corrected = _sum(get("SRAM Correctable"), get("DRAM Correctable"))
        uncorrected = _sum(sram_unc, dram_unc)
        if corrected is None and uncorrected is None:  # pre-Ampere: Single Bit / Double Bit
            corrected, uncorrected = get("Single Bit", "Total"), get("Double Bit", "Total")
            dram_unc = get("Double Bit", "Device Memory")
        ecc[f"{name}_corrected"] = corrected
        ecc[f"{name}_uncorrected"] = uncorrected
        ecc[f"{name}_uncorrected_dram"] = dram_unc
        ecc[f"{name}_uncorrected_sram"] = sram_unc
    return ecc if any(v is not None for v in ecc.values()) else None


def _retired(f: Mapping[tuple[str, ...], str]) -> dict[str, Any] | None:
    single = _int(f.get(("Retired Pages", "Single Bit ECC")))
    double = _int(f.get(("Retired Pages", "Double Bit ECC")))
    pending = _yes(
        f.get(("Retired Pages", "Pending Page Blacklist")) or f.get(("Retired Pages", "Pending Page Retirement"))
    )
    if single is None and double is None and pending is None:
        return None
    return {"single_bit": single, "double_bit": double, "pending": pending}


def _remapped(f: Mapping[tuple[str, ...], str]) -> dict[str, Any] | None:
    rows = {
        "correctable": _int(f.get(("Remapped Rows", "Correctable Error"))),
        "uncorrectable": _int(f.get(("Remapped Rows", "Uncorrectable Error"))),
        "pending": _yes(f.get(("Remapped Rows", "Pending"))),
        "failure": _yes(f.get(("Remapped Rows", "Remapping Failure Occurred"))),
    }
    return rows if any(v is not None for v in rows.values()) else None


def _clock_reasons(f: Mapping[tuple[str, ...], str]) -> list[str]:
    active = []
    for path, value in f.items():
        if path[0] in ("Clocks Event Reasons", "Clocks Throttle Reasons") and _yes(value):
            name = CLOCK_REASONS.get(path[-1])
            if name is not None:
                active.append(name)
    return active


def _pcie(f: Mapping[tuple[str, ...], str]) -> dict[str, int | None] | None:
    link = ("PCI", "GPU Link Info")
    pcie = {
        "gen": _int(
            f.get((*link, "PCIe Generation", "Current")) or f.get((*link, "PCIe Generation", "Device Current"))
        ),
        "gen_max": _int(f.get((*link, "PCIe Generation", "Max")) or f.get((*link, "PCIe Generation", "Device Max"))),
        "width": _int(f.get((*link, "Link Width", "Current"))),
        "width_max": _int(f.get((*link, "Link Width", "Max"))),
        "replay_counter": _int(f.get(("PCI", "Replays Since Reset"))),
    }
    return pcie if any(v is not None for v in pcie.values()) else None


def _recovery_action(f: Mapping[tuple[str, ...], str]) -> int | None:
    value = f.get(("GPU Recovery Action",))
    if value is not None:
        return _ACTION_CODES.get(value.strip().lower())
    if _yes(f.get(("GPU Reset Status", "Drain and Reset Recommended"))):
        return 4
    if _yes(f.get(("GPU Reset Status", "Reset Required"))):
        return 1
    return None


def gpu_from_block(pci: str, f: Mapping[tuple[str, ...], str], index: int | None) -> dict[str, Any]:
    """One GPU of the snapshot from its `nvidia-smi -q` block (fields NVML would give, None where absent)."""
    action = _recovery_action(f)
    unreadable = sorted(" / ".join(p) for p, v in f.items() if RESET_REQUIRED_TEXT.lower() in v.lower())
    reasons = _clock_reasons(f)
    return {
        "index": index,
        "name": f.get(("Product Name",)),
        "uuid": f.get(("GPU UUID",)),
        "serial": f.get(("Serial Number",)),
        "pci_bus_id": normalize_pci_bus_id(pci),
        "lost": False,
        "error": None,
        "ecc_mode": _yes(f.get(("ECC Mode", "Current"))),
        "ecc": _ecc(f),
        "retired_pages": _retired(f),
        "remapped_rows": _remapped(f),
        "temperature_c": _int(f.get(("Temperature", "GPU Current Temp"))),
        "temperature_slowdown_c": _int(f.get(("Temperature", "GPU Slowdown Temp"))),
        "temperature_shutdown_c": _int(f.get(("Temperature", "GPU Shutdown Temp"))),
        "clock_event_reason_names": reasons,
        "pcie": _pcie(f),
        "recovery_action": action,
        "recovery_action_name": None if action is None else RECOVERY_ACTIONS.get(action),
        "reset_required": bool(unreadable) or None,
        "errors": {path: RESET_REQUIRED_TEXT for path in unreadable},
    }


def parse_query(text: str, source: str = SOURCE_QUERY) -> dict[str, Any] | None:
    """The `gpuguard.nvml/1` snapshot an `nvidia-smi -q` report stands for, or None when it holds no GPU."""
    blocks = list(_blocks(text))
    if not blocks:
        return None
    attached = _ATTACHED.search(text)
    complete = attached is not None and int(attached["n"]) == len(blocks)
    gpus = [
        gpu_from_block(pci, block_fields(lines), i if complete else None) for i, (pci, _, lines) in enumerate(blocks)
    ]
    driver = _DRIVER.search(text)
    return {
        "schema": SCHEMA,
        "status": "ok",
        "reason": None,
        "collected_at": None,
        "driver_version": driver["v"] if driver else None,
        "source": source,
        "complete": complete,
        "gpus": gpus,
    }


# --------------------------------------------------------------------------------------------------
# The nvidia-smi table

_TABLE_GPU = lazy_re(
    r"^\|\s+(?P<index>\d+)\s+(?P<name>.*?)\s+(?:On|Off)\s*\|\s*(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"
    r"\s+\S+\s*\|(?P<ecc>[^|]*)\|"
)
_TABLE_ROW = lazy_re(r"^\|(?P<a>[^|]*)\|(?P<b>[^|]*)\|(?P<c>[^|]*)\|")
_SENSOR_NAMES = ("fan", "temperature", "performance state", "power")


@dataclass(frozen=True)
class TableGpu:
    """One GPU row pair of the `nvidia-smi` table: what could not be read (ERR!)."""

    index: int
    pci_bus_id: str | None
    name: str
    line: int
    unreadable: tuple[str, ...] = field(default=())


def table_gpus(text: str) -> list[TableGpu]:
    """The GPUs of an `nvidia-smi` table and the fields it printed as `ERR!`."""
    lines = text.splitlines()
    out: list[TableGpu] = []
    for n, line in enumerate(lines):
        m = _TABLE_GPU.match(line.strip())
        if m is None:
            continue
        bad = ["uncorrectable ECC count"] if "ERR!" in m["ecc"] else []
        if n + 1 < len(lines):
            row = _TABLE_ROW.match(lines[n + 1].strip())
            if row is not None:
                tokens = row["a"].split()
                bad += [_SENSOR_NAMES[min(i, 3)] for i, t in enumerate(tokens) if t.startswith("ERR!")]
                if "ERR!" in row["b"]:
                    bad.append("memory usage")
                if "ERR!" in row["c"]:
                    bad.append("utilisation / compute mode")
        pci = normalize_pci_bus_id(m["pci"])
        out.append(TableGpu(int(m["index"]), pci, m["name"].strip(), n + 1, tuple(dict.fromkeys(bad))))
    return out


def table_events(text: str, source: str | None = None) -> list[Event]:
    """`smi_err` fault events for the table's GPUs that show `ERR!` (one sensor alone: benign)."""
    events = []
    for g in table_gpus(text):
        if not g.unreadable:
            continue
        benign = len(g.unreadable) == 1 and g.unreadable[0] in ("fan", "power")
        fields = {
            "fault": "smi_err",
            "pci_bus_id": g.pci_bus_id,
            "gpu_index": g.index,
            "device": "gpu",
            "unreadable_fields": list(g.unreadable),
        }
        diagnosis = f"nvidia-smi could not read GPU {g.index}'s {', '.join(g.unreadable)} (ERR!): " + (
            "one sensor alone is usually transient (no action; watch whether it persists)."
            if benign
            else "the driver cannot read the GPU: look for Xids in the kernel log, reset the GPU; if it fails, reboot."
        )
        events.append(
            Event(
                "gpu_fault",
                g.line,
                f"nvidia-smi GPU {g.index} {g.pci_bus_id}: ERR!",
                fields,
                None,
                source,
                "info" if benign else "critical",
                diagnosis,
            )
        )
    return events


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmiReport:
    """What a pasted file held: an `nvidia-smi -q` snapshot and / or the table's events."""

    path: str
    snapshot: dict[str, Any] | None
    events: tuple[Event, ...]


def read_report(path: str, *, max_bytes: int = MAX_BYTES) -> SmiReport | None:
    """`nvidia-smi` output in a (small) regular file: None when the file holds none, is bigger than
    `max_bytes` (a log, not a paste) or is no regular file (`foundation.boundedread.open_regular`: a FIFO
    never blocks the open). A file that cannot be opened raises its one-line error (66, 77, ...)."""
    try:
        with open_regular(path, what="an nvidia-smi report") as (fd, st):
            if st.st_size > max_bytes:
                return None
            raw = b""
            while len(raw) <= max_bytes:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                raw += chunk
    except DataError:
        return None  # a FIFO, a device, a directory: not a pasted report (the log readers say what it is)
    if len(raw) > max_bytes or not any(m in raw for m in REPORT_MARKS):
        return None
    text = raw.decode("utf-8", "replace")
    snapshot = parse_query(text, f"{SOURCE_QUERY} in {path}") if looks_like_query(text) else None
    events = tuple(table_events(text, path)) if "NVIDIA-SMI" in text or "Bus-Id" in text else ()
    if snapshot is None and not events:
        return None
    return SmiReport(path, snapshot, events)
