"""Real processes switch generation in place: gloo on loopback, SIGKILL / SIGSTOP, the directory ledger.

Each test launches 4 plain worker processes (recovery.inplace_train) that train a float64 model whose
result does not depend on the world size; the survivors must end equal to a single-process reference
run, in the same processes, and the ledger must hold one certified chain.
"""

from __future__ import annotations

import json
import math
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.examples.inplace_train import Cluster, reference
from gpuguard.generation.ledger_open import open_ledger

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path, faults: str, steps: int, n: int = 4, env: dict[str, str] | None = None):
    job = tmp_path / "job"
    with Cluster.launch(
        job, n, steps=steps, faults=faults, step_sleep=0.01, pg_timeout=5.0, grace=3.0, extra_env=env
    ) as c:
        codes = c.wait(100)
        pids = {r: p.pid for r, p in c.procs.items()}
        logs = {r: c.log(r) for r in c.procs}
        results = c.results()
    return job, codes, pids, logs, results


def _assert_chain(job, url=None):
    led = open_ledger(job, url)
    history = led.history()
    # one certificate per generation, each the child of the one before: never two activations of one parent
    assert led.generations() == [c.generation for c in history] == list(range(len(history)))
    for parent, child in zip(history, history[1:]):
        assert child.parent_generation == parent.generation
        assert child.parent_certificate_digest == parent.digest()
    return history


def _assert_oracle(results, survivors, steps, pids):
    ref = reference(steps)
    assert sorted(results) == sorted(survivors)
    digests = {d["digest"] for d in results.values()}
    assert len(digests) == 1  # every replica holds the same state
    for r, doc in results.items():
        assert doc["pid"] == pids[r]  # the same process: nothing was restarted
        assert doc["last_step"] == steps
        assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(doc["params"], ref)), doc["params"]


def test_mid_update_kill_then_a_member_livelocks_while_joining(tmp_path):
    # rank 3 dies after its update of step 5, before committing it: ranks 0-2 had committed step 5,
    # so they roll back to the frontier (4). Rank 2 then livelocks while joining generation 2 (running,
    # never reporting): generation 2's group cannot form, its survivors report, the coordinator kills
    # rank 2 after the grace period: a clean generation 3.
    steps = 12
    job, codes, pids, logs, results = _run(tmp_path, "3:5:before_commit:kill,2:2:joining:spin", steps)
    assert codes[3] == -9 and codes[2] == -9, logs
    assert codes[0] == 0 and codes[1] == 0, logs
    _assert_oracle(results, [0, 1], steps, pids)
    history = _assert_chain(job)
    assert [c.extra.get("switch") for c in history[1:]] == ["restart", "in-place", "in-place"]
    g2, g3 = history[2], history[3]
    assert g2.frontier.step == 4 and len(g2.members) == 3 and g2.reason == "rank-failure"
    assert g2.extra["rolled_back"] and g2.extra["layout"]["dp"] == 3 and g2.extra["layout"]["global_batch"] == 12
    assert g2.quiescence == "proved" and any("gone" in e for e in g2.quiescence_evidence)
    assert g3.frontier.step == 4 and len(g3.members) == 2  # generation 2 committed nothing
    assert g3.reason == "hang" and list(g3.extra["evicted"]["killed"]) == [2]
    assert any("no report within 3 s, killed" in e for e in g3.quiescence_evidence)
    assert {m.incarnation.pid for m in g3.members} == {pids[0], pids[1]}
    assert set(g3.extra["phases"]) >= {"detect", "reported", "evicted", "frontier"}


@pytest.mark.etcd
def test_coordinator_dies_mid_decision_and_a_frozen_survivor_is_evicted(tmp_path, etcd_url):
    # rank 3 dies in step 4; rank 2 freezes (SIGSTOP) right after reporting; rank 0, the first coordinator,
    # dies while deciding. Rank 1 completes the decision: 0 and 3 gone, 2 killed; it trains on alone.
    # The ledger (the decision) lives in etcd here.
    u = urlsplit(etcd_url)
    url = f"etcd://{u.hostname}:{u.port}/inplace-{uuid.uuid4().hex}"
    steps = 8
    job, codes, pids, logs, results = _run(
        tmp_path, "3:4:before_allreduce:kill,2:1:reported:stop,0:1:coordinate:kill", steps, env={"GPUGUARD_LEDGER": url}
    )
    assert codes[2] == -9, f"the frozen rank was not killed: {codes}"  # evicted, never re-admitted
    assert codes[1] == 0, logs[1]
    _assert_oracle(results, [1], steps, pids)
    history = _assert_chain(job, url)
    assert not (job / "ledger").exists()
    g2 = history[-1]
    assert g2.generation == 2 and [m.incarnation.pid for m in g2.members] == [pids[1]]
    assert g2.extra["switch"] == "in-place" and g2.extra["coordinator"]["rank"] == 1
    assert sorted(g2.extra["evicted"]["dead"]) == [0, 3] and list(g2.extra["evicted"]["killed"]) == [2]
    assert any("stopped (SIGSTOP), killed" in e for e in g2.quiescence_evidence)


def test_a_tp_group_missing_a_member_is_refused_not_shrunk(tmp_path):
    # two ranks declared as one TP=2 group: losing one leaves a group that cannot compute
    job, codes, pids, logs, results = _run(tmp_path, "1:2:before_allreduce:kill", 4, n=2, env={"INPLACE_TP": "2"})
    assert codes == {0: 4, 1: -9}, logs  # the survivor stops (status 4): the restart path takes over
    assert not results
    refused = json.loads((job / "coord" / "inplace" / "g1" / "refused.json").read_text())
    assert "replica 0" in refused["reason"] and "tp=2" in refused["reason"]
    assert "in-place switch refused" in logs[0]
    assert open_ledger(job).generations() == [0, 1]  # nothing was certified
