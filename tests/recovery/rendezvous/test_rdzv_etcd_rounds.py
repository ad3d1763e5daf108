"""Rendezvous rounds bound to generations, and `gpu-recover rendezvous` on the `gpuguard` (etcd) backend.

- the torch-free etcd client answers `get`/`compare_set`/`set` as the TCPStore client does (the
  trigger's protocol runs unchanged on both), and writes on the run's lease;
- on c10d, a round's binding is a TCPStore key beside torch's state, which torch still reads as before;
- ONE real job (2 torchrun agents on etcd, the gpuguard Runtime, gloo), in order: a worker is
  SIGKILLed, the job restarts, generation 2's certificate names the new round and the etcd key of
  that round names generation 2 and its digest (`gpu-generation show/history`, `gpu-recover
  rendezvous --state` agree); then two operators run `gpu-recover rendezvous --expect-round R` at
  once: exactly one new round (one `done`; the other coalesces on it, or finds it already made),
  and generation 3 is bound to it.

Agents are started with the `torchrun` console script (see test_rdzv_etcd_torchrun.py) and killed
by pid, with their workers, at the end.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpuguard.examples import demo
from gpuguard.foundation.errors import GpuguardError, UsageError
from gpuguard.foundation.etcd import EtcdClient, parse_endpoints
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.recovery.rendezvous import state as R
from gpuguard.recovery.rendezvous.etcd_keys import EtcdRendezvousClient, run_prefix
from gpuguard.recovery.rendezvous.signed_state import create_secret_file
from gpuguard.recovery.rendezvous.tcpstore import StoreClient
from tests.support.cli import BIN, free_port, run_cli
from tests.support.processes import kill_trees, run_concurrently

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(150)]

PREFIX = "/gpuguard-test/rounds"


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


def _etcd_get(endpoint: str, key: bytes):
    with EtcdClient(parse_endpoints(endpoint), timeout=5) as conn:
        return conn.get(key, "test")


# -- the clients ------------------------------------------------------------------------------------


def test_etcd_client_answers_like_the_tcpstore_client(endpoint, tmp_path):
    import torch.distributed as dist

    run = f"cas-{uuid.uuid4().hex[:8]}"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    names = [R.LEASE_PREFIX + run, R.round_key(run, 4), f"torch.rendezvous.{run}"]
    steps = [(b"", b"a"), (b"", b"b"), (b"a", b"c"), (b"x", b"d"), (b"c", b""), (b"", b"e")]
    conf = {"key_prefix": PREFIX, "lease_ttl": "30", "secret_file": str(create_secret_file(tmp_path / "s"))}
    with StoreClient("127.0.0.1", server.port, 5) as tcp, EtcdRendezvousClient(endpoint, run, conf) as etcd:
        for name in names:
            assert etcd.get(name) is None and tcp.get(name) is None
            assert etcd.compare_set(name, b"x", b"y") == tcp.compare_set(name, b"x", b"y") == b"x"  # missing: kept
            assert etcd.get(name) is None
            for expected, desired in steps:
                assert etcd.compare_set(name, expected, desired) == tcp.compare_set(name, expected, desired)
                assert etcd.get(name) == tcp.get(name)
            etcd.set(name, b"z")
            tcp.set(name, b"z")
            assert etcd.get(name) == tcp.get(name) == b"z"
    base = run_prefix(PREFIX, run)
    lease = int(_etcd_get(endpoint, base + b"lease").value)
    for key in (b"trigger", b"rounds/4", b"state"):
        assert _etcd_get(endpoint, base + key).lease == lease  # cleaned with the run
    with pytest.raises(KeyError):
        EtcdRendezvousClient(endpoint, run, conf).etcd_key("torch.rendezvous.other-run")


def test_c10d_round_binding_sits_beside_torchs_state(tmp_path):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    server.set("torch.rendezvous.job", b"torch-state")
    ep = R.Endpoint("127.0.0.1", server.port, "job")
    R.bind_round(ep, 3, 7, "d" * 64, "jobx")
    with StoreClient("127.0.0.1", server.port, 5) as client:
        got = R.read_bindings(client, "job", 4, count=3)
    assert [(b["round"], b["status"], b["generation"]) for b in got] == [
        (4, "not yet certified", None),
        (3, "certified", 7),
        (2, "not yet certified", None),
    ]
    assert got[1]["digest"] == "d" * 64 and got[1]["job_id"] == "jobx"
    assert server.get("torch.rendezvous.job") == b"torch-state"  # torch's key untouched, readable by torch
    assert json.loads(server.get("gpuguard/rdzv-round/job/3"))["generation"] == 7
    assert R.parse_binding(1, b"{not json")["status"] == "unreadable"


def test_backend_is_named_by_options_or_guessed():
    ep = R.find_endpoint(endpoint="e1:2379,e2", run_id="r")
    assert (ep.backend, ep.host, ep.port, ep.etcd) == ("gpuguard", "e1", 2379, "e1:2379,e2")
    assert R.find_endpoint(endpoint="h:29400", run_id="r").backend == "c10d"
    ep = R.find_endpoint(endpoint="h", run_id="r", backend="gpuguard")
    assert (ep.backend, ep.port) == ("gpuguard", 2379)
    with pytest.raises(UsageError):
        R.find_endpoint(endpoint="h", run_id="r", backend="etcd-v2")


# -- one real job on etcd ---------------------------------------------------------------------------


class Job:
    def __init__(self, root: Path, endpoint: str) -> None:
        self.root, self.endpoint = root, endpoint
        self.job_dir = root / "job"
        self.job_dir.mkdir(parents=True)
        self.run_id = f"bind-{uuid.uuid4().hex[:8]}"
        self.secret = create_secret_file(root / "rendezvous.secret")  # the agents start before the job's key exists
        self.base = run_prefix(PREFIX, self.run_id)
        self.procs: list[subprocess.Popen] = []

    def start_agent(self) -> None:
        env = demo.worker_env()
        env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC")}
        env["GPUGUARD_PG_TIMEOUT"] = "20"
        i = len(self.procs)
        conf = (
            f"key_prefix={PREFIX},read_timeout=5,last_call_timeout=1,join_timeout=60,lease_ttl=60,"
            f"secret_file={self.secret}"
        )
        argv = [
            str(BIN / "torchrun"),
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=gpuguard",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            "--local-addr=127.0.0.1",
            "--max-restarts=3",
            "--monitor-interval=0.2",
            "-m",
            "gpuguard.examples.demo_train",
            "--job-dir",
            str(self.job_dir),
            "--steps",
            "100000",
            "--sleep",
            "0.2",
            "--kill",
            "1:3:after-allreduce",
        ]
        with open(self.root / f"agent-{i}.log", "wb") as log:
            self.procs.append(
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- agent {i}\n" + (self.root / f"agent-{i}.log").read_text(errors="replace")[-2500:]
            for i in range(len(self.procs))
        )

    def wait_for(self, what, timeout: float, label: str):
        end = time.monotonic() + timeout
        while True:
            got = what()
            if got:
                return got
            if time.monotonic() > end:
                raise AssertionError(f"{label}: not within {timeout} s\n{self.logs()}")
            assert all(p.poll() is None for p in self.procs), f"an agent exited\n{self.logs()}"
            time.sleep(0.1)

    def cert(self, generation: int, timeout: float = 90) -> dict:
        """Generation N's certificate with its parts read in (a `/2` file holds only the header)."""
        path = self.job_dir / "ledger" / f"gen-{generation}.json"

        def read():
            if not path.exists():
                return None
            try:
                return open_ledger(self.job_dir).get(generation).expanded_dict()
            except (OSError, ValueError, GpuguardError):
                return None

        return self.wait_for(read, timeout, f"generation {generation}'s certificate")

    def binding(self, round_: int, timeout: float = 10) -> dict:
        def read():
            kv = _etcd_get(self.endpoint, self.base + b"rounds/%d" % round_)
            return (json.loads(kv.value), kv.lease) if kv else None

        doc, lease = self.wait_for(read, timeout, f"the binding of round {round_}")
        assert lease == int(_etcd_get(self.endpoint, self.base + b"lease").value)  # on the run's lease
        return doc

    def generation_json(self, *args: str) -> dict:
        r = run_cli("gpu-generation", *args, "--job-dir", str(self.job_dir), "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def state(self, *extra: str) -> dict:
        r = run_cli(
            "gpu-recover",
            "rendezvous",
            "--state",
            "--json",
            "--rdzv-endpoint",
            self.endpoint,
            "--run-id",
            self.run_id,
            *extra,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["details"]

    def stop(self) -> None:
        kill_trees(self.procs)


@pytest.fixture(scope="module")
def job(tmp_path_factory, endpoint):
    j = Job(tmp_path_factory.mktemp("rdzv-rounds"), endpoint)
    try:
        j.start_agent()
        time.sleep(0.5)
        j.start_agent()
        yield j
    finally:
        j.stop()


@pytest.mark.slow
def test_a_restart_binds_its_round_to_the_generation_activated_in_it(job):
    g1 = job.cert(1)
    assert g1["extra"]["rendezvous_round"] == 0 and g1["extra"]["attempt"].startswith("r0-")
    g2 = job.cert(2)  # rank 1 killed itself at step 3; both agents re-rendezvoused
    rnd = g2["extra"]["rendezvous_round"]
    assert isinstance(rnd, int) and rnd >= 1 and g2["reason"] == "rank-failure", g2["extra"]
    assert g2["extra"]["attempt"].startswith(f"r{rnd}-")
    hist = job.generation_json("history")["generations"]
    digests = {g["generation"]: g["digest"] for g in hist}
    assert [(g["generation"], g["rendezvous_round"]) for g in hist] == [(0, None), (1, 0), (2, rnd)]
    bound = job.binding(rnd)
    assert (bound["round"], bound["generation"], bound["digest"]) == (rnd, 2, digests[2])
    assert bound["schema"] == "gpuguard.rdzv-round/1" and bound["job_id"] == g2["job_id"]
    assert job.binding(0)["generation"] == 1 and job.binding(0)["digest"] == digests[1]
    show = job.generation_json("show")
    assert show["certificate"]["generation"] == 2 and show["rendezvous_round"] == rnd and show["digest"] == digests[2]
    text = run_cli("gpu-generation", "show", "--job-dir", str(job.job_dir), timeout=60).stdout
    assert f"rendezvous     round {rnd} (attempt r{rnd}-" in text
    # gpu-recover reads the state from etcd: backend named, or found from the live agent's command line
    for extra in (("--rdzv-backend", "gpuguard"), ()):
        st = job.state(*extra)
        assert st["endpoint"]["backend"] == "gpuguard" and st["state"]["round"] == rnd
        assert st["rounds"][0] == {
            "round": rnd,
            "status": "certified",
            "generation": 2,
            "digest": digests[2],
            "job_id": g2["job_id"],
            "time": bound["time"],
        }
        assert st["rounds"][-1]["round"] == 0 and st["rounds"][-1]["generation"] == 1
    r = run_cli("gpu-recover", "rendezvous", "--state", "--job-dir", str(job.job_dir), timeout=30)
    assert r.returncode == 0, r.stderr
    assert f"round {rnd}: generation 2, certificate {digests[2][:12]}" in r.stdout and "at etcd " in r.stdout
    code = (
        "import sys, json; from pathlib import Path; from gpuguard.recovery.rendezvous import state as R; "
        f"ep = R.find_endpoint(job_dir=Path({str(job.job_dir)!r})); st, b = R.read_with_rounds(ep); "
        "print(json.dumps([ep.backend, st.round, b[0]['generation'], 'torch' in sys.modules]))"
    )
    out = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout) == ["gpuguard", rnd, 2, False], out.stderr


@pytest.mark.slow
def test_b_two_operators_on_etcd_make_exactly_one_round_bound_to_the_next_generation(job):
    job.cert(2)
    before = job.state()["state"]
    assert before["complete"] and before["wait_list"] == []
    start = before["round"]
    common = ["rendezvous", "--rdzv-endpoint", job.endpoint, "--run-id", job.run_id, "--yes", "--json"]
    # Both operators saw round `start` and want it replaced once: `--expect-round`. Started at once,
    # the second may still arrive after the first one's round has completed and its lease is
    # released (its start-up is slower: it reads the live agent's command line; the agents react
    # within tens of ms): then it is `already-advanced`, not a second round. Without --expect-round
    # a call that does not overlap another one is a request for a round of its own.
    cmds = [
        [str(BIN / "gpu-recover"), *common, "--expect-round", str(start), "--rdzv-backend", "gpuguard"],
        [str(BIN / "gpu-recover"), *common, "--expect-round", str(start)],  # the backend from the live agent
    ]
    docs = run_concurrently(cmds)
    outcomes = sorted(d["outcome"] for d in docs)
    assert outcomes in (["coalesced", "done"], ["already-advanced", "done"]), docs
    assert all(d["details"]["round_after"] == start + 1 for d in docs), [d["details"] for d in docs]
    (done,) = [d for d in docs if d["outcome"] == "done"]
    assert done["details"]["round_before"] == start and done["details"]["rounds_seen"] == [start, start + 1]
    (other,) = [d for d in docs if d["outcome"] != "done"]
    assert other["details"]["round_before"] == start, other  # it saw the same round: the same request
    assert all(d["details"]["wait_list_entry_gone"] for d in docs)
    assert {d["details"]["endpoint"]["backend"] for d in docs} == {"gpuguard"}
    g3 = job.cert(3)
    assert g3["extra"]["rendezvous_round"] == start + 1, g3["extra"]
    digest = job.generation_json("show")["digest"]
    assert job.binding(start + 1)["generation"] == 3 and job.binding(start + 1)["digest"] == digest
    time.sleep(2)  # no storm: still one round more, nothing left waiting, no foreign node
    st = job.state()
    assert st["state"]["round"] == start + 1 and st["state"]["wait_list"] == [] and st["state"]["complete"]
    assert sorted(st["state"]["participants"]) == sorted(st["state"]["last_heartbeat_age_s"])
    assert [b["generation"] for b in st["rounds"][:2]] == [3, 2]
    trigger = _etcd_get(job.endpoint, job.base + b"trigger")
    assert trigger is not None and trigger.value == b""  # released, on the run's lease
    # an idempotent retry for the round that has passed does nothing
    r = run_cli("gpu-recover", *common, "--expect-round", str(start), timeout=30)
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "already-advanced", r.stderr


@pytest.mark.parametrize("backend", ["c10d", "gpuguard"])
def test_a_rendezvous_nobody_serves_is_75_not_a_hang(backend):
    t0 = time.monotonic()
    r = run_cli(
        "gpu-recover",
        "rendezvous",
        "--state",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--run-id",
        "x",
        "--rdzv-backend",
        backend,
        timeout=60,
    )
    assert r.returncode == 75, (r.returncode, r.stderr)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_c10d_job_binds_its_rounds_in_the_agents_tcpstore(tmp_path):
    """The same binding on torch's c10d backend: a key in the agent's TCPStore beside torch's state;
    the job restarts and trains on (torch reads only its own keys)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    port, run_id = free_port(), f"c10d-{uuid.uuid4().hex[:6]}"
    argv = demo.torchrun_argv(
        job_dir,
        workers=2,
        steps=100000,
        kills=["1:3:after-allreduce"],
        max_restarts=3,
        port=port,
        run_id=run_id,
        extra=["--sleep", "0.2"],
    )
    env = {**demo.worker_env(), "GPUGUARD_PG_TIMEOUT": "20"}
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        g2 = tmp_path / "job" / "ledger" / "gen-2.json"
        end = time.monotonic() + 90
        while not g2.exists():
            assert proc.poll() is None and time.monotonic() < end, (tmp_path / "agent.log").read_text()[-3000:]
            time.sleep(0.2)
        digests = {
            g["generation"]: (g["digest"], g["rendezvous_round"])
            for g in json.loads(
                run_cli("gpu-generation", "history", "--job-dir", str(job_dir), "--json", timeout=60).stdout
            )["generations"]
        }
        digest, rnd = digests[2]
        assert rnd >= 1 and digests[1][1] == 0

        def bound():
            r = run_cli(
                "gpu-recover", "rendezvous", "--state", "--json", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--run-id", run_id, timeout=30,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            rounds = {b["round"]: b for b in json.loads(r.stdout)["details"]["rounds"]}
            return rounds if rounds.get(rnd, {}).get("generation") == 2 else None

        end = time.monotonic() + 10
        while (rounds := bound()) is None:
            assert time.monotonic() < end, "round not bound"
            time.sleep(0.2)
        assert rounds[rnd]["digest"] == digest and rounds[0]["generation"] == 1
        assert rounds[0]["digest"] == digests[1][0]
        assert proc.poll() is None  # the job trains on in generation 2
    finally:
        demo.stop_job(proc, job_dir)
