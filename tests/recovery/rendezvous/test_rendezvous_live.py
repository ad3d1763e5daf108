"""gpu-recover and gpu-doctor against ONE real torchrun + gloo job (2 workers), in order:
torch-free state read → two concurrent `rendezvous` → exactly one new round → the restarted workers
stuck in group init are flagged → SIGUSR1 orphans the workers → flagged → the `hang` runbook's abort
kills them by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import free_port, run_cli
from tests.support.processes import run_concurrently
from tests.support.recover_job import start_job, stop_job, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("rdzv-live")
    gate = root / "delay-rank1"
    j = start_job(
        root / "job",
        free_port(),
        run_id="gg-live",
        extra_env={"RECOVER_JOB_INIT_DELAY": "1:12", "RECOVER_JOB_INIT_DELAY_IF": str(gate)},
    )
    j.gate = gate
    try:
        wait_for(lambda: j.steps() >= 4 or j.proc.poll() is not None, 90, "the job's first steps")
        assert j.proc.poll() is None, j.log.read_text()[-3000:]
        yield j
    finally:
        stop_job(j)


def _state(job) -> dict:
    r = run_cli(
        "gpu-recover",
        "rendezvous",
        "--state",
        "--json",
        "--rdzv-endpoint",
        f"127.0.0.1:{job.port}",
        "--run-id",
        job.run_id,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["details"]["state"]


def test_read_live_state_without_torch(job):
    code = (
        "import sys, json; from pathlib import Path; from gpuguard.recovery.rendezvous import state as R; "
        f"ep = R.find_endpoint(job_dir=Path({str(job.job_dir)!r})); st = R.read(ep); "
        "print(json.dumps({'torch': 'torch' in sys.modules, 'round': st.round, 'run_id': ep.run_id, "
        "'port': ep.port, 'n': len(st.participants), 'complete': st.complete}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc == {"torch": False, "round": 0, "run_id": "gg-live", "port": job.port, "n": 1, "complete": True}
    # the CLI finds the agent from the job dir too, and reading changes nothing
    r = run_cli("gpu-recover", "rendezvous", "--state", "--json", "--job-dir", str(job.job_dir), timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["details"]["state"]["round"] == 0
    assert _state(job)["wait_list"] == []


def test_dry_run_and_no_confirmation_change_nothing(job):
    before = _state(job)["round"]
    r = run_cli("gpu-recover", "rendezvous", "--job-dir", str(job.job_dir), "--dry-run", "--json", timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outcome"] == "dry-run"
    r = run_cli("gpu-recover", "rendezvous", "--job-dir", str(job.job_dir), input="", timeout=30)
    assert r.returncode == 4 and "--yes" in r.stderr
    time.sleep(1.5)
    assert _state(job)["round"] == before


def test_two_operators_at_once_make_exactly_one_round(job):
    before = _state(job)["round"]
    job.gate.touch()  # the restarted rank 1 will start its process group 12 s late
    n_inc = len(list((job.job_dir / "incarnations").glob("*.json")))
    cmd = [
        str(Path(sys.executable).parent / "gpu-recover"),
        "rendezvous",
        "--job-dir",
        str(job.job_dir),
        "--yes",
        "--json",
    ]
    docs = run_concurrently([cmd, cmd])
    assert sorted(d["outcome"] for d in docs) == ["coalesced", "done"]
    assert all(d["details"]["round_after"] == before + 1 for d in docs), (before, [d["details"] for d in docs])
    assert all(d["details"]["wait_list_entry_gone"] for d in docs)
    # no storm: a few seconds later the round is still before + 1 and the wait_list is empty
    time.sleep(3)
    st = _state(job)
    assert st["round"] == before + 1 and st["wait_list"] == [] and st["complete"]
    assert list(st["participants"]) == [n for n in st["last_heartbeat_age_s"]]  # nothing foreign left behind
    log = job.log.read_text()
    assert log.count("new nodes") == 1
    # an idempotent retry of the same request (the round it was meant for has passed) does nothing
    r = run_cli(
        "gpu-recover",
        "rendezvous",
        "--job-dir",
        str(job.job_dir),
        "--expect-round",
        str(before),
        "--yes",
        "--json",
        timeout=30,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "already-advanced"
    wait_for(lambda: len(list((job.job_dir / "incarnations").glob("*.json"))) >= n_inc + 2, 60, "new incarnations")
    audit = [json.loads(line) for line in (job.job_dir / "audit.log").read_text().splitlines()]
    assert sorted(
        a["outcome"] for a in audit if a["action"] == "rendezvous" and a["outcome"] in ("done", "coalesced")
    ) == ["coalesced", "done"]


def test_doctor_flags_workers_stuck_in_group_init(job):
    def flagged():
        r = run_cli(
            "gpu-doctor",
            "diagnose",
            "torchrun",
            "--job-dir",
            str(job.job_dir),
            "--init-timeout",
            "3",
            "--json",
            timeout=30,
        )
        doc = json.loads(r.stdout)
        return (r, doc) if any(h["kind"] == "stuck-in-init" for h in doc["hazards"]) else None

    r, doc = wait_for(flagged, 20, "the stuck-in-init hazard", interval=0.5)
    assert r.returncode == 2 and doc["verdict"] == "hung"
    hazard = next(h for h in doc["hazards"] if h["kind"] == "stuck-in-init")
    assert 0 in hazard["ranks"]  # rank 0 waits in init_process_group for the late rank 1
    job.gate.unlink()


def test_sigusr1_orphans_are_flagged_and_the_hang_runbook_kills_them_by_pid(job):
    workers = job.worker_pids()
    assert len(workers) == 2
    os.kill(job.agent_pid, signal.SIGUSR1)  # unhandled by torchrun: kills only the agent
    job.proc.wait(timeout=15)
    assert all(os.path.exists(f"/proc/{pid}") for pid in workers)
    r = run_cli("gpu-doctor", "diagnose", "torchrun", "--job-dir", str(job.job_dir), "--json", timeout=30)
    doc = json.loads(r.stdout)
    assert r.returncode == 2, r.stderr
    orphans = next(h for h in doc["hazards"] if h["kind"] == "orphaned-workers")
    assert set(orphans["pids"]) == workers and doc["verdict"] == "orphaned"
    # dry run: nothing is signalled, nothing recorded
    audit_before = (job.job_dir / "audit.log").read_bytes()
    r = run_cli("gpu-recover", "abort", "--job-dir", str(job.job_dir), "--dry-run", "--json", timeout=30)
    assert r.returncode == 0 and len(json.loads(r.stdout)["details"]["would_terminate"]) == 2
    assert job.worker_pids() == workers and (job.job_dir / "audit.log").read_bytes() == audit_before
    r = run_cli("gpu-recover", "runbook", "run", "hang", "--job-dir", str(job.job_dir), "--yes", "--json", timeout=90)
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    assert [(s["name"], s["outcome"]) for s in run["steps"]] == [
        ("diagnose", "done"),
        ("abort", "done"),
        ("restore", "skipped"),
        ("verify", "skipped"),
    ]
    assert job.worker_pids() == set()
    records = [json.loads(x) for x in (job.job_dir / "audit.log").read_text().splitlines()]
    (abort,) = [a for a in records if a["action"] == "abort" and a["run_id"] == run["run_id"]]
    assert set(abort["detail"]["terminated"]) == workers and abort["detail"]["quiescence"] == "proved"
    assert len(abort["detail"]["evidence"]) == len(list((job.job_dir / "incarnations").glob("*.json")))
    # idempotent: abort again finds every incarnation gone
    r = run_cli("gpu-recover", "abort", "--job-dir", str(job.job_dir), "--yes", "--json", timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "noop"
    assert (job.job_dir / "audit.log").read_bytes().startswith(audit_before)
