"""`gpu-recover demo`: the README's main command, run for real (4 gloo workers under torchrun)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_demo_kills_a_worker_mid_update_and_ends_certified(cli, tmp_path):
    job = tmp_path / "job"
    res = cli("gpu-recover", "demo", "--job-dir", str(job), "--json", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gpuguard.demo/1" and doc["ok"] is True
    assert doc["kill"]["point"] == "mid-update" and doc["kill"]["rank"] == 2
    assert doc["generations"] == [1, 2]
    assert doc["frontier"] in (doc["kill"]["step"] - 1, doc["kill"]["step"] - 2)
    assert doc["resumed_at"] == doc["frontier"] + 1
    assert doc["final_hashes_equal"] and doc["verify_rc"] == 0
    # the job dir is left for inspection: ledger, snapshots with manifests, incarnations, the log
    assert (job / "ledger" / "gen-2.json").exists() and (job / "torchrun.log").exists()
    assert list((job / "snapshots").glob("step-*/gpuguard.manifest.json"))
    assert len(list((job / "incarnations").glob("*.json"))) == 8


def test_demo_refuses_a_job_dir_in_use(cli, tmp_path):
    (tmp_path / "something").write_text("x")
    res = cli("gpu-recover", "demo", "--job-dir", str(tmp_path))
    assert res.returncode == 64
    assert "not empty" in res.stderr and res.stderr.count("\n") == 1
