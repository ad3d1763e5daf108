"""A re-rendezvous ends its last call once every agent known to be alive has joined (issue 23).

- the rule alone (`may_end_last_call`, `HeartbeatMemory`): an agent between its exit and its join
  (its heartbeat gone from the state, fresh in the memory) is waited for; a wait-list agent is
  waited for; an expired one is not; torch's own preconditions hold;
- on a real etcd, three real handlers (min 2, max 3, a 4 s last call): one stops its heartbeats
  (its host is gone) and the two others re-rendezvous. With the early end they are done as soon as
  the lost one's heartbeat expired; with `last_call_early=0` they wait the full last call after
  that. A live agent that re-joins late is waited for (all three are in the round), and a job's
  first round keeps torch's last call.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from gpuguard.recovery.rendezvous.last_call import HeartbeatMemory, may_end_last_call
from gpuguard.recovery.rendezvous.signed_state import create_secret_file

PREFIX = "/gpuguard-test/rdzv-last-call"
SECRET: dict[str, str] = {}
LAST_CALL = 4  # seconds: long enough that waiting it out cannot pass for the early end
EXPIRY = 2  # keep_alive_interval 1 s x keep_alive_max_attempt 2


def _node(i: int) -> _NodeDesc:
    return _NodeDesc("host", 100 + i, 0)


def _settings(min_nodes: int = 2, max_nodes: int = 3) -> RendezvousSettings:
    return RendezvousSettings(
        "run", min_nodes, max_nodes, RendezvousTimeout(), timedelta(seconds=1), keep_alive_max_attempt=2
    )


def _open_round(participants: list[int], waiting: list[int] = (), beat_age: float = 0.0) -> _RendezvousState:
    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    state.round = 3
    state.participants = {_node(i): 0 for i in participants}
    state.wait_list = {_node(i) for i in waiting}
    state.last_heartbeats = {_node(i): now - timedelta(seconds=beat_age) for i in (*participants, *waiting)}
    state.deadline = now + timedelta(seconds=LAST_CALL)
    return state


def _alive(memory: HeartbeatMemory) -> set:
    return memory.alive(datetime.now(timezone.utc), timedelta(seconds=EXPIRY))


def test_the_rule_waits_for_every_agent_known_to_be_alive_and_only_those():
    s = _settings()
    memory = HeartbeatMemory()
    old = _open_round([0, 1, 2])
    old.last_heartbeats[_node(2)] -= timedelta(seconds=EXPIRY + 1)  # node 2's host went dark
    memory.observe(old.last_heartbeats)
    now = _open_round([0, 1])
    memory.observe(now.last_heartbeats)
    assert _alive(memory) == {_node(0), _node(1)}
    assert may_end_last_call(now, s, _alive(memory))  # the lost node's beat expired: nobody else comes
    # node 1 exited (its exit op deleted its heartbeat) and has not joined yet: fresh in the memory
    between = _open_round([0])
    between.deadline = None
    assert not may_end_last_call(between, s, _alive(memory))
    racing = _open_round([0, 2])  # a state where min is met without node 1, which is alive
    assert not may_end_last_call(racing, s, _alive(memory))
    # a wait-list agent is alive and not a participant: torch's last call
    waiting = _open_round([0, 1], waiting=[3])
    memory.observe(waiting.last_heartbeats)
    assert not may_end_last_call(waiting, s, _alive(memory))
    # torch's own preconditions: no deadline set, complete, closed, too few or too many
    fresh = HeartbeatMemory()
    for mutate in (
        lambda st: setattr(st, "deadline", None),
        lambda st: setattr(st, "complete", True),
        lambda st: setattr(st, "closed", True),
    ):
        st = _open_round([0, 1])
        mutate(st)
        fresh.observe(st.last_heartbeats)
        assert not may_end_last_call(st, s, _alive(fresh))
    assert not may_end_last_call(_open_round([0]), s, set())
    assert not may_end_last_call(_open_round([0, 1, 2, 3]), s, set())
    assert may_end_last_call(_open_round([0, 1, 2]), s, set())


def test_the_memory_keeps_the_newest_beat_and_forgets_expired_ones():
    memory = HeartbeatMemory()
    now = datetime.now(timezone.utc)
    memory.observe({_node(0): now - timedelta(seconds=10), _node(1): now})
    memory.observe({_node(0): now - timedelta(seconds=0.5)})
    memory.observe({_node(0): now - timedelta(seconds=20), _node(2): "not a time"})  # older, garbage
    assert _alive(memory) == {_node(0), _node(1)}
    later = now + timedelta(seconds=EXPIRY - 0.2)  # node 0's newest beat is 2.3 s old then, node 1's 1.8 s
    assert memory.alive(later, timedelta(seconds=EXPIRY)) == {_node(1)}
    memory.observe({_node(0): now - timedelta(seconds=0.4)})  # an older beat than the one forgotten: still old
    assert memory.alive(later, timedelta(seconds=EXPIRY)) == {_node(1)}
    assert memory.alive(later + timedelta(seconds=1), timedelta(seconds=EXPIRY)) == set()


# --- real handlers on a real etcd -------------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(etcd_url, tmp_path_factory) -> str:
    SECRET["path"] = str(create_secret_file(tmp_path_factory.mktemp("rdzv-last-call") / "rendezvous.secret"))
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


def _handler(endpoint: str, run: str, early: bool = True):
    conf = {
        "key_prefix": PREFIX,
        "read_timeout": "5",
        "secret_file": SECRET["path"],
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "2",
        "lease_ttl": "30",
        "last_call_timeout": str(LAST_CALL),
        "join_timeout": "40",
        "last_call_early": "1" if early else "0",
    }
    return get_rendezvous_handler(RendezvousParameters("gpuguard", endpoint, run, 2, 3, **conf))


def _together(handlers, delays=None) -> list:
    """`next_rendezvous` of each handler in a thread of its own (after its delay); their infos."""
    out: list = [None] * len(handlers)
    errors: list[BaseException] = []

    def join(i, h):
        try:
            time.sleep((delays or [0] * len(handlers))[i])
            out[i] = h.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return out


def _lose_one_and_rejoin(endpoint: str, early: bool) -> tuple[float, list]:
    """Round 1 with three agents; the third stops its heartbeats; the two others re-rendezvous.
    Returns the seconds from the third's heartbeat expiry to the last survivor's return."""
    run = f"lc-{uuid.uuid4().hex[:8]}"
    handlers = [_handler(endpoint, run, early) for _ in range(3)]
    try:
        first = _together(handlers)
        assert sorted(i.world_size for i in first) == [3, 3, 3]  # max_nodes: complete at once
        lost = handlers[2]
        lost._stop_heartbeats()
        with lost._heartbeat_lock:
            last_beat = time.monotonic()  # its last heartbeat is no later than now
        infos = _together(handlers[:2])
        done = time.monotonic()
        assert sorted(i.world_size for i in infos) == [2, 2]
        assert sorted(i.rank for i in infos) == [0, 1]
        return done - (last_beat + EXPIRY), infos
    finally:
        for h in handlers[:2]:
            h.shutdown()


@pytest.mark.etcd
@pytest.mark.timeout(180)
def test_survivors_complete_the_round_once_the_lost_agent_expired_not_a_last_call_later(endpoint):
    early, _ = _lose_one_and_rejoin(endpoint, early=True)
    torch_last_call, _ = _lose_one_and_rejoin(endpoint, early=False)
    # the round opens when the sanitizer drops the lost agent (its beat older than EXPIRY); torch
    # then waits LAST_CALL more, the early end at most a state poll more
    assert early < 1.5, early
    assert torch_last_call > LAST_CALL - 0.5, torch_last_call


@pytest.mark.etcd
@pytest.mark.timeout(180)
def test_a_live_agent_that_rejoins_late_is_in_the_round_and_a_first_round_keeps_the_last_call(endpoint):
    run = f"lc-{uuid.uuid4().hex[:8]}"
    handlers = [_handler(endpoint, run) for _ in range(3)]
    try:
        t0 = time.monotonic()
        first = _together(handlers[:2] + [handlers[2]], delays=[0, 0, 1.0])  # all three, one 1 s late
        assert [i.world_size for i in first] == [3, 3, 3]  # the first round's last call let it in
        assert time.monotonic() - t0 < LAST_CALL  # and the third completed it (max_nodes)
        again = _together(handlers, delays=[0, 0, 1.5])  # the third, alive, re-joins 1.5 s late
        assert [i.world_size for i in again] == [3, 3, 3]
        assert all(h.last_call.rounds_done == 2 for h in handlers)
    finally:
        for h in handlers:
            h.shutdown()
    # two agents of a first start: torch's last call runs in full (agents come up seconds apart)
    run = f"lc-{uuid.uuid4().hex[:8]}"
    pair = [_handler(endpoint, run) for _ in range(2)]
    try:
        t0 = time.monotonic()
        assert [i.world_size for i in _together(pair)] == [2, 2]
        assert time.monotonic() - t0 > LAST_CALL - 0.5
        assert all(h.last_call.ended_early == 0 for h in pair)
    finally:
        for h in pair:
            h.shutdown()


def test_the_switch_is_checked():
    from gpuguard.recovery.rendezvous.backend import _conf_flag

    def params(value):
        return RendezvousParameters("gpuguard", "localhost:1", "r", 1, 1, last_call_early=value)

    assert _conf_flag(params("0"), "last_call_early", True) is False
    assert _conf_flag(params("true"), "last_call_early", False) is True
    with pytest.raises(ValueError, match="0 or 1"):
        _conf_flag(params("yes please"), "last_call_early", True)
