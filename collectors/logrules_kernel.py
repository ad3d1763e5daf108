"""Rules for NVIDIA kernel-driver lines: Xid, SXid, fallen off the bus, GPU identity, reset required, GSP
timeouts; and the NIC driver's (mlx5) memory-registration errors, job-level network evidence.

Why here: the driver's formats drifted for 15 years (no `PCI:` prefix, `pid='<unknown>'`,
`Ch 00000008` vs `channel 0x0000000c`, PCI domains, multi-line fallen-off-bus without an Xid) and the
node verdict must read all of them. Each rule is pure: (line text, line number, state) -> a finding.
Formats: docs/log-formats.md, "Kernel driver lines".
"""

from __future__ import annotations

import functools
import re

from gpuguard.collectors.logrule import ABSORBED, Found, ParseState, Rule, lazy_re
from gpuguard.collectors.logtime import line_time
from gpuguard.foundation import gpu_faults
from gpuguard.foundation import xid_catalog as catalog

_PCI = r"[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}(?:\.[0-7])?|[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7]"
_PCI_RE = lazy_re(
    r"^(?:(?P<dom>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})(?:\.(?P<fn>[0-7]))?$"
)


_BUSDEV_RE = lazy_re(r"^(?P<bus>[0-9A-Fa-f]{1,4}):(?P<dev>[0-9A-Fa-f]{1,2})$")


@functools.lru_cache(maxsize=4096)  # a node has a handful of GPUs: the same few addresses on every line
def normalize_pci(text: str | None) -> str | None:
    """`PCI:0000:CB:00` / `0000:01:00` / `00000000:10:1C.0` / `01:00.0` / old `0003:00` (bus:device, no
    domain) -> `dddd:bb:dd.f` (lower case)."""
    if not text:
        return None
    text = text.strip()
    if text[:4].upper() == "PCI:":
        text = text[4:]
    m = _PCI_RE.match(text)
    if m is None:
        old = _BUSDEV_RE.match(text)
        if old is None or int(old["bus"], 16) > 0xFF:
            return None
        return f"0000:{int(old['bus'], 16):02x}:{int(old['dev'], 16):02x}.0"
    dom = int(m["dom"] or "0", 16)
    return f"{dom:04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}.{m['fn'] or '0'}"


# The code is any token up to the comma: only 1-6 ASCII digits are a code; anything else (7+ digits, hex,
# a sign, other scripts' digits) is reported as an unreadable code that needs review, never dropped.
_XID = lazy_re(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>" + _PCI + r"|[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,2}|\.\.\.)\):\s*(?P<xid>[^,\s]+),?\s*"
    r"(?:pid=(?P<pid>'<unknown>'|<unknown>|[0-9]+),\s*(?:name=(?P<name>[^,]*),\s*)?)?(?P<msg>.*)"
)
_CODE = lazy_re(r"[0-9]{1,6}", re.ASCII)
_CHANNEL = lazy_re(r"(?:\bCh (?P<ch>[0-9a-fA-F]{8})\b|\bchannel (?P<ch2>0x[0-9a-fA-F]+))")
_CAUSED_BY = lazy_re(r"caused by previous Xid (\d+)")
_GPC = lazy_re(r"\(GPC (\d+), TPC (\d+), SM (\d+)\)")
_PLUGIN_XID = lazy_re(r"XidCriticalError: Xid=(?P<xid>[0-9]{1,6}) on Device=(?P<dev>[^,\s]+),")


def _xid_found(code: int, fields: dict, message: str) -> Found:
    info = catalog.lookup(code)
    if code == 154:
        change = catalog.parse_xid154(message)
        if change is not None:
            fields["recovery_action_from"] = change[0].code
            fields["recovery_action_to"] = change[1].code
            fields["recovery_action"] = change[1].name
    elif code == 45:
        m = _CAUSED_BY.search(message)
        if m is not None:
            fields["caused_by"] = int(m.group(1))
    elif 144 <= code <= 150:
        dec = catalog.decode_nvlink5(message)
        if dec is not None:
            fields["nvlink_severity"] = dec.pop("severity")
            fields.update({("nvlink_" + k if k in ("unit", "fatal") else k): v for k, v in dec.items()})
    elif code in (63, 64) and ("reset gpu to activate" in message.lower() or "to activate" in message.lower()):
        fields["remap_pending"] = True  # Ampere+ "reset gpu to activate", pre-Ampere "reload the driver to activate"
    elif code == 13:
        m = _GPC.search(message)
        if m is not None:
            fields.update(gpc=int(m.group(1)), tpc=int(m.group(2)), sm=int(m.group(3)))
    if _SPECIAL.isdisjoint(fields):
        sev, diagnosis = _plain_verdict(code)
    else:
        sev, diagnosis = _verdict(code, fields, info)
    fields["catalog_severity"] = sev
    return Found("xid", fields, catalog.event_severity(sev), diagnosis)


