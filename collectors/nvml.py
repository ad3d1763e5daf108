"""NVML collector: one JSON-able snapshot of every GPU's health counters (`gpuguard.nvml/1`).

`pynvml` is imported lazily (the doctor must start fast and run where no driver exists), every call is
guarded (a feature the SKU lacks is `null`, a lost GPU is recorded and the others still collected), and
the whole probe runs in a worker thread with a deadline, because a sick GPU can block NVML for minutes
(GSP timeouts, Xid 119; nvidia-smi stuck in D state after Xid 45). The snapshot is the same document
`--nvml-snapshot FILE` accepts, so every verdict can be reproduced offline.

Lazy imports (start-up time): pynvml, only when the live probe runs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuguard.foundation.errors import DataError, from_os_error

SCHEMA = "gpuguard.nvml/1"
DEFAULT_TIMEOUT_S = 10.0

# pynvml exception class names that mean "there is no NVIDIA stack on this node" (status unknown).
NO_DRIVER_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
# Answers that mean "this SKU / binding has no such counter": the field is null, not an error.
_ABSENT_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_InvalidArgument")

RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}
CLOCK_EVENT_REASONS = {
    0x001: "GpuIdle",
    0x002: "ApplicationsClocksSetting",
    0x004: "SwPowerCap",
    0x008: "HwSlowdown",
    0x010: "SyncBoost",
    0x020: "SwThermalSlowdown",
    0x040: "HwThermalSlowdown",
    0x080: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}
_NVLINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3), ("ecc_data", 4))
_FI_RECOVERY_ACTION_FALLBACK = 271  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION in recent headers


def clock_event_names(mask: int | None) -> list[str]:
    """Names of the bits set in a clock-event (throttle) reason mask."""
    if not mask:
        return []
    return [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """NVML's `00000000:3B:00.0` -> `0000:3b:00.0` (the form the kernel-log parser emits)."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return bus_id.strip().lower() or None
    domain, bus, devfn = parts
    if "." not in devfn:
        devfn += ".0"
    return f"{domain[-4:].rjust(4, '0')}:{bus.rjust(2, '0')}:{devfn}"


def unknown_snapshot(reason: str, status: str = "unknown") -> dict[str, Any]:
    """The snapshot when NVML could not be asked: no driver, a hung probe, a version mismatch."""
    return {
        "schema": SCHEMA,
        "status": status,
        "reason": reason,
        "collected_at": time.time(),
        "driver_version": None,
        "gpus": [],
    }


