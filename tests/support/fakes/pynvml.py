"""A fake `pynvml` for tests: the real function names, exception classes and error codes, driven by a
recorded NVML snapshot (`gpuguard.nvml/1`, the shape `gpuguard.collectors.nvml` emits).

This is the ONLY fake in the test suite: it sits exactly at the `pynvml` module boundary. CLI tests put
`tests/support/fakes` first on PYTHONPATH and name the snapshot in `$GPUGUARD_FAKE_NVML`. A null field in the
snapshot makes the matching call raise `NVMLError_NotSupported`, as a real driver does for a feature the
SKU lacks. Test-only controls live under the snapshot's `"fake"` key:

    "fake": {"init_error": 12,      # nvmlInit raises NVMLError(12) = LibraryNotFound (9 = DriverNotLoaded)
             "hang_s": 30,          # nvmlInit sleeps first (a hung driver)
             "events": false}       # nvmlDeviceRegisterEvents raises NotSupported (no event support)

Events (`nvmlEventSetWait`): `$GPUGUARD_FAKE_NVML_EVENTS` names a file of JSON lines
`{"type": 8, "data": 79, "index": 0}` (nvmlEventType bits, the Xid, the GPU); each line appended is one
event, delivered once; a wait without a new line raises NVMLError_Timeout after its timeout.

Without `$GPUGUARD_FAKE_NVML` the fake behaves like a machine without a driver (LibraryNotFound).
"""

from __future__ import annotations

import json
import os
import string
import sys
import time
from types import SimpleNamespace

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_LOCATION_DEVICE_MEMORY = 2
NVML_MEMORY_LOCATION_DRAM = 2
NVML_MEMORY_LOCATION_SRAM = 7
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_NVLINK_ERROR_DL_ECC_DATA = 4
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 271
NVML_SUCCESS = 0


class NVMLError(Exception):
    """Same construction as the real binding: `NVMLError(12)` is an `NVMLError_LibraryNotFound`."""

    _valClassMapping: dict = {}
    _errcode_to_string = {
        1: "Uninitialized",
        2: "Invalid Argument",
        3: "Not Supported",
        4: "Insufficient Permissions",
        5: "Already Initialized",
        6: "Not Found",
        7: "Insufficient Size",
        8: "Insufficient External Power",
        9: "Driver Not Loaded",
        10: "Timeout",
        11: "Interrupt Request Issue",
        12: "NVML Shared Library Not Found",
        13: "Function Not Found",
        14: "Corrupted infoROM",
        15: "GPU is lost",
        16: "GPU requires restart",
        17: "The operating system has blocked the request.",
        18: "RM has detected an NVML/RM version mismatch.",
        20: "Insufficient Memory",
        999: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


def _make_error_classes() -> None:
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        value = getattr(module, name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(value)})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[value] = cls


_make_error_classes()

_state: dict = {"snapshot": None, "initialized": False}


def _snapshot() -> dict:
    if not _state["initialized"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _state["snapshot"]


def nvmlInit() -> None:
    path = os.environ.get("GPUGUARD_FAKE_NVML")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path, encoding="utf-8") as fh:
        snap = json.load(fh)
    fake = snap.get("fake") or {}
    if fake.get("hang_s"):
        time.sleep(float(fake["hang_s"]))
    if fake.get("init_error"):
        raise NVMLError(int(fake["init_error"]))
    _state.update(snapshot=snap, initialized=True)


nvmlInitWithFlags = lambda flags=0: nvmlInit()  # noqa: E731 - same signature as the real binding


def nvmlShutdown() -> None:
    _state["initialized"] = False


def nvmlSystemGetDriverVersion() -> str:
    return _snapshot().get("driver_version") or "0.0"


def nvmlSystemGetNVMLVersion() -> str:
    return _snapshot().get("nvml_version") or "0.0"


def nvmlDeviceGetCount() -> int:
    return len(_snapshot().get("gpus") or [])


def nvmlDeviceGetHandleByIndex(index: int):
    gpus = _snapshot().get("gpus") or []
    if not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return SimpleNamespace(index=index, gpu=gpus[index])


def _value(handle, *path, identity: bool = False):
    gpu = handle.gpu
    if gpu.get("lost") and not identity:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    value = gpu
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return value


def nvmlDeviceGetName(handle) -> str:
    return _value(handle, "name", identity=True)


def nvmlDeviceGetUUID(handle) -> str:
    return _value(handle, "uuid", identity=True)


def nvmlDeviceGetSerial(handle) -> str:
    return _value(handle, "serial")


def nvmlDeviceGetPciInfo(handle):
    bus = _value(handle, "pci_bus_id", identity=True)
    return SimpleNamespace(busId="0000" + bus.upper(), busIdLegacy=bus.upper())


def nvmlDeviceGetEccMode(handle):
    enabled = _value(handle, "ecc_mode")
    return [int(enabled), int(enabled)]