# Fields that refine an Xid's verdict; without them the verdict is the code's alone (and cached).
_SPECIAL = frozenset(("recovery_action_to", "caused_by", "nvlink_severity", "nvlink_unit", "remap_pending"))


@functools.lru_cache(maxsize=2048)  # the verdict of a code without refining fields: the same on every line
def _plain_verdict(code: int) -> tuple[str, str]:
    return _verdict(code, {}, catalog.lookup(code))


def _verdict(code: int, fields: dict, info: catalog.XidInfo) -> tuple[str, str]:
    """(catalog severity, diagnosis) of one Xid line."""
    sev = catalog.xid_severity(code, fields)
    diagnosis = f"Xid {code} {info.name}: {info.meaning} [{info.category}]. "
    if code == 154 and "recovery_action_to" in fields:
        act = catalog.recovery_action(fields["recovery_action_to"])
        diagnosis += f"Authoritative driver recovery action: {act.name}. {act.action}"
    elif code == 45 and "caused_by" in fields:
        diagnosis += f"Sympathetic: caused by Xid {fields['caused_by']}; act on that one."
    elif 144 <= code <= 150 and "nvlink_unit" in fields:
        kind = "fatal" if fields["nvlink_fatal"] else "non-fatal"
        diagnosis += f"NVLink5 {fields['nvlink_unit']} {kind} on link {fields['link']}. "
        diagnosis += catalog.lookup(code).action if sev == "reset" else "Watch for repeats on the same link."
    else:
        diagnosis += info.action
    if fields.get("remap_pending"):
        diagnosis += (
            " A row remap is pending until the GPU is reset: reset it at a convenient time (repeats after reset: RMA)."
        )
    if not info.known:
        diagnosis = f"Xid {code}: not in the catalog; needs review (never treated as healthy)."
    return sev, diagnosis


def _xid(text: str, line_no: int, state: ParseState) -> Found | None:
    if "NVRM: Xid" not in text:
        return None
    m = _XID.search(text)
    if m is None:
        return None
    raw = m["xid"]
    if _CODE.fullmatch(raw) is None:
        return _unreadable_xid(raw, m, text)
    if not text[m.end("xid") :].strip():
        # Every driver format puts a comma after the code: a line that ends right after its digits
        # may have been cut there ("...): 1" of 145), so its code is not trusted.
        return _unreadable_xid(raw, m, text, truncated=True)
    code = int(raw)
    pid = m["pid"]
    name = (m["name"] or "").strip()
    message = m["msg"].strip()
    fields: dict = {
        "xid": code,
        "pci_bus_id": normalize_pci(m["pci"]),
        "pid": int(pid) if pid and pid.isdigit() else None,
        "process": name if name and name != "<unknown>" else None,
        "name": catalog.lookup(code).name,
        "message": message[:500],
    }
    ch = _CHANNEL.search(message)
    if ch is not None:
        fields["channel"] = int(ch["ch"], 16) if ch["ch"] else int(ch["ch2"], 16)
    return _xid_found(code, fields, message)


def _unreadable_xid(raw: str, m: re.Match[str], text: str, truncated: bool = False) -> Found:
    fields: dict = {
        "xid": None,
        "xid_raw": raw[:40],
        "pci_bus_id": normalize_pci(m["pci"]),
        "pid": int(m["pid"]) if m["pid"] and m["pid"].isdigit() else None,
        "process": (m["name"] or "").strip() or None,
        "name": "UNREADABLE",
        "message": m["msg"].strip()[:500],
        "catalog_severity": "review",
    }
    why = "ends the line, which may be cut there" if truncated else "is not a code gpuguard can read (1-6 ASCII digits)"
    return Found(
        "xid",
        fields,
        "warning",
        f"Xid code {raw[:40]!r} {why}: needs review by an operator (never treated as healthy).",
    )


