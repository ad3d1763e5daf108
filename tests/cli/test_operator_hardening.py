"""Issue 28 findings 8 and 9 on the real console scripts: read-only commands write nothing, a mutating
one checks its audit log before it acts, a missing snapshot root is said, unreadable incarnation
records are shown, and a job-provided string can neither forge a line nor reorder one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpuguard.foundation.jobdir import ensure_job
from gpuguard.generation.job import init_job, open_job_ledger
from tests.support.cli import run_cli
from tests.support.generation import child


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _snapshot_job(tmp_path: Path) -> Path:
    import torch

    from gpuguard.recovery.snapshots.store import save_snapshot

    job = tmp_path / "job"
    init_job(job)
    ensure_job(job)
    save_snapshot(job, 0, {"w": torch.ones(4)}, generation=0, owner="t")
    return job


def test_gpu_recover_verify_writes_nothing(tmp_path):
    job = tmp_path / "job"
    init_job(job)
    before = _tree(job)
    r = run_cli("gpu-recover", "verify", "--job-dir", str(job), "--timeout", "1")
    assert r.returncode == 0, r.stderr
    assert _tree(job) == before and not (job / "audit.log").exists()


def test_restore_with_a_linked_audit_log_refuses_before_it_pins(tmp_path):
    job = _snapshot_job(tmp_path)
    victim = tmp_path / "elsewhere.log"
    victim.write_text("")
    (job / "audit.log").symlink_to(victim)
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--yes")
    assert r.returncode == 73, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "symbolic link" in r.stderr
    assert not (job / "restore.json").exists(), "pinned, then failed to record it"
    assert victim.read_text() == ""


def test_verify_deep_with_a_missing_snapshot_root_is_66(tmp_path):
    job = _snapshot_job(tmp_path)
    missing = tmp_path / "no-such-root"
    r = run_cli("gpu-generation", "verify", "--job-dir", str(job), "--deep", "--snapshot-root", str(missing))
    assert r.returncode == 66 and len(r.stderr.strip().splitlines()) == 1 and str(missing) in r.stderr
    r = run_cli(
        "gpu-generation", "verify", "--job-dir", str(job), "--deep", env={"GPUGUARD_SNAPSHOT_ROOT": str(missing)}
    )
    assert r.returncode == 66
    assert run_cli("gpu-generation", "verify", "--job-dir", str(job), "--deep").returncode == 0


def test_status_says_when_incarnation_records_are_unreadable(tmp_path):
    job = tmp_path / "job"
    init_job(job)
    ensure_job(job)
    (job / "incarnations").mkdir()
    (job / "incarnations" / "bad.json").write_text("{not json")
    os.mkfifo(job / "incarnations" / "fifo.json")
    r = run_cli("gpu-recover", "status", "--job-dir", str(job), "--json", timeout=60)
    doc = json.loads(r.stdout)
    assert len(doc["incarnations"]["unreadable"]) == 2
    assert any("incarnation record(s) unreadable" in why for why in doc["reasons"])
    text = run_cli("gpu-recover", "status", "--job-dir", str(job), timeout=60).stdout
    assert "incarnations   2 record(s) unreadable" in text and "fifo.json" in text


def test_a_newline_in_a_job_id_cannot_forge_a_line_and_bidi_is_escaped(tmp_path):
    job = tmp_path / "job"
    init_job(job, job_id="real\nsafe to resume: yes, because FORGED")
    led = open_job_ledger(job)
    led.activate(child(led.require_active(), (), key=led.key, reason="rank-failure\u202egnp.exe"))
    for argv in (("gpu-generation", "show"), ("gpu-generation", "history"), ("gpu-recover", "status")):
        r = run_cli(*argv, "--job-dir", str(job), timeout=60)
        assert not any(line.startswith("safe to resume: yes, because FORGED") for line in r.stdout.splitlines()), argv
        assert "\u202e" not in r.stdout, argv
    show = run_cli("gpu-generation", "show", "--job-dir", str(job)).stdout
    assert "real\\x0asafe to resume" in show and "rank-failure\\u202egnp.exe" in show
