"""gpu-recover actions on real processes and real files: abort, restore, verify; dry-run; confirmation."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpuguard.foundation.jobdir import ensure_job
from tests.support.cli import run_cli
from tests.support.processes import reap, record, spawn


def test_abort_never_kills_a_process_whose_create_time_differs(tmp_path):
    victim, bystander, stubborn = spawn(), spawn(), spawn(ignore_term=True)
    try:
        record(tmp_path, victim, 0)
        record(tmp_path, bystander, 1, start_shift=-100.0)  # the pid was "reused" by another process
        record(tmp_path, stubborn, 2)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["schema"] == "gpuguard.action/1" and doc["outcome"] == "done"
        assert sorted(doc["details"]["terminated"]) == sorted([victim.pid, stubborn.pid])
        assert doc["details"]["killed_after_grace"] == [stubborn.pid]
        assert doc["details"]["quiescence"] == "proved"
        ev = "\n".join(doc["details"]["evidence"])
        assert f"pid {bystander.pid}: gone (pid now belongs to a newer process: not signalled)" in ev
        assert f"pid {stubborn.pid}: terminated by SIGKILL" in ev
        assert victim.wait(10) == -15 and stubborn.wait(10) == -9
        assert bystander.poll() is None  # alive: never signalled
        q = json.loads(Path(doc["details"]["evidence_file"]).read_text())
        assert q["schema"] == "gpuguard.quiescence/1" and len(q["gone"]) == 3 and q["alive"] == []
        audit = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
        assert [a["outcome"] for a in audit] == ["done"] and audit[0]["args"]["grace_s"] == 1.0
    finally:
        reap(victim, bystander, stubborn)


def test_dry_run_changes_nothing_and_no_confirmation_is_refused(tmp_path):
    proc = spawn()
    try:
        record(tmp_path, proc, 0)
        before = sorted(p.name for p in tmp_path.rglob("*"))
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--dry-run", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "dry-run"
        r = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--dry-run")
        assert r.returncode == 66  # nothing to restore: said so, changed nothing
        assert sorted(p.name for p in tmp_path.rglob("*")) == before and proc.poll() is None
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), input="")
        assert r.returncode == 4 and "--yes" in r.stderr and proc.poll() is None
        (refused,) = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
        assert refused["outcome"] == "refused" and refused["exit_code"] == 4
    finally:
        reap(proc)


def test_restore_refuses_corrupt_states_with_bounded_tries(tmp_path):
    ensure_job(tmp_path)
    for step in (2, 4, 6, 8, 10):
        d = tmp_path / "snapshots" / f"step-{step}"
        d.mkdir(parents=True)
        (d / "state.json").write_text("{not json")
    r = run_cli(
        "gpu-recover", "restore", "--job-dir", str(tmp_path), "--yes", "--max-tries", "2", "--step", "9", "--json"
    )
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    reasons = {rej["step"]: rej["reason"] for rej in doc["details"]["rejected"]}
    assert reasons[10].startswith("after the frontier")
    assert reasons[8].startswith("state record") and reasons[6].startswith("state record")
    assert "not tried" in reasons[4] and "not tried" in reasons[2]
    assert not (tmp_path / "restore.json").exists()


def test_verify_waits_with_a_timeout_then_verifies(tmp_path):
    ensure_job(tmp_path)  # a job whose first certificate is not there yet
    r = run_cli("gpu-recover", "verify", "--job-dir", str(tmp_path), "--timeout", "0.5")
    assert r.returncode == 75 and "within 0.5 s" in r.stderr
    from gpuguard.generation.job import init_job

    init_job(tmp_path)
    r = run_cli("gpu-recover", "verify", "--job-dir", str(tmp_path), "--json", "--timeout", "5")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["outcome"] == "done" and doc["details"]["generation"] == 0
    r = run_cli("gpu-recover", "verify", "--job-dir", str(tmp_path), "--newer-than", "0", "--timeout", "0.3")
    assert r.returncode == 75


def test_missing_job_dir_is_one_line_and_exit_66(tmp_path):
    r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path / "nope"), "--yes")
    assert r.returncode == 66 and len(r.stderr.strip().splitlines()) == 1


def test_restore_skips_a_corrupted_snapshot_and_pins_the_previous_verified_one(tmp_path):
    import torch

    from gpuguard.recovery.snapshots.store import save_snapshot

    ensure_job(tmp_path)
    for step in (3, 6, 9):
        save_snapshot(tmp_path, step, {"w": torch.full((4,), float(step))}, generation=0, owner="test")
    shard = next(p for p in (tmp_path / "snapshots" / "step-9").rglob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte on disk
    shard.write_bytes(bytes(data))
    r = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--yes", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["details"]["chosen"]["step"] == 6
    assert [rej["step"] for rej in doc["details"]["rejected"]] == [9]
    assert "corrupt" in doc["details"]["rejected"][0]["reason"]
    pin = json.loads((tmp_path / "restore.json").read_text())
    assert pin["step"] == 6 and pin["manifest_digest"] == doc["details"]["chosen"]["manifest_digest"]
    # idempotent: the same choice again changes nothing
    r = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--yes", "--json")
    assert json.loads(r.stdout)["outcome"] == "noop"
    r = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--yes", "--step", "5", "--json")
    assert json.loads(r.stdout)["details"]["chosen"]["step"] == 3


def test_restore_finds_the_states_on_the_shared_snapshot_root(tmp_path):
    """Across hosts the snapshots live on shared storage, not in the host's job dir: restore reads
    them there (--snapshot-root or the runtime's GPUGUARD_SNAPSHOT_ROOT) and pins that path."""
    import torch

    from gpuguard.recovery.snapshots.store import save_snapshot

    job, shared = tmp_path / "job", tmp_path / "shared"
    ensure_job(job)
    for step in (4, 8):
        save_snapshot(shared, step, {"w": torch.full((4,), float(step))}, generation=0, owner="test")
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--yes", "--json", env={"GPUGUARD_SNAPSHOT_ROOT": ""})
    assert r.returncode == 66 and "no snapshot or checkpoint to restore" in r.stderr  # not in the job dir
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--snapshot-root", str(shared), "--yes", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["details"]["chosen"]["step"] == 8 and doc["details"]["snapshot_root"] == str(shared)
    assert json.loads((job / "restore.json").read_text())["path"] == str(shared / "snapshots" / "step-8")
    r = run_cli(
        "gpu-recover",
        "restore",
        "--job-dir",
        str(job),
        "--step",
        "5",
        "--yes",
        "--json",
        env={"GPUGUARD_SNAPSHOT_ROOT": str(shared)},
    )
    assert r.returncode == 0 and json.loads(r.stdout)["details"]["chosen"]["step"] == 4
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--snapshot-root", str(tmp_path / "gone"), "--yes")
    assert r.returncode == 66 and len(r.stderr.strip().splitlines()) == 1


def test_abort_never_signals_a_worker_of_another_gpuguard_job(tmp_path):
    """Same torchrun run id, right pid and start time, but launched for another gpuguard job
    (GPUGUARD_JOB_ID differs from job.json's id): not this job's, left alone."""
    ours, theirs = spawn(job_id=tmp_path.name), spawn(job_id="another-job")
    try:
        record(tmp_path, ours, 0)  # job.json's id is the directory's name
        record(tmp_path, theirs, 1)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--yes", "--grace", "1", "--json", timeout=60)
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [ours.pid] and ours.wait(10) == -15
        assert theirs.poll() is None
        mine = {p["rank"]: p for p in details["processes"]}
        assert mine[1]["outcome"] == "not-the-job" and "job id" in mine[1]["reason"]
    finally:
        reap(ours, theirs)


def test_abort_never_signals_a_process_that_is_not_the_jobs(tmp_path):
    """A forged record with the right pid and start time names an unrelated process: it lacks the
    job's run id in its environment (or runs as another uid), so it is reported and left alone,
    and the abort proves nothing."""
    stranger, other_uid, worker = spawn(run_id=None), spawn(), spawn()
    try:
        record(tmp_path, stranger, 0)
        record(tmp_path, other_uid, 1, uid=12345)
        record(tmp_path, worker, 2)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [worker.pid] and worker.wait(10) == -15
        assert stranger.poll() is None and other_uid.poll() is None  # never signalled
        unverified = "\n".join(details["unverified"])
        assert f"pid {stranger.pid}: alive but not the job's (its TORCHELASTIC_RUN_ID is unset" in unverified
        assert f"pid {other_uid.pid}: alive but not the job's (runs as uid {os.getuid()}, the record says 12345)" in (
            unverified
        )
        assert details["quiescence"] == "unknown"
    finally:
        reap(stranger, other_uid, worker)


def test_an_unreadable_record_is_never_a_quiescence_proof(tmp_path):
    """A dangling link among the records used to empty the whole scan ("every incarnation is gone")."""
    worker = spawn()
    try:
        record(tmp_path, worker, 0)
        (tmp_path / "incarnations" / "zz-dangling.json").symlink_to(tmp_path / "nowhere.json")
        (tmp_path / "incarnations" / "garbage.json").write_text("{not json")
        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--yes", "--grace", "1", "--json", timeout=60)
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [worker.pid]  # the good record was still read
        assert details["quiescence"] == "unknown"
        assert sum("unreadable incarnation record" in u for u in details["unverified"]) == 2
        assert any("symbolic link" in u for u in details["unverified"])
    finally:
        reap(worker)
