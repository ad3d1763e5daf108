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

from gpuguard.foundation.env import INCARNATION_ID_ENV, JOB_DIR_ENV, JOB_ID_ENV

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
DEFAULT_RUN_IDS = frozenset({"", "none"})  # torchrun's default run id (no --rdzv-id): names no job

JobVerdict = Literal["job", "gone", "not-the-job", "unknown"]


@dataclass(frozen=True)
class JobProcessClaim:
    """What is known about a worker process before it may be signalled. Only `pid` and `start_time`
    come from the record; every other fact a live process must confirm comes from the system or the
    job dir, never from what a record says alone (a forged record chooses its own claims)."""

    pid: int
    start_time: float
    owner_uid: int | None = None  # who owns the record file (the kernel set it): the process must run as them
    uid: int | None = None  # the uid the record says (a second check; None in records before it existed)
    run_id: str | None = None  # the record's TORCHELASTIC_RUN_ID: confirmed only by the process's own environment
    agent_pid: int | None = None  # its parent when it started (the torchrun agent): while alive, still its parent
    job_id: str | None = None  # job.json's job id (the job dir's, not the record's)
    job_dir: str | None = None  # the job dir itself, against the process's GPUGUARD_JOB_DIR
    incarnation_id: str | None = None  # the recorded incarnation, against GPUGUARD_INCARNATION_ID


@dataclass(frozen=True)
class JobProcessCheck:
    """The answer: `job` only when the live process proves it; the reason names the proof or the mismatch."""

    verdict: JobVerdict
    reason: str
    process: Any = None  # the psutil.Process, only when verdict == "job"


def _shown(value: str, limit: int = 80) -> str:
    """An id as a reason shows it: quoted, control characters escaped, at most `limit` characters."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def check_job_process(claim: JobProcessClaim) -> JobProcessCheck:
    """Prove (or refuse) that the live process at `claim.pid` is the job's worker, from facts the
    system holds: its start time, its uid, its own environment (`/proc/<pid>/environ`, as the kernel
    keeps it from exec) and its parent chain.

    1. pid + start time: a reused pid or a dead process is `gone`.
    2. uid: it runs as the owner of the record file (and as the record's uid, when it has one).
    3. no contradiction in its environment: another job's GPUGUARD_JOB_ID, GPUGUARD_JOB_DIR or
       GPUGUARD_INCARNATION_ID, or another TORCHELASTIC_RUN_ID than the record's.
    4. a positive proof in its environment: this job's GPUGUARD_JOB_ID or GPUGUARD_JOB_DIR, the
       record's GPUGUARD_INCARNATION_ID, or the record's torchrun run id when that is a real one
       (torchrun's default `none`, what an unset variable reads as, names no job). Without one it is
       `not-the-job`: a record pointing at an unrelated process proves nothing.
    5. the parent: while the recorded agent (the worker's parent at start) is alive it must still be
       the parent (a process re-parented away from a live agent is not the job's; an orphan whose
       agent is gone is still the job's).

    Anything that cannot be read is `unknown`, which callers treat as "not signalled, not proved gone".
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
        real_uid = proc.uids().real
        for want, whose in ((claim.owner_uid, "its record's file is owned by"), (claim.uid, "the record says")):
            if want is not None and real_uid != want:
                return JobProcessCheck("not-the-job", f"runs as uid {real_uid}, {whose} {want}")
        env = proc.environ()
        mismatch, proofs = _environment_facts(claim, env, proc)
        if mismatch is not None:
            return JobProcessCheck("not-the-job", mismatch)
        if not proofs:
            found = env.get(RUN_ID_ENV)
            shown = "unset" if found is None else f"{_shown(found)} (torchrun's default, which names no job)"
            return JobProcessCheck(
                "not-the-job",
                f"its {RUN_ID_ENV} is {shown} and its environment names neither this job ({JOB_ID_ENV}, "
                f"{JOB_DIR_ENV}) nor its incarnation ({INCARNATION_ID_ENV}): nothing proves it the job's",
            )
        if claim.agent_pid is not None and pid_alive(claim.agent_pid):
            if proc.ppid() != claim.agent_pid:
                return JobProcessCheck(
                    "not-the-job", f"its parent is pid {proc.ppid()}, not the job's live agent {claim.agent_pid}"
                )
            proofs.append("agent")
        checked = ["pid", "start time", "uid", *proofs]
        return JobProcessCheck("job", f"{', '.join(checked[:-1])} and {checked[-1]} match", proc)
    except psutil.NoSuchProcess:
        return JobProcessCheck("gone", "exited while being checked")
    except psutil.AccessDenied:
        return JobProcessCheck("unknown", "cannot read its uid or environment (run as root or as the job's user)")


def _environment_facts(claim: JobProcessClaim, env: dict[str, str], proc: Any) -> tuple[str | None, list[str]]:
    """(the first contradiction, or None; the proofs found) in the process's own environment."""
    proofs: list[str] = []
    found_run = env.get(RUN_ID_ENV)
    if claim.run_id is not None and found_run is not None:
        if found_run != claim.run_id:
            return f"its {RUN_ID_ENV} is {_shown(found_run)}, the job's is {_shown(claim.run_id)}", []
        if found_run not in DEFAULT_RUN_IDS:
            proofs.append("run id")
    for name, claimed, what in (
        (JOB_ID_ENV, claim.job_id, "job id"),
        (INCARNATION_ID_ENV, claim.incarnation_id, "incarnation id"),
    ):
        found = env.get(name)
        if claimed is None or found is None:
            continue
        if found != claimed:
            return f"its {name} is {_shown(found)}, the record's {what} is {_shown(claimed)}", []
        proofs.append(what)
    found_dir = env.get(JOB_DIR_ENV)
    if claim.job_dir is not None and found_dir:
        where = _resolved(found_dir, proc)
        if where is not None and where != os.path.realpath(claim.job_dir):
            return f"its {JOB_DIR_ENV} is {_shown(found_dir)}, not this job dir", []
        if where is not None:
            proofs.append("job dir")
    return None, proofs


def _resolved(path: str, proc: Any) -> str | None:
    """`path` as the process sees it (a relative one from its working directory), links followed."""
    if not os.path.isabs(path):
        try:
            path = os.path.join(proc.cwd(), path)
        except Exception:  # noqa: BLE001 - an unreadable cwd: the variable proves nothing either way
            return None
    return os.path.realpath(path)