class _Guard:
    """Call one NVML function: absent feature -> None, GPU lost -> remembered, other error -> recorded."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.errors: dict[str, str] = {}
        self.lost: str | None = None
        self.reset_required = False

    def __call__(self, key: str, fname: str, *args: Any) -> Any:
        fn = getattr(self.nv, fname, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            name = type(exc).__name__
            if name in _ABSENT_ERRORS:
                return None
            if name == "NVMLError_GpuIsLost":
                self.lost = str(exc)
                return None
            if name == "NVMLError_ResetRequired":  # "GPU requires reset": the GPU answers nothing until reset
                self.reset_required = True
            self.errors[key] = f"{name}: {exc}"
            return None


def _gpu(nv: Any, index: int) -> dict[str, Any]:
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        lost = type(exc).__name__ == "NVMLError_GpuIsLost"
        return {
            "index": index,
            "name": None,
            "uuid": None,
            "pci_bus_id": None,
            "lost": lost,
            "error": f"{type(exc).__name__}: {exc}",
        }
    g = _Guard(nv)
    name = g("name", "nvmlDeviceGetName", handle)
    uuid = g("uuid", "nvmlDeviceGetUUID", handle)
    serial = g("serial", "nvmlDeviceGetSerial", handle)
    pci = g("pci_bus_id", "nvmlDeviceGetPciInfo", handle)
    ecc_mode = g("ecc_mode", "nvmlDeviceGetEccMode", handle)
    ecc: dict[str, Any] = {}
    for err_type, err_name in ((0, "corrected"), (1, "uncorrected")):
        for ctr_type, ctr_name in ((0, "volatile"), (1, "aggregate")):
            key = f"{ctr_name}_{err_name}"
            ecc[key] = g(f"ecc.{key}", "nvmlDeviceGetTotalEccErrors", handle, err_type, ctr_type)
            if err_type == 1:
                for loc, where in ((2, "dram"), (7, "sram")):
                    ecc[f"{key}_{where}"] = g(
                        f"ecc.{key}_{where}", "nvmlDeviceGetMemoryErrorCounter", handle, err_type, ctr_type, loc
                    )
    sbe = g("retired_pages.single_bit", "nvmlDeviceGetRetiredPages", handle, 0)
    dbe = g("retired_pages.double_bit", "nvmlDeviceGetRetiredPages", handle, 1)
    pending = g("retired_pages.pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    retired = (
        None
        if sbe is None and dbe is None and pending is None
        else {
            "single_bit": None if sbe is None else len(sbe),
            "double_bit": None if dbe is None else len(dbe),
            "pending": None if pending is None else bool(pending),
        }
    )
    rows = g("remapped_rows", "nvmlDeviceGetRemappedRows", handle)
    remapped = (
        None
        if rows is None
        else {
            "correctable": int(rows[0]),
            "uncorrectable": int(rows[1]),
            "pending": bool(rows[2]),
            "failure": bool(rows[3]),
        }
    )
    power_mw = g("power_w", "nvmlDeviceGetPowerUsage", handle)
    limit_mw = g("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", handle)
    reasons = g("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None and "clock_event_reasons" not in g.errors:
        reasons = g("clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    pcie = {
        "gen": g("pcie.gen", "nvmlDeviceGetCurrPcieLinkGeneration", handle),
        "gen_max": g("pcie.gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", handle),
        "width": g("pcie.width", "nvmlDeviceGetCurrPcieLinkWidth", handle),
        "width_max": g("pcie.width_max", "nvmlDeviceGetMaxPcieLinkWidth", handle),
        "replay_counter": g("pcie.replay_counter", "nvmlDeviceGetPcieReplayCounter", handle),
    }
    links = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        if g.lost:
            break
        state = g(f"nvlink.{link}.state", "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            continue
        entry: dict[str, Any] = {"link": link, "active": bool(state)}
        for cname, cid in _NVLINK_COUNTERS:
            entry[cname] = g(f"nvlink.{link}.{cname}", "nvmlDeviceGetNvLinkErrorCounter", handle, link, cid)
        links.append(entry)
    action = _recovery_action(nv, g, handle)
    bus_id = getattr(pci, "busId", None) if pci is not None else None
    return {
        "index": index,
        "name": name,
        "uuid": uuid,
        "serial": serial,
        "pci_bus_id": normalize_pci_bus_id(bus_id),
        "lost": g.lost is not None,
        "error": g.lost,
        "ecc_mode": None if ecc_mode is None else bool(ecc_mode[0]),
        "ecc": ecc,
        "retired_pages": retired,
        "remapped_rows": remapped,
        "temperature_c": g("temperature_c", "nvmlDeviceGetTemperature", handle, 0),
        "temperature_slowdown_c": g("temperature_slowdown_c", "nvmlDeviceGetTemperatureThreshold", handle, 1),
        "temperature_shutdown_c": g("temperature_shutdown_c", "nvmlDeviceGetTemperatureThreshold", handle, 0),
        "power_w": None if power_mw is None else power_mw / 1000.0,
        "power_limit_w": None if limit_mw is None else limit_mw / 1000.0,
        "clock_event_reasons": reasons,
        "clock_event_reason_names": clock_event_names(reasons),
        "pcie": pcie,
        "nvlink": links,
        "recovery_action": action,
        "recovery_action_name": None if action is None else RECOVERY_ACTIONS.get(action, f"0x{action:x}"),
        "reset_required": g.reset_required or None,
        "errors": g.errors,
    }


def _recovery_action(nv: Any, g: _Guard, handle: Any) -> int | None:
    """The driver's GPU recovery action (newer drivers only; a field value, absent in old bindings)."""
    field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field is None:
        return None
    values = g("recovery_action", "nvmlDeviceGetFieldValues", handle, [field])
    if not values or getattr(values[0], "nvmlReturn", 1) != 0:
        return None
    return int(values[0].value.uiVal)


def probe(nv: Any) -> dict[str, Any]:
    """Collect the snapshot through the `pynvml`-shaped module `nv` (no timeout: see `collect`)."""
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        name = type(exc).__name__
        status = "unknown" if name in NO_DRIVER_ERRORS else "failed"
        return {**unknown_snapshot(f"{name}: {exc}", status), "nvml_error": name}
    try:
        driver = _Guard(nv)("driver_version", "nvmlSystemGetDriverVersion")
        count = nv.nvmlDeviceGetCount()
        gpus = [_gpu(nv, i) for i in range(count)]
    except nv.NVMLError as exc:
        return {**unknown_snapshot(f"{type(exc).__name__}: {exc}", "failed"), "nvml_error": type(exc).__name__}
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a broken library must not hide the result
            pass
    if isinstance(driver, bytes):
        driver = driver.decode("ascii", "replace")
    return {
        "schema": SCHEMA,
        "status": "ok",
        "reason": None,
        "collected_at": time.time(),
        "driver_version": driver,
        "gpus": gpus,
    }


def _import_pynvml() -> Any:
    import pynvml  # lazy: the binding is a ctypes module, cheap, but only needed here

    return pynvml


