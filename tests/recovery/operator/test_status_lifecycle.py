"""`gpu-recover status` in each state of a real torchrun job: running, restarting (agent alive),
finished, down, switching in place; the resume step it names is the step the job then resumes from
and the step `gpu-recover restore` would pin.

Restart-path job: the demo job (`tests/support/jobs/status_job.py`: `demo_train` behind a gate that
holds a restarted worker before activation while a file exists), 2 gloo workers under one torchrun
agent with one restart allowed. In-place job: `inplace_train` under one torchrun agent with 3
workers, whose coordinator stops itself (SIGSTOP, a real signal) when an operator's abort makes the
survivors switch, and is continued by the test.

Before this status page: mid-restart it said "every member is gone, safe to resume, resume from
step 0" (the first generation's certified frontier) and a finished job was "CRITICAL: the job is down".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuguard.examples import demo
from gpuguard.foundation.identity import GONE_STATES, process_status
from gpuguard.foundation.inplace_files import request_abort
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import JOBS, free_port, run_cli
from tests.support.recover_job import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 24


def status(job: Path) -> tuple[int, dict]:
    r = run_cli("gpu-recover", "status", "--job-dir", str(job), "--json", timeout=90)
    assert r.returncode in (0, 1, 2, 3), r.stderr
    return r.returncode, json.loads(r.stdout)


def restore_step(job: Path) -> int:
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--dry-run", "--json", timeout=90)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)["details"]["resume"]["step"])


def active(job: Path):
    try:
        return open_ledger(job).active()
    except Exception:  # noqa: BLE001 - not initialised yet
        return None


def committed(job: Path, generation: int) -> int:
    try:
        return open_ledger(job).last_committed_by_all(generation) or -1
    except Exception:  # noqa: BLE001
        return -1


def gone(cert) -> bool:
    return all(process_status(m.incarnation.pid, m.incarnation.start_time) in GONE_STATES for m in cert.members)


def torchrun(nproc: int, max_restarts: int, *job: str) -> list[str]:
    """One torchrun agent on this host (c10d rendezvous on a free port) running `job`."""
    return [
        str(Path(sys.executable).with_name("torchrun")),
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=st{os.getpid()}",
        "--monitor-interval=0.1",
        *job,
    ]


def launch(job: Path, steps: int, hold: Path, log: Path) -> subprocess.Popen:
    argv = torchrun(
        2,
        1,
        str(JOBS / "status_job.py"),
        "--job-dir",
        str(job),
        "--steps",
        str(steps),
        "--sleep",
        "0.3",
    )
    env = {**demo.worker_env(), "STATUS_JOB_HOLD": str(hold), "GPUGUARD_PG_TIMEOUT": "30"}
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_status_running_restarting_finished_down_on_a_real_torchrun_job(tmp_path):
    job, hold, log = tmp_path / "job", tmp_path / "hold", tmp_path / "torchrun.log"
    job.mkdir()
    proc = launch(job, STEPS, hold, log)
    try:
        first = wait_for(lambda: (c := active(job)) is not None and c.members and c, 120, "generation 1", 0.2)
        wait_for(lambda: committed(job, first.generation) >= 3, 120, "3 committed steps", 0.2)

        code, doc = status(job)  # running
        assert doc["job"]["state"] == "running", (doc, log.read_text()[-2000:])
        assert code in (0, 1) and not doc["safe_to_resume"] and "still alive" in doc["because"]
        assert any("agent pid" in e and "alive" in e for e in doc["job"]["evidence"])

        hold.touch()  # the restarted workers wait before activation: the restart stays in progress
        victim = next(m for m in first.members if m.rank == 1).incarnation.pid
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: gone(first), 60, "the first generation's members gone", 0.1)
        code, doc = status(job)  # restarting: torchrun's agent restarts the workers itself
        assert doc["job"]["state"] == "restarting (agent alive)", (doc, log.read_text()[-2000:])
        assert code == 1 and doc["state"] == "warning" and not doc["safe_to_resume"]
        assert "rank 0, 1 gone" in doc["job"]["evidence"][0]
        assert "a second copy would split it" in doc["because"]
        resume = doc["resume"]["step"]
        assert resume >= 3 and f"resume from step {resume}" in doc["because"]
        assert resume == restore_step(job)  # status and restore name one step

        hold.unlink()
        second = wait_for(lambda: (c := active(job)) is not None and c.generation > first.generation and c, 120, "g2")
        assert second.frontier.step == resume  # the job resumed where status said it would
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]

        code, doc = status(job)  # finished: every member closed its step log, no agent left
        assert doc["job"]["state"] == "finished", (doc, log.read_text()[-2000:])
        assert code == 0 and doc["state"] == "healthy" and doc["safe_to_resume"]
        assert f"closed its step log in generation {second.generation} at step {STEPS}" in " ".join(
            doc["job"]["evidence"]
        )
        assert doc["resume"]["step"] == restore_step(job) == STEPS
        assert "the job finished cleanly" in doc["because"] and f"resume from step {STEPS}" in doc["because"]

        proc = launch(job, 4 * STEPS, hold, log)  # the same job continued, then its node lost at once
        third = wait_for(lambda: (c := active(job)) is not None and c.generation > second.generation and c, 120, "g3")
        wait_for(lambda: committed(job, third.generation) >= STEPS + 2, 120, "2 more committed steps", 0.2)
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for w in workers:
            w.kill()
        proc.wait(timeout=30)
        wait_for(lambda: gone(third), 30, "the members gone", 0.1)
        code, doc = status(job)  # down: members gone without a clean close, nothing brings them back
        assert doc["job"]["state"] == "down", doc
        assert code == 2 and doc["state"] == "critical" and doc["safe_to_resume"]
        assert "ended without closing its step log" in " ".join(doc["job"]["evidence"])
        # the newest snapshot may lag the commits by the one its writer had in flight when killed
        assert doc["resume"]["step"] == restore_step(job) > STEPS
        page = run_cli("gpu-recover", "status", "--job-dir", str(job), timeout=90)
        assert page.returncode == 2 and "job            down" in page.stdout.splitlines()
        assert f"resume step    {doc['resume']['step']}: " in page.stdout
    finally:
        hold.unlink(missing_ok=True)
        demo.stop_job(proc, job)
        for p in psutil.process_iter(["pid", "cmdline"]):
            if str(job) in " ".join(p.info.get("cmdline") or []):
                p.kill()


def test_status_switching_in_place_on_a_real_torchrun_job(tmp_path):
    job, log = tmp_path / "job", tmp_path / "torchrun.log"
    job.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env.update(
        {
            "GPUGUARD_JOB_DIR": str(job),
            "INPLACE_STEPS": "400",
            "INPLACE_STEP_SLEEP": "0.1",
            "GPUGUARD_PG_TIMEOUT": "10",
            "INPLACE_GRACE": "3",
            "INPLACE_FAULTS": "0:1:coordinate:stop",  # the coordinator of the switch from generation 1 stops
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
        }
    )
    argv = torchrun(3, 0, "-m", "gpuguard.examples.inplace_train")
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        first = wait_for(lambda: (c := active(job)) is not None and c.members and c, 120, "generation 1", 0.2)
        wait_for(lambda: committed(job, 1) >= 3, 120, "3 committed steps", 0.2)
        request_abort(job, 1, "test: operator abort")
        fault = job / "faults" / "0-coordinate-1.json"
        wait_for(fault.exists, 60, "the coordinator to stop", 0.1)
        stopped = json.loads(fault.read_text())["pid"]
        wait_for(lambda: psutil.Process(stopped).status() == psutil.STATUS_STOPPED, 10, "SIGSTOP", 0.05)

        code, doc = status(job)
        assert doc["job"]["state"] == "switching in place", (doc, log.read_text()[-2000:])
        assert code == 1 and not doc["safe_to_resume"] and "switching to the next generation" in doc["because"]
        evidence = " ".join(doc["job"]["evidence"])
        assert "in-place reports of generation 1 from rank 0, 1, 2" in evidence
        assert "an operator asked generation 1 to switch" in evidence

        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_for(lambda: (c := active(job)) is not None and c.generation == 2 and c, 60, "generation 2", 0.1)
        wait_for(lambda: committed(job, 2) >= 1, 60, "a commit in generation 2", 0.2)
        code, doc = status(job)
        assert doc["job"]["state"] == "running" and doc["ledger"]["active_generation"] == 2, doc
        assert {m["pid"] for m in doc["members"]} == {m.incarnation.pid for m in first.members}  # the same processes
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        demo.stop_job(proc, job)
        for p in psutil.process_iter(["pid", "cmdline", "environ"]):
            try:
                if (p.info.get("environ") or {}).get("GPUGUARD_JOB_DIR") == str(job):
                    p.kill()
            except psutil.Error:
                pass
        time.sleep(0.2)
