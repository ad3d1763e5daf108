"""The signed rendezvous state: nothing an attacker can write under the run's key reaches torch's
`pickle.loads`, and nothing there can hang an agent or `gpu-recover rendezvous --state`.

- the seal (HMAC-SHA256 under the job's rendezvous secret) round-trips, and any other value is refused;
- the secret is a checked file (no link, 0600, our own) or the job dir's generation.key, and the
  backend refuses to start without one;
- real torchrun agents on etcd with a planted pickle under `<prefix>/<run id>/state`: no marker file,
  one refusal line per agent; a sealed shared-reference DAG: refused within its deadline;
- `gpu-recover rendezvous --state`: a sealed DAG is 65 within its deadline, Ctrl-C during the decode
  is 130 at once, a badly typed state is 65;
- a trickling etcd ends the backend's and the operator's calls by their deadline.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, PermissionDeniedError
from gpuguard.foundation.etcd import EtcdClient, parse_endpoints, put_op
from gpuguard.generation.keys import create_key_file
from gpuguard.recovery.rendezvous import backend as rdzv_backend
from gpuguard.recovery.rendezvous import state as R
from gpuguard.recovery.rendezvous.etcd_keys import EtcdRendezvousClient, run_prefix
from gpuguard.recovery.rendezvous.signed_state import (
    ForeignState,
    create_secret_file,
    derive_key,
    rendezvous_secret,
    seal,
    unseal,
)
from tests.foundation.test_unpickle_deadline import hashed_dag
from tests.support.cli import BIN, JOBS, run_cli
from tests.support.etcd_cluster import start_tls_etcd
from tests.support.processes import kill_trees
from tests.support.tcp_faults import TricklingServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180)]

PREFIX = "/gpuguard-test/signed"


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    return create_secret_file(tmp_path_factory.mktemp("secret") / "rendezvous.secret")


def _key(secret: Path) -> bytes:
    got = rendezvous_secret(str(secret))
    assert got is not None
    return got


class _Marker:
    """A pickle that, loaded by plain `pickle.loads`, creates a file (what an attacker plants)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plant(endpoint: str, key: bytes, value: bytes) -> None:
    with EtcdClient(parse_endpoints(endpoint), timeout=5) as c:
        c.txn("test plant", [], [put_op(key, value)])


def _torch_state(round_: int = 3) -> bytes:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    s = _RendezvousState()
    s.round, s.complete = round_, True
    node = _NodeDesc("127.0.0.1", 4242, 0)
    s.participants = {node: 0}
    s.last_heartbeats = {node: datetime.now(timezone.utc)}
    return pickle.dumps(s)


# -- the seal ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(body=st.binary(max_size=200), secret=st.binary(min_size=32, max_size=32), flip=st.integers(0, 10_000))
def test_a_sealed_value_opens_only_unchanged_under_its_key_and_etcd_key(body, secret, flip):
    k = derive_key(secret)
    value = seal(k, b"/p/run/state", body)
    assert unseal(k, b"/p/run/state", value) == body
    for other_key, other_etcd in ((derive_key(secret[::-1] + b"x"), b"/p/run/state"), (k, b"/p/other/state")):
        if other_key != k or other_etcd != b"/p/run/state":
            with pytest.raises(ForeignState):
                unseal(other_key, other_etcd, value)
    i = flip % len(value)
    tampered = value[:i] + bytes([value[i] ^ 1]) + value[i + 1 :]
    with pytest.raises(ForeignState):
        unseal(k, b"/p/run/state", tampered)


def test_the_secret_file_is_checked_like_a_key(tmp_path, monkeypatch):
    good = create_secret_file(tmp_path / "s")
    assert good.stat().st_mode & 0o777 == 0o600 and rendezvous_secret(str(good)) is not None
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(DataError, match="symbolic link"):
        rendezvous_secret(str(link))
    loose = tmp_path / "loose"
    loose.write_text((tmp_path / "s").read_text())
    loose.chmod(0o644)
    with pytest.raises(PermissionDeniedError, match="readable or writable by others"):
        rendezvous_secret(str(loose))
    with pytest.raises(NoInputError, match="no rendezvous secret"):
        rendezvous_secret(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        create_key_file(theirs)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionDeniedError, match="owned by uid 65534"):
            rendezvous_secret(str(theirs))
    # no file named: the job dir's signing key (GPUGUARD_JOB_DIR), else nothing
    monkeypatch.delenv("GPUGUARD_JOB_DIR", raising=False)
    assert rendezvous_secret(None) is None
    job = tmp_path / "job"
    job.mkdir()
    create_key_file(job / "generation.key")
    monkeypatch.setenv("GPUGUARD_JOB_DIR", str(job))
    assert rendezvous_secret(None) == rendezvous_secret(None, job) != rendezvous_secret(str(good))


