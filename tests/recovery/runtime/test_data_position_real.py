"""The data position as certified state across a world-size change (issue 24 item 2), on real torchrun jobs.

3 gloo workers train `tests/support/jobs/data_job.py` (replicated state, a `SampleStream` registered
with `activate(data=...)`); rank 2 is SIGKILLed at the start of step 9 and the job stops. It is
launched again with 2 workers on the same job directory: the certified snapshot (model, optimizer,
data position) is restored and the run goes on at world size 2. Under the documented rule
(docs/formats/sharded-snapshots.md, "Data position") every step's global batch is the fault-free
run's, each rank takes its positions of it, and every sample is seen once an epoch; the update is
world-size free, so the final parameters equal the one-process reference bitwise. On main the
position was not state (`activate` had no `data`): a restart began the data again at sample 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuguard.generation.ledger_open import open_ledger
from gpuguard.recovery.runtime.data import SampleStream, reference_batches
from tests.recovery.snapshots.test_sharded_snapshot import finish
from tests.support.cli import JOBS, free_port
from tests.support.data_stream import assert_follows_the_rule
from tests.support.jobs.data_job import BATCH, SEED, SIZE, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, KILL_STEP = 14, 9


def torchrun(job: Path, workers: int, *args: str) -> tuple[int, str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={workers}",
        "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.1", str(JOBS / "data_job.py"), str(job), "--steps", str(STEPS), *args,
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUGUARD_PG_TIMEOUT": "20"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
    )
    return finish(proc, 120)


def history(job: Path) -> dict[int, dict[int, dict]]:
    """step -> rank -> the record of the newest generation that ran it (a redone step replaces)."""
    out: dict[int, dict[int, dict]] = {}
    gen_of: dict[int, int] = {}
    for path in sorted((job / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            step, gen = rec["step"], rec["generation"]
            if gen > gen_of.get(step, -1):
                gen_of[step], out[step] = gen, {}
            if gen == gen_of[step]:
                out[step][rank] = rec
    return out


def test_a_job_that_loses_a_rank_and_resumes_at_world_size_2_takes_the_rules_samples_and_ends_bitwise(tmp_path):
    job = tmp_path / "job"
    rc, out = torchrun(job, 3, "--kill", f"2:{KILL_STEP}")
    assert rc != 0 and (job / "faults" / f"kill-r2-s{KILL_STEP}-step-start.json").exists(), out[-3000:]
    rc, out = torchrun(job, 2)
    assert rc == 0, out[-3000:]
    cert = open_ledger(job).require_active()
    assert cert.generation == 2 and len(cert.members) == 2 and 1 <= cert.frontier.step < KILL_STEP
    resumed_at = cert.frontier.step + 1

    assert_follows_the_rule(history(job), resumed_at, STEPS)

    got = torch.load(job / "final.pt", weights_only=True)
    ref = reference(STEPS)
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []


def test_a_position_of_another_dataset_or_not_on_a_step_boundary_is_refused():
    stream = SampleStream(SIZE, BATCH, SEED)
    for bad, why in (
        ({**stream.state_dict(), "size": 61}, "size 61"),
        ({**stream.state_dict(), "position": 5}, "not a step boundary"),
        ({"epoch": 1}, "lacks position"),
    ):
        with pytest.raises(ValueError, match=why):
            SampleStream(SIZE, BATCH, SEED).load_state_dict(bad)
    stream.take(0, 1)
    again = SampleStream(SIZE, BATCH, SEED)
    again.load_state_dict(stream.state_dict())
    assert again.peek() == stream.peek() == reference_batches(SIZE, BATCH, SEED, 2)[1]
