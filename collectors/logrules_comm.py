"""Rules for collective-communication lines: NCCL WARN / errors, ProcessGroupNCCL watchdog, gloo.

Why: a collective failure surfaces on every rank, but only some lines name the op, the sequence
number, the rank and the cause; these rules extract exactly those fields so the job vote can compare
ranks. Formats: docs/log-formats.md, "Communication lines" (several PyTorch eras).
"""

from __future__ import annotations

import re

from gpuguard.collectors.logrule import Found, ParseState, Rule, lazy_re

_RANK_IN_PG = lazy_re(r"\bRank (\d+)\]")
_RANK_PREFIX = lazy_re(r"\[rank(\d+)\]:")
_PG = lazy_re(r"\[PG (?:ID )?(?P<pg>\d+)(?: PG GUID (?P<guid>\d+)(?:\((?P<name>[^)]*)\))?)? Rank \d+\]")


def rank_of(text: str) -> int | None:
    """The rank a PyTorch line names: `[Rank 3]` / `[PG 1 Rank 3]` inside, else the `[rank3]:` prefix."""
    m = _RANK_IN_PG.search(text, 0, 4000)
    if m is None:
        m = _RANK_PREFIX.search(text, 0, 200)
    return int(m.group(1)) if m else None


def _pg(text: str) -> dict:
    m = _PG.search(text, 0, 4000)
    if m is None:
        return {}
    out: dict = {"pg": int(m["pg"])}
    if m["name"]:
        out["pg_name"] = m["name"]
    return out


# --- NCCL -------------------------------------------------------------------------------------------

_NCCL_WARN = lazy_re(
    r"(?:(?P<host>[^\s:\[\]|]+):(?P<pid>\d+):(?P<tid>\d+) )?(?:\[(?P<dev>\d+)\] )?"
    r"(?:(?P<file>[\w./-]+):(?P<line>\d+) )?(?:\((?P<func>[^)]*)\) )?NCCL WARN (?P<msg>.*)"
)
_OLD_WARN = lazy_re(  # NCCL 2.2 and older: no `NCCL` token
    r"(?:(?P<host>[^\s:\[\]|]+):(?P<pid>\d+):(?P<tid>\d+) )?(?:\[(?P<dev>\d+)\] )?"
    r"(?P<file>[\w./-]+\.(?:cc|cu|c|h|cpp|hpp)):(?P<line>\d+) WARN (?P<msg>.*)"
)
_IB_STATUS = lazy_re(r"(?:with error |status=)(?P<st>\d+).*?vendor err (?P<vendor>\d+)")
_PEER = lazy_re(r"from peer (?P<peer>[0-9A-Za-z.:_-]+<\d+>)")
IBV_WC_STATUS = {
    0: "SUCCESS",
    1: "LOC_LEN_ERR",
    2: "LOC_QP_OP_ERR",
    3: "LOC_EEC_OP_ERR",
    4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR",
    6: "MW_BIND_ERR",
    7: "BAD_RESP_ERR",
    8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR",
    10: "REM_ACCESS_ERR",
    11: "REM_OP_ERR",
    12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR",
}
_WARN_DIAGNOSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        lazy_re(r"Bootstrap Root : rank \d+ of \d+ ranks has already checked in"),
        "Two processes hold the same rank of one communicator (a rank launched twice, a stale process from an "
        "earlier attempt, or RANK / LOCAL_RANK computed wrongly by the launcher): stop the duplicate and check "
        "the launcher's rank assignment.",
    ),
    (
        lazy_re(r"Bootstrap Root : mismatch in rank count"),
        "The processes disagree on the communicator's size (WORLD_SIZE differs between nodes): check the launch "
        "command on every node.",
    ),
    (
        lazy_re(r"Got async event : port error|async event.*port error"),
        "An InfiniBand port of this node reported a port error: a flapping link or a bad cable. Find the port "
        "(`ibstat`, the kernel log's mlx5 lines), reseat or replace the cable, check the switch port counters "
        "(`ibqueryerrors`).",
    ),
    (
        lazy_re(r"ibv_reg_mr|Cannot allocate memory"),
        "Locked-memory limit too low for RDMA registration: set memlock unlimited (limits.conf, and `ulimit -l` inside the job/mpirun).",
    ),
    (
        lazy_re(r"ibv_create_qp|ibv_create_cq"),
        "InfiniBand verbs resource creation failed: RDMA limits in the container/job (memlock, device access).",
    ),
    (lazy_re(r"ibv_modify_qp.*unreachable"), "RoCE GID/route problem: the NIC cannot reach the peer."),
    (lazy_re(r"Cuda failure.*out of memory|CUDA calloc"), "GPU out of memory while NCCL allocated its buffers."),
    (lazy_re(r"Cuda failure"), "A CUDA call inside NCCL failed: GPU/driver state (999 = reset/reboot the GPU)."),
    (
        lazy_re(r"Connection closed by remote peer|Broken pipe|Connection reset by peer|Connection closed by"),
        "The peer closed the connection: usually a remote rank crashed first (secondary error); find that rank's log.",
    ),
    (
        lazy_re(r"Failed to execute operation"),
        "The NCCL proxy thread failed during connection setup (secondary to a network or peer error).",
    ),
    (
        lazy_re(r"NCCL_SOCKET_IFNAME|no socket interface|neither AF_INET|Address family not supported"),
        "No usable network interface: NCCL_SOCKET_IFNAME names a missing interface or none is usable.",
    ),
    (
        lazy_re(r"Connect to .* failed|connect.* failed"),
        "Cannot connect to a peer: interface selection, firewall or routing.",
    ),
)


