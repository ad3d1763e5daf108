"""The agents wait on a watch of the state key, not on torch's 1 s poll (issue 23), on a real etcd.

- `wait_for_change` returns at the first change of the state key (also one made between the read
  and the wait), and otherwise after its bound, never later: with nothing changing, with a refused
  and with a silent etcd (no busy loop, no thread left behind); a watch etcd ends because the held
  state's revision was compacted away (on an etcd of its own: compaction is server-wide) is the
  same pause, one watch, then the next read works;
- the handler's join loop reacts to the other agent's join at once: two real handlers, the first
  parked in torch's SYNC wait; with torch's poll it returns up to 1 s after the second;
- the hook is this handler's alone: torch's module and its other handlers keep their `_delay`.
"""

from __future__ import annotations

import pickle
import re
import socket
import threading
import time
import urllib.request
import uuid
from urllib.parse import urlsplit

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic
from torch.distributed.elastic.rendezvous import utils as torch_utils
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from gpuguard.foundation.etcd import EtcdClient, parse_endpoints
from gpuguard.recovery.rendezvous import backend as rdzv_etcd
from gpuguard.recovery.rendezvous.signed_state import create_secret_file
from tests.support.etcd_cluster import start_plain_etcd

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

PREFIX = "/gpuguard-test/rdzv-watch"
SECRET: dict[str, str] = {}


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


@pytest.fixture(scope="module", autouse=True)
def _secret(tmp_path_factory):
    SECRET["path"] = str(create_secret_file(tmp_path_factory.mktemp("rdzv-watch") / "rendezvous.secret"))


def _params(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 4, **conf: str) -> RendezvousParameters:
    conf = {"key_prefix": PREFIX, "read_timeout": "5", "secret_file": SECRET["path"], **conf}
    return RendezvousParameters("gpuguard", endpoint, run_id, min_nodes, max_nodes, **conf)


def _state(round_: int) -> bytes:
    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _woken(mine, other, token: int, round_: int):
    """(changed, seconds) of `mine` waiting (5 s at most) on the state `token` while `other`
    writes round `round_` over it 0.3 s in."""
    writer = threading.Timer(0.3, lambda: other.set_state(_state(round_), token))
    writer.start()
    try:
        return _timed(mine.wait_for_change, token, 5.0)
    finally:
        writer.join(timeout=10)


def test_wait_ends_at_the_first_change_and_never_past_its_bound(endpoint):
    run = uuid.uuid4().hex
    mine, _ = rdzv_etcd.create_backend(_params(endpoint, run))
    other, _ = rdzv_etcd.create_backend(_params(endpoint, run))  # another agent of the run
    _, token, _ = mine.set_state(_state(0))
    changed, took = _timed(mine.wait_for_change, token, 0.6)
    assert changed is False and 0.55 < took < 1.2  # nothing changed: the whole bound, as torch's sleep
    changed, took = _woken(mine, other, token, 1)
    assert changed is True and 0.25 < took < 2.0, took  # woken by the write, long before 5 s
    # a change between the read and the wait is not missed: the watch starts after the state held
    assert mine.get_state() is not None
    _, held = mine.get_state()
    _, newer, ok = other.set_state(_state(2), held)
    assert ok
    changed, took = _timed(mine.wait_for_change, held, 5.0)
    assert changed is True and took < 1.0
    # and a state already read is not a change (no busy loop): the full bound again
    changed, took = _timed(mine.wait_for_change, mine.get_state()[1], 0.5)
    assert changed is False and took > 0.45
    # no state held yet (torch's token None): torch's plain pause
    changed, took = _timed(mine.wait_for_change, None, 0.3)
    assert changed is False and 0.25 < took < 1.0


def test_a_refused_or_silent_etcd_costs_the_bound_not_more_and_not_a_spin(endpoint):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)  # the kernel accepts; nobody ever answers
    silent = f"127.0.0.1:{srv.getsockname()[1]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{s.getsockname()[1]}"
    run = uuid.uuid4().hex
    good, _ = rdzv_etcd.create_backend(_params(endpoint, run))
    try:
        for where in (silent, refused):
            good.conn = EtcdClient(parse_endpoints(where), timeout=5)  # etcd gone after the backend started
            before = threading.active_count()
            changed, took = _timed(good.wait_for_change, 7, 0.5)
            assert changed is False and 0.45 < took < 1.5, (where, took)
            assert threading.active_count() == before
    finally:
        srv.close()


@pytest.fixture(scope="module")
def own_endpoint(tmp_path_factory):
    """An etcd of this module's own: a compaction is server-wide (and so is the watch counter)."""
    srv = start_plain_etcd(tmp_path_factory.mktemp("etcd-compact"))
    yield srv.endpoint
    srv.stop()


