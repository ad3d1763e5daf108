"""recovery.runtime.activation (pure) and recovery.runtime.attempt: frontier, quiescence, reason, attempt tokens."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.recovery.runtime import activation as act
from gpuguard.recovery.runtime.attempt import current_attempt
from gpuguard.recovery.snapshots.store import Rejection, Selection
from tests.support.generation import numbered as inc
from tests.support.generation import snapshot_info as snap
from tests.support.generation import started as cert


@given(parent_frontier=st.integers(0, 100), committed=st.none() | st.integers(0, 200))
def test_limit_never_passes_what_all_members_committed(parent_frontier, committed):
    parent = cert(4, parent_frontier)
    limit = act.frontier_limit(parent, committed)
    assert limit == max(parent_frontier, -1 if committed is None else committed)
    assert act.frontier_limit(None, committed) == 0


@given(chosen=st.none() | st.integers(0, 50), committed=st.none() | st.integers(0, 50))
@settings(max_examples=60)
def test_choice_is_the_verified_snapshot_or_the_initial_state(chosen, committed):
    parent = cert(4, 0)
    sel = Selection(snap(chosen) if chosen is not None else None, (Rejection(60, Path("/x"), "corrupt: z"),))
    choice = act.choose_frontier(parent, committed, sel)
    limit = act.frontier_limit(parent, committed)
    assert choice.frontier.step <= limit
    if chosen is not None and chosen <= limit:
        assert (choice.frontier.step, choice.frontier.state_manifest_digest) == (chosen, "m")
    else:
        assert (choice.frontier.step, choice.frontier.state_manifest_digest) == (0, "")
    assert choice.rejected == ("step 60: corrupt: z",)


def test_quiescence_needs_every_old_incarnation_seen_gone():
    parent = cert(3)
    gone_all = [act.Hello(0, inc(10).to_dict(), "h", old_gone=("inc0", "inc1", "inc2"))]
    assert act.quiescence(parent, gone_all)[0] == "proved"
    some = [act.Hello(0, inc(10).to_dict(), "h", old_gone=("inc0", "inc1"))]
    q, evidence = act.quiescence(parent, some)
    assert q == "unknown" and any("inc2" in e and "no member" in e for e in evidence)
    alive = [act.Hello(0, inc(10).to_dict(), "h", old_gone=("inc0", "inc1"), old_alive=("inc2",))]
    q, evidence = act.quiescence(parent, alive)
    assert q == "unknown" and any("still running" in e for e in evidence)
    assert act.quiescence(cert(0), [])[0] == "proved"


def test_reason_follows_the_world_size():
    assert act.reason(cert(0), 4) == "start"
    assert act.reason(cert(4), 4) == "rank-failure"
    assert act.reason(cert(4), 3) == "scale-down"
    assert act.reason(cert(3), 4) == "scale-up"


@given(st.lists(st.integers(0, 5), max_size=8))
def test_hellos_must_cover_every_rank_once(ranks):
    hellos = [act.Hello(r, {"id": f"i{n}"}, "h") for n, r in enumerate(ranks)]
    problems = act.check_hellos(hellos, 4)
    assert (problems == []) == (sorted(ranks) == [0, 1, 2, 3])


def test_hello_round_trips():
    h = act.Hello(2, inc(2).to_dict(), "h", ("a",), ("b",), 7)
    assert act.Hello.from_dict(h.to_dict()) == h


def test_attempt_falls_back_loudly_without_a_rendezvous():
    a = current_attempt({"MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "2", "GPUGUARD_RDZV_ENDPOINT": ""})
    assert a.token == "c2-p1234" and a.round is None and "restart count" in a.source
