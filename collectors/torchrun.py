"""What the OS says about a torchrun job's processes (psutil; no torch).

Finds the torchrun agents on this host by their command line and joins the job dir's incarnation
records with the live process table, so that recovery actions and `gpu-doctor diagnose torchrun`
never act on a PID that now belongs to another process (`foundation.identity`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

from gpuguard.collectors.step_records import read_job
from gpuguard.foundation.identity import matching_process, pid_alive
from gpuguard.foundation.jobdir import iter_incarnations
from gpuguard.foundation.steplog import safe_incarnation
from gpuguard.foundation.torchrun_facts import AgentFacts, TorchrunFacts, WorkerFacts


def _torchrun_index(argv: list[str]) -> int | None:
    """Index of the torchrun token in an agent's argv (`torchrun`, `python torchrun`, `python -m torch.distributed.run`)."""
    base = [os.path.basename(a) for a in argv[:3]]
    if base and base[0] == "torchrun":
        return 0
    if len(base) > 1 and base[0].startswith("python"):
        if base[1] == "torchrun":
            return 1
        if base[1] == "-m" and len(argv) > 2 and argv[2] in ("torch.distributed.run", "torch.distributed.launch"):
            return 2
    return None


def parse_torchrun_cmdline(argv: list[str]) -> dict[str, str] | None:
    """torchrun's rendezvous options from an agent's argv; None when it is not a torchrun agent."""
    start = _torchrun_index(argv)
    if start is None:
        return None
    opts: dict[str, str] = {}
    wanted = {"rdzv_endpoint", "rdzv_id", "rdzv_backend", "rdzv_conf", "nnodes", "max_restarts", "signals_to_handle"}
    flags = {"standalone", "no_python", "module", "m", "run_path", "no-python"}
    i = start + 1
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "--":
            break  # the training script: the rest are its arguments
        name, eq, value = arg.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name in flags:
            if name == "standalone":
                opts["standalone"] = "1"
        elif eq:
            if name in wanted:
                opts[name] = value
        elif i + 1 < len(argv):
            i += 1
            if name in wanted:
                opts[name] = argv[i]
        i += 1
    return opts


def torchrun_agents() -> list[tuple[int, list[str], dict[str, str]]]:
    """Live torchrun agents on this host: (pid, argv, rendezvous options)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info.get("cmdline") or []
        opts = parse_torchrun_cmdline(argv) if argv else None
        if opts is not None:
            found.append((proc.info["pid"], argv, opts))
    return found


def gather(job_dir: Path | None) -> TorchrunFacts:
    """Agents on this host + the job's recorded workers on this host, joined with the process table."""
    notes: list[str] = []
    agents = [AgentFacts(pid, opts) for pid, _argv, opts in torchrun_agents()]
    workers: list[WorkerFacts] = []
    if job_dir is not None:
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
            workers.append(
                WorkerFacts(
                    rec.rank,
                    rec.incarnation_id,
                    rec.pid,
                    proc is not None,
                    rec.agent_pid,
                    pid_alive(rec.agent_pid),
                    ppid,
                    rec.start_time,
                    steps,
                    rec.restart_count,
                    rec.run_id,
                )
            )
    return TorchrunFacts(tuple(agents), tuple(workers), tuple(notes))
