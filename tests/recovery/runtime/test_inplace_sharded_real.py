"""Real processes switch in place with sharded state (FSDP2 / HSDP on gloo): the shards move from memory.

HSDP 2 x 2 loses rank 3 after its update of step 5, before its commit: the survivors (ranks 0-2, the
same processes) roll back to step 4 and go on as FSDP2 over 3 ranks, each taking what it now holds
from its own memory or a surviving replica (rank 3's shards exist on rank 1). The state rebuilt in
place must be, bitwise, the state generation 1 had after step 4 (the layout-independent digest the
job logged), and the run must end equal to the one-process reference. Plain FSDP2 over 3 ranks has
no replica of a lost shard: the switch is refused, saying so, and a relaunch at 2 restores the
certified snapshot resharded (the restart path). With the policy "keep the HSDP layout", the same loss
drops the damaged replica whole: rank 2 leaves (status 0), ranks 0-1 keep their model and shards, moved
to the new mesh, and nothing moves between ranks. The same under real torchrun agents losing a node:
tests/examples/test_demo_hsdp.py. A rank lost before the first commit: the survivors switch in place
from the initial state they remembered at activation (its optimizer fresh), digest-checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuguard.examples.fsdp_train import reference
from gpuguard.examples.inplace_train import Cluster
from gpuguard.foundation.errors import EXIT_REFUSED
from gpuguard.foundation.inplace_files import read_switch_records
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 8


def _run(
    job: Path,
    n: int,
    faults: str,
    shard: int,
    backend: str = "gloo",
    shrink: str = "repartition",
    digests: bool = True,
) -> tuple[dict, dict, dict]:
    with Cluster.launch(
        job,
        n,
        steps=STEPS,
        faults=faults,
        step_sleep=0.02,
        pg_timeout=5.0,
        grace=3.0,
        module="gpuguard.examples.inplace_fsdp",
        extra_env={
            "INPLACE_SHARD": str(shard),
            "INPLACE_DIGESTS": "1" if digests else "0",
            "GPUGUARD_BACKEND": backend,
            "INPLACE_SHRINK": shrink,
        },
    ) as c:
        codes = c.wait(150)
        pids = {r: p.pid for r, p in c.procs.items()}
        logs = {r: c.log(r) for r in c.procs}
    return codes, pids, logs


def _digests(job: Path) -> dict[tuple[int, int], str]:
    lines = (job / "fsdp-out" / "digests.jsonl").read_text().splitlines()
    return {(d["generation"], d["step"]): d["digest"] for d in map(json.loads, lines)}


def _assert_reference(job: Path) -> None:
    # the global-mean gradient is the same at any world size; only the reduction order differs
    final, ref = torch.load(job / "results" / "final.pt", weights_only=True), reference(STEPS)
    for k, v in ref.items():
        torch.testing.assert_close(final[k], v, atol=2e-5, rtol=1e-4)


def test_hsdp_survivors_switch_in_place_taking_the_lost_shards_from_a_replica(tmp_path):
    job = tmp_path / "job"
    codes, pids, logs = _run(job, 4, "3:5:before_commit:kill", shard=2)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -9}, logs
    cert = open_ledger(job).require_active()
    assert cert.generation == 2 and cert.extra["switch"] == "in-place" and cert.frontier.step == 4
    assert sorted(m.incarnation.pid for m in cert.members) == [pids[0], pids[1], pids[2]]  # no restart
    assert cert.ownership_map_version == 1 and list(cert.extra["rolled_back"]) == [0, 1, 2]
    # the certified digest is the state generation 1 held after step 4, and the state rebuilt in place
    digests = _digests(job)
    assert cert.extra["sharded_state_digest"] == digests[(1, 4)] == digests[(2, 4)]
    records = [read_switch_records(job, 2)[r] for r in range(3)]
    reshard = records[0]["reshard"]
    assert reshard["in_place"] and 0 < reshard["elements_moved"] < reshard["elements"]
    # what moved went peer to peer: every element one rank received another sent, none read from disk
    assert sum(r["reshard"]["mine"]["received"] for r in records) == sum(r["reshard"]["mine"]["sent"] for r in records)
    assert sum(r["reshard"]["mine"]["received"] for r in records) == reshard["elements_moved"]
    assert any("sent from a surviving replica to" in line for line in reshard["lines"])
    assert not any("read from snapshot" in line for line in reshard["lines"])
    assert list(cert.extra["sharded_state"]["lost"]) == [3]
    shown = run_cli("gpu-generation", "show", "--job-dir", str(job))
    assert shown.returncode == 0 and "in the survivors' memory" in shown.stdout and "lost ranks [3]" in shown.stdout
    deep = run_cli("gpu-generation", "verify", "--deep", "--job-dir", str(job))
    assert deep.returncode == 0, deep.stdout + deep.stderr
    results = {r: json.loads((job / "results" / f"{r}.json").read_text()) for r in range(3)}
    assert all(d["world"] == 3 and d["last_step"] == STEPS and d["pid"] == pids[r] for r, d in results.items())
    _assert_reference(job)


def test_hsdp_keeping_its_layout_drops_the_damaged_replica_and_moves_nothing(tmp_path):
    job = tmp_path / "job"
    # no digest collective at the start of a step: the survivors notice the loss inside FSDP's forward,
    # so the model they keep stopped mid-iteration (unsharded parameters registered, work in flight)
    codes, pids, logs = _run(job, 4, "3:5:before_commit:kill", shard=2, shrink="keep-layout", digests=False)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -9}, logs
    assert "leaves: generation 2 keeps the HSDP layout without this rank's damaged replica" in logs[2]
    cert = open_ledger(job).require_active()
    assert cert.generation == 2 and cert.extra["switch"] == "in-place" and cert.frontier.step == 4
    assert sorted(m.incarnation.pid for m in cert.members) == [pids[0], pids[1]]  # no restart
    assert cert.extra["layout_kept"]["replica_ranks"] == 2 and list(cert.extra["layout_kept"]["dropped"]) == [2]
    assert list(cert.extra["evicted"]["dead"]) == [3] and list(cert.extra["rolled_back"]) == [0, 1]
    records = read_switch_records(job, 2)
    assert sorted(records) == [0, 1]
    for rec in records.values():
        reshard = rec["reshard"]
        assert reshard["layout_kept"] and not reshard["rebuilt"]  # the same model, on the new mesh
        assert reshard["elements_moved"] == 0 and reshard["elements"] > 0
        assert reshard["mine"]["received"] == reshard["mine"]["sent"] == 0
    results = {r: json.loads((job / "results" / f"{r}.json").read_text()) for r in (0, 1)}
    assert all(d["world"] == 2 and d["last_step"] == STEPS and d["pid"] == pids[r] for r, d in results.items())
    assert not (job / "results" / "2.json").exists()
    _assert_reference(job)


def test_a_rank_lost_before_the_first_commit_switches_in_place_from_the_initial_state(tmp_path):
    job = tmp_path / "job"
    # rank 3 dies after its update of step 1: the survivors committed step 1, nobody proves rank 3 did
    codes, pids, logs = _run(job, 4, "3:1:before_commit:kill", shard=2)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -9}, logs
    cert = open_ledger(job).require_active()
    assert cert.generation == 2 and cert.extra["switch"] == "in-place" and cert.frontier.step == 0
    assert cert.frontier.state_manifest_digest == ""  # no snapshot: the survivors' memory is the state
    assert sorted(m.incarnation.pid for m in cert.members) == [pids[0], pids[1], pids[2]]  # no restart
    assert list(cert.extra["rolled_back"]) == [0, 1, 2]
    # the certified digest is the initial state generation 1 started from, and the state rebuilt in place
    digests = _digests(job)
    assert cert.extra["sharded_state_digest"] == digests[(1, 0)] == digests[(2, 0)]
    assert read_switch_records(job, 2)[0]["reshard"]["in_place"]
    results = {r: json.loads((job / "results" / f"{r}.json").read_text()) for r in range(3)}
    assert all(d["world"] == 3 and d["last_step"] == STEPS and d["pid"] == pids[r] for r, d in results.items())
    _assert_reference(job)  # the fresh optimizer took its first step in generation 2, as in a fault-free run


def test_plain_fsdp_is_refused_in_place_and_restarts_resharded_from_the_snapshot(tmp_path):
    job = tmp_path / "job"
    # the world group in torch's device:backend form (a GPU job: cpu:gloo,cuda:nccl; this torch has no NCCL)
    codes, _pids, logs = _run(job, 3, "2:5:before_commit:kill", shard=0, backend="cpu:gloo")
    assert codes == {0: EXIT_REFUSED, 1: EXIT_REFUSED, 2: -9}, logs
    for r in (0, 1):
        assert "in-place switch refused: ranks [2] lost; no survivor holds" in logs[r]
        assert "no replica of the lost shards survives" in logs[r] and "Traceback" not in logs[r]
    assert open_ledger(job).require_active().generation == 1  # nothing certified in place
    codes, _pids, logs = _run(job, 2, "", shard=0, backend="cpu:gloo")
    assert codes == {0: 0, 1: 0}, logs
    cert = open_ledger(job).require_active()
    assert cert.extra.get("switch") != "in-place" and cert.frontier.state_manifest_digest
    frontier = cert.frontier.step
    assert frontier >= 3  # at most the snapshot in flight at the kill is lost (a snapshot every step)
    digests = _digests(job)
    assert digests[(2, frontier)] == digests[(1, frontier)]  # restored bitwise, resharded 3 -> 2
    _assert_reference(job)
