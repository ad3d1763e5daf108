"""Node loss under real multi-agent torchrun: the survivors on the other agents switch generation in place.

3 torchrun agents on localhost (c10d rendezvous, --nnodes=3, 1 worker each). Once the job commits
steps, the agent whose worker holds rank 0 (the first coordinator and the snapshot writer) is
SIGKILLed together with its worker (a node loss). The surviving agents see healthy workers and no
new rendezvous round, so they restart nothing: the surviving workers certify generation 2 in place
and finish, in the same processes, and the new rank 0 takes over the snapshots. An operator's abort
of generation 2 then takes the same path: generation 3, same members.

The rendezvous endpoint is a TCPStore on a "host" that runs no training (this test process): with
the default agent-hosted store, losing *that* node makes every surviving agent fail in
`num_nodes_waiting()` and SIGTERM its workers (measured: the survivors had already certified
generation 2 in place when their agents killed them). Losing any other node is survived either way.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import psutil
import pytest

from gpuguard.examples.demo_node_loss import AGENTS, start_agent, stop_agents
from gpuguard.examples.inplace_train import reference
from gpuguard.foundation.inplace_files import request_abort
from gpuguard.foundation.steplog import committed_steps
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import free_port, run_cli

pytestmark = pytest.mark.timeout(150)

STEPS = 60


def _listener(port: int, pids: list[int]) -> int | None:
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                    return pid
        except psutil.Error:
            continue
    return None


def _committed(job) -> int:
    try:
        return max((c.step for c in committed_steps(job, 1)), default=-1)
    except Exception:  # noqa: BLE001 - the ledger is not initialised yet
        return -1


def test_node_loss_is_survived_in_place_without_restarts(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env.update(
        {
            "GPUGUARD_JOB_DIR": str(job),
            "INPLACE_STEPS": str(STEPS),
            "INPLACE_STEP_SLEEP": "0.05",
            "GPUGUARD_PG_TIMEOUT": "5",
            "INPLACE_GRACE": "3",
            "PYTHONWARNINGS": "ignore",
        }
    )
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    agents: list[subprocess.Popen] = []
    try:
        for i in range(AGENTS):
            agents.append(start_agent(tmp_path / f"agent-{i}.log", port=port, rdzv_id="inplace", env=env))
        end = time.monotonic() + 90
        while _committed(job) < 5 and time.monotonic() < end:
            time.sleep(0.05)
        assert _committed(job) >= 5, (tmp_path / "agent-0.log").read_text()[-3000:]
        assert _listener(port, [a.pid for a in agents]) is None  # no agent hosts the store
        first = {m.rank: m.incarnation.pid for m in open_ledger(job).get(1).members}
        victim = next(a for a in agents if first[0] in {c.pid for c in psutil.Process(a.pid).children(recursive=True)})
        vworkers = psutil.Process(victim.pid).children(recursive=True)
        os.kill(victim.pid, signal.SIGKILL)  # the node: its agent and its worker, at once
        for w in vworkers:
            w.kill()
        lost = {r for r, pid in first.items() if pid in {w.pid for w in vworkers}}
        assert lost == {0}
        survivors = sorted(set(first) - lost)
        end = time.monotonic() + 60
        while len(open_ledger(job).generations()) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        request_abort(job, 2, "test: operator abort")  # the operator's abort takes the same in-place path
        end = time.monotonic() + 90
        results = job / "results"
        while time.monotonic() < end and len(list(results.glob("*.json")) if results.exists() else []) < 2:
            time.sleep(0.1)
        docs = {
            r: json.loads((results / f"{r}.json").read_text()) for r in survivors if (results / f"{r}.json").exists()
        }
        logs = "\n".join((tmp_path / f"agent-{i}.log").read_text(errors="replace")[-2000:] for i in range(AGENTS))
        assert sorted(docs) == survivors, logs
        ref = reference(STEPS)
        for r, doc in docs.items():
            assert doc["pid"] == first[r], "a surviving worker was restarted"
            assert doc["world"] == 2 and doc["last_step"] == STEPS
            assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(doc["params"], ref))
        led = open_ledger(job)
        history = led.history()
        assert led.generations() == list(range(len(history))) == [0, 1, 2, 3], logs
        g2, g3 = history[2], history[3]
        assert g2.extra["switch"] == "in-place" and g2.reason == "rank-failure" and g2.quiescence == "proved"
        assert sorted(m.incarnation.pid for m in g2.members) == sorted(first[r] for r in survivors)
        assert g3.extra["switch"] == "in-place" and g3.reason == "operator" and g3.members == g2.members
        assert not g3.admitted and g3.frontier.step >= g2.frontier.step
        # no new rendezvous round in place: both name the round their members were started in
        started_in = history[1].extra["rendezvous_round"]
        assert g2.extra["rendezvous_round"] == g3.extra["rendezvous_round"] == started_in is not None
        shown = run_cli("gpu-generation", "show", "--job-dir", str(job), "--json", timeout=60)
        assert shown.returncode == 0, shown.stderr
        extra = json.loads(shown.stdout)["certificate"]["extra"]
        assert extra["switch"] == "in-place" and {"detect", "evicted", "frontier"} <= set(extra["phases"])
        # no agent started a second worker: one incarnation record per original worker
        assert len(list((job / "incarnations").glob("*.json"))) == AGENTS
        # the new rank 0 writes the snapshots now: one of generation 2 or 3 exists
        gens = {json.loads(p.read_text())["generation"] for p in (job / "snapshots").glob("step-*/state.json")}
        assert gens & {2, 3}, gens
        for a in agents:
            if a is not victim:
                assert a.poll() is None or a.returncode == 0, logs
    finally:
        stop_agents(agents)
        del store
