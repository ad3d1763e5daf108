"""Ownership map and transfer plan (pure): who owns what after a membership change, and from where."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.generation.ownership import OwnershipMap, plan_problems, plan_transfer


def test_shrink_keeps_survivor_objects_and_moves_orphans():
    old = OwnershipMap(4, 4, {"a": 0, "b": 1, "c": 2, "d": 3})
    # rank 2 died; survivors 0,1,3 become 0,1,2
    new, plan = plan_transfer(old, new_world_size=3, survivors={0: 0, 1: 1, 3: 2}, replicas={"c": [1]})
    assert new.version == 5 and new.world_size == 3
    by = {t.object: t for t in plan}
    assert by["a"].source == "local" and by["d"].to_rank == 2 and by["d"].source == "local"
    assert by["c"].source in ("replica", "local") and by["c"].to_rank == new.owners["c"]
    assert plan_problems(new, plan) == []


def test_lost_object_without_replica_comes_from_checkpoint():
    old = OwnershipMap(1, 2, {"a": 0, "b": 1})
    new, plan = plan_transfer(old, new_world_size=2, survivors={0: 0})
    by = {t.object: t for t in plan}
    assert by["b"].source == "checkpoint" and by["b"].from_rank is None and by["b"].to_rank == 1


def test_replica_on_another_survivor_is_copied():
    old = OwnershipMap(1, 3, {"a": 0, "b": 1, "c": 2, "x": 0})
    new, plan = plan_transfer(old, new_world_size=2, survivors={0: 0, 2: 1}, replicas={"b": [2]})
    t = next(t for t in plan if t.object == "b")
    assert new.owners["b"] == 1 and t.source == "local"  # least-loaded rank 1 already holds the replica
    old2 = OwnershipMap(1, 3, {"a": 0, "b": 1, "c": 2, "y": 2})
    new2, plan2 = plan_transfer(old2, new_world_size=2, survivors={0: 0, 2: 1}, replicas={"b": [2]})
    t2 = next(t for t in plan2 if t.object == "b")
    assert new2.owners["b"] == 0 and (t2.source, t2.from_rank) == ("replica", 1)


def test_invalid_inputs_are_refused():
    old = OwnershipMap(1, 2, {"a": 0})
    with pytest.raises(ValueError):
        plan_transfer(old, new_world_size=0, survivors={})
    with pytest.raises(ValueError):
        plan_transfer(old, new_world_size=2, survivors={0: 5})
    with pytest.raises(ValueError):
        plan_transfer(old, new_world_size=2, survivors={0: 1, 1: 1})
    with pytest.raises(ValueError):
        OwnershipMap(1, 2, {"a": 2})


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_plan_covers_every_object_exactly_once(data):
    old_ws = data.draw(st.integers(1, 8))
    objs = data.draw(st.lists(st.text("abcdef", min_size=1, max_size=4), unique=True, max_size=30))
    owners = {o: data.draw(st.integers(0, old_ws - 1)) for o in objs}
    new_ws = data.draw(st.integers(1, 8))
    alive = data.draw(st.lists(st.integers(0, old_ws - 1), unique=True, max_size=min(old_ws, new_ws)))
    survivors = dict(zip(alive, data.draw(st.permutations(range(new_ws)))[: len(alive)]))
    replicas = {o: data.draw(st.lists(st.integers(0, old_ws - 1), max_size=2)) for o in objs}
    new, plan = plan_transfer(
        OwnershipMap(3, old_ws, owners), new_world_size=new_ws, survivors=survivors, replicas=replicas
    )
    assert plan_problems(new, plan) == []
    assert set(new.owners) == set(objs)
    for t in plan:
        if t.source in ("local", "survivor", "replica"):
            assert t.from_rank is not None and 0 <= t.from_rank < new_ws
        if owners[t.object] in survivors and survivors[owners[t.object]] == t.to_rank:
            assert t.source == "local"
    loads = new.load()
    moved = [t for t in plan if owners[t.object] not in survivors]
    if moved:  # orphans are spread: no rank gets more than the least-loaded + 1 among orphan targets
        assert max(loads.values()) - min(loads.get(r, 0) for r in range(new_ws)) <= max(1, len(objs))
