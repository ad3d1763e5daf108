"""Issue 28 finding 3: an abort proof that cannot be forged from the record. Real processes, real
records, the installed `gpu-recover`: a forged record (run id "none", what an unset
TORCHELASTIC_RUN_ID reads as; a dead agent; no uid) pointing at root's or nobody's `sleep`, and a
garbage record, signal nothing; a worker whose own environment names the job is signalled."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from gpuguard.foundation.jobdir import IncarnationRecord, ensure_job, write_incarnation
from tests.support.cli import run_cli
from tests.support.processes import reap

SLEEP = shutil.which("sleep") or "/bin/sleep"


def _started(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # setpriv execs sleep: wait until the process is the sleep
        try:
            if psutil.Process(proc.pid).name() == "sleep":
                return proc
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    pytest.fail(f"{argv} did not start")


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    return gone.pid


def _forge(job_dir: Path, pid: int, rank: int, **fields) -> str:
    """A record as an attacker who can write the job dir writes it: the right pid and start time, the
    rest whatever reads as innocuous."""
    inc = uuid.uuid4().hex
    base = dict(
        incarnation={
            "id": inc,
            "host": socket.gethostname(),
            "pid": pid,
            "start_time": psutil.Process(pid).create_time(),
        },
        rank=rank,
        local_rank=rank,
        world_size=2,
        generation=None,
        agent_pid=_dead_pid(),
        run_id="none",
        master_addr="127.0.0.1",
        master_port=1,
        restart_count=0,
        uid=None,
    )
    write_incarnation(job_dir, IncarnationRecord(**{**base, **fields}))
    return inc


def _abort(job_dir: Path) -> dict:
    r = run_cli("gpu-recover", "abort", "--job-dir", str(job_dir), "--yes", "--grace", "1", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["details"]


def test_a_forged_record_never_signals_roots_sleep(tmp_path):
    ensure_job(tmp_path)
    victim = _started(["env", "-i", SLEEP, "300"])  # root's, with an empty environment
    try:
        _forge(tmp_path, victim.pid, 0)
        details = _abort(tmp_path)
        assert victim.poll() is None, "abort killed an unrelated root process"
        assert details["terminated"] == [] and details["quiescence"] == "unknown"
        (row,) = details["processes"]
        assert row["outcome"] == "not-the-job" and "nothing proves it the job's" in row["reason"]
    finally:
        reap(victim)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_forged_record_never_signals_another_users_sleep(tmp_path):
    ensure_job(tmp_path)
    env = {"TORCHELASTIC_RUN_ID": "none", "PATH": "/usr/bin:/bin"}  # even claiming the record's run id
    victim = _started(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SLEEP, "300"], env=env)
    try:
        assert psutil.Process(victim.pid).uids().real == 65534
        _forge(tmp_path, victim.pid, 0)
        details = _abort(tmp_path)
        assert victim.poll() is None, "abort killed nobody's process"
        (row,) = details["processes"]
        assert row["outcome"] == "not-the-job" and "runs as uid 65534" in row["reason"]
    finally:
        reap(victim)


def test_a_garbage_record_signals_nothing(tmp_path):
    ensure_job(tmp_path)
    victim = _started([SLEEP, "300"])  # our own environment, our uid
    try:
        _forge(tmp_path, victim.pid, 0, run_id="", agent_pid=0, master_port=0, restart_count=-1)
        (tmp_path / "incarnations" / "junk.json").write_bytes(b"\x00\xff{" + b"[" * 10_000)
        details = _abort(tmp_path)
        assert victim.poll() is None
        outcomes = sorted(p["outcome"] for p in details["processes"])
        assert outcomes == ["not-the-job", "unreadable"] and details["terminated"] == []
    finally:
        reap(victim)


def test_a_worker_whose_environment_names_the_job_is_signalled(tmp_path):
    """torchrun's default run id proves nothing, but a worker started with the job's id, its job dir or
    its incarnation id in its environment is the job's, and abort ends it."""
    job = ensure_job(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "TORCHELASTIC_"))}
    by_id = _started([SLEEP, "300"], env={**base, "TORCHELASTIC_RUN_ID": "none", "GPUGUARD_JOB_ID": job.job_id})
    by_dir = _started([SLEEP, "300"], env={**base, "GPUGUARD_JOB_DIR": str(tmp_path)})
    inc = uuid.uuid4().hex
    by_inc = _started([SLEEP, "300"], env={**base, "GPUGUARD_INCARNATION_ID": inc})
    elsewhere = _started([SLEEP, "300"], env={**base, "GPUGUARD_JOB_DIR": str(tmp_path / "other-job")})
    try:
        _forge(tmp_path, by_id.pid, 0, agent_pid=os.getpid())
        _forge(tmp_path, by_dir.pid, 1, agent_pid=os.getpid())
        write_incarnation(
            tmp_path,
            IncarnationRecord(
                incarnation={
                    "id": inc,
                    "host": socket.gethostname(),
                    "pid": by_inc.pid,
                    "start_time": psutil.Process(by_inc.pid).create_time(),
                },
                rank=2,
                local_rank=2,
                world_size=4,
                generation=None,
                agent_pid=os.getpid(),
                run_id="none",
                master_addr="127.0.0.1",
                master_port=1,
                restart_count=0,
            ),
        )
        _forge(tmp_path, elsewhere.pid, 3, agent_pid=os.getpid())
        details = _abort(tmp_path)
        assert sorted(details["terminated"]) == sorted([by_id.pid, by_dir.pid, by_inc.pid])
        for proc in (by_id, by_dir, by_inc):
            assert proc.wait(10) == -15
        assert elsewhere.poll() is None  # its GPUGUARD_JOB_DIR is another job's
        reasons = {p["pid"]: p["reason"] for p in details["processes"]}
        assert "not this job dir" in reasons[elsewhere.pid]
    finally:
        reap(by_id, by_dir, by_inc, elsewhere)