# -- the backend, in process ------------------------------------------------------------------------


def _backend(endpoint: str, secret: Path, run: str):
    params = RendezvousParameters(
        "gpuguard", endpoint, run, 1, 2, key_prefix=PREFIX, read_timeout="5", secret_file=str(secret)
    )
    return rdzv_backend.create_backend(params)[0]


def test_get_state_refuses_a_planted_pickle_before_torch_sees_it(endpoint, secret, tmp_path, caplog):
    run = f"plant-{uuid.uuid4().hex[:8]}"
    backend = _backend(endpoint, secret, run)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(marker))
    other = derive_key(b"\x01" * 32)
    for value in (
        base64.b64encode(payload),  # what torch's c10d format holds (what the old backend decoded)
        payload,
        seal(other, backend.key, base64.b64encode(payload)),  # sealed, with another job's secret
    ):
        _plant(endpoint, backend.key, value)
        caplog.clear()
        with pytest.raises(RendezvousStateError, match=r"refused the state .*never unpickled"):
            backend.get_state()
        assert [r.getMessage() for r in caplog.records if "refused the state" in r.getMessage()] != []
    # sealed with the right secret: the restricted unpickler refuses it too, torch never loads it
    _plant(endpoint, backend.key, seal(backend.seal_key, backend.key, base64.b64encode(payload)))
    with pytest.raises(RendezvousStateError, match="not allowed"):
        backend.get_state()
    assert not marker.exists()


def test_a_sealed_shared_reference_dag_is_refused_within_its_deadline(endpoint, secret):
    backend = _backend(endpoint, secret, f"dag-{uuid.uuid4().hex[:8]}")
    dag = hashed_dag(60, "dict key")
    assert len(dag) < 1024
    _plant(endpoint, backend.key, seal(backend.seal_key, backend.key, base64.b64encode(dag)))
    t0 = time.monotonic()
    with pytest.raises(RendezvousStateError, match="took more than 1.0 s"):
        backend.get_state()
    # the deadline is 1 s of the decoder's CPU: a loaded host stretches the wall time, a hang never ends
    assert time.monotonic() - t0 < 10
    # a real state goes through
    good = _torch_state()
    _plant(endpoint, backend.key, seal(backend.seal_key, backend.key, base64.b64encode(good)))
    assert backend.get_state()[0] == good


# -- gpu-recover rendezvous --state --------------------------------------------------------------------


def _state_cli(endpoint: str, run: str, secret: Path, **kw):
    return run_cli(
        "gpu-recover", "rendezvous", "--state", "--rdzv-endpoint", endpoint, "--run-id", run,
        "--rdzv-backend", "gpuguard", "--rdzv-conf", f"key_prefix={PREFIX},secret_file={secret}", **kw,
    )  # fmt: skip


def test_the_operator_refuses_what_the_agents_refuse(endpoint, secret):
    run = f"op-{uuid.uuid4().hex[:8]}"
    key = run_prefix(PREFIX, run) + b"state"
    k = _key(secret)
    _plant(endpoint, key, seal(k, key, base64.b64encode(_torch_state(5))))
    r = _state_cli(endpoint, run, secret, timeout=60)
    assert r.returncode == 0 and "round 5" in r.stdout, r.stderr
    _plant(endpoint, key, base64.b64encode(_torch_state(5)))  # unsigned
    r = _state_cli(endpoint, run, secret, timeout=60)
    assert r.returncode == 65 and "not a signed state" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    _plant(endpoint, key, seal(k, key, base64.b64encode(hashed_dag(60, "dict key"))))
    t0 = time.monotonic()
    r = _state_cli(endpoint, run, secret, timeout=60)
    assert r.returncode == 65 and "took more than 1.0 s" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 15  # start-up, then the 1 s deadline


