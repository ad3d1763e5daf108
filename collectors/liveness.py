"""Is a rank's process alive, and how did it end: the process table and torchrun's failure reports.

The process table is read through `foundation.identity` (pid + start time), so a pid the kernel
handed to another process reads as gone. Exit codes come from torchrun's own failure summary in the
launcher's log; communication errors from the `[rankN]:` lines ranks printed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import Iterable

from gpuguard.foundation.identity import process_status
from gpuguard.foundation.observations import ProcessState


def probe_process(pid: int | None, start_time: float | None = None, start_wall: float = 0.0) -> ProcessState:
    """The OS view of a rank's process (psutil; no torch). A reused pid counts as gone.

    `start_time` is the identity the step-log header recorded; logs written before it was recorded
    pass only `start_wall` (the header's wall time), and a process created after it is not the writer.
    """
    if pid is None:
        return ProcessState("unknown", "no pid in the record header")
    status = process_status(pid, start_time, not_before=start_wall or None)
    if status == "reused":
        return ProcessState("gone", f"pid {pid} now belongs to a newer process")
    if status == "gone":
        return ProcessState("gone", f"pid {pid} does not exist")
    if status == "unknown":
        return ProcessState("unknown", f"pid {pid}: access denied")
    return ProcessState(status, f"pid {pid} status {status}")


_EXIT = re.compile(r"exitcode\s*:?\s*(-?\d+)\)?[^\n]*?\(pid:\s*(\d+)\)")


def exit_codes_from_logs(paths: Iterable[str | os.PathLike[str]]) -> dict[int, int]:
    """pid -> exit code from torchrun's failure lines (`failed (exitcode: -9) local_rank: 3 (pid: 123)`,
    `exitcode  : -6 (pid: 123)`): the launcher is the only one that saw the worker's status."""
    out: dict[int, int] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if "exitcode" in line:
                        m = _EXIT.search(line)
                        if m:
                            out[int(m.group(2))] = int(m.group(1))
        except OSError:
            continue
    return out


_COMM_MARKERS = (
    "Watchdog caught collective operation timeout",
    "detected by watchdog",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL error",
    "ncclRemoteError",
    "ncclSystemError",
    "ncclInternalError",
    "Timed out waiting",
    "Socket Timeout",
    "remote process exited",
    "Application timeout caused pair closure",
)
_RANK_PREFIX = re.compile(r"\[(?:rank|Rank |PG \d+ Rank )(\d{1,7})\]")


def comm_errors_from_logs(paths: Iterable[str | os.PathLike[str]], limit: int = 10_000) -> dict[int, list[str]]:
    """rank -> communication error lines it printed (`[rank3]:` / `[Rank 3]` prefixes: torchrun's
    per-rank prefixes, the NCCL watchdog's own). Lines without a rank are skipped: no one to attach them to."""
    out: dict[int, list[str]] = {}
    n = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if not any(m in line for m in _COMM_MARKERS):
                        continue
                    m = _RANK_PREFIX.search(line)
                    if m is None:
                        continue
                    msgs = out.setdefault(int(m.group(1)), [])
                    if len(msgs) < 8:
                        msgs.append(line.strip()[:400])
                    n += 1
                    if n >= limit:
                        return out
        except OSError:
            continue
    return out


def with_exit_code(proc: ProcessState, pid: int | None, codes: dict[int, int]) -> ProcessState:
    if pid is None or pid not in codes or proc.state not in ("gone", "zombie", "unknown"):
        return proc
    code = codes[pid]
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    try:
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}"
    except ValueError:
        pass
    return ProcessState("gone", f"{proc.detail}; torchrun: {how}", exit_code=code)


def local_host() -> str:
    return socket.gethostname()
