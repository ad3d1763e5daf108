"""Real processes recorded as worker incarnations in a job dir (for abort and runbook tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

from gpuguard.foundation.jobdir import IncarnationRecord, ensure_job, write_incarnation

IGNORE_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
)


RUN_ID = "t"  # the torchrun run id the fake workers carry in their environment, as torchrun's do


def spawn(ignore_term: bool = False, *, run_id: str | None = RUN_ID, job_id: str | None = None) -> subprocess.Popen:
    """A process that looks like one of the job's workers (run id in its environment), or, with
    `run_id=None`, an unrelated process a forged record could name; `job_id`: its GPUGUARD_JOB_ID."""
    code = IGNORE_TERM if ignore_term else "import time; print('ready', flush=True); time.sleep(300)"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "GPUGUARD_JOB_ID")}
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    if job_id is not None:
        env["GPUGUARD_JOB_ID"] = job_id
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def record(
    job_dir: Path,
    proc: subprocess.Popen,
    rank: int,
    *,
    start_shift: float = 0.0,
    generation: int | None = None,
    uid: int | None = None,
) -> str:
    inc = uuid.uuid4().hex
    ensure_job(job_dir)  # what the runtime's first start writes: the directory is a job's
    write_incarnation(
        job_dir,
        IncarnationRecord(
            incarnation={
                "id": inc,
                "host": socket.gethostname(),
                "pid": proc.pid,
                "start_time": psutil.Process(proc.pid).create_time() + start_shift,
            },
            rank=rank,
            local_rank=rank,
            world_size=2,
            generation=generation,
            agent_pid=os.getpid(),
            run_id=RUN_ID,
            master_addr="127.0.0.1",
            master_port=1,
            restart_count=0,
            uid=os.getuid() if uid is None else uid,
        ),
    )
    return inc


def reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)


def kill_trees(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each launcher and every descendant by pid (torchrun starts its workers in sessions of
    their own, so a process-group kill of the launcher would leave them running), then reap."""
    for p in procs:
        try:
            tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        for proc in tree:
            try:
                proc.kill()
            except psutil.Error:
                pass
        p.wait(timeout=10)


def run_concurrently(cmds: list[list[str]], timeout: float = 60) -> list[dict]:
    """Start every command at once (operators racing), wait for all, and return their JSON outputs;
    each must exit 0. Nothing is left running if one hangs."""
    import json

    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    docs = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    return docs