def test_ctrl_c_during_the_decode_ends_it_at_once(endpoint, secret):
    """The decode of a 60-level DAG never ends in any process; Ctrl-C stops the command now, with 130."""
    run = f"int-{uuid.uuid4().hex[:8]}"
    key = run_prefix(PREFIX, run) + b"state"
    # a 1 MiB string ahead of the DAG: the load's deadline is 1 s + 0.5 s, time to send the signal
    padded = b"\x80\x04X" + (1 << 20).to_bytes(4, "little") + b"p" * (1 << 20) + b"0" + hashed_dag(60, "dict key")[2:]
    _plant(endpoint, key, seal(_key(secret), key, base64.b64encode(padded)))
    argv = [str(BIN / "gpu-recover"), "rendezvous", "--state", "--rdzv-endpoint", endpoint, "--run-id", run,
            "--rdzv-backend", "gpuguard", "--rdzv-conf", f"key_prefix={PREFIX},secret_file={secret}"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        while not psutil.Process(proc.pid).children() and time.monotonic() < end:  # the decode's forked child
            time.sleep(0.005)
        assert psutil.Process(proc.pid).children(), "the decode never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        kill_trees([proc])
    assert proc.returncode == 130 and err.strip().endswith("interrupted") and err.count("\n") == 1, err


def _typed(mutate) -> bytes:
    state = R.decode_state(base64.b64encode(_torch_state()))
    mutate(state)
    return R.encode_state(state)


BADLY_TYPED = {
    "round as text": lambda s: setattr(s, "round", "3"),
    "participants as a list": lambda s: setattr(s, "participants", [1, 2]),
    "a node's pid as text": lambda s: setattr(s, "wait_list", {R.NodeDesc("h", "12", 0)}),  # type: ignore[arg-type]
    "a heartbeat that is no time": lambda s: s.last_heartbeats.update({R.NodeDesc("h", 1, 0): 5}),
    "the deadline as a number": lambda s: setattr(s, "deadline", 12.5),
    "no round at all": lambda s: delattr(s, "round"),
}


@pytest.mark.parametrize("case", sorted(BADLY_TYPED))
def test_a_badly_typed_state_is_65_not_70(endpoint, secret, case):
    run = f"typed-{uuid.uuid4().hex[:8]}"
    key = run_prefix(PREFIX, run) + b"state"
    _plant(endpoint, key, seal(_key(secret), key, _typed(BADLY_TYPED[case])))
    with pytest.raises(DataError, match="not a _RendezvousState"):
        R.decode_state(_typed(BADLY_TYPED[case]))
    r = _state_cli(endpoint, run, secret, timeout=60)
    assert r.returncode == 65 and r.stderr.count("\n") == 1 and "not a _RendezvousState" in r.stderr, r.stderr


# -- real torchrun agents -------------------------------------------------------------------------------


def _agents(tmp_path: Path, endpoint: str, run: str, secret: Path, n: int = 2) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TORCH_DISABLE", "GPUGUARD_"))}
    env.update({"RDZV_JOB_OUT": str(tmp_path), "RDZV_JOB_STEPS": "3", "PYTHONWARNINGS": "ignore"})
    conf = f"key_prefix={PREFIX},read_timeout=5,join_timeout=30,last_call_timeout=1,secret_file={secret}"
    procs = []
    for i in range(n):
        with open(tmp_path / f"agent-{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(BIN / "torchrun"),
                        f"--nnodes={n}",
                        "--nproc-per-node=1",
                        "--rdzv-backend=gpuguard",
                        f"--rdzv-endpoint={endpoint}",
                        f"--rdzv-id={run}",
                        f"--rdzv-conf={conf}",
                        "--local-addr=127.0.0.1",
                        "--monitor-interval=0.2",
                        str(JOBS / "rdzv_job.py"),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float) -> float:
    t0 = time.monotonic()
    try:
        for p in procs:
            p.wait(timeout=max(0.1, timeout - (time.monotonic() - t0)))
    finally:
        kill_trees(procs)
    return time.monotonic() - t0


@pytest.mark.slow
def test_torchrun_agents_refuse_a_planted_pickle_and_run_nothing(endpoint, secret, tmp_path):
    run = f"agents-{uuid.uuid4().hex[:8]}"
    key = run_prefix(PREFIX, run) + b"state"
    marker = tmp_path / "pwned"
    _plant(endpoint, key, base64.b64encode(pickle.dumps(_Marker(marker))))  # before any agent starts
    procs = _agents(tmp_path, endpoint, run, secret)
    _finish(procs, 90)
    logs = [(tmp_path / f"agent-{i}.log").read_text(errors="replace") for i in range(len(procs))]
    assert not marker.exists(), "the planted pickle ran"
    assert all(p.returncode != 0 for p in procs)
    for log in logs:
        lines = [ln for ln in log.splitlines() if ln.startswith(f"gpuguard rendezvous '{run}': refused the state")]
        assert len(lines) == 1, log[-3000:]
        assert "not a signed state" in lines[0] and "never unpickled" in lines[0]
    assert not list(tmp_path.glob("start-*.json"))  # no worker ever started


@pytest.mark.slow
def test_torchrun_agents_refuse_a_sealed_dag_within_its_deadline(endpoint, secret, tmp_path):
    run = f"agents-dag-{uuid.uuid4().hex[:8]}"
    key = run_prefix(PREFIX, run) + b"state"
    _plant(endpoint, key, seal(_key(secret), key, base64.b64encode(hashed_dag(60, "dict key"))))
    procs = _agents(tmp_path, endpoint, run, secret)
    took = _finish(procs, 90)
    assert all(p.returncode != 0 for p in procs) and took < 60
    for i in range(len(procs)):
        log = (tmp_path / f"agent-{i}.log").read_text(errors="replace")
        assert "refused the state" in log and "took more than 1.0 s" in log, log[-3000:]


# -- a trickling etcd ------------------------------------------------------------------------------------


def test_a_trickling_etcd_ends_the_backend_and_the_operator_by_their_deadline(secret):
    srv = TricklingServer(interval=1.0)
    try:
        params = RendezvousParameters(
            "gpuguard", srv.endpoint, "t", 1, 2, key_prefix=PREFIX, read_timeout="2", secret_file=str(secret)
        )
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="did not answer within 2 s"):
            rdzv_backend.create_handler(params)
        assert time.monotonic() - t0 < 4.0  # 2 s, and the slack a loaded 2-core host needs to wake
        client = EtcdRendezvousClient(srv.endpoint, "t", {"key_prefix": PREFIX, "secret_file": str(secret)}, 2.0)
        t0 = time.monotonic()
        with pytest.raises(GpuguardError, match="did not answer within 2 s"):
            client.get("torch.rendezvous.t")
        assert time.monotonic() - t0 < 4.0  # 2 s, and the slack a loaded 2-core host needs to wake
        t0 = time.monotonic()
        r = _state_cli(srv.endpoint, "t", secret, timeout=60)
        assert r.returncode == 75 and r.stderr.count("\n") == 1, r.stderr
        assert time.monotonic() - t0 < 15  # start-up and one 5 s deadline (the command's own timeout)
    finally:
        srv.close()


