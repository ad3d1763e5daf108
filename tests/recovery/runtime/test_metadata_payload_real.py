"""Issue 28 finding 2 on real torchrun jobs (gloo, 2 workers): a planted `.metadata` never runs.

A job trains and snapshots; a `.metadata` whose unpickling creates a marker file replaces the newest
snapshot's; the job is launched again. The coordinator refuses that state in one line (the manifest
binds `.metadata`), the job resumes from the previous snapshot, and no marker file appears anywhere.
On main, both restoring workers ran the payload (the marker was written) before DCP failed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest

from gpuguard.examples import demo
from gpuguard.generation.ledger_open import open_ledger
from tests.recovery.runtime.test_runtime_sharded import launch as launch_sharded
from tests.recovery.snapshots.test_dcp_metadata_bound import Payload
from tests.recovery.snapshots.test_sharded_snapshot import finish
from tests.support.cli import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def plant(snapshot: Path, marker: Path) -> None:
    (snapshot / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def replicated(job: Path, steps: int) -> str:
    argv = demo.torchrun_argv(
        job, workers=2, steps=steps, kills=[], max_restarts=0, port=free_port(), run_id=f"m{os.getpid()}-{steps}"
    )
    env = {**demo.worker_env(), "GPUGUARD_PG_TIMEOUT": "20"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    rc, out = finish(proc, 120)
    assert rc == 0, out[-4000:]
    return out


def sharded(job: Path, steps: int) -> str:
    return launch_sharded(job, 2, steps, "--no-digests", timeout=110)


@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_a_planted_metadata_is_refused_in_one_line_and_the_job_resumes_from_the_previous_state(tmp_path, kind):
    launch = replicated if kind == "replicated" else sharded
    job = tmp_path / "job"
    launch(job, 4)
    newest = max((job / "snapshots").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    step = int(newest.name.split("-")[1])
    marker = tmp_path / "pwned"
    plant(newest, marker)
    out = launch(job, step + 2)
    refusals = [line for line in out.splitlines() if f"rejected step {step}:" in line]
    assert refusals, out[-4000:]
    assert all(".metadata: BLAKE3" in line and "replaced or corrupted" in line for line in refusals), refusals
    ledger = open_ledger(job)
    resumed = ledger.require_active()
    assert resumed.frontier.step == step - 1, (resumed.frontier.step, step)
    assert any(r.startswith(f"step {step}: corrupt: .metadata") for r in resumed.extra["rejected"])
    assert not marker.exists()
    assert not [p for p in tmp_path.rglob("pwned")]
    if kind == "replicated":
        resumes = [json.loads(line) for line in (job / "demo-out" / "resume-0.jsonl").read_text().splitlines()]
        assert resumes[-1]["frontier_step"] == step - 1
