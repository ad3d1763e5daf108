"""`gpu-recover demo --scenario hsdp`, run for real: 4 torchrun agents train HSDP (2 replicas x 2 shards),
the node of rank 3 is lost mid-step, the survivors switch in place (same processes, no agent restarts
anything) to FSDP2 over 3, taking rank 3's shards from its replica in memory, certified and verified.
With the policy "keep the HSDP layout" the same loss drops the damaged replica whole: 0 elements move."""

from __future__ import annotations

import json

import psutil
import pytest

from gpuguard.generation.ledger_open import open_ledger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_hsdp_demo_survives_a_node_loss_in_place_resharded_from_memory(cli, tmp_path):
    job = tmp_path / "job"
    res = cli("gpu-recover", "demo", "--scenario", "hsdp", "--job-dir", str(job), "--json", timeout=220)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gpuguard.demo/1" and doc["scenario"] == "hsdp" and doc["ok"] is True
    assert doc["switch"] == "in-place" and doc["reason"] == "rank-failure" and doc["world_after"] == 3
    assert doc["generations"] == [0, 1, 2] and doc["kill"]["rank"] == 3
    assert doc["pids_unchanged"] and doc["agents_restarted_nothing"] and doc["verify_deep_rc"] == 0
    # the rebuilt state is bitwise the certified one, and the run ends equal to the one-process reference
    assert doc["restored_bitwise"] and doc["matches_reference"]
    assert doc["final_max_abs_diff"] <= doc["tolerance"]["atol"]
    assert 0 <= doc["steps_redone"] <= 1 and doc["frontier"] >= doc["kill"]["after_step"] - 1
    # shards moved peer to peer from the survivors' memory, none read from a snapshot
    assert 0 < doc["elements_moved"] < doc["elements"]
    assert any("sent from a surviving replica to" in line for line in doc["reshard_lines"])
    assert not any("read from snapshot" in line for line in doc["reshard_lines"])
    cert = open_ledger(job).get(2)
    assert cert.extra["switch"] == "in-place" and cert.ownership_map_version == 1
    assert list(cert.extra["sharded_state"]["lost"]) == [3]
    survivors = [m.incarnation.pid for m in cert.members]
    pids = [doc["kill"]["agent_pid"], *doc["kill"]["worker_pids"], *survivors]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    shown = cli("gpu-generation", "show", "--job-dir", str(job))
    assert shown.returncode == 0 and "in the survivors' memory" in shown.stdout and "lost ranks [3]" in shown.stdout


def test_hsdp_keeping_its_layout_under_torchrun_drops_the_damaged_replica_and_moves_nothing(cli, tmp_path):
    job = tmp_path / "job"
    argv = ("gpu-recover", "demo", "--scenario", "hsdp", "--shrink", "keep-layout", "--steps", "12", "--kill-step", "4")
    res = cli(*argv, "--job-dir", str(job), "--json", timeout=220)
    said = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, said
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["shrink"] == "keep-layout", said
    assert doc["switch"] == "in-place" and doc["world_after"] == 2 and doc["dropped"] == [2], said
    assert doc["elements_moved"] == 0 and doc["elements"] and doc["rebuilt"] is False, said
    assert doc["pids_unchanged"] and doc["agents_restarted_nothing"] and doc["verify_deep_rc"] == 0, said
    assert doc["restored_bitwise"] and doc["matches_reference"], said
    cert = open_ledger(job).get(2)
    assert list(cert.extra["layout_kept"]["dropped"]) == [2] and list(cert.extra["evicted"]["dead"]) == [3]
    assert "leaves: generation 2 keeps the HSDP layout" in (job / "agent-2.log").read_text(errors="replace")


def test_the_shrink_policy_is_a_usage_error_outside_the_hsdp_scenario(cli, tmp_path):
    res = cli("gpu-recover", "demo", "--shrink", "keep-layout", "--job-dir", str(tmp_path / "j"))
    assert res.returncode == 64 and "--shrink applies to --scenario hsdp only" in res.stderr
    assert not (tmp_path / "j").exists()