def _ib_diagnosis(status: int, vendor: int) -> str:
    name = IBV_WC_STATUS.get(status, f"status {status}")
    if status == 12:
        return (
            f"IB/RoCE work completion IBV_WC_{name} (vendor err {vendor}): transport retries exceeded - the two NICs "
            "cannot talk (link, routing) or the link is very bad. Check the fabric/cables; NCCL_IB_TIMEOUT can help."
        )
    if status == 4:
        return f"IB work completion IBV_WC_{name}: local protection error (GPUDirect RDMA memory registration)."
    if status == 5:
        return f"IB work completion IBV_WC_{name}: the queue pair was already in error (secondary)."
    return f"IB work completion IBV_WC_{name} (vendor err {vendor}): network fabric error."


def _nccl_warn(text: str, line_no: int, state: ParseState) -> Found | None:
    i = text.find("WARN ")
    window = text[max(0, i - 300) :]
    m = _NCCL_WARN.search(window) or _OLD_WARN.search(window)
    if m is None:
        return None
    msg = m["msg"].strip()
    fields: dict = {
        "host": m["host"],
        "pid": int(m["pid"]) if m["pid"] else None,
        "rank": rank_of(text[: max(0, i)]) if "rank" in text[: max(0, i)].lower() else None,
        "device": int(m["dev"]) if m["dev"] else None,
        "location": f"{m['file']}:{m['line']}" if m["file"] else None,
        "message": msg[:1000],
    }
    diag = f"NCCL warning: {msg[:200]} (gpuguard knows no advice for this warning: read it with the lines around it)"
    ib = _IB_STATUS.search(msg)
    if ib is not None and "completion" in msg:
        st, vendor = int(ib["st"]), int(ib["vendor"])
        fields.update(ib_status=st, ib_status_name=IBV_WC_STATUS.get(st), vendor_err=vendor)
        peer = _PEER.search(msg)
        if peer is not None:
            fields["peer"] = peer["peer"]
        diag = _ib_diagnosis(st, vendor)
    else:
        for pattern, text_ in _WARN_DIAGNOSES:
            if pattern.search(msg):
                diag = text_
                break
    return Found("nccl_warn", fields, "warning", diag)


_NCCL_ERROR_IN = lazy_re(r"NCCL error in: (?P<loc>[^,]+), (?P<err>.*?)(?:, NCCL versi(?:on (?P<ver>[\d.]+))?.*)?$")
NCCL_RESULTS = {
    "ncclUnhandledCudaError": 1,
    "ncclSystemError": 2,
    "ncclInternalError": 3,
    "ncclInvalidArgument": 4,
    "ncclInvalidUsage": 5,
    "ncclRemoteError": 6,
    "ncclInProgress": 7,
    "ncclTimeout": 8,
}
_NCCL_RESULT = lazy_re(r"(?<![\w])(?P<res>" + "|".join(NCCL_RESULTS) + r"): (?P<desc>.*)")
_RESULT_DIAGNOSES = {
    1: "A CUDA call inside NCCL failed: check the `Last error` (999 = GPU/driver in a bad state: reset/reboot; OOM at init).",
    2: "A system call or IB verbs call failed, or a remote peer exited: check NCCL WARN lines (memlock, ibv_create_qp, sockets).",
    3: "NCCL internal check failed: often a downstream symptom of a peer failure or bad configuration (e.g. NCCL_SOCKET_IFNAME).",
    4: "Invalid argument passed to NCCL: launch/config error.",
    5: "Invalid NCCL usage (too many async ops, mixing streams in a group...): launch/config error.",
    6: "A remote process exited or the network failed: find the rank that died first, or the IB/RoCE error.",
    7: "NCCL operation still in progress (non-blocking communicator).",
    8: "NCCL operation timed out.",
}
_TEXT_TO_RESULT = {
    "unhandled cuda error": 1,
    "unhandled system error": 2,
    "internal error": 3,
    "invalid argument": 4,
    "invalid usage": 5,
    "remote process exited": 6,
}