# -- TLS: the rendezvous' own --rdzv-conf keys -------------------------------------------------------------


def test_the_backend_and_the_operator_over_tls_with_a_client_certificate(secret, tmp_path):
    srv, certs, _ = start_tls_etcd(tmp_path)
    try:
        conf = {
            "key_prefix": PREFIX,
            "protocol": "https",
            "ca_cert": str(certs.ca),
            "ssl_cert": str(certs.client_cert),
            "ssl_cert_key": str(certs.client_key),
            "secret_file": str(secret),
        }
        run = f"tls-{uuid.uuid4().hex[:8]}"
        backend, store = rdzv_backend.create_backend(RendezvousParameters("gpuguard", srv.endpoint, run, 1, 2, **conf))
        state = _torch_state(4)
        got = backend.set_state(state)
        assert got is not None and got[2] and backend.get_state()[0] == state
        store.set("k", "v")
        assert store.get("k") == b"v"
        with EtcdRendezvousClient(srv.endpoint, run, conf) as client:
            assert R.read_state(client, run)[0].round == 4
        without = {k: v for k, v in conf.items() if k not in ("ssl_cert", "ssl_cert_key")}
        with pytest.raises(RendezvousConnectionError, match="TLS"):  # etcd wants our certificate
            rdzv_backend.create_handler(
                RendezvousParameters("gpuguard", srv.endpoint, run, 1, 2, read_timeout="3", **without)
            )
    finally:
        srv.stop()
