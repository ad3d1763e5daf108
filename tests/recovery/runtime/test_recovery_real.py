"""The runtime against real torchrun jobs (4 gloo workers, torch's default shared store).

Launches are shared between assertions (the machine has 2 cores): one no-fault reference run,
one job that is SIGKILLed at every point of a step in turn (4 kills -> 4 recoveries), and one
continuation of that job after a snapshot shard was corrupted on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.examples import demo
from gpuguard.foundation.steplog import committed_steps
from gpuguard.recovery.snapshots.store import select_restorable
from tests.support.generation import child, members

pytestmark = pytest.mark.slow

STEPS = 16
# rank:step:point -- every kill point of a step, on a different rank each time
KILLS = ["1:3:before-allreduce", "2:6:after-allreduce", "3:9:mid-update", "0:12:snapshot"]
CONTINUE_TO = 19


def launch(
    job_dir: Path, steps: int, kills: list[str] = (), timeout: float = 150.0, max_restarts: int = 6
) -> tuple[int, str]:
    argv = demo.torchrun_argv(
        job_dir,
        workers=4,
        steps=steps,
        kills=list(kills),
        max_restarts=max_restarts,
        port=demo.free_port(),
        run_id=f"t{os.getpid()}-{job_dir.name}",
        extra=["--hashes"],
    )
    env = demo.worker_env()
    env["GPUGUARD_PG_TIMEOUT"] = "30"
    lines: list[str] = []
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        lines.append(out)
    except subprocess.TimeoutExpired:
        demo.stop_job(proc, job_dir)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"torchrun job did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        demo.stop_job(proc, job_dir)
    return proc.returncode, "".join(lines)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    job = tmp_path_factory.mktemp("ref")
    rc, out = launch(job, CONTINUE_TO)
    assert rc == 0, out[-4000:]
    return {r["step"]: r["hash"] for r in records(job / "demo-out" / "hashes.jsonl")}


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory, reference) -> tuple[Path, str]:
    job = tmp_path_factory.mktemp("kills")
    rc, out = launch(job, STEPS, KILLS)
    assert rc == 0, out[-6000:]
    return job, out


def test_every_kill_point_resumes_at_the_certified_frontier_with_the_reference_state(killed_job, reference):
    from gpuguard.generation.ledger_open import open_ledger

    job, out = killed_job
    fired = sorted(json.loads(p.read_text())["step"] for p in (job / "faults").glob("kill-*.json"))
    assert fired == [3, 6, 9, 12], out[-3000:]
    ledger = open_ledger(job)
    history = ledger.history()
    assert [c.generation for c in history] == list(range(len(KILLS) + 2))  # genesis, start, one per kill
    for rank in range(4):
        resumes = records(job / "demo-out" / f"resume-{rank}.jsonl")
        assert [r["generation"] for r in resumes] == [1, 2, 3, 4, 5]
        for kill_step, r in zip(fired, resumes[1:]):
            cert = ledger.get(r["generation"])
            assert r["frontier_step"] == cert.frontier.step
            # RPO: at most one committed step lost (the killed step itself was never committed by all)
            assert kill_step - 2 <= cert.frontier.step <= kill_step, (kill_step, cert.frontier.step)
            assert r["hash"] == reference[cert.frontier.step], f"rank {rank} resumed from a different state"
            assert cert.quiescence == "proved" and cert.reason == "rank-failure"
            assert cert.extra["attempt_source"].startswith("rendezvous round")
            assert cert.ranks[rank].id == r["incarnation"]
    finals = [records(job / "demo-out" / f"final-{rank}.jsonl")[-1] for rank in range(4)]
    assert {f["hash"] for f in finals} == {reference[STEPS]}


def test_step_records_separate_collective_wait_from_compute(killed_job):
    """The runtime marks the all-reduce, so the vote can name the rank that never arrived."""
    from gpuguard.collectors.step_records import read_job

    job, _ = killed_job
    ranks = read_job(job).ranks
    assert sorted(ranks) == [0, 1, 2, 3]
    for series in ranks.values():
        assert series.steps, f"rank {series.rank} wrote no step records"
        # every finished step carries the bytes of its all-reduce (the demo model's gradients)
        assert all(s.nbytes > 0 for s in series.steps), series.steps[-3:]
        assert series.steps[-1].step == STEPS


def test_a_kill_during_the_snapshot_never_publishes_a_partial_one(killed_job):
    from gpuguard.generation.ledger_open import open_ledger

    job, _ = killed_job
    cert = open_ledger(job).get(5)  # the generation after the kill inside rank 0's snapshot writer
    assert cert.frontier.step == 11
    assert not list((job / "snapshots").glob("step-*/.*tmp*"))


def test_certificates_verify_with_the_cli(killed_job, cli):
    job, _ = killed_job
    from gpuguard.generation.ledger_open import open_ledger
    from gpuguard.generation.verify import verify_ledger

    ledger = open_ledger(job)
    report = verify_ledger(ledger, ledger.key)
    assert report.ok, [str(f) for f in report.findings]
    assert report.checked == list(range(6))


def test_a_corrupted_snapshot_shard_is_rejected_and_the_previous_state_is_used(killed_job, reference):
    """Step 16's shard is corrupted (the manifest catches it); step 15's state record claims another
    in-memory digest (`state.json` is not under the manifest: the members load it, find another
    digest, refuse, and the next attempt skips it). The job resumes from step 14, the newest state
    that verifies and loads. (A truncated `.metadata` used to play step 15's part: the manifest
    binds it now, so the coordinator refuses it before any member tries.)"""
    from gpuguard.generation.ledger_open import open_ledger

    job, _ = killed_job
    newest = job / "snapshots" / f"step-{STEPS}"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    sel = select_restorable(job, STEPS)
    assert sel.chosen is not None and sel.chosen.step == STEPS - 1
    assert any(r.step == STEPS and "corrupt" in r.reason for r in sel.rejected)
    record = job / "snapshots" / f"step-{STEPS - 1}" / "state.json"
    doc = json.loads(record.read_text())
    doc["state_digest"] = "0" * 64
    record.write_text(json.dumps(doc))
    # an activation that died between its chunks and its transaction left chunks no certificate names
    before = open_ledger(job)
    lost = child(before.require_active(), members(5), extra={"lost": True})
    orphans = set(lost.chunk_refs()) - set(before.require_active().chunk_refs())
    before._write_chunks(list(lost.chunks()))
    assert orphans and orphans <= set(before._chunk_stamps())

    rc, out = launch(job, CONTINUE_TO)
    assert rc == 0, out[-4000:]
    assert "pruned" in out and not orphans & set(open_ledger(job)._chunk_stamps())  # the activator tidied
    assert "refuses to start" in out and "differs from the snapshot's" in out
    ledger = open_ledger(job)
    refused, cert = ledger.get(6), ledger.require_active()
    assert refused.frontier.step == STEPS - 1  # certified, then refused by its members: never ran
    assert cert.generation == 7 and cert.frontier.step == STEPS - 2
    assert any(f"step {STEPS}" in r and "corrupt" in r for r in refused.extra["rejected"])
    assert any(f"step {STEPS - 1}" in r and "unrestorable" in r for r in cert.extra["rejected"])
    assert not committed_steps(job, 6) and ledger.frontier_record(6) is None  # never ran a step
    resume = records(job / "demo-out" / "resume-0.jsonl")[-1]
    assert resume["hash"] == reference[STEPS - 2]
    finals = [records(job / "demo-out" / f"final-{rank}.jsonl")[-1] for rank in range(4)]
    assert {f["hash"] for f in finals} == {reference[CONTINUE_TO]}


def test_a_stale_incarnation_cannot_commit_or_publish_a_snapshot(killed_job):
    """An old-generation incarnation (as a zombie would be) is fenced: dropped and counted, and the
    ledger never hears of it (a commit is local; the watch names the newer generation)."""
    job, _ = killed_job
    code = r"""
