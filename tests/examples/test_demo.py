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
    # every demo's output passes the deep check (the certified frontier's snapshot is never pruned)
    deep = cli("gpu-generation", "verify", "--deep", "--job-dir", str(job), "--json", timeout=60)
    assert deep.returncode == 0 and json.loads(deep.stdout)["deep"]["manifests"] >= 1, deep.stdout + deep.stderr


@pytest.mark.etcd
def test_demo_on_the_etcd_rendezvous_recovers_and_binds_each_round_to_its_generation(cli, tmp_path, etcd_url):
    """The same demo with `--rdzv-backend=gpuguard`: the restart's new round is certified as generation 2."""
    job = tmp_path / "job"
    endpoint = etcd_url.split("://", 1)[1]
    res = cli("gpu-recover", "demo", "--job-dir", str(job), "--rdzv-endpoint", endpoint, "--json", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["generations"] == [1, 2] and doc["final_hashes_equal"]
    hist = json.loads(cli("gpu-generation", "history", "--job-dir", str(job), "--json", timeout=60).stdout)
    rounds = {g["generation"]: g["rendezvous_round"] for g in hist["generations"]}
    assert rounds[1] == 0 and rounds[2] >= 1, rounds  # the restart's round, read from etcd


def test_demo_refuses_a_job_dir_in_use(cli, tmp_path):
    (tmp_path / "something").write_text("x")
    res = cli("gpu-recover", "demo", "--job-dir", str(tmp_path))
    assert res.returncode == 64
    assert "not empty" in res.stderr and res.stderr.count("\n") == 1
