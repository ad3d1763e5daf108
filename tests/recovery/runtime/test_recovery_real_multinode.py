"""Multi-node on one machine: three torchrun agents (`--nnodes=2:3`, one worker each) on localhost.

Node loss (one agent SIGKILLed with its worker) -> the other two re-rendezvous at world size 2 and
restore the certified state; a new agent joins -> world size 3 again, certified as a scale-up.
Runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with torch 2.13's shared store a node joining
after round 0 waits forever for `torch.rendezvous.<id>.<round>/MASTER_ADDR` (only round 0 writes
it), a torchrun limitation measured here, independent of gpuguard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuguard.examples import demo
from gpuguard.foundation.jobdir import read_incarnations
from gpuguard.generation.ledger_open import open_ledger

pytestmark = pytest.mark.slow


def _agent(job: Path, port: int, name: str, env: dict[str, str]) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2:3",
        "--nproc-per-node=1",
        "--max-restarts=5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=mn{os.getpid()}",
        "--monitor-interval=0.1",
        "--rdzv-conf=last_call_timeout=1,join_timeout=120",
        "-m",
        "gpuguard.examples.demo_train",
        "--job-dir",
        str(job),
        "--steps",
        "50",
        "--sleep",
        "0.25",
    ]
    log = open(job / f"agent-{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _cert(job: Path, generation: int, timeout: float) -> dict:
    path = job / "ledger" / f"gen-{generation}.json"
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            logs = "\n".join(p.read_text()[-1500:] for p in sorted(job.glob("agent-*.log")))
            pytest.fail(f"generation {generation} not certified within {timeout} s\n{logs}")
        time.sleep(0.2)
    time.sleep(0.1)
    return open_ledger(job).get(generation).expanded_dict()  # a /2 file holds only the header


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_node_loss_scales_down_and_a_new_node_scales_up_certified(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    port = demo.free_port()
    env = demo.worker_env()
    env["GPUGUARD_PG_TIMEOUT"] = "20"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents = {"a": _agent(job, port, "a", env)}
    time.sleep(1.0)  # agent a hosts the rendezvous store
    agents["b"] = _agent(job, port, "b", env)
    agents["c"] = _agent(job, port, "c", env)
    try:
        g1 = _cert(job, 1, 150)
        assert g1["extra"]["world_size"] == 3 and g1["reason"] == "start"
        time.sleep(3.0)
        victims = [r for r in read_incarnations(job) if r.agent_pid == agents["c"].pid]
        assert len(victims) == 1
        os.killpg(agents["c"].pid, signal.SIGKILL)  # the node: its agent and its worker
        os.kill(victims[0].pid, signal.SIGKILL)

        g2 = _cert(job, 2, 150)
        assert (g2["reason"], g2["extra"]["world_size"], g2["quiescence"]) == ("scale-down", 2, "proved")
        assert victims[0].incarnation_id in " ".join(g2["quiescence_evidence"])
        time.sleep(2.0)
        agents["d"] = _agent(job, port, "d", env)

        g3 = _cert(job, 3, 150)
        assert (g3["reason"], g3["extra"]["world_size"]) == ("scale-up", 3)
        assert g3["frontier"]["step"] >= g2["frontier"]["step"]
        assert 2 in g3["admitted"]
        for name in ("a", "b", "d"):
            assert agents[name].wait(timeout=150) == 0
    finally:
        for proc in agents.values():
            demo.stop_job(proc, job)

    out = job / "demo-out"
    by_gen: dict[int, set[tuple[int, str]]] = {}
    for path in out.glob("resume-*.jsonl"):
        for r in _records(path):
            by_gen.setdefault(r["generation"], set()).add((r["frontier_step"], r["hash"]))
    # every member of a generation restored the same certified state (DCP load at the new world size)
    assert {g: len(v) for g, v in by_gen.items()} == {1: 1, 2: 1, 3: 1}
    assert next(iter(by_gen[2]))[0] == g2["frontier"]["step"]
    assert next(iter(by_gen[3]))[0] == g3["frontier"]["step"]
    finals = [_records(out / f"final-{rank}.jsonl")[-1] for rank in range(3)]
    assert len({f["hash"] for f in finals}) == 1 and {f["generation"] for f in finals} == {3}