def _nccl_error(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _NCCL_ERROR_IN.search(text)
    if m is not None:
        err = m["err"].strip()
        code = next((c for t, c in _TEXT_TO_RESULT.items() if err.startswith(t)), None)
        fields = {
            "error": err[:500],
            "location": m["loc"].strip(),
            "nccl_version": m["ver"],
            "nccl_result": code,
            "rank": rank_of(text),
        }
        diag = _RESULT_DIAGNOSES.get(code or 0, "NCCL error surfaced by PyTorch.")
        return Found("nccl_error", fields, "warning", diag)
    m = _NCCL_RESULT.search(text)
    if m is None:
        return None
    code = NCCL_RESULTS[m["res"]]
    fields = {"error": m["desc"].strip()[:500], "result": m["res"], "nccl_result": code, "rank": rank_of(text)}
    return Found("nccl_error", fields, "warning", _RESULT_DIAGNOSES[code])


# --- PyTorch ProcessGroupNCCL watchdog ----------------------------------------------------------------

_WORK = lazy_re(r"WorkNCCL\((?P<work>.*?)\) (?:ran for (?P<elapsed>\d+) milliseconds|timed out in blocking wait)")
_SEQ = lazy_re(r"SeqNum=(\d+)")
_OP = lazy_re(r"OpType=(\w+)")
_NUMEL_IN = lazy_re(r"NumelIn=(-?\d+)")
_NUMEL_OUT = lazy_re(r"NumelOut=(-?\d+)")
_TIMEOUT = lazy_re(r"Timeout\(ms\)=(\d+)")
_NUMEL_UNKNOWN = 2**64 - 1


def _watchdog_timeout(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _WORK.search(text)
    if m is None:
        return None
    work = m["work"]
    seq, op, nin, nout, tmo = (
        _SEQ.search(work),
        _OP.search(work),
        _NUMEL_IN.search(work),
        _NUMEL_OUT.search(work),
        _TIMEOUT.search(work),
    )
    fields: dict = {
        "seq": int(seq.group(1)) if seq else None,
        "op": op.group(1) if op else None,
        "timeout_ms": int(tmo.group(1)) if tmo else None,
        "elapsed_ms": int(m["elapsed"]) if m["elapsed"] else None,
        "rank": rank_of(text),
    }
    for key, found in (("numel_in", nin), ("numel_out", nout)):
        if found is not None:
            value = int(found.group(1))
            fields[key] = None if value in (_NUMEL_UNKNOWN, -1) else value
    fields.update(_pg(text))
    if m["elapsed"] is None:
        fields["blocking_wait"] = True
    who = f"rank {fields['rank']}" if fields["rank"] is not None else "this rank"
    diag = (
        f"Collective {fields['op']} #{fields['seq']} did not finish within {fields['timeout_ms']} ms on {who}: "
        "a peer is hung, dead or on another code path. Compare SeqNum/OpType across ranks; the earliest "
        "failing host usually shows an Xid/ECC/IB error first."
    )
    if fields["seq"] == 1:
        diag += " SeqNum 1: the first collective never completed - connectivity/topology at setup, not a mid-run hang."
    if fields["elapsed_ms"] and fields["timeout_ms"] and fields["elapsed_ms"] > 2 * fields["timeout_ms"]:
        diag += " It ran far past its timeout: the watchdog itself was stalled."
    return Found("watchdog_timeout", fields, "warning", diag)


_STATUS = (
    lazy_re(
        r"detected by watchdog at work: (?P<seq>\d+), last enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL work: (?P<done>-?\d+)"
    ),
    lazy_re(
        r"Timeout at NCCL work: (?P<seq>\d+), last enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL work: (?P<done>-?\d+)"
    ),
    lazy_re(
        r"failure detected by watchdog at work sequence id: (?P<seq>\d+) PG status: last enqueued work: (?P<enq>-?\d+), last completed work: (?P<done>-?\d+)"
    ),
)


def _watchdog_failure(text: str, line_no: int, state: ParseState) -> Found | None:
    for pattern in _STATUS:
        m = pattern.search(text)
        if m is not None:
            break
    else:
        return None
    fields: dict = {
        "seq": int(m["seq"]),
        "last_enqueued": int(m["enq"]),
        "last_completed": int(m["done"]),
        "rank": rank_of(text),
    }
    fields.update(_pg(text))
    diag = (
        f"Process group stopped at work {fields['seq']} (last completed {fields['last_completed']}): "
        "compare this position across ranks to find the one that fell behind."
    )
    if fields["last_completed"] == -1:
        diag += " No collective ever completed: connectivity/topology problem at setup."
    return Found("watchdog_failure", fields, "warning", diag)


_STUCK = lazy_re(r"watchdog got stuck for (\d+) seconds")
_WORK_QUEUE = lazy_re(r"workMetaList_\.size\(\)=(\d+)")


def _watchdog_hang(text: str, line_no: int, state: ParseState) -> Found | None:
    fields: dict = {"rank": rank_of(text)}
    stuck = _STUCK.search(text)
    if stuck is not None:
        fields["stuck_s"] = int(stuck.group(1))
        fields["reason"] = "watchdog stuck"
    elif "Heartbeat monitor timed out" in text:
        fields["reason"] = "heartbeat monitor timed out"
        q = _WORK_QUEUE.search(text)
        if q is not None:
            fields["queued_work"] = int(q.group(1))
    elif "detected no heartbeat of its watchdog" in text:
        fields["reason"] = "first process group without watchdog heartbeat"
    else:
        return None
    fields.update(_pg(text))
    return Found(
        "watchdog_hang",
        fields,
        "warning",
        "The ProcessGroupNCCL watchdog itself made no progress: a NCCL/CUDA API call hangs (or a thread holds "
        "the GIL inside CUDA). The process will be aborted; a GPU or driver hang on this rank is likely.",
    )


_ABORT = lazy_re(
    r"taking the entire process down|Terminating the process after attempting to dump debug info|"
    r"watchdog thread terminated with(?: exception)?"
)


def _watchdog_abort(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _ABORT.search(text)
    if m is None:
        return None
    return Found(
        "watchdog_abort",
        {"rank": rank_of(text), **_pg(text)},
        "warning",
        "ProcessGroupNCCL is aborting the process (SIGABRT, torchrun exit code -6) after a collective "
        "error/timeout: the cause is in the lines before.",
    )


# --- gloo ---------------------------------------------------------------------------------------------

_GLOO = lazy_re(r"gloo/(?:transport/)?[\w/]+\.(?:cc|h):(?P<line>\d+)\] (?P<msg>.*)")
_GLOO_TIMEOUT = lazy_re(r"Timed out waiting (?P<ms>\d+)ms for (?P<op>recv|send) operation")
_GLOO_PEER = lazy_re(r"(?:by peer|error) \[?(?P<peer>[0-9A-Za-z.:_-]+?)\]?:(?P<port>\d+)")


def _gloo(text: str, line_no: int, state: ParseState) -> Found | None:
    m = _GLOO.search(text)
    if m is None:
        return None
    msg = m["msg"].strip()
    fields: dict = {"error": msg[:500], "rank": rank_of(text)}
    t = _GLOO_TIMEOUT.search(msg)
    if t is not None:
        fields.update(timeout_ms=int(t["ms"]), op=t["op"])
        other = "send" if t["op"] == "recv" else "recv"
        diag = (
            f"gloo {t['op']} timed out after {t['ms']} ms: a peer rank never posted the matching {other} - "
            "it is hung, much slower, or on another code path (straggler/hung rank)."
        )
    elif "Connection closed by peer" in msg or "Connection reset by peer" in msg or "Read error" in msg:
        peer = _GLOO_PEER.search(msg)
        if peer is not None:
            fields["peer"] = f"{peer['peer']}:{peer['port']}"
        diag = "The gloo peer closed or reset the connection: that peer process most likely exited first (secondary)."
    elif "enforce fail" in text or "EnforceNotMet" in text:
        diag = "gloo internal check failed (misuse of async send/recv buffers)."
    else:
        diag = "gloo transport error."
    return Found("gloo_error", fields, "warning", diag)


RULES: tuple[Rule, ...] = (
    Rule(("WorkNCCL",), _watchdog_timeout),
    Rule(("NCCL WARN", " WARN "), _nccl_warn),
    Rule(("NCCL error in",) + tuple(NCCL_RESULTS), _nccl_error),
    Rule(("detected by watchdog", "Timeout at NCCL work"), _watchdog_failure),
    Rule(("watchdog got stuck", "Heartbeat monitor timed out", "no heartbeat of its watchdog"), _watchdog_hang),
    Rule(
        ("taking the entire process down", "Terminating the process after", "watchdog thread terminated"),
        _watchdog_abort,
    ),
    Rule(("gloo",), _gloo),
)
