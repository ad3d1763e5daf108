"""The gpuguard job id and the incarnation id in a live process's environment (issue 15, item 1): a claim
that carries them proves the process the job's only when its environment agrees, or lacks them."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from gpuguard.foundation.env import JOB_ID_ENV
from gpuguard.foundation.identity import INCARNATION_ID_ENV, RUN_ID_ENV, JobProcessClaim, check_job_process
from tests.support.processes import RUN_ID, reap


def _worker(**env: str) -> subprocess.Popen:
    """A real process with the run id and exactly the given gpuguard ids in its (exec-time) environment."""
    base = {k: v for k, v in os.environ.items() if k not in (JOB_ID_ENV, INCARNATION_ID_ENV, RUN_ID_ENV)}
    code = "import time; print('ready', flush=True); time.sleep(300)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**base, RUN_ID_ENV: RUN_ID, **env}
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _claim(proc: subprocess.Popen, **kw: str | None) -> JobProcessClaim:
    start = psutil.Process(proc.pid).create_time()
    return JobProcessClaim(proc.pid, start, uid=os.getuid(), run_id=RUN_ID, agent_pid=os.getpid(), **kw)


def test_matching_job_and_incarnation_ids_are_the_jobs_and_say_so() -> None:
    proc = _worker(**{JOB_ID_ENV: "job-a", INCARNATION_ID_ENV: "inc-1"})
    try:
        check = check_job_process(_claim(proc, job_id="job-a", incarnation_id="inc-1"))
        assert check.verdict == "job" and check.process.pid == proc.pid
        assert check.reason == "pid, start time, uid, run id, job id, incarnation id and agent match"
    finally:
        reap(proc)


@pytest.mark.parametrize(
    ("claim", "reason"),
    [
        (
            {"job_id": "job-b", "incarnation_id": "inc-1"},
            f"its {JOB_ID_ENV} is 'job-a', the record's job id is 'job-b'",
        ),
        (
            {"job_id": "job-a", "incarnation_id": "inc-2"},
            f"its {INCARNATION_ID_ENV} is 'inc-1', the record's incarnation id is 'inc-2'",
        ),
    ],
    ids=["job-id", "incarnation-id"],
)
def test_another_id_in_its_environment_is_not_the_jobs_and_never_handed_out(claim: dict, reason: str) -> None:
    proc = _worker(**{JOB_ID_ENV: "job-a", INCARNATION_ID_ENV: "inc-1"})
    try:
        check = check_job_process(_claim(proc, **claim))
        assert check.verdict == "not-the-job" and check.reason == reason and check.process is None
    finally:
        reap(proc)


def test_ids_missing_on_either_side_prove_nothing_either_way() -> None:
    bare = _worker()  # launched without them: the run id, uid and agent still decide
    named = _worker(**{JOB_ID_ENV: "job-a", INCARNATION_ID_ENV: "inc-1"})
    try:
        check = check_job_process(_claim(bare, job_id="job-a", incarnation_id="inc-1"))
        assert check.verdict == "job" and "job id" not in check.reason
        check = check_job_process(_claim(named))  # a record that does not carry them (older records)
        assert check.verdict == "job" and "incarnation id" not in check.reason
    finally:
        reap(bare, named)


def test_a_hostile_id_is_shown_escaped_and_bounded() -> None:
    proc = _worker(**{JOB_ID_ENV: "\x1b[2J" + "x" * 500})
    try:
        check = check_job_process(_claim(proc, job_id="job-a"))
        assert check.verdict == "not-the-job" and "\x1b" not in check.reason and "\\x1b[2J" in check.reason
        assert len(check.reason) < 250 and check.reason.count("...") == 1
    finally:
        reap(proc)