def collect(timeout: float = DEFAULT_TIMEOUT_S, *, loader: Callable[[], Any] = _import_pynvml) -> dict[str, Any]:
    """Probe NVML in a worker thread; past `timeout` seconds give up with status `unknown`.

    The worker is a daemon thread: if the driver never answers, it is abandoned, never joined, so
    the sweep still finishes on time.
    """
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["snapshot"] = probe(loader())
        except ImportError as exc:
            result["snapshot"] = unknown_snapshot(f"pynvml is not installed ({exc})")
        except Exception as exc:  # noqa: BLE001 - a broken binding is a finding, not a crash
            result["snapshot"] = unknown_snapshot(f"NVML probe failed: {type(exc).__name__}: {exc}", "failed")

    worker = threading.Thread(target=work, name="gpuguard-nvml-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        snap = unknown_snapshot(f"NVML probe did not answer within {timeout:g} s (driver hung?)")
        snap["timed_out"] = True
        return snap
    return result["snapshot"]


# ---------------------------------------------------------------------------------------------------
# Loading a recorded snapshot (`--nvml-snapshot FILE`): validated, one clear error per problem.

_GPU_NUMBERS = (
    "temperature_c",
    "temperature_slowdown_c",
    "temperature_shutdown_c",
    "power_w",
    "power_limit_w",
    "clock_event_reasons",
    "recovery_action",
    "index",
)
_SECTIONS = {
    "ecc": None,  # any int-valued keys
    "retired_pages": {"single_bit": int, "double_bit": int, "pending": bool},
    "remapped_rows": {"correctable": int, "uncorrectable": int, "pending": bool, "failure": bool},
    "pcie": {"gen": int, "gen_max": int, "width": int, "width_max": int, "replay_counter": int},
}


def _check_type(value: Any, kind: type, where: str) -> None:
    if value is None:
        return
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise DataError(f"{where}: expected {kind.__name__} or null, got {type(value).__name__} {value!r:.40}")


def validate_snapshot(doc: Any, what: str = "NVML snapshot") -> dict[str, Any]:
    """Check a snapshot's shape and types; raise DataError naming the first bad field."""
    if not isinstance(doc, dict):
        raise DataError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise DataError(f"{what}: schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    status = doc.get("status", "ok")
    if status not in ("ok", "unknown", "failed"):
        raise DataError(f"{what}: status must be ok, unknown or failed, got {status!r}")
    _check_type(doc.get("reason"), str, f"{what}: reason")
    gpus = doc.get("gpus", [])
    if not isinstance(gpus, list):
        raise DataError(f"{what}: gpus must be a list")
    for i, gpu in enumerate(gpus):
        where = f"{what}: gpus[{i}]"
        if not isinstance(gpu, dict):
            raise DataError(f"{where}: expected an object")
        for key in ("name", "uuid", "serial", "pci_bus_id", "error"):
            _check_type(gpu.get(key), str, f"{where}.{key}")
        _check_type(gpu.get("lost"), bool, f"{where}.lost")
        _check_type(gpu.get("reset_required"), bool, f"{where}.reset_required")
        _check_type(gpu.get("ecc_mode"), bool, f"{where}.ecc_mode")
        for key in _GPU_NUMBERS:
            _check_type(
                gpu.get(key),
                int if key in ("clock_event_reasons", "recovery_action", "index") else float,
                f"{where}.{key}",
            )
        for section, fields in _SECTIONS.items():
            sub = gpu.get(section)
            if sub is None:
                continue
            if not isinstance(sub, dict):
                raise DataError(f"{where}.{section}: expected an object")
            for key, value in sub.items():
                _check_type(value, (fields or {}).get(key, int), f"{where}.{section}.{key}")
        links = gpu.get("nvlink") or []
        if not isinstance(links, list):
            raise DataError(f"{where}.nvlink: expected a list")
        for j, link in enumerate(links):
            if not isinstance(link, dict):
                raise DataError(f"{where}.nvlink[{j}]: expected an object")
            _check_type(link.get("link"), int, f"{where}.nvlink[{j}].link")
            _check_type(link.get("active"), bool, f"{where}.nvlink[{j}].active")
            for cname, _ in _NVLINK_COUNTERS:
                _check_type(link.get(cname), int, f"{where}.nvlink[{j}].{cname}")
        if gpu.get("pci_bus_id") is not None:
            gpu["pci_bus_id"] = normalize_pci_bus_id(gpu["pci_bus_id"])
    return doc


def load_snapshot(path: str) -> dict[str, Any]:
    """Read and validate a recorded snapshot file (`-` is not accepted: the kernel log may use stdin)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(64 * 1024 * 1024)
    except OSError as exc:
        raise from_os_error(exc, f"NVML snapshot {path}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"NVML snapshot {path}: not valid JSON ({exc})") from None
    return validate_snapshot(doc, f"NVML snapshot {path}")