def _watches_started(endpoint: str) -> int:
    """The watch streams etcd has opened (one per `/v3/watch` request of the gateway)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:  # noqa: S310 - our own etcd
        text = r.read().decode()
    m = re.search(
        r'^grpc_server_started_total\{grpc_method="Watch",grpc_service="etcdserverpb.Watch"[^}]*\} (\d+)', text, re.M
    )
    assert m, "etcd exports no watch counter"
    return int(m.group(1))


def test_a_watch_ended_by_compaction_is_the_plain_pause_then_a_normal_read(own_endpoint):
    run = uuid.uuid4().hex
    mine, _ = rdzv_etcd.create_backend(_params(own_endpoint, run))
    other, _ = rdzv_etcd.create_backend(_params(own_endpoint, run))
    _, token, _ = mine.set_state(_state(0))
    _, newer, ok = other.set_state(_state(1), token)  # a change after the held state...
    assert ok
    with EtcdClient(parse_endpoints(own_endpoint), timeout=5) as admin:
        for i in range(3):  # ... then more writes, and etcd compacted past the held state's next revision
            admin.put(f"/elsewhere/{i}", b"x")
        now = int(admin.range(b"/", "test revision")["header"]["revision"])
        admin.call("kv/compaction", {"revision": str(now), "physical": True}, "test compaction")
        assert now > token + 1 and admin.watch(mine.key, token + 1, 2.0) == "ended"  # etcd ends such a watch
    watches, threads = _watches_started(own_endpoint), threading.active_count()
    changed, took = _timed(mine.wait_for_change, token, 1.0)
    # not a change (no event came: the next read finds it), not at once, not in a loop, not past the bound
    assert changed is False and 0.95 < took < 1.6, took
    assert _watches_started(own_endpoint) - watches == 1  # one watch for the whole pause
    assert threading.active_count() == threads  # no thread left behind
    state, read = mine.get_state()  # and the next read is a normal one
    assert pickle.loads(state).round == 1 and read == newer
    changed, took = _timed(mine.wait_for_change, read, 0.3)  # and from there the watch works again
    assert changed is False and 0.25 < took < 1.0
    changed, took = _woken(mine, other, read, 2)
    assert changed is True and took < 2.0, took


def test_the_join_loop_reacts_to_the_other_agents_join_at_once(endpoint):
    """A parks in torch's SYNC wait (1 of 2 nodes); B joins and completes the round. Measured: B's
    completing write (its backend's successful `set_state`, timed as it returns) to A's
    `next_rendezvous` return (A is rank 0: created first, so it waits for nobody's store key).
    With torch's poll A notices up to 1 s later (uniform, so 4 trials all under 0.35 s happen by
    chance with p ~ 0.35^4 = 1.5%); with the watch it notices at the write."""
    lags = []
    for _ in range(4):
        run = f"watch-{uuid.uuid4().hex[:8]}"
        a = get_rendezvous_handler(_params(endpoint, run, 2, 2, keep_alive_interval="5"))
        b = get_rendezvous_handler(_params(endpoint, run, 2, 2, keep_alive_interval="5"))
        done: dict[str, float] = {}
        real_set_state = b._gpuguard_backend.set_state

        def set_state(state, token=None, real_set_state=real_set_state, done=done):
            out = real_set_state(state, token)
            if out is not None and out[2]:
                done["b"] = time.monotonic()  # B's last successful write before it returns: the completion
            return out

        b._gpuguard_backend.set_state = set_state
        errors: list[BaseException] = []

        def join_a(a=a, done=done, errors=errors):
            try:
                a.next_rendezvous()
                done["a"] = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        ta = threading.Thread(target=join_a)
        ta.start()
        try:
            time.sleep(1.5)  # A has joined and waits for B (SYNC)
            assert "a" not in done and not errors
            assert b.next_rendezvous().rank == 1
            ta.join(timeout=20)
            assert not ta.is_alive() and not errors, errors
            lags.append(done["a"] - done["b"])
        finally:
            ta.join(timeout=20)
            for h in (a, b):
                h.shutdown()
    assert max(lags) < 0.35, lags


def test_the_hook_is_this_handlers_alone(endpoint):
    assert rdzv_etcd.WATCHES_SYNC  # this torch's loop pauses through `_delay`: the watch replaces it
    handler = get_rendezvous_handler(_params(endpoint, uuid.uuid4().hex))
    assert isinstance(handler._op_executor, rdzv_etcd._WatchingOpExecutor)
    assert handler._op_executor._torch_run is not None
    assert torch_dynamic._delay is torch_utils._delay  # torch's module untouched
    assert torch_dynamic._DistributedRendezvousOpExecutor.run.__globals__["_delay"] is torch_utils._delay
    handler.shutdown()
