"""The simulated matrix: gpuguard never fails; the others fail where the benchmark says they do.

Expectations are checked against the runs (derived, not hard-coded rows): the test fails if a
strategy stops failing (or starts failing) on the class of schedules the claim is about.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguard.transitions import report, runner
from gpuguard.transitions.certified import Certified
from gpuguard.transitions.runner import make_strategy
from gpuguard.transitions.schedules import BOUNDARIES, FAULTS, Schedule

SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def rows():
    # tmpfs when there is one: the semantics do not depend on the disk, fsync latency does (CI is shared)
    return runner.run_matrix(layouts=("dp",), workdir=SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None)


def pick(rows, strategy, **kw):
    return [r for r in rows if r.strategy == strategy and all(getattr(r, k) == v for k, v in kw.items())]


def test_the_matrix_covers_every_fault_and_boundary(rows):
    for name in ("restart-all", "communicator-only", "gpuguard"):
        assert {(r.fault, r.boundary) for r in pick(rows, name)} == {(f, b) for f in FAULTS for b in BOUNDARIES}


def test_gpuguard_has_no_semantic_failure(rows):
    bad = [f"{r.fault}@{r.boundary}: {r.detail}" for r in pick(rows, "gpuguard") if r.semantic_failure]
    assert not bad


def test_communicator_only_fails_mid_update_and_on_stale_completions(rows):
    assert all(r.semantic_failure for r in pick(rows, "communicator-only", boundary="mid-optimizer-write"))
    for b in ("before-allreduce", "allreduce-partial"):
        (r,) = pick(rows, "communicator-only", fault="stale-completion", boundary=b)
        assert r.semantic_failure and any(
            f["kind"] in ("wrong-gradient", "stale-effect-visible") for f in r.findings
        ), r.detail


def test_restart_all_is_right_with_a_whole_checkpoint_but_slower_and_loses_more(rows):
    whole = [r for r in pick(rows, "restart-all") if r.fault not in ("corrupt-shard",)]
    assert whole and not [r.detail for r in whole if r.semantic_failure]
    assert all(r.semantic_failure for r in pick(rows, "restart-all", fault="corrupt-shard"))
    for r in whole:
        (g,) = pick(rows, "gpuguard", fault=r.fault, boundary=r.boundary)
        assert r.recovery_s > g.recovery_s
        assert r.steps_lost >= g.steps_lost
    assert sum(r.steps_lost for r in whole) > sum(g.steps_lost for g in pick(rows, "gpuguard"))


def test_gpuguard_fenced_the_late_results(rows):
    late = pick(rows, "gpuguard", fault="stale-completion") + pick(rows, "gpuguard", fault="rank-reuse")
    for r in late:
        # a late shard write lands in the old generation's unsealed checkpoint (no manifest): never read
        if r.boundary != "mid-checkpoint-write":
            assert r.fenced >= 1, (r.fault, r.boundary)
    assert all(r.sync_ops_per_step >= 3 for r in pick(rows, "gpuguard"))  # a commit record per rank per step


def test_partially_written_sharded_checkpoint_breaks_restart_all_not_gpuguard():
    sch = Schedule("process-death", "mid-checkpoint-write", layout="zero1")
    assert runner.run_one(sch, "restart-all").semantic_failure
    g = runner.run_one(sch, "gpuguard")
    assert not g.semantic_failure, g.detail
    bad = runner.run_one(Schedule("corrupt-shard", "before-commit", layout="zero1"), "gpuguard")
    assert not bad.semantic_failure and bad.steps_lost > 3  # the corrupted checkpoint was refused: older one


def test_a_gpuguard_without_its_fence_is_caught(monkeypatch):
    """Negative control: the benchmark can see a broken gpuguard."""
    monkeypatch.setattr(Certified, "accept_late", lambda self, sim, p, item: True)
    r = runner.run_one(Schedule("stale-completion", "allreduce-partial"), "gpuguard")
    assert r.semantic_failure and "stale" in r.detail or "gradient" in r.detail


def test_the_document_and_the_exit_decision(rows):
    doc = json.loads(json.dumps(report.document(rows)))
    assert doc["schema"] == "gpuguard.bench/1" and doc["bench"] == "transitions"
    assert {r["strategy"] for r in doc["results"]} == {"restart-all", "communicator-only", "gpuguard"}
    assert doc["ratios"]["recovery_speedup"] > 1 and doc["ratios"]["steps_lost_ratio"] < 1
    assert report.gpuguard_failures(rows) == 0
    broken = [runner.Row(**{**r.__dict__, "semantic_failure": True}) if r.strategy == "gpuguard" else r for r in rows]
    assert report.gpuguard_failures(broken) == 42  # the CLI exits 1 on any


def test_the_ledger_gpuguard_left_behind_verifies(tmp_path):
    """The simulator drives the real ledger: its chain verifies, the late writers are on record."""
    from gpuguard.generation.verify import verify_ledger
    from gpuguard.transitions.oracle import judge
    from gpuguard.transitions.sim import Sim

    s = make_strategy("gpuguard")
    sim = Sim(Schedule("rank-reuse", "mid-ledger-write"), s, tmp_path)
    sim.run()
    assert judge(sim.outcome()).ok
    report_ = verify_ledger(s.ledger, s.key)
    assert report_.ok, [str(f) for f in report_.findings]
    history = s.ledger.history()
    assert [c.generation for c in history] == [0, 1, 2]
    assert history[2].quiescence == "rolled_back" and history[2].admitted == (3,)  # the reused rank, admitted
    assert s.ledger.fenced_count() >= 2  # the zombie's commit records (old generation; old incarnation)
    assert any(r.violations[0].rule == "compare-and-swap" for r in s.ledger.refusals())  # the late activation


@pytest.mark.parametrize(
    "kw",
    [
        dict(fault="nope", boundary="before-commit"),
        dict(fault="process-death", boundary="nope"),
        dict(fault="process-death", boundary="before-commit", victim_rank=0),
        dict(fault="process-death", boundary="before-commit", fault_step=5),
    ],
)
def test_bad_schedules_are_refused(kw):
    with pytest.raises(ValueError):
        Schedule(**kw)
