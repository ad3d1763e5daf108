"""Process identity on real processes: a record proves a live process is the job's only when pid,
start time, uid, the torchrun run id in its environment and its parent agent all match."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from gpuguard.foundation.identity import (
    START_TIME_TOLERANCE_S,
    JobProcessClaim,
    check_job_process,
    matches,
    process_status,
    same_process,
)
from tests.support.processes import RUN_ID, reap, spawn


def _claim(proc: subprocess.Popen, **kw) -> JobProcessClaim:
    base = {
        "pid": proc.pid,
        "start_time": psutil.Process(proc.pid).create_time(),
        "uid": os.getuid(),
        "run_id": RUN_ID,
        "agent_pid": os.getpid(),
    }
    return JobProcessClaim(**{**base, **kw})


def test_the_tolerance_is_one_rule() -> None:
    assert matches(100.0, 100.0 + START_TIME_TOLERANCE_S)
    assert not matches(100.0, 100.0 + 2 * START_TIME_TOLERANCE_S)


def test_a_real_worker_is_proven_the_jobs() -> None:
    proc = spawn()
    try:
        check = check_job_process(_claim(proc))
        assert check.verdict == "job" and check.process.pid == proc.pid
        assert same_process(proc.pid, psutil.Process(proc.pid).create_time())
    finally:
        reap(proc)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"run_id": "another-job"}, "TORCHELASTIC_RUN_ID is 't', the job's is 'another-job'"),
        ({"uid": 4242}, "the record says 4242"),
        ({"agent_pid": 1}, "not the job's live agent 1"),
    ],
    ids=["run-id", "uid", "agent"],
)
def test_a_mismatch_is_not_the_jobs(change: dict, reason: str) -> None:
    proc = spawn()
    try:
        check = check_job_process(_claim(proc, **change))
        assert check.verdict == "not-the-job" and reason in check.reason and check.process is None
    finally:
        reap(proc)


def test_an_unrelated_process_with_the_right_pid_and_start_time_is_not_the_jobs() -> None:
    stranger = spawn(run_id=None)  # what a forged record would point at
    try:
        check = check_job_process(_claim(stranger))
        assert check.verdict == "not-the-job" and "TORCHELASTIC_RUN_ID is unset" in check.reason
    finally:
        reap(stranger)


def test_a_reused_pid_and_a_dead_process_are_gone() -> None:
    proc = spawn()
    try:
        claim = _claim(proc)
        older = JobProcessClaim(proc.pid, claim.start_time - 100, run_id=RUN_ID)
        assert check_job_process(older).verdict == "gone"
        assert process_status(proc.pid, older.start_time) == "reused"
    finally:
        reap(proc)
    assert check_job_process(claim).verdict == "gone"


def test_a_zombie_is_gone_and_a_stopped_worker_is_still_the_jobs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = psutil.Process(proc.pid).create_time()
    deadline = time.monotonic() + 10
    while process_status(proc.pid, start) != "zombie" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert check_job_process(JobProcessClaim(proc.pid, start)).verdict == "gone"
    proc.wait(5)
    stopped = spawn()
    try:
        os.kill(stopped.pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 10
        while process_status(stopped.pid, psutil.Process(stopped.pid).create_time()) != "stopped":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert check_job_process(_claim(stopped)).verdict == "job"
    finally:
        reap(stopped)
