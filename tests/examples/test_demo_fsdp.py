"""`gpu-recover demo --scenario fsdp`, run for real: 4 torchrun agents train an FSDP2 model with sharded
snapshots, one node (agent + worker) is SIGKILLed, the 3 others resume from the certified snapshot
resharded, bitwise at the frontier, within the stated tolerance of a fault-free reference at the end."""

from __future__ import annotations

import json

import psutil
import pytest

from gpuguard.generation.ledger_open import open_ledger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_fsdp_demo_resumes_a_lost_node_resharded_and_certified(cli, tmp_path):
    job = tmp_path / "job"
    res = cli(
        "gpu-recover", "demo", "--scenario", "fsdp", "--steps", "8", "--kill-step", "3", "--job-dir", str(job),
        "--json", timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gpuguard.demo/1" and doc["scenario"] == "fsdp" and doc["ok"] is True
    assert (doc["first_world"], doc["world_after"], doc["reason"]) == (4, 3, "scale-down")
    assert doc["generations"] == [0, 1, 2] and doc["kill"]["rank"] == 3
    # the frontier: the last snapshot every member's part made durable before the kill (the one in
    # flight at the kill is lost; ranks are at most a step apart: FSDP2's all-gathers pace them)
    assert 0 <= doc["steps_lost"] <= 2 and doc["frontier"] == doc["kill"]["after_step"] - doc["steps_lost"]
    assert doc["restored_bitwise"] and doc["certified_plan_held"] and doc["matches_reference"]
    assert doc["rng"].startswith("RNG not restored: world 4 -> 3")
    assert doc["reshard_lines"][0] == "world 4 -> 3 (ownership map v0 -> v1)"
    assert any(line.startswith("rank 3 (lost)'s shards of") for line in doc["reshard_lines"])
    assert doc["verify_deep_rc"] == 0
    cert = open_ledger(job).get(2)
    assert list(cert.extra["reshard"]["lost"]) == [3] and cert.extra["ownership_map"]["world_size"] == 4
    assert len(cert.members) == 3 and cert.ownership_map_version == 1
    # nothing the demo started is left running
    pids = [doc["kill"]["agent_pid"], *doc["kill"]["worker_pids"], *(m.incarnation.pid for m in cert.members)]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