import json, sys, torch
from gpuguard.recovery.runtime.runtime import Runtime, FencedError
from gpuguard.recovery.runtime.writers import ReplicatedWriter
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.examples.demo_train import build
job = sys.argv[1]
rt = Runtime(job, rank=1, world_size=4, local_rank=1, master_addr="127.0.0.1", master_port=1, run_id="x",
             restart_count=0, use_agent_store=True)
ledger = open_ledger(job)
old = ledger.get(ledger.require_active().generation - 1)
rt.context.generation = old.generation  # a zombie of the older generation
rt.context.incarnation = old.ranks[1]
rt.objects.model, rt.objects.optimizer = build()
before = ledger.fenced_count()
try:
    rt.commit(3)
    print("COMMITTED")
except FencedError as exc:
    print("FENCED", exc)
ReplicatedWriter(rt.context, rt.outcomes).write(99, rt.state_dict())
print(json.dumps({"fenced_commits": rt.counters.fenced_commits, "fenced_snapshots": rt.counters.fenced_snapshots,
                  "ledger_fenced": ledger.fenced_count() - before}))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("FENCED")
    counts = json.loads(lines[-1])
    # fenced by the generation watch before anything is written: the ledger holds nothing of it
    assert counts == {"fenced_commits": 1, "fenced_snapshots": 1, "ledger_fenced": 0}
    assert not (job / "snapshots" / "step-99").exists()


def test_members_refuse_to_start_when_the_certificate_cannot_be_verified(killed_job, tmp_path):
    """A job dir whose signing key does not match its ledger: the members refuse, one line each, exit 4."""
    import shutil

    from gpuguard.generation.keys import KEY_FILE

    job = tmp_path / "forged"
    shutil.copytree(killed_job[0], job)
    (job / KEY_FILE).write_text(os.urandom(32).hex() + "\n")
    before = sorted(p.name for p in (job / "ledger").glob("gen-*.json"))
    rc, out = launch(job, STEPS + 2, max_restarts=0, timeout=120)
    assert rc != 0
    refusals = [line for line in out.splitlines() if "refuses to start" in line]
    # the first refusal makes torchrun stop the others (SIGTERM), so not every rank may get to say it
    assert refusals, out[-3000:]
    assert all(
        line.startswith("gpuguard: rank ") and "wrong signing key or tampered ledger" in line for line in refusals
    ), refusals
    assert "exitcode: 4" in out
    assert sorted(p.name for p in (job / "ledger").glob("gen-*.json")) == before  # nothing activated