def _plugin_xid(text: str, line_no: int, state: ParseState) -> Found | None:
    """NVIDIA k8s-device-plugin's report of an Xid (the GPU UUID, no PCI address)."""
    m = _PLUGIN_XID.search(text)
    if m is None:
        return None
    code = int(m["xid"])
    fields: dict = {
        "xid": code,
        "pci_bus_id": None,
        "pid": None,
        "process": None,
        "name": catalog.lookup(code).name,
        "gpu_uuid": m["dev"],
        "reporter": "k8s-device-plugin",
    }
    return _xid_found(code, fields, "")


_SXID = lazy_re(
    r"SXid \((?:PCI:)?(?P<pci>"
    + _PCI
    + r")\):\s*(?P<sxid>[0-9]{1,6}),\s*(?:(?P<sev>Fatal|Non-fatal|Nonfatal),\s*)?(?P<msg>.*)"
)


def _sxid(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _SXID.search(text)
    if m is None:
        return None
    fatal = m["sev"] == "Fatal"
    fields = {
        "sxid": int(m["sxid"]),
        "pci_bus_id": normalize_pci(m["pci"]),
        "fatal": fatal,
        "message": m["msg"].strip()[:500],
    }
    diag = f"NVSwitch SXid {fields['sxid']} ({'fatal' if fatal else 'non-fatal'}): see the Fabric Manager user guide. "
    diag += (
        "A fatal NVSwitch error takes down the NVLink partition: drain the node, reset the GPUs/"
        "NVSwitches (or restart the VM) and check the link."
        if fatal
        else "Watch for repeats on the same link."
    )
    return Found("sxid", fields, "critical" if fatal else "warning", diag)


_GPU_LOST_LINE = lazy_re(r"GPU (?:at )?(?:PCI:)?(?P<pci>" + _PCI + r"):? (?:GPU )?has fallen off the bus")
_GPU_NAMED = lazy_re(r"NVRM: The NVIDIA GPU (?P<pci>" + _PCI + r")\b")
_GPU_IS_LOST = lazy_re(r"device handle for GPU ?(?P<pci>[0-9A-Fa-f:.]+): GPU is lost")
_LOST_DIAG = (
    "GPU lost: it fell off the PCIe bus (treated as Xid 79). Drain the node and reboot; if it "
    "repeats, check power, seating, cooling and SBIOS, then RMA."
)


def _gpu_named(text: str, line_no: int, state: ParseState) -> Found | None:
    """First line of the multi-line fallen-off-bus message: remember which GPU it names."""
    m = _GPU_NAMED.search(text) if "The NVIDIA GPU" in text else None
    if m is None:
        return None
    timestamp, uptime = line_time(text, state.year)
    state.named_gpu = (normalize_pci(m["pci"]), line_no, timestamp, uptime)
    return ABSORBED


def _gpu_lost(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _GPU_LOST_LINE.search(text) or _GPU_IS_LOST.search(text)
    fields: dict = {"pci_bus_id": normalize_pci(m["pci"]) if m else None}
    timestamp = None
    if m is None:
        if "fallen off the bus" not in text:
            return None
        named = state.named_gpu
        if named is not None and 0 < line_no - named[1] <= 3:
            fields["pci_bus_id"] = named[0]
            timestamp = named[2]
            if named[3] is not None:
                fields["uptime_s"] = named[3]
            state.named_gpu = None
    fields["source_form"] = "nvidia-smi" if "GPU is lost" in text else "kernel"
    return Found("gpu_lost", fields, "critical", _LOST_DIAG, timestamp=timestamp)


_IDENTITY = lazy_re(r"NVRM: GPU at (?:PCI:)?(?P<pci>" + _PCI + r"):\s+(?P<uuid>GPU-[0-9A-Za-z-]+)")
_SERIAL = lazy_re(r"NVRM: GPU Board Serial Number: (?P<serial>\S+)")


def _identity(text: str, line_no: int, state: ParseState) -> Found | None:
    if "NVRM: GPU" not in text:
        return None
    m = _IDENTITY.search(text)
    if m is not None:
        pci = normalize_pci(m["pci"])
        state.identity = (pci, line_no)
        return Found(
            "gpu_identity",
            {"pci_bus_id": pci, "uuid": m["uuid"]},
            "info",
            "GPU identity printed before its first Xid since boot (maps PCI address to UUID).",
        )
    m = _SERIAL.search(text)
    if m is not None:
        pci = state.identity[0] if state.identity and 0 < line_no - state.identity[1] <= 2 else None
        return Found(
            "gpu_identity", {"pci_bus_id": pci, "serial": m["serial"]}, "info", "GPU board serial number (for an RMA)."
        )
    return None


_RESET_REQUIRED = lazy_re(r"NV_ERR_RESET_REQUIRED|NVRM: .*Reset required")  # not other drivers' resets
_GPU_INDEX = lazy_re(r"\bGPU(\d+)\b")


def _reset_required(text: str, line_no: int, state: ParseState) -> Found | None:
    if _RESET_REQUIRED.search(text) is None:
        return None
    m = _GPU_INDEX.search(text)
    fields = {"gpu_index": int(m.group(1)) if m else None, "message": text.strip()[:500]}
    return Found(
        "gpu_reset_required",
        fields,
        "critical",
        "The driver needs a GPU reset (NV_ERR_RESET_REQUIRED) before the GPU works again; "
        "CUDA reports 'busy or unavailable'. Drain the GPU and reset it (nvidia-smi -r).",
    )


_HUNG = lazy_re(r"task (?P<task>\S+?):(?P<pid>\d+) blocked for more than (?P<s>\d+) seconds")


def _hung_task(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _HUNG.search(text)
    if m is None:
        return None
    return Found(
        "hung_task",
        {"task": m["task"], "pid": int(m["pid"]), "blocked_s": int(m["s"])},
        "warning",
        "A task is stuck in uninterruptible sleep (D state). After Xid 45/119 bursts, nvidia-smi/NVML calls "
        "hang like this: health probes must time out; a reboot clears it.",
    )


# --- GPU faults without an Xid --------------------------------------------------------------------

_INIT_FAILED = lazy_re(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>" + _PCI + r"):\s*(?P<what>RmInitAdapter failed!?|rm_init_adapter failed)"
    r"(?:\s*\((?P<code>[^)]*)\))?(?:, device minor number (?P<minor>[0-9]+))?"
)
_ATTACH = lazy_re(r"[Cc]annot attach (?:gpu|GPU)(?:\s+(?:at\s+)?(?:PCI:)?(?P<pci>" + _PCI + r"))?")
_HANDLE_UNKNOWN = lazy_re(r"device handle for GPU ?(?P<pci>[0-9A-Fa-f:.]+): (?P<err>Unknown Error|[^.]*)")


def _fault(name: str, fields: dict, severity: str | None = None, diagnosis: str | None = None) -> Found:
    info = gpu_faults.fault(name)
    fields = {"fault": name, **fields}
    return Found(
        "gpu_fault",
        fields,
        severity or catalog.event_severity(info.severity),
        diagnosis or f"{info.name}. {info.action}",
    )


_INIT_WORDS = ("nit_adapter", "nitAdapter", "annot attach", "No devices were found", "device handle for GPU")


def _init_failed(text: str, line_no: int, state: ParseState) -> Found | None:
    if not any(w in text for w in _INIT_WORDS):  # the shared `NVRM: ` marker: most lines are none of these
        return None
    m = _INIT_FAILED.search(text)
    if m is not None:
        fields: dict = {"pci_bus_id": normalize_pci(m["pci"]), "message": text.strip()[-300:]}
        if m["code"]:
            fields["init_code"] = m["code"]
        if m["minor"]:
            fields["minor"] = int(m["minor"])
        return _fault("init_failed", fields)
    m = _ATTACH.search(text)
    if m is not None:
        return _fault("init_failed", {"pci_bus_id": normalize_pci(m["pci"]), "message": text.strip()[-300:]})
    if "No devices were found" in text:
        return _fault("init_failed", {"pci_bus_id": None, "message": "nvidia-smi: No devices were found"})
    m = _HANDLE_UNKNOWN.search(text)
    if m is not None and "GPU is lost" not in text:
        return _fault("unreachable", {"pci_bus_id": normalize_pci(m["pci"]), "error": m["err"].strip()[:200]})
    return None


# PCIe Advanced Error Reporting, from the GPU (`nvidia <pci>:`) or the port above it (`pcieport <pci>:`).
_AER_DEV = lazy_re(
    r"(?:^|[\s\]])(?P<drv>nvidia|pcieport) (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]):"
)
_AER_SEV = lazy_re(
    r"(?:severity=)?(?P<sev>Uncorrected \(Fatal\)|Uncorrectable \(Fatal\)|Uncorrected \(Non-Fatal\)|"
    r"Uncorrectable \(Non-Fatal\)|Corrected|Correctable)"
)
_AER_SOURCE = lazy_re(
    r"(?:error received|error message received from):? (?P<src>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])"
)
_AER_FAILED = lazy_re(r"AER: (?:can't recover|device recovery failed)|has no AER-aware driver")


def _aer(text: str, line_no: int, state: ParseState) -> Found | None:
    d = _AER_DEV.search(text)
    if d is None:
        return None  # another device (audio function, USB, NIC): not a GPU or its port
    m = _AER_SEV.search(text, d.end())
    failed = _AER_FAILED.search(text, d.end()) is not None
    if m is None and not failed:
        return None
    sev = m["sev"].lower() if m else ""
    fault = (
        "pcie_fatal"
        if "fatal" in sev and "non-fatal" not in sev
        else "pcie_nonfatal"
        if "non-fatal" in sev
        else "pcie_corrected"
        if sev
        else "pcie_fatal"
        if "recovery failed" in text or "can't recover" in text
        else "pcie_corrected"
    )
    if "has no AER-aware driver" in text:
        fault = "pcie_fatal" if state.aer_fatal_line and 0 < line_no - state.aer_fatal_line <= 12 else ""
        if not fault:
            return None
    if fault == "pcie_fatal":
        state.aer_fatal_line = line_no
    fields: dict = {"pci_bus_id": d["pci"].lower(), "device": "gpu" if d["drv"] == "nvidia" else "port"}
    below = state.bridges.get(fields["pci_bus_id"])
    if below is not None and fields["device"] == "port":
        fields["buses_below"] = [below[0], below[1]]  # the judge maps them to the GPU there
    src = _AER_SOURCE.search(text)
    if src is not None:
        fields["error_source"] = src["src"].lower()
    if failed:
        fields["recovery_failed"] = True
    return _fault(fault, fields)


_BRIDGE = lazy_re(
    r"pci (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): PCI bridge to \[bus (?P<lo>[0-9a-fA-F]{2})(?:-(?P<hi>[0-9a-fA-F]{2}))?\]"
)


def _bridge(text: str, line_no: int, state: ParseState) -> Found | None:
    """Boot-time topology (`pci 0000:3a:00.0: PCI bridge to [bus 3b]`): which buses sit below a port, so an
    AER error on the port can name the GPU below it. Not an event."""
    m = _BRIDGE.search(text)
    if m is None:
        return None
    lo = int(m["lo"], 16)
    state.bridges[m["pci"].lower()] = (lo, int(m["hi"], 16) if m["hi"] else lo)
    return ABSORBED


# GSP firmware (Turing+ open and proprietary drivers): the driver names the GPU by its index, not its PCI
# address (`NVRM: GPU6 _kgspIsHeartbeatTimedOut: ...`); very old lines name no GPU at all.
_GSP = lazy_re(r"NVRM: (?:GPU(?P<idx>\d+) )?(?P<fn>_?k[a-zA-Z]+_?\w*): (?P<msg>.*)")
_GSP_TIMEOUT = lazy_re(r"[Hh]eartbeat timed out|\*+ ?GSP Timeout ?\*+|Timeout (?:after \d+s of )?waiting for RPC")
_MEMSYS = lazy_re(r"Memory Subsystem Error detected")


def _gsp(text: str, line_no: int, state: ParseState) -> Found | None:
    """GSP heartbeat / RPC timeouts and memory-subsystem errors a GPU reports without an Xid line."""
    if "kgsp" not in text and "kgmmu" not in text:  # most NVRM lines: no regex needed
        return None
    m = _GSP.search(text)
    if m is None:
        return None
    msg = m["msg"]
    if _MEMSYS.search(msg) is not None:
        name = "memsys_error"
    elif _GSP_TIMEOUT.search(msg) is not None:
        name = "gsp_timeout"
    else:
        return None
    fields = {
        "pci_bus_id": None,
        "gpu_index": int(m["idx"]) if m["idx"] is not None else None,
        "function": m["fn"],
        "message": msg.strip()[:300],
    }
    return _fault(name, fields)


# Mellanox / NVIDIA ConnectX (mlx5) driver errors: memory registration and firmware commands.
_MLX5 = lazy_re(
    r"(?:(?:infiniband|mlx5_core) (?P<dev>[\w.:-]+): )?(?P<fn>create_mkey_callback|mlx5_cmd_check|mlx5_cmd_out_err)"
    r"[:\d]*:?\(pid (?P<pid>\d+)\): (?P<msg>.*)"
)
_MLX5_STATUS = lazy_re(r"status (?:[a-z ]+\()?(?P<st>-?(?:0x)?[0-9a-f]+)\)?")
_ERRNO = {-12: "ENOMEM", -22: "EINVAL", -5: "EIO", -110: "ETIMEDOUT", -16: "EBUSY"}


def _mlx5(text: str, line_no: int, state: ParseState) -> Found | None:
    """A NIC that could not register memory (`async reg mr failed`) or refused a firmware command: job-level
    network evidence (NCCL / UCX over InfiniBand or RoCE), never a GPU verdict."""
    m = _MLX5.search(text)
    if m is None or ("failed" not in m["msg"] and "error" not in m["msg"]):
        return None
    st = _MLX5_STATUS.search(m["msg"])
    status = int(st["st"], 0) if st is not None else None
    fields = {
        "device": m["dev"],
        "function": m["fn"],
        "pid": int(m["pid"]),
        "mlx5_status": status,
        "errno": _ERRNO.get(status) if status is not None else None,
        "message": m["msg"].strip()[:300],
    }
    if "reg mr" in m["msg"] or "mkey" in m["msg"]:
        advice = (
            "The NIC could not register (pin) memory for RDMA"
            + (" (ENOMEM: out of memory-translation resources or the locked-memory limit)" if status == -12 else "")
            + ": check `ulimit -l` inside the job (memlock unlimited), the number of registered regions "
            "(NCCL_IB / UCX buffer settings) and GPUDirect RDMA (nvidia-peermem). Job-level network "
            "evidence, not a GPU fault."
        )
    else:
        advice = (
            "A ConnectX firmware command failed: see the syndrome in the NIC driver documentation; if RDMA "
            "transfers fail with it, check the NIC's firmware and driver (OFED) versions. Not a GPU fault."
        )
    return Found("nic_error", fields, "warning", advice)


_FM = lazy_re(r"fabric ?manager", re.I)
_FM_FAILED = lazy_re(r"fail|error|FAILURE|exited", re.I)


def _fabric(text: str, line_no: int, state: ParseState) -> Found | None:
    if _FM.search(text) is None or _FM_FAILED.search(text) is None:
        return None
    fields = {"pci_bus_id": None, "message": text.strip()[-300:]}
    if "NV_WARN_NOTHING_TO_DO" in text:
        return _fault(
            "fabric_manager",
            fields,
            "info",
            "Fabric Manager found no NVSwitch (NV_WARN_NOTHING_TO_DO): this system has none, so Fabric Manager is "
            "not needed; disable the service. On an HGX/DGX system it means the NVSwitch driver sees no switches.",
        )
    return _fault("fabric_manager", fields)


RULES: tuple[Rule, ...] = (
    # One shared `NVRM: ` marker for the driver's rules (the marker scan holds at most 64 patterns)
    Rule(("NVRM: ",), _xid),
    Rule(("XidCriticalError",), _plugin_xid),
    Rule(("SXid",), _sxid),
    Rule(("NVRM: ",), _gpu_named),
    Rule(("fallen off the bus", "GPU is lost"), _gpu_lost),
    # Markers chosen for the fast scanner: few and shared ones. The Aho-Corasick SIMD prefilter takes at
    # most 64 patterns: one marker past that makes `gpu-doctor logs` ~2x slower (bench/logs.py).
    Rule(("NVRM: ", "No devices were found", "device handle for GPU", "annot attach"), _init_failed),
    Rule(("NVRM: ",), _identity),
    Rule(("NVRM: ",), _gsp),
    Rule(("AER: ", "PCIe Bus Error", "AER-aware"), _aer),
    Rule(("abric",), _fabric),
    Rule(("PCI bridge to",), _bridge),
    Rule(("NV_ERR_RESET_REQUIRED", "Reset required"), _reset_required),
    Rule(("blocked for more than",), _hung_task),
    Rule(("mlx5",), _mlx5),
)
