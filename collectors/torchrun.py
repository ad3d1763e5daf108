"""What the OS says about a torchrun job's processes (psutil; no torch).

Joins the job dir's incarnation records with the live process table, so that recovery actions and
`gpu-doctor diagnose torchrun` never act on a PID that now belongs to another process: a process is
the recorded incarnation only if its create time matches the record.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from gpuguard.recovery.hazards import AgentFacts, Assessment, WorkerFacts, assess

CREATE_TIME_TOLERANCE_S = 0.5


def matching_process(pid: int, start_time: float) -> Any | None:
    """The live psutil.Process for (pid, create_time), or None (gone, zombie, or a reused pid)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start_time) > CREATE_TIME_TOLERANCE_S:
            return None
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def pid_state(pid: int, start_time: float) -> str:
    """alive | gone | zombie | reused: what happened to a recorded process."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start_time) > CREATE_TIME_TOLERANCE_S:
            return "reused"
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return "zombie"
        return "alive"
    except psutil.ZombieProcess:
        return "zombie"
    except psutil.NoSuchProcess:
        return "gone"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def gather(job_dir: Path | None, *, init_timeout_s: float, now: float | None = None) -> Assessment:
    """Agents on this host + the job's recorded workers on this host → hazards."""
    import psutil

    from gpuguard.recovery.rendezvous import torchrun_agents

    now = time.time() if now is None else now
    notes: list[str] = []
    agents = [AgentFacts(pid, opts) for pid, _argv, opts in torchrun_agents()]
    workers: list[WorkerFacts] = []
    if job_dir is not None:
        from gpuguard.collectors.steps import read_job
        from gpuguard.recovery.jobdir import iter_incarnations
        from gpuguard.recovery.steplog import safe_incarnation

        series = read_job(job_dir).ranks
        host = socket.gethostname()
        records = []
        for rec in iter_incarnations(job_dir):
            if isinstance(rec, Exception):
                notes.append(str(rec))
            elif rec.host and rec.host != host:
                notes.append(f"rank {rec.rank} incarnation {rec.incarnation_id} runs on {rec.host}: not checked here")
            else:
                records.append(rec)
        job_agents = {r.agent_pid for r in records}
        agents = [a for a in agents if a.pid in job_agents]  # other jobs on the host are not this job's
        for rec in records:
            proc = matching_process(rec.pid, rec.start_time)
            ppid = None
            if proc is not None:
                try:
                    ppid = proc.ppid()
                except psutil.Error:
                    proc = None
            s = series.get(rec.rank)
            steps = len(s.steps) if s is not None and s.incarnation == safe_incarnation(rec.incarnation_id) else -1
            if steps == -1 and s is None:
                steps = 0  # the rank never wrote a record at all
            workers.append(WorkerFacts(rec.rank, rec.incarnation_id, rec.pid, proc is not None, rec.agent_pid,
                                       _alive(rec.agent_pid), ppid, rec.start_time, steps, rec.restart_count,
                                       rec.run_id))
    return assess(agents, workers, now=now, init_timeout_s=init_timeout_s, notes=notes)
