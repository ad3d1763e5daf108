"""Helpers for the gpu-recover tests: a real torchrun + gloo job, bounded waits, cleanup by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpuguard.foundation.jobdir import ensure_job

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB = REPO / "tests" / "support" / "jobs" / "recover_job.py"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Job:
    proc: subprocess.Popen
    job_dir: Path
    port: int
    run_id: str
    log: Path

    @property
    def agent_pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> set[int]:
        """The live processes of every recorded incarnation (orphans included), pid + create time checked."""
        from gpuguard.foundation.identity import matching_process
        from gpuguard.foundation.jobdir import read_incarnations

        return {r.pid for r in read_incarnations(self.job_dir) if matching_process(r.pid, r.start_time) is not None}

    def steps(self) -> int:
        total = 0
        for f in (self.job_dir / "ranks").glob("*.steplog"):
            total += sum(1 for line in f.read_text(errors="replace").splitlines() if line.startswith("E "))
        return total


def start_job(job_dir: Path, port: int, *, nproc: int = 2, run_id: str = "gg-test", extra_env=None) -> Job:
    job_dir.mkdir(parents=True, exist_ok=True)
    ensure_job(job_dir, created_by="test")  # what the runtime writes first: a gpuguard job dir
    log = job_dir.parent / f"{job_dir.name}.torchrun.log"
    env = {
        **os.environ,
        "GPUGUARD_JOB_DIR": str(job_dir),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOGLEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    cmd = [
        str(BIN / "torchrun"),
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        str(JOB),
    ]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(proc, job_dir, port, run_id, log)


def stop_job(job: Job) -> None:
    """Kill the agent's process group and every worker of this job (also orphans), by PID."""
    pids = job.worker_pids()
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        job.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
