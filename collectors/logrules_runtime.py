"""Rules for the process side: torchrun agent events, rendezvous, CUDA errors, host-level problems.

Why: a torchrun summary says *which* worker died and how (exit code, signal), CUDA errors say whether
the GPU or the program is at fault, and rendezvous errors say the job cannot even form. Formats:
docs/log-formats.md, "Launcher and process lines" (old `ERROR:torch.distributed...`, 2024
`[...] torch.distributed...: [ERROR]`, glog-style, launcher prefixes) and the real logs.
"""

from __future__ import annotations

import signal as _signal
from typing import Any

from gpuguard.collectors.logrule import ABSORBED, Found, ParseState, Rule, hw_fault, lazy_re
from gpuguard.collectors.logrules_comm import rank_of
from gpuguard.foundation import gpu_faults
from gpuguard.foundation import xid_catalog as catalog


def signal_name(exitcode: int | None) -> str | None:
    """torchrun reports death by signal N as exit code -N."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return _signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


def _exit_diagnosis(exitcode: int | None, sig: str | None) -> str:
    if sig == "SIGABRT":
        return (
            "Worker aborted (SIGABRT): usually a C++ abort - the ProcessGroupNCCL watchdog after a collective "
            "timeout or CUDA error. The cause is in that rank's own log."
        )
    if sig == "SIGKILL":
        return "Worker killed (SIGKILL): host OOM killer or an external kill; check `dmesg` for oom-kill and host RAM."
    if sig == "SIGSEGV":
        return "Worker crashed (SIGSEGV): native crash in an extension, driver or library."
    if sig in ("SIGTERM", "SIGINT"):
        return "Worker terminated by the agent or an operator (usually after a sibling failed first)."
    if exitcode == 1:
        return "Worker raised a Python exception: the traceback is in that rank's log (or its error_file with @record)."
    return f"Worker exited with code {exitcode}."


_FAILED = lazy_re(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<lr>\d+) \(pid: (?P<pid>\d+)\)(?: of binary: (?P<bin>.*))?"
)
# ChildFailedError summary records (launchers may prefix them, e.g. `[default0]:`).
_SUM_RANK = lazy_re(r"(?:^|[\s:])rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<lr>\d+)\)")
_SUM_HOST = lazy_re(r"(?:^|[\s:])host\s+:\s*(?P<host>\S+)")
_SUM_EXIT = lazy_re(r"(?:^|[\s:])exitcode\s*:\s*(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)")


def _worker_failure(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _FAILED.search(text)
    if m is not None:
        code = int(m["code"])
        sig = signal_name(code)
        fields: dict[str, Any] = {
            "local_rank": int(m["lr"]),
            "exitcode": code,
            "signal": sig,
            "pid": int(m["pid"]),
            "binary": (m["bin"] or "").strip() or None,
        }
        return Found("worker_failure", fields, "warning", _exit_diagnosis(code, sig))
    m = _SUM_EXIT.search(text)
    if m is not None:
        code = int(m["code"])
        sig = signal_name(code)
        fields = {"local_rank": None, "exitcode": code, "signal": sig, "pid": int(m["pid"]), "summary": True}
        if state.summary and 0 < line_no - state.summary_line <= 4:
            fields.update({k: v for k, v in state.summary.items()})
        if state.root_cause_line and 0 < line_no - state.root_cause_line <= 8:
            fields["root_cause"] = True
            state.root_cause_line = 0  # one record per "Root Cause" header
        state.summary = {}
        return Found("worker_failure", fields, "warning", _exit_diagnosis(code, sig))
    m = _SUM_RANK.search(text)
    if m is not None:
        state.summary = {
            **(
                {"host": state.summary["host"]}
                if "host" in state.summary and 0 < line_no - state.summary_line <= 2
                else {}
            ),
            "rank": int(m["rank"]),
            "local_rank": int(m["lr"]),
        }
        state.summary_line = line_no
        return ABSORBED
    return None


def _summary_host(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _SUM_HOST.search(text)
    if m is None:
        return None
    state.summary = {"host": m["host"]}
    state.summary_line = line_no
    return ABSORBED


def _root_cause(text: str, line_no: int, state: ParseState) -> Found | None:
    state.root_cause_line = line_no
    return ABSORBED


_CLOSING = lazy_re(r"Sending process (?P<pid>\d+) closing signal (?P<sig>\w+)")


def _worker_stop(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _CLOSING.search(text)
    if m is None:
        return None
    return Found(
        "worker_stop",
        {"pid": int(m["pid"]), "signal": m["sig"]},
        "info",
        f"The torchrun agent stops a worker ({m['sig']}), normally because another worker failed first.",
    )


_RESTART = lazy_re(r"Worker group FAILED\. (?P<left>\d+)/(?P<max>\d+) attempts left; will restart worker group")
_GROUP_FAILED = lazy_re(r"Worker group failed")


def _worker_group(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _RESTART.search(text)
    if m is not None:
        fields = {"attempts_left": int(m["left"]), "max_restarts": int(m["max"])}
        return Found(
            "worker_restart",
            fields,
            "warning",
            f"torchrun restarts the whole worker group ({m['left']}/{m['max']} attempts left): a new "
            "incarnation of every rank; state must come from the last committed checkpoint.",
        )
    if _GROUP_FAILED.search(text):
        return Found("worker_group_failed", {}, "warning", "The torchrun worker group failed; see the worker failures.")
    return None


_JOINED = lazy_re(
    r"joined round (?P<round>\d+) of the rendezvous '(?P<rdzv>[^']*)' as rank (?P<rank>\d+) in a world of size (?P<ws>\d+)"
)
_KV = lazy_re(r"\b(?P<k>restart_count|master_addr|master_port|group_rank|group_world_size)=(?P<v>[^\s,]+)")
_KV_INT = {"restart_count", "master_port", "group_rank", "group_world_size"}
_RDZV_ERROR = lazy_re(
    r"Rendezvous(?:Connection|Timeout|Closed|State)?Error|keep-alive heartbeat|\[c10d\] The client socket|"
    r"clients joined|rendezvous.*(?:timed out|failed)"
)
_ENDPOINT = lazy_re(r"connect to (?:\[(?P<h6>[^\]]+)\]|(?P<h>[0-9A-Za-z._-]+)):(?P<port>\d+)")
_ERRNO = lazy_re(r"errno: (?P<n>\d+) - (?P<msg>[^)]*)")


def kv_fields(text: str) -> dict:
    out: dict = {}
    for m in _KV.finditer(text):
        v = m["v"]
        out[m["k"]] = int(v) if m["k"] in _KV_INT and v.isdigit() else v
    return out


def _rendezvous(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _RDZV_ERROR.search(text)
    if m is not None:
        fields: dict = {"error": text.strip()[-500:]}
        ep = _ENDPOINT.search(text)
        if ep is not None:
            fields["endpoint"] = f"{ep['h6'] or ep['h']}:{ep['port']}"
        en = _ERRNO.search(text)
        if en is not None:
            fields["errno"] = int(en["n"])
        return Found(
            "rendezvous_error",
            fields,
            "warning",
            "Rendezvous/TCPStore failure: the store endpoint is unreachable (wrong MASTER_ADDR, host name resolving "
            "to a bogus address, firewall, or the agent on node 0 is gone). Check the endpoint from every node.",
        )
    m = _JOINED.search(text)
    if m is not None:
        fields = {
            "phase": "joined",
            "round": int(m["round"]),
            "rendezvous": m["rdzv"],
            "group_rank": int(m["rank"]),
            "group_world_size": int(m["ws"]),
        }
        return Found(
            "rendezvous", fields, "info", f"Rendezvous round {m['round']}: this node joined as rank {m['rank']}."
        )
    if "Rendezvous complete for workers" in text:
        found = Found(
            "rendezvous",
            {"phase": "complete", **kv_fields(text)},
            "info",
            "Rendezvous completed; the worker group starts (restart_count = the agent's restart round).",
        )
        state.pending = (line_no, text, found)
        return ABSORBED
    if "Rendezvous'ing worker group" in text:
        return Found("rendezvous", {"phase": "start"}, "info", "The torchrun agent starts a rendezvous round.")
    return None


def _rendezvous_kv(text: str, line_no: int, state: ParseState) -> Found | None:
    """`restart_count=0`, `group_rank=0`... lines that complete a pending `Rendezvous complete` event."""
    if state.pending is None:
        return None
    kv = kv_fields(text)
    if not kv:
        return None
    state.pending[2].fields.update(kv)
    return ABSORBED


# --- CUDA -------------------------------------------------------------------------------------------

_CUDA_PATTERNS = (
    lazy_re(r"cuda runtime error \((?P<code>\d+)\) : (?P<err>.*?)(?: at \S+:\d+)?\s*$"),
    lazy_re(r"CUDA error: (?P<err>.*?)\s*$"),
    lazy_re(r"failed to initialize CUDA: (?P<err>.*?)\s*$"),
    lazy_re(r"Triton Error \[CUDA\]: (?P<err>.*?)\s*$"),
    lazy_re(r"Cuda failure (?:(?P<code>\d+) )?'(?P<err>[^']*)'"),
    lazy_re(r"(?P<err>CUDA-capable device\(s\) is/are busy or unavailable|no CUDA-capable device is detected)"),
    lazy_re(r"CUDA_ERROR_(?P<err>[A-Z_]+)"),
    lazy_re(r"(?P<err>CUDA out of memory)"),
)
# (substring of the error, CUDA runtime code, severity, diagnosis)
_CUDA_KINDS = (
    (
        "ecc",
        214,
        "critical",
        "Uncorrectable ECC error: GPU memory hardware. Check Xid 48/94/95, NVML remapped rows and "
        "retired pages; drain the GPU and reset it; repeats mean RMA. (Other ranks then fail with timeouts.)",
    ),
    (
        "illegal memory access",
        700,
        "warning",
        "Illegal memory access: a kernel bug in the application or a library (not "
        "hardware unless Xid 31/13 repeat on the same GPU). Restart with CUDA_LAUNCH_BLOCKING=1 to locate it.",
    ),
    (
        "unspecified launch failure",
        719,
        "warning",
        "A kernel crashed: correlate with Xid 13/31/43/109 on this GPU "
        "(Xid 109 = context-switch timeout, driver/host-memory interaction).",
    ),
    (
        "busy or unavailable",
        46,
        "warning",
        "The GPU is in exclusive-process mode and in use, or stuck needing a reset "
        "(NV_ERR_RESET_REQUIRED in dmesg): then drain and reset it.",
    ),
    (
        "no cuda-capable device",
        100,
        "warning",
        "No GPU visible: CUDA_VISIBLE_DEVICES, a missing driver, or the GPU was "
        "lost (check `nvidia-smi` and dmesg for 'fallen off the bus').",
    ),
    (
        "unknown error",
        999,
        "critical",
        "CUDA 'unknown error': the GPU or driver is in a bad state; reset the GPU or reboot.",
    ),
    (
        "out of memory",
        2,
        "warning",
        "GPU out of memory: the workload's footprint (batch size, fragmentation), not hardware.",
    ),
    ("launch timed out", 702, "warning", "Kernel ran too long (display watchdog or hang)."),
    (
        "device-side assert",
        710,
        "warning",
        "Device-side assertion in a kernel (e.g. an index out of range): application bug.",
    ),
)


def _cuda(text: str, line_no: int, state: ParseState) -> Found | None:
    for pattern in _CUDA_PATTERNS:
        m = pattern.search(text)
        if m is not None:
            break
    else:
        return None
    err = m["err"].strip().rstrip(".")
    if pattern.pattern.startswith("CUDA_ERROR_"):
        err = "CUDA_ERROR_" + err
    if not err:
        return None
    low = err.lower().replace("_", " ")
    fields: dict = {"error": err[:300], "rank": rank_of(text)}
    code = m.groupdict().get("code")
    if code:
        fields["cuda_code"] = int(code)
    severity, diag = "warning", f"CUDA error: {err[:200]}."
    for needle, rt_code, sev, text_ in _CUDA_KINDS:
        if needle in low:
            severity, diag = sev, text_
            fields.setdefault("cuda_code", rt_code)
            break
    fault = hw_fault(err) or ("unknown_error" if "unknown error" in low else None)
    if fault is not None:
        info = gpu_faults.fault(fault)
        fields["fault"] = fault
        severity = catalog.event_severity(info.severity)
        diag = f"{info.name}. {info.action}"
    if "watchdog" in text:
        fields["via_watchdog"] = True
    return Found("cuda_error", fields, severity, diag)


# --- host-level lines that explain GPU job failures ------------------------------------------------------

_NVML = lazy_re(r"Failed to initialize NVML: (?P<err>.*)")
_HW_SEVERITY = lazy_re(r"\[Hardware Error\]:\s+event severity: (?P<sev>\w+)")
_PCIE = lazy_re(
    r"(?P<pci>[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]): (?P<avail>[\d.]+ Gb/s) available PCIe bandwidth, limited by "
    r"(?P<lim>.*?) link at (?P<at>\S+) \(capable of (?P<cap>[\d.]+ Gb/s)"
)


def _host(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _NVML.search(text)
    if m is not None:
        err = m["err"].strip()
        mismatch = "mismatch" in err
        return Found(
            "driver_error",
            {"error": err[:300]},
            "critical" if mismatch else "warning",
            "Kernel module and user-space NVIDIA libraries differ: compare /proc/driver/nvidia/version with "
            "the installed packages; fix the packages and reload the module (or reboot)."
            if mismatch
            else "NVML cannot start: driver not loaded or not accessible.",
        )
    m = _HW_SEVERITY.search(text)
    if m is not None:
        sev = m["sev"].lower()
        return Found(
            "host_hw_error",
            {"hw_severity": sev},
            "critical" if sev == "fatal" else "warning",
            "Host hardware error reported by APEI/GHES (e.g. host DRAM ECC): a host problem, not the GPU; "
            "check the record's section type and the BMC/SEL.",
        )
    m = _PCIE.search(text)
    if m is not None:
        fields = {"pci_bus_id": m["pci"], "available": m["avail"], "capable": m["cap"], "limited_at": m["at"]}
        return Found(
            "pcie_degraded",
            fields,
            "info",
            f"PCIe link below its capability ({m['avail']} of {m['cap']}), limited at {m['at']}: a platform/"
            "topology fact (switch or slot), not a fault; compare with NVML current vs max link gen/width.",
        )
    if "UCX" in text and "max locked memory" in text:
        return Found(
            "config_error",
            {"error": text.strip()[-300:]},
            "warning",
            "Locked-memory limit too low for RDMA (UCX): set `ulimit -l unlimited` for the job.",
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule(("exitcode", "local_rank"), _worker_failure),
    Rule(("host      :",), _summary_host),
    Rule(("Root Cause (first observed failure)",), _root_cause),
    Rule(("closing signal",), _worker_stop),
    Rule(("orker group",), _worker_group),
    Rule(("endezvous", "[c10d]", "clients joined"), _rendezvous),
    Rule(("restart_count=", "master_addr=", "master_port=", "group_rank=", "group_world_size="), _rendezvous_kv),
)

# A CUDA kernel's own assertion, as the device prints it (PyTorch ATen, Triton, user kernels):
# `<file>:<line>: <kernel>: block: [x,y,z], thread: [x,y,z] Assertion `<condition>` failed.`
_ASSERT = lazy_re(
    r"(?:(?P<file>(?:[A-Za-z]:)?[^\s:]+\.(?:cu|cuh|cpp|h|py)):(?P<line>\d+): )?(?:(?P<kernel>[\w<>, ]+?): )?"
    r"block: \[(?P<block>[\d, ]+)\], thread: \[(?P<thread>[\d, ]+)\] Assertion `(?P<cond>.*)` failed"
)


def _cuda_assert(text: str, line_no: int, state: ParseState) -> Found | None:
    """A device-side assertion: the application's inputs (an index or a label out of range), not the GPU."""
    m = _ASSERT.search(text)
    if m is None:
        return None
    fields: dict[str, Any] = {
        "file": m["file"],
        "source_line": int(m["line"]) if m["line"] else None,
        "kernel": (m["kernel"] or "").strip()[-200:] or None,
        "block": m["block"].replace(" ", ""),
        "thread": m["thread"].replace(" ", ""),
        "condition": m["cond"][:300],
        "rank": rank_of(text[: m.start()]) if "rank" in text[: m.start()].lower() else None,
    }
    where = f" in {fields['kernel']}" if fields["kernel"] else ""
    return Found(
        "cuda_assert",
        fields,
        "warning",
        f"Device-side assertion{where}: `{fields['condition'][:120]}` failed. An application bug or bad input "
        "(an index or a class label out of range), not a GPU fault: the GPU stays usable. Rerun with "
        "CUDA_LAUNCH_BLOCKING=1 to see the Python call that launched the kernel.",
    )


CUDA_RULES: tuple[Rule, ...] = (
    Rule(("] Assertion",), _cuda_assert),
    Rule(
        (
            "cuda runtime error",
            "CUDA error",
            "Triton Error [CUDA]",
            "Cuda failure",
            "CUDA-capable device",
            "CUDA_ERROR_",
            "CUDA out of memory",
        ),
        _cuda,
    ),
)

HOST_RULES: tuple[Rule, ...] = (
    Rule(("Failed to initialize NVML", "[Hardware Error]", "available PCIe bandwidth", "max locked memory"), _host),
)
