"""Process identity: is the process at this pid still the one we recorded?

A pid alone names nothing: the kernel hands it to the next process once the old one is reaped. Every
record gpuguard keeps of a process (incarnation records and the certificates' incarnations, step-log
headers) stores the pair (pid, start time), where the start time is psutil's `create_time()` of that
process (in-place reports carry the pid; their start time is the member's in the parent certificate), and
every reader asks this module whether the live process at that pid is the same one. One rule, here.

The tolerance: both sides of the comparison are psutil `create_time()` values of one process on one
boot (boot time from `/proc/stat` plus the start tick, 10 ms granularity), so they are equal unless
the wall clock was stepped in between (the kernel shifts the boot time with it). Two processes with
the same pid started within `START_TIME_TOLERANCE_S` of each other would need the pid space to wrap
in that time, which a Linux host with pid_max >= 32768 does not do in 50 ms.

Lazy imports (start-up time): psutil, only when a process is probed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import psutil

START_TIME_TOLERANCE_S = 0.05
# Against a wall-clock time (`time.time()`), not another create time: `/proc/stat`'s boot time has
# whole-second resolution, so a create time can read up to a second late; two seconds of slack.
WALL_CLOCK_SLACK_S = 2.0

ProcessStatus = Literal["running", "sleeping", "stopped", "disk-sleep", "zombie", "gone", "reused", "unknown"]
GONE_STATES: frozenset[str] = frozenset({"zombie", "gone", "reused"})
ALIVE_STATES: frozenset[str] = frozenset({"running", "sleeping", "stopped", "disk-sleep"})


def own_start_time() -> float:
    """This process's start time, as the records store it."""
    import psutil  # lazy: the doctor's start-up path never pays for psutil when it does not probe

    return float(psutil.Process(os.getpid()).create_time())


def matches(recorded_start: float, live_start: float) -> bool:
    """The identity rule itself: the same process iff the start times agree within the tolerance."""
    return abs(live_start - recorded_start) <= START_TIME_TOLERANCE_S


def matching_process(pid: int, start_time: float) -> psutil.Process | None:
    """The live psutil.Process for (pid, start time), or None (gone, zombie, a reused pid, no access)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if not matches(start_time, proc.create_time()):
            return None
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def process_status(pid: int, start_time: float | None = None, *, not_before: float | None = None) -> ProcessStatus:
    """What became of a recorded process: running, sleeping, stopped, disk-sleep, zombie, gone or reused.

    `start_time` is the recorded start time (the identity). Records that lack one (step logs written
    before format 1 carried it) pass `not_before`, the wall time the record was written: a process
    created after its own record cannot be the one that wrote it. `unknown` means no access.
    """
    import psutil

    try:
        proc = psutil.Process(pid)
        created = proc.create_time()
        status = proc.status()
    except psutil.ZombieProcess:
        return "zombie"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.AccessDenied:
        return "unknown"
    if start_time is not None and not matches(start_time, created):
        return "reused"
    if start_time is None and not_before is not None and created > not_before + WALL_CLOCK_SLACK_S:
        return "reused"
    if status == psutil.STATUS_ZOMBIE:
        return "zombie"
    if status == psutil.STATUS_DEAD:
        return "gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    if status == psutil.STATUS_DISK_SLEEP:
        return "disk-sleep"
    if status == psutil.STATUS_RUNNING:
        return "running"
    return "sleeping"


def same_process(pid: int, start_time: float) -> bool:
    """Is this exact process (pid + start time) still alive (a zombie or a reused pid is not)?"""
    return process_status(pid, start_time) in ALIVE_STATES


def pid_alive(pid: int) -> bool:
    """Any live, non-zombie process at this pid (for pids recorded without a start time)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
