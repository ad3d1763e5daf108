"""The pure rules of the in-place switch (recovery.runtime.switch): layout shrink, coordinator, state agreement."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.recovery.runtime.switch import (
    Layout,
    Report,
    agree_on_state,
    choose_coordinator,
    dense_ranks,
    shrink_layout,
    steps_to_roll_back,
    switch_reason,
)


def _rep(rank: int, committed: int | None, digests: dict[int, str]) -> Report:
    return Report(1, rank, f"inc{rank}", 100 + rank, "h", committed, digests, "Connection closed by peer", 1.0)


def test_dp_shrink_keeps_survivors_and_the_global_batch():
    s = shrink_layout(Layout(dp=4, global_batch=12), [3])
    assert s.layout == Layout(dp=3, global_batch=12)
    assert s.kept_ranks == (0, 1, 2)
    assert s.layout.to_dict()["per_replica_batch"] == 4.0


def test_tp_group_missing_a_member_is_refused_with_the_reason():
    s = shrink_layout(Layout(dp=2, tp=2), [1])
    assert s.layout is None
    assert "replica 0" in s.refused and "tp=2" in s.refused


def test_whole_tp_replica_lost_shrinks():
    s = shrink_layout(Layout(dp=3, tp=2, pp=2), range(4, 8))
    assert s.layout == Layout(dp=2, tp=2, pp=2)
    assert s.kept_ranks == (0, 1, 2, 3, 8, 9, 10, 11)


def test_nothing_left_is_refused():
    assert shrink_layout(Layout(dp=2), [0, 1]).refused == "no complete data-parallel replica survives"
    assert "not in" in shrink_layout(Layout(dp=2), [5]).refused


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.data())
def test_shrink_never_splits_a_replica(tp, pp, dp, data):
    layout = Layout(dp=dp, tp=tp, pp=pp)
    lost = data.draw(st.sets(st.integers(0, layout.world - 1)))
    s = shrink_layout(layout, lost)
    if s.layout is not None:
        assert not set(s.kept_ranks) & lost
        assert len(s.kept_ranks) == s.layout.world
        per = tp * pp
        assert all(set(range(r - r % per, r - r % per + per)) <= set(s.kept_ranks) for r in s.kept_ranks)
    else:
        assert s.refused


def test_coordinator_is_the_lowest_living_reporter():
    assert choose_coordinator([2, 1, 3]) == 1
    assert choose_coordinator([2, 1, 3], gone=[1]) == 2
    assert choose_coordinator([1], gone=[1]) is None
    assert dense_ranks([3, 0, 2]) == {0: 0, 2: 1, 3: 2}


def test_reason_names_the_worst_event():
    assert switch_reason(dead=[3], killed=[1], operator=False) == "rank-failure"
    assert switch_reason(dead=[], killed=[1], operator=False) == "hang"
    assert switch_reason(dead=[], killed=[], operator=True) == "operator"


def test_state_agreement_needs_every_survivor_at_the_frontier_with_one_digest():
    ok = agree_on_state([_rep(0, 8, {7: "a", 8: "b"}), _rep(1, 7, {6: "z", 7: "a"})], 7)
    assert ok.digest == "a" and not ok.problems
    split = agree_on_state([_rep(0, 7, {7: "a"}), _rep(1, 7, {7: "b"})], 7)
    assert split.digest is None and "disagree" in split.problems[0]
    missing = agree_on_state([_rep(0, 9, {8: "a", 9: "b"})], 7)
    assert missing.digest is None and "no local state of step 7" in missing.problems[0]
    assert steps_to_roll_back(8, 7) == 1 and steps_to_roll_back(7, 7) == 0 and steps_to_roll_back(None, 3) == 0


@given(
    st.integers(0, 50),
    st.one_of(st.none(), st.integers(0, 10**6)),
    st.dictionaries(st.integers(0, 10**6), st.text(max_size=8), max_size=4),
)
def test_report_round_trip(rank, committed, digests):
    rep = Report(3, rank, "i", 7, "host", committed, digests, "x", 2.5)
    assert Report.from_dict(rep.to_dict()) == rep