_ECC_KEYS = {
    (0, 0): "volatile_corrected",
    (1, 0): "volatile_uncorrected",
    (0, 1): "aggregate_corrected",
    (1, 1): "aggregate_uncorrected",
}


def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType) -> int:
    return _value(handle, "ecc", _ECC_KEYS[(errorType, counterType)])


def nvmlDeviceGetMemoryErrorCounter(handle, errorType, counterType, locationType) -> int:
    where = {2: "dram", 7: "sram"}.get(locationType)
    if where is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return _value(handle, "ecc", f"{_ECC_KEYS[(errorType, counterType)]}_{where}")


def nvmlDeviceGetRetiredPages(handle, sourceFilter):
    key = "single_bit" if sourceFilter == 0 else "double_bit"
    return [0x1000 * (i + 1) for i in range(_value(handle, "retired_pages", key))]


def nvmlDeviceGetRetiredPagesPendingStatus(handle) -> int:
    return int(_value(handle, "retired_pages", "pending"))


def nvmlDeviceGetRemappedRows(handle):
    rows = _value(handle, "remapped_rows")
    return (rows["correctable"], rows["uncorrectable"], int(rows["pending"]), int(rows["failure"]))


def nvmlDeviceGetTemperature(handle, sensor) -> int:
    return _value(handle, "temperature_c")


def nvmlDeviceGetTemperatureThreshold(handle, threshold) -> int:
    key = {0: "temperature_shutdown_c", 1: "temperature_slowdown_c"}.get(threshold)
    if key is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return _value(handle, key)


def nvmlDeviceGetPowerUsage(handle) -> int:
    return int(round(_value(handle, "power_w") * 1000))


def nvmlDeviceGetEnforcedPowerLimit(handle) -> int:
    return int(round(_value(handle, "power_limit_w") * 1000))


def nvmlDeviceGetCurrentClocksEventReasons(handle) -> int:
    return _value(handle, "clock_event_reasons")


nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons


def nvmlDeviceGetCurrPcieLinkGeneration(handle) -> int:
    return _value(handle, "pcie", "gen")


def nvmlDeviceGetMaxPcieLinkGeneration(handle) -> int:
    return _value(handle, "pcie", "gen_max")


def nvmlDeviceGetCurrPcieLinkWidth(handle) -> int:
    return _value(handle, "pcie", "width")


def nvmlDeviceGetMaxPcieLinkWidth(handle) -> int:
    return _value(handle, "pcie", "width_max")


def nvmlDeviceGetPcieReplayCounter(handle) -> int:
    return _value(handle, "pcie", "replay_counter")


def _link(handle, link: int) -> dict:
    for entry in _value(handle, "nvlink"):
        if entry["link"] == link:
            return entry
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED if link < NVML_NVLINK_MAX_LINKS else NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetNvLinkState(handle, link: int) -> int:
    return int(_link(handle, link)["active"])


_LINK_COUNTERS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data", 4: "ecc_data"}


def nvmlDeviceGetNvLinkErrorCounter(handle, link: int, counter: int) -> int:
    value = _link(handle, link).get(_LINK_COUNTERS[counter])
    if value is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return value


def nvmlDeviceGetFieldValues(handle, fieldIds):
    out = []
    for field_id in fieldIds:
        ret, value = NVML_ERROR_NOT_SUPPORTED, 0
        if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
            action = handle.gpu.get("recovery_action")
            if handle.gpu.get("lost"):
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if action is not None:
                ret, value = NVML_SUCCESS, action
        out.append(
            SimpleNamespace(
                fieldId=field_id, nvmlReturn=ret, value=SimpleNamespace(uiVal=value, ullVal=value, siVal=value)
            )
        )
    return out


nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeClock = 0x10
_events: dict = {"offset": 0}


def nvmlEventSetCreate():
    _snapshot()
    return SimpleNamespace(handles=[])


def nvmlDeviceRegisterEvents(handle, mask, event_set) -> None:
    if (_snapshot().get("fake") or {}).get("events") is False:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    event_set.handles.append(handle)


def _next_event():
    path = os.environ.get("GPUGUARD_FAKE_NVML_EVENTS")
    if not path or not os.path.exists(path):
        return None
    with open(path, "rb") as fh:
        fh.seek(_events["offset"])
        line = fh.readline()
    if not line.endswith(b"\n"):
        return None
    _events["offset"] += len(line)
    doc = json.loads(line)
    return SimpleNamespace(eventType=doc.get("type", 8), eventData=doc.get("data", 0), gpu_index=doc.get("index"))


def nvmlEventSetWait_v2(event_set, timeout_ms):
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        event = _next_event()
        if event is not None:
            return event
        left = deadline - time.monotonic()
        if left <= 0:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(min(0.02, left))


nvmlEventSetWait = nvmlEventSetWait_v2


def nvmlEventSetFree(event_set) -> None:
    return None
