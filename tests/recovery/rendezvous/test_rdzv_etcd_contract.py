"""The `gpuguard` torchrun rendezvous backend and its etcd store against a real etcd on loopback.

torch's backend contract (absent state, fencing tokens, corrupt state, run-id isolation), random
interleavings of set_state with fresh and stale tokens (hypothesis), the store ops against c10d's
HashStore as the model, bounded waits, unreachable and silent etcd, leases, the entry point, and
16 agent processes that only rendezvous through torchrun's handler registry.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from importlib.metadata import entry_points
from urllib.parse import urlsplit

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from gpuguard.foundation.etcd import parse_endpoints, put_op, range_kvs
from gpuguard.generation.keys import read_key_file
from gpuguard.recovery.rendezvous import backend as rdzv_etcd
from gpuguard.recovery.rendezvous.etcd_keys import RunLease, run_prefix
from gpuguard.recovery.rendezvous.etcd_store import EtcdConnection, EtcdStore, EtcdUnavailableError
from gpuguard.recovery.rendezvous.signed_state import create_secret_file, derive_key, unseal_state
from tests.support.cli import SUPPORT

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

PREFIX = "/gpuguard-test/rdzv"


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


SECRET: dict[str, str] = {}  # the rendezvous secret every backend of this module signs with


@pytest.fixture(scope="module", autouse=True)
def _secret(tmp_path_factory):
    SECRET["path"] = str(create_secret_file(tmp_path_factory.mktemp("rdzv") / "rendezvous.secret"))


def _params(endpoint: str, run_id: str | None = None, **conf: str) -> RendezvousParameters:
    conf.setdefault("key_prefix", PREFIX)
    conf.setdefault("read_timeout", "5")
    conf.setdefault("secret_file", SECRET["path"])
    return RendezvousParameters("gpuguard", endpoint, run_id or uuid.uuid4().hex, 1, 4, **conf)


def _state(round_: int) -> bytes:
    """A real pickled `_RendezvousState` (the backend refuses bytes that are not one)."""
    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def _conn(endpoint: str) -> EtcdConnection:
    return EtcdConnection(parse_endpoints(endpoint), timeout=5)


def _keys(endpoint: str, prefix: bytes) -> list[bytes]:
    return [kv.key for kv in range_kvs(_conn(endpoint).range(prefix, "test keys", prefix=True, keys_only=True))]


# -- torch's RendezvousBackend contract ------------------------------------------------------------


def test_absent_state_create_fence_and_stale_tokens(endpoint):
    backend, _ = rdzv_etcd.create_backend(_params(endpoint))
    assert backend.name == "gpuguard"
    assert backend.get_state() is None
    one, two = _state(1), _state(2)
    first = backend.set_state(one)
    assert first is not None and first[0] == one and first[2] is True
    assert backend.get_state() == (one, first[1])
    again = backend.set_state(_state(9))  # no token: only creates
    assert again == (one, first[1], False)
    second = backend.set_state(two, first[1])
    assert second is not None and second[2] is True and second[1] != first[1]
    assert backend.set_state(_state(3), first[1]) == (two, second[1], False)  # stale token
    for bogus in ("abc", b"1", -1, 0, True, 1.5, str(second[1]), object()):
        assert backend.set_state(_state(4), bogus) == (two, second[1], False), bogus
    assert backend.get_state() == (two, second[1])


def test_invalid_or_stale_token_on_absent_state_is_none(endpoint):
    backend, _ = rdzv_etcd.create_backend(_params(endpoint))
    assert backend.set_state(b"x", 12345) is None
    assert backend.set_state(b"x", "junk") is None
    assert backend.get_state() is None


@pytest.mark.parametrize("value", [b"%%% not base64 %%%", b""])
def test_corrupt_state_raises_state_error(endpoint, value):
    backend, _ = rdzv_etcd.create_backend(_params(endpoint))
    got = backend.set_state(_state(1))
    _conn(endpoint).txn("test", [], [put_op(backend.key, value, None)])
    with pytest.raises(RendezvousStateError):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(_state(2), got[1])  # the failed compare returns the corrupt value


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set", "set", "get", "bogus"]),
            st.integers(0, 2),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_random_interleavings_follow_the_fencing_model(endpoint, ops):
    """Three agents, each with its own connection and last-seen token, against one model state."""
    run = uuid.uuid4().hex
    agents = [rdzv_etcd.create_backend(_params(endpoint, run))[0] for _ in range(3)]
    tokens: list[object] = [None, None, None]
    model: tuple[bytes, object] | None = None
    seen_tokens: list[int] = []
    for op, who, payload in ops:
        b = agents[who]
        if op == "get":
            got = b.get_state()
            assert got == model
            tokens[who] = None if got is None else got[1]
            continue
        token = tokens[who] if op == "set" else "stale-or-foreign"
        payload = _state(payload)
        res = b.set_state(payload, token)
        should_win = op == "set" and ((model is None and token is None) or (model is not None and token == model[1]))
        if should_win:
            assert res is not None and res[0] == payload and res[2] is True
            assert all(res[1] > t for t in seen_tokens)  # tokens only move forward
            seen_tokens.append(res[1])
            model = (payload, res[1])
        elif model is None:
            assert res is None
        else:
            assert res == (*model, False)
        tokens[who] = None if res is None else res[1]


@settings(max_examples=40, deadline=None)
@given(a=st.text(min_size=1, max_size=12), b=st.text(min_size=1, max_size=12))
def test_run_prefixes_never_nest(a, b):
    """Distinct run ids give key prefixes of which neither is a prefix of the other."""
    pa, pb = run_prefix(PREFIX, a), run_prefix(PREFIX, b)
    if a != b:
        assert not pa.startswith(pb) and not pb.startswith(pa)


def test_run_ids_that_look_like_paths_do_not_collide(endpoint):
    ids = ["job", "job/state", "job%2Fstate", "job/store/x", "job/", "j%"]
    stores = {}
    for rid in ids:
        backend, store = rdzv_etcd.create_backend(_params(endpoint, f"{rid}-{uuid.uuid4().hex[:6]}"))
        backend.set_state(_state(len(stores)))
        store.set("x", rid)
        stores[rid] = (backend, store)
    for i, (rid, (backend, store)) in enumerate(stores.items()):
        assert backend.get_state()[0] == _state(i)
        assert store.get("x") == rid.encode() and store.num_keys() == 1


# -- the store ---------------------------------------------------------------------------------------

KEYS = st.sampled_from(["a", "b", "c/d"])
VALUES = st.sampled_from(["", "0", "1", "-3", "x", "12"])
STORE_OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("add"), KEYS, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
    st.tuples(st.just("delete_key"), KEYS),
    st.tuples(st.just("check"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("multi_get"), st.lists(KEYS, min_size=1, max_size=3)),
    st.tuples(st.just("num_keys")),
)


def _apply(store: dist.Store, op: tuple) -> object:
    try:
        return getattr(store, op[0])(*op[1:])
    except dist.DistStoreError:
        return "timeout"
    except ValueError:
        return "not an integer"
    except RuntimeError as exc:  # HashStore's "stoll" on a non-integer add
        return "not an integer" if "stoll" in str(exc) else repr(exc)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(STORE_OPS, min_size=1, max_size=20))
def test_store_ops_match_hashstore(endpoint, ops):
    model = dist.HashStore()
    model.set_timeout(timedelta(milliseconds=30))
    store = EtcdStore.connect(endpoint, uuid.uuid4().hex, key_prefix=PREFIX, store_timeout=0.03, lease_ttl=60)
    for op in ops:
        assert _apply(store, op) == _apply(model, op), op


def test_store_through_prefix_store_and_multi_ops(endpoint):
    store = EtcdStore.connect(endpoint, uuid.uuid4().hex, key_prefix=PREFIX)
    ps = dist.PrefixStore("torch.rendezvous.r.0", store)  # what the agents get
    ps.multi_set(["role/0", "role/1", "role/0"], ["a", "b", "c"])
    assert ps.multi_get(["role/0", "role/1"]) == [b"c", b"b"]
    ps.set_timeout(timedelta(milliseconds=300))
    assert store.timeout == timedelta(milliseconds=300)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        ps.wait(["missing"])
    assert time.monotonic() - t0 < 3
    big = [f"k{i}" for i in range(300)]  # more than etcd's 128 operations per transaction
    store.multi_set(big, [str(i) for i in range(300)])
    assert store.multi_get(big) == [str(i).encode() for i in range(300)]
    assert store.check(big) and store.num_keys() == 302


def test_wait_and_get_honour_their_timeouts_and_wake_on_set(endpoint):
    store = EtcdStore.connect(endpoint, uuid.uuid4().hex, key_prefix=PREFIX, store_timeout=0.5)
    for call in (lambda: store.wait(["nope"]), lambda: store.get("nope"), lambda: store.multi_get(["nope"])):
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            call()
        assert 0.45 < time.monotonic() - t0 < 3
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["nope"], timedelta(seconds=0.2))  # an explicit timeout wins over the store's
    assert time.monotonic() - t0 < 2
    store.set_timeout(timedelta(seconds=20))
    setter = threading.Timer(0.3, lambda: store.multi_set(["x", "y"], ["1", "2"]))
    setter.start()
    t0 = time.monotonic()
    store.wait(["x", "y"])
    assert time.monotonic() - t0 < 3  # woken by the watch, long before the 20 s timeout
    threading.Timer(0.3, lambda: store.set("late", "v")).start()
    assert store.get("late") == b"v"


def test_concurrent_adds_lose_nothing(endpoint):
    run = uuid.uuid4().hex
    stores = [EtcdStore.connect(endpoint, run, key_prefix=PREFIX) for _ in range(4)]
    threads = [threading.Thread(target=lambda s=s: [s.add("n", 1) for _ in range(15)]) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert stores[0].get("n") == b"60"


# -- unreachable and silent etcd ------------------------------------------------------------------------


def test_refused_endpoint_fails_fast_and_says_so(endpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"unreachable or not answering within 2 s.*connection refused"):
        rdzv_etcd.create_handler(_params(dead, read_timeout="2"))
    assert time.monotonic() - t0 < 2
    # a cluster endpoint list skips the dead member
    handler = rdzv_etcd.create_handler(_params(f"{dead},{endpoint}"))
    assert handler.get_backend() == "gpuguard"


def test_silent_etcd_is_bounded_by_read_timeout():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)  # the kernel accepts; nobody ever answers
    silent = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="did not answer within 1 s"):
            rdzv_etcd.create_handler(_params(silent, read_timeout="1"))
        assert time.monotonic() - t0 < 3
        conn = EtcdConnection(parse_endpoints(silent), timeout=1)
        store = EtcdStore(conn, b"/x/store/", timeout=timedelta(seconds=60))
        for call in (lambda: store.wait(["k"]), lambda: store.set("k", "v"), lambda: store.add("k", 1)):
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailableError):
                call()
            assert time.monotonic() - t0 < 3  # the request timeout, not the 60 s store timeout
    finally:
        srv.close()


# -- leases and cleanup ----------------------------------------------------------------------------------


def test_every_key_is_on_the_run_lease_and_expires_without_agents(endpoint):
    run = uuid.uuid4().hex
    backend, store = rdzv_etcd.create_backend(_params(endpoint, run, lease_ttl="3", keep_alive_interval="1"))
    backend.set_state(_state(0))
    store.set("k", "v")
    base = run_prefix(PREFIX, run)
    conn = _conn(endpoint)
    kvs = {kv.key: kv for kv in range_kvs(conn.range(base, "test", prefix=True))}
    assert set(kvs) == {base + b"lease", base + b"state", base + b"store/k"}
    lease = {kv.lease for kv in kvs.values()}
    assert len(lease) == 1 and 0 not in lease
    ttl = conn.call("lease/timetolive", {"ID": str(lease.pop())}, "test")
    assert 0 < int(ttl["TTL"]) <= 3
    end = time.monotonic() + 15  # nobody refreshes: gone after ~3 s
    while _keys(endpoint, base) and time.monotonic() < end:
        time.sleep(0.25)
    assert _keys(endpoint, base) == []
    # the next call finds the lease gone and starts a new one
    assert backend.set_state(_state(1)) is not None and store.add("n", 2) == 2


def test_lease_is_shared_and_refreshed_by_any_member(endpoint):
    run = uuid.uuid4().hex
    base = run_prefix(PREFIX, run)
    a = RunLease(_conn(endpoint), base + b"lease", 30)
    b = RunLease(_conn(endpoint), base + b"lease", 30)
    assert a.id() == b.id()
    assert a.revoke() and not b.revoke()
    assert b.id() != 0 and _keys(endpoint, base) == [base + b"lease"]
    b.revoke()


def test_endpoint_lists():
    eps = parse_endpoints("a:1, b ,[::1]:3,http://c:4/,[fe80::2]")
    assert [(e.host, e.port) for e in eps] == [("a", 1), ("b", 2379), ("::1", 3), ("c", 4), ("fe80::2", 2379)]
    for bad in ("", ",", "a:0", "a:99999"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_validation_of_rdzv_conf(endpoint, monkeypatch):
    with pytest.raises(ValueError, match="lease_ttl"):
        rdzv_etcd.create_backend(_params(endpoint, lease_ttl="5", keep_alive_interval="5"))
    with pytest.raises(ValueError, match="read_timeout"):
        rdzv_etcd.create_backend(_params(endpoint, read_timeout="0"))
    with pytest.raises(ValueError, match="protocol"):
        rdzv_etcd.create_backend(_params(endpoint, protocol="gopher"))
    monkeypatch.delenv("GPUGUARD_JOB_DIR", raising=False)
    with pytest.raises(ValueError, match="needs the job's rendezvous secret"):  # no unsigned mode
        rdzv_etcd.create_backend(_params(endpoint, secret_file=""))


# -- registration ------------------------------------------------------------------------------------------


def test_entry_point_registers_with_torchrun(endpoint):
    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "gpuguard"]
    loaded = ep.load()
    assert loaded is rdzv_etcd.create_handler and loaded() is rdzv_etcd.create_handler  # torch calls it bare
    handler = get_rendezvous_handler(_params(endpoint))  # torch's registry, as torchrun builds it
    assert isinstance(handler, rdzv_etcd.EtcdRendezvousHandler)
    assert handler.get_backend() == "gpuguard" and handler.use_agent_store is False


# -- 16 agents that only rendezvous --------------------------------------------------------------------------


def test_sixteen_concurrent_agents_rendezvous_and_clean_up(endpoint):
    run = f"sixteen-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "rdzv_agents.py"),
            "--n",
            "16",
            "--endpoint",
            endpoint,
            "--run-id",
            run,
            "--timeout",
            "60",
            "--conf",
            f"key_prefix={PREFIX},last_call_timeout=1,join_timeout=60,closed_ttl=30,secret_file={SECRET['path']}",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    agents = json.loads(proc.stdout)["agents"]
    assert sorted(a["rank"] for a in agents) == list(range(16))
    assert {a["world"] for a in agents} == {16}
    assert len({a["master"] for a in agents}) == 1  # one MASTER_ADDR:PORT for the workers, via etcd
    assert not any(a["use_agent_store"] for a in agents)
    # the last agent to shut down left only the closed state, on a short lease of its own
    base = run_prefix(PREFIX, run)
    assert _keys(endpoint, base) == [base + b"state"]
    (kv,) = range_kvs(_conn(endpoint).range(base + b"state", "test"))
    key = derive_key(read_key_file(SECRET["path"], "secret", "", ""))
    state = pickle.loads(unseal_state(key, base + b"state", kv.value))  # sealed: the test trusts its own secret
    assert state.closed and len(state.participants) == 16
    ttl = _conn(endpoint).call("lease/timetolive", {"ID": str(kv.lease)}, "test")
    assert 0 < int(ttl["TTL"]) <= 30
