"""Real torchrun jobs on `--rdzv-backend=gpuguard` (etcd v3) on loopback: gloo workers, node loss, no etcd.

- 2 agents x 1 gloo worker (--nnodes=2) complete their all-reduce steps; etcd keeps only the closed
  state afterwards, on its short lease.
- --nnodes=1:3 with 2 agents: the agent of group rank 0 (the one that published the workers'
  MASTER_ADDR, whose worker hosts the workers' TCPStore) is SIGKILLed with its worker (a host
  loss; torchrun starts workers in sessions of their own, so they are killed by pid). No agent hosts any store, so the other agent only sees a failed worker: it
  restarts it, rendezvous alone on etcd, and the new worker finishes as rank 0 of a world of 1.
- an etcd that accepts connections and never answers: torchrun exits non-zero within seconds and
  says which endpoint did not answer within which timeout.

The agents are started with the `torchrun` console script, not `python -m torch.distributed.run`:
torch's dynamic rendezvous calls `inspect.stack()` on every state change, and under `-m` each call
scans all of `sys.modules` (runpy's frozen frames are not files), seconds per agent on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from gpuguard.foundation.etcd import EtcdClient, parse_endpoints, range_kvs
from gpuguard.recovery.rendezvous.etcd_keys import run_prefix
from gpuguard.recovery.rendezvous.signed_state import create_secret_file
from tests.support.cli import BIN, JOBS
from tests.support.etcd_cluster import EtcdCluster
from tests.support.processes import kill_trees

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(150)]

PREFIX = "/gpuguard-test/torchrun"
TORCHRUN = BIN / "torchrun"
JOB = JOBS / "rdzv_job.py"


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


class Agents:
    """torchrun agents, each a "host": the agent and its workers (all killed at the end, by pid)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []  # type: ignore[var-annotated]
        self.out = tmp / "out"
        self.out.mkdir()
        self.secret = create_secret_file(tmp / "rendezvous.secret")  # what every agent signs the state with

    def start(
        self, endpoint: str, run_id: str, nnodes: str, conf: str, *, steps: int, pause: float = 0.0, fail: int = 0
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TORCH_DISABLE"))}
        env.update(
            {
                "RDZV_JOB_OUT": str(self.out),
                "RDZV_JOB_STEPS": str(steps),
                "RDZV_JOB_SLEEP": str(pause),
                "RDZV_JOB_FAIL_RESTARTS": str(fail),
                "PYTHONWARNINGS": "ignore",
                "LOGLEVEL": "INFO",  # torchrun's own log: what a failure message shows
            }
        )
        i = len(self.procs)
        with open(self.tmp / f"agent-{i}.log", "wb") as log:
            p = subprocess.Popen(
                [
                    str(TORCHRUN),
                    f"--nnodes={nnodes}",
                    "--nproc-per-node=1",
                    "--rdzv-backend=gpuguard",
                    f"--rdzv-endpoint={endpoint}",
                    f"--rdzv-id={run_id}",
                    f"--rdzv-conf={conf},secret_file={self.secret}",
                    "--local-addr=127.0.0.1",
                    "--max-restarts=5",
                    "--monitor-interval=0.2",
                    str(JOB),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(
            f"--- agent {i}\n" + (self.tmp / f"agent-{i}.log").read_text(errors="replace")[-2500:]
            for i in range(len(self.procs))
        )

    def docs(self, pattern: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(pattern))]

    def wait_for(self, what, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not what():
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s\n{self.logs()}")
            time.sleep(0.1)

    def kill_all(self) -> None:
        kill_trees(self.procs)


@pytest.fixture
def agents(tmp_path):
    a = Agents(tmp_path)
    yield a
    a.kill_all()


def _keys(endpoint: str, prefix: bytes) -> list[tuple[bytes, int]]:
    with EtcdClient(parse_endpoints(endpoint), timeout=5) as conn:
        return [(kv.key, kv.lease) for kv in range_kvs(conn.range(prefix, "test", prefix=True, keys_only=True))]


def _listening(pid: int) -> set[int]:
    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        return set()


def test_two_agents_run_gloo_allreduce_steps(agents, endpoint):
    run = f"two-{uuid.uuid4().hex[:8]}"
    conf = f"key_prefix={PREFIX},read_timeout=5,last_call_timeout=1,join_timeout=60,closed_ttl=30"
    procs = [agents.start(endpoint, run, "2", conf, steps=5) for _ in range(2)]
    agents.wait_for(lambda: all(p.poll() is not None for p in procs), 90)
    assert [p.returncode for p in procs] == [0, 0], agents.logs()
    done = agents.docs("done-*.json")
    assert sorted(d["rank"] for d in done) == [0, 1] and {d["world"] for d in done} == {2}
    assert {d["sum"] for d in done} == {3.0} and {d["steps"] for d in done} == {5}
    assert len({d["master"] for d in done}) == 1
    assert {d["use_agent_store"] for d in done} == {"False"}  # rank 0 worker hosts the workers' store
    assert {d["agent_pid"] for d in done} == {p.pid for p in procs}
    base = run_prefix(PREFIX, run)
    assert [k for k, _ in _keys(endpoint, base)] == [base + b"state"], "only the closed state stays"


def test_losing_the_first_agent_leaves_the_other_running(agents, endpoint):
    run = f"loss-{uuid.uuid4().hex[:8]}"
    conf = (
        f"key_prefix={PREFIX},read_timeout=5,last_call_timeout=2,join_timeout=60,"
        "keep_alive_interval=1,keep_alive_max_attempt=2,lease_ttl=30,closed_ttl=30"
    )
    procs = [agents.start(endpoint, run, "1:3", conf, steps=100, pause=0.05)]
    time.sleep(0.5)  # the first agent joins first
    procs.append(agents.start(endpoint, run, "1:3", conf, steps=100, pause=0.05))

    def both_stepping() -> bool:
        starts = agents.docs("start-*.json")
        prog = [agents.out / f"progress-{d['restart']}-{d['rank']}" for d in starts if d["world"] == 2]
        return len(prog) == 2 and all(p.exists() and int(p.read_text() or 0) >= 3 for p in prog)

    agents.wait_for(both_stepping, 60)
    first = {d["rank"]: d for d in agents.docs("start-*.json") if d["world"] == 2}
    victim = next(p for p in procs if p.pid == first[0]["agent_pid"])
    survivor = next(p for p in procs if p is not victim)
    # no agent hosts a store; the rank-0 worker hosts the workers' TCPStore (MASTER_PORT)
    assert not _listening(victim.pid) and not _listening(survivor.pid)
    assert int(first[0]["master"].rsplit(":", 1)[1]) in _listening(first[0]["pid"])
    host = [victim.pid, *(c.pid for c in psutil.Process(victim.pid).children(recursive=True))]
    assert first[0]["pid"] in host
    for pid in host:  # the host: its agent and its worker (torchrun starts workers in their own session)
        os.kill(pid, signal.SIGKILL)
    victim.wait(timeout=10)
    agents.wait_for(lambda: survivor.poll() is not None, 90)
    assert survivor.returncode == 0, agents.logs()
    after = [d for d in agents.docs("done-*.json") if d["agent_pid"] == survivor.pid]
    assert len(after) == 1, agents.logs()
    (d,) = after
    assert d["world"] == 1 and d["rank"] == 0 and d["restart"] >= 1 and d["steps"] == 100
    assert d["master"] != first[0]["master"]  # a new store, hosted by the new rank 0's worker
    base = run_prefix(PREFIX, run)
    assert [k for k, _ in _keys(endpoint, base)] == [base + b"state"], "the survivor cleaned up"


def test_a_long_elastic_run_keeps_only_the_last_two_rounds_store_keys(agents, endpoint):
    """Every round leaves MASTER_ADDR/PORT and per-agent keys in the agents' store: without pruning a
    job that restarts often grows etcd by every round it ever had."""
    run = f"grow-{uuid.uuid4().hex[:8]}"
    conf = f"key_prefix={PREFIX},read_timeout=5,last_call_timeout=1,join_timeout=60,closed_ttl=30"
    proc = agents.start(endpoint, run, "1", conf, steps=40, pause=0.1, fail=4)  # rounds 0..4
    agents.wait_for(lambda: (agents.out / "progress-4-0").exists(), 90)
    base = run_prefix(PREFIX, run)
    rounds = set()
    for key, _ in _keys(endpoint, base + b"store/"):
        head = key[len(base + b"store/") :].split(b"/", 1)[0]  # torch.rendezvous.<run>.<round>
        rounds.add(int(head.rsplit(b".", 1)[1]))
    assert rounds == {3, 4}, rounds
    agents.wait_for(lambda: proc.poll() is not None, 60)
    assert proc.returncode == 0, agents.logs()


def test_silent_etcd_fails_torchrun_with_a_clear_error(agents):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)  # accepts, never answers
    try:
        t0 = time.monotonic()
        p = agents.start(f"127.0.0.1:{srv.getsockname()[1]}", "silent", "1", "read_timeout=2", steps=1)
        agents.wait_for(lambda: p.poll() is not None, 60)
        took = time.monotonic() - t0
    finally:
        srv.close()
    log = agents.logs()
    assert p.returncode != 0
    assert "RendezvousConnectionError" in log and "not answering within 2 s" in log, log
    assert took < 30, took
    assert not agents.docs("start-*.json")  # no worker ever started


def test_etcd_cluster_member_loss_is_survived_and_quorum_loss_is_a_clear_error(agents, tmp_path):
    """3 etcd members: the job rides through the loss of the leader (first in the endpoint list);
    with a second member gone there is no quorum, and the agents stop with the etcd error in a
    bounded time instead of hanging."""
    cluster = EtcdCluster.start(tmp_path / "etcd")
    try:
        leader = cluster.leader()
        assert leader is not None
        endpoints = cluster.endpoints(first=leader)
        run = f"cluster-{uuid.uuid4().hex[:8]}"
        conf = (
            "read_timeout=3,last_call_timeout=1,join_timeout=60,keep_alive_interval=1,"
            "keep_alive_max_attempt=5,lease_ttl=30"
        )
        procs = [agents.start(endpoints, run, "2", conf, steps=2000, pause=0.02) for _ in range(2)]

        def steps() -> list[int]:
            return [
                int((agents.out / f"progress-0-{r}").read_text() or 0)
                for r in (0, 1)
                if (agents.out / f"progress-0-{r}").exists()
            ]

        agents.wait_for(lambda: len(steps()) == 2 and min(steps()) >= 5, 60)
        cluster.kill(leader)
        before = min(steps())
        end = time.monotonic() + 6  # heartbeats (1 s) and state polls keep going through the failover
        while time.monotonic() < end:
            assert all(p.poll() is None for p in procs), agents.logs()
            time.sleep(0.2)
        assert min(steps()) > before + 20, agents.logs()
        assert not (agents.out / "start-0-1.json").exists(), "no restart: the rendezvous never noticed"
        survivors = [m for m in cluster.members if m.proc is not None and m.proc.poll() is None]
        cluster.kill(survivors[0])  # 1 of 3 left: no quorum
        t0 = time.monotonic()
        agents.wait_for(lambda: all(p.poll() is not None for p in procs), 60)
        took = time.monotonic() - t0
    finally:
        cluster.stop()
    assert all(p.returncode != 0 for p in procs)
    log = agents.logs()
    # a read no member answered, or a write whose answer never came (outcome unknown): within 3 s either way
    assert "RendezvousConnectionError" in log and "answer" in log and "within 3 s" in log, log
    assert took < 45, took
