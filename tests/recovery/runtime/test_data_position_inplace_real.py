"""The data position across an in-place world-size change (issue 24, "a fault-free-equivalent data
stream ... and in place"), on a real torchrun job.

3 torchrun agents on this host (c10d rendezvous on a store in this process, one gloo worker each) run
`tests/support/jobs/inplace_data_job.py`: AdamW, a `SampleStream` registered with
`InPlaceRuntime.activate(data=...)`. Rank 1 holds at the start of step 6, after the others took their
samples of it and wait in its collective; then its node (agent and worker) is SIGKILLed. The survivors
switch to world size 2 in the same processes and redo the steps after the frontier. Under the rule
(docs/formats/sharded-snapshots.md, "Data position") every step's global batch is the fault-free run's,
each rank takes its positions of it, and every sample is seen once an epoch; the update is world-size
free, so the final parameters equal a plain one-process loop's bitwise (no runtime: a read that stepped
the fresh AdamW at activation made them differ), with the same optimizer step count.

Without the in-place rollback of the position (the survivors' state equalled the frontier's, so it was
kept as it was) the redone step took the next step's samples: the stream skipped a batch.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpuguard.examples.demo_node_loss import lose_node, start_agent, stop_agents
from gpuguard.foundation.env import JOB_DIR_ENV, PG_TIMEOUT_ENV
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import free_port
from tests.support.data_stream import assert_follows_the_rule
from tests.support.jobs.data_job import reference
from tests.support.jobs.inplace_data_job import hold_marker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AGENTS, STEPS, LOST, HOLD = 3, 14, 1, 6


def _wait(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _newest(job: Path) -> dict[int, dict[int, dict]]:
    """step -> rank (of its generation) -> the record of the newest generation that ran the step."""
    out: dict[int, dict[int, dict]] = {}
    gen_of: dict[int, int] = {}
    for path in sorted((job / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            step, gen = rec["step"], rec["generation"]
            if gen > gen_of.get(step, -1):
                gen_of[step], out[step] = gen, {}
            if gen == gen_of[step]:
                out[step][rec["rank"]] = rec
    return out


def test_survivors_switching_in_place_take_the_rules_samples_and_end_bitwise_like_a_plain_run(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env.update({JOB_DIR_ENV: str(job), PG_TIMEOUT_ENV: "10", "DATA_STEPS": str(STEPS), "DATA_HOLD": f"{LOST}:{HOLD}",
                "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})  # fmt: skip
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    logs = [tmp_path / f"agent-{i}.log" for i in range(AGENTS)]
    agents = []
    try:
        for log in logs:
            agents.append(
                start_agent(log, port=port, rdzv_id="data", env=env, module="tests.support.jobs.inplace_data_job")
            )
        tails = lambda: "\n".join(p.read_text(errors="replace")[-2500:] for p in logs)  # noqa: E731
        assert _wait(hold_marker(job, LOST, HOLD).exists, 150), tails()
        first = {m.rank: m.incarnation.pid for m in open_ledger(job).get(1).members}
        lose_node(job, agents, first, LOST)
        survivors = sorted(set(first) - {LOST})
        results = job / "results"
        assert _wait(lambda: all((results / f"{r}.pt").exists() for r in survivors), 150), tails()
    finally:
        stop_agents(agents)
        del store

    cert = open_ledger(job).require_active()
    assert cert.generation == 2 and cert.extra.get("switch") == "in-place" and len(cert.members) == 2
    assert {m.incarnation.pid for m in cert.members} == {first[r] for r in survivors}  # the same processes
    resumed_at = cert.frontier.step + 1
    assert 1 <= resumed_at <= HOLD

    assert_follows_the_rule(_newest(job), resumed_at, STEPS)

    ref = reference(STEPS)  # a plain loop in one process, no runtime
    for r in survivors:
        got = torch.load(results / f"{r}.pt", weights_only=True)
        assert int(got["last"]) == STEPS
        assert [k for k in ref if not torch.equal(ref[k], got["params"][k])] == [], r
        assert got["steps"].tolist() == [float(STEPS)] * len(ref)  # AdamW's step count: one per step
