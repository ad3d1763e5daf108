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
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gpuguard.foundation.env import INCARNATION_ID_ENV, JOB_ID_ENV

if TYPE_CHECKING:
    import psutil

START_TIME_TOLERANCE_S = 0.05
_HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
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


# -- signalling exactly one process -------------------------------------------------------------------
SignalOutcome = Literal["sent", "gone", "denied"]


def send_signal_checked(pid: int, start_time: float, sig: int) -> SignalOutcome:
    """Send `sig` to the process (pid, start time) and to no other: "sent", "gone" (it is not there, or
    the pid is another process's now: nothing was signalled) or "denied" (no permission).

    The identity is checked right before the signal, and the signal goes through a handle on that
    process, never through a bare pid: a pidfd (Linux >= 5.3: `pidfd_open` pins the process, so the
    kernel delivers to it or to nobody, even if the pid is reused in between) or, without one,
    psutil's `send_signal`, which re-checks the create time itself.
    """
    if _HAS_PIDFD:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            fd = -1  # no pidfd here (a seccomp filter, an old kernel): psutil below
        if fd >= 0:
            try:
                # the pidfd names whatever had the pid when it was opened; that process is ours only if
                # the pid's create time, read after the open, is the recorded one
                status = process_status(pid, start_time)
                if status not in ALIVE_STATES:
                    return "gone" if status in GONE_STATES else "denied"
                signal.pidfd_send_signal(fd, sig)
                return "sent"
            except ProcessLookupError:
                return "gone"
            except PermissionError:
                return "denied"
            finally:
                os.close(fd)
    import psutil

    proc = matching_process(pid, start_time)
    if proc is None:
        return "denied" if process_status(pid, start_time) == "unknown" else "gone"
    try:
        proc.send_signal(sig)  # psutil re-checks the create time: never a reused pid
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.AccessDenied:
        return "denied"
    return "sent"


def wait_gone(pid: int, start_time: float, timeout: float) -> bool:
    """Poll until the process (pid, start time) is gone or a zombie (its parent may reap it later)."""
    end = time.monotonic() + max(0.0, timeout)
    while process_status(pid, start_time) not in GONE_STATES:
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


def kill_confirmed(pid: int, start_time: float, timeout: float = 5.0) -> bool:
    """SIGKILL exactly the process (pid, start time) and wait until it is gone (a stopped process dies
    on SIGKILL too): True once it is gone (or was already), False if it could not be signalled or
    outlived `timeout`. Every kill in gpuguard goes through here or `send_signal_checked`."""
    outcome = send_signal_checked(pid, start_time, signal.SIGKILL)
    if outcome == "denied":
        return False
    return outcome == "gone" or wait_gone(pid, start_time, timeout)


# -- is it the job's? (before any signal) ------------------------------------------------------------
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker's environment at spawn
# INCARNATION_ID_ENV: a launcher that names each worker's incarnation exports it (nothing in gpuguard sets
# it yet); when the process's environment has it, it must be the recorded incarnation's id

JobVerdict = Literal["job", "gone", "not-the-job", "unknown"]


@dataclass(frozen=True)
class JobProcessClaim:
    """What a record says about a worker process: the identity a live process must prove."""

    pid: int
    start_time: float
    uid: int | None = None  # the real uid it ran as (records written before this field: None)
    run_id: str | None = None  # TORCHELASTIC_RUN_ID of the job (None: not checked)
    agent_pid: int | None = None  # its torchrun agent (None: not checked)
    job_id: str | None = None  # the gpuguard job id (job.json); checked against GPUGUARD_JOB_ID when it is set
    incarnation_id: str | None = None  # the recorded incarnation; checked against GPUGUARD_INCARNATION_ID when set


@dataclass(frozen=True)
class JobProcessCheck:
    """The answer: `job` only when every recorded fact matches; the reason names the first mismatch."""

    verdict: JobVerdict
    reason: str
    process: Any = None  # the psutil.Process, only when verdict == "job"


def _shown(value: str, limit: int = 80) -> str:
    """An id as a reason shows it: quoted, control characters escaped, at most `limit` characters."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def check_job_process(claim: JobProcessClaim) -> JobProcessCheck:
    """Prove (or refuse) that the live process at `claim.pid` is the job's recorded worker.

    Checked in order: pid + start time (a reused pid is `gone`), uid, the torchrun run id in the
    process's own environment (as the kernel holds it from exec: a forged record naming an unrelated
    process fails here), the gpuguard job id and the incarnation id in that environment (each only when
    the claim carries it and the environment has it: a job launched without them proves nothing by their
    absence, but another job's id is proof it is not this one's), and the parent agent (a process
    re-parented away from a live agent is not the job's; one whose agent is gone is an orphan of the job
    and still its own). Anything that cannot be read is `unknown`, which callers treat as "not
    signalled, not proved gone".
    """
    import psutil

    status = process_status(claim.pid, claim.start_time)
    if status in GONE_STATES:
        return JobProcessCheck("gone", f"{status}" if status != "reused" else "pid now belongs to a newer process")
    if status == "unknown":
        return JobProcessCheck("unknown", "no access to the process")
    try:
        proc = psutil.Process(claim.pid)
        if not matches(claim.start_time, proc.create_time()):
            return JobProcessCheck("gone", "pid now belongs to a newer process")
        if claim.uid is not None and proc.uids().real != claim.uid:
            return JobProcessCheck("not-the-job", f"runs as uid {proc.uids().real}, the record says {claim.uid}")
        checked = ["pid", "start time", *(["uid"] if claim.uid is not None else [])]
        env = proc.environ() if (claim.run_id, claim.job_id, claim.incarnation_id) != (None, None, None) else {}
        if claim.run_id is not None:
            # torchrun's own default run id is the literal "none"; a worker started without torchrun
            # records that too, so an unset variable reads as "none" (the agent check still applies)
            found = env.get(RUN_ID_ENV)
            if (found if found is not None else "none") != claim.run_id:
                shown = f"{found!r}" if found is not None else "unset"
                return JobProcessCheck("not-the-job", f"its {RUN_ID_ENV} is {shown}, the job's is {claim.run_id!r}")
            checked.append("run id")
        for name, claimed, what in (
            (JOB_ID_ENV, claim.job_id, "job id"),
            (INCARNATION_ID_ENV, claim.incarnation_id, "incarnation id"),
        ):
            found = env.get(name)
            if claimed is None or found is None:
                continue
            if found != claimed:
                return JobProcessCheck(
                    "not-the-job", f"its {name} is {_shown(found)}, the record's {what} is {_shown(claimed)}"
                )
            checked.append(what)
        if claim.agent_pid is not None:
            parent = proc.ppid()
            if parent != claim.agent_pid and pid_alive(claim.agent_pid):
                return JobProcessCheck(
                    "not-the-job", f"its parent is pid {parent}, not the job's live agent {claim.agent_pid}"
                )
            checked.append("agent")
        return JobProcessCheck("job", f"{', '.join(checked[:-1])} and {checked[-1]} match", proc)
    except psutil.NoSuchProcess:
        return JobProcessCheck("gone", "exited while being checked")
    except psutil.AccessDenied:
        return JobProcessCheck("unknown", "cannot read its uid or environment (run as root or as the job's user)")
