"""The sharded layout (chunks, holders, writers) and the reshard plan: pure, property-checked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.generation.ownership import (
    Chunk,
    ShardLayout,
    describe_reshard,
    layout_from_keys,
    plan_reshard,
    plan_transfer,
    reshard_problems,
)


def fsdp_layout(shapes: dict[str, tuple[int, ...]], world: int, version: int = 0, stored: bool = True) -> ShardLayout:
    """FSDP2's Shard(0) layout: torch.chunk of dim 0 over `world` ranks (ceil-sized, the last ones may be empty)."""
    held: dict[int, dict[str, tuple[int, ...]]] = {r: {} for r in range(world)}
    writers = {}
    for fqn, shape in shapes.items():
        step = -(-shape[0] // world)
        for r in range(world):
            lo, hi = min(r * step, shape[0]), min((r + 1) * step, shape[0])
            if hi <= lo:
                continue
            c = Chunk(fqn, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])
            held[r][c.key] = c.sizes
            writers[c.key] = r
    return layout_from_keys(version, world, held, writers if stored else None)


shapes_st = st.dictionaries(
    st.sampled_from(["model.0.weight", "model.0.bias", "optim.state.0.weight.exp_avg", "model.2.weight"]),
    st.tuples(st.integers(1, 17), st.integers(1, 5)),
    min_size=1,
)


@settings(max_examples=150, deadline=None)
@given(shapes_st, st.integers(1, 8), st.integers(1, 8))
def test_a_reshard_plan_fills_every_new_chunk_exactly_once(shapes, old_world, new_world):
    old = fsdp_layout(shapes, old_world)
    new = fsdp_layout(shapes, new_world, version=1, stored=False)
    plan = plan_reshard(old, new)
    assert reshard_problems(new, plan) == []
    assert all(t.source == "checkpoint" and t.from_rank is None for t in plan)  # restart path: memory is gone
    for t in plan:  # every read is inside the stored chunk it names
        stored = old.chunks[t.old_key]
        assert stored.overlap(t.region) == t.region
        assert old.writers[t.old_key] == t.old_writer


def test_a_plan_with_a_hole_is_reported():
    shapes = {"w": (8, 2)}
    old, new = fsdp_layout(shapes, 2), fsdp_layout(shapes, 3, 1, stored=False)
    plan = plan_reshard(old, new)
    assert reshard_problems(new, plan[1:]) == ["rank 0: chunk w@0,0 gets 0 of its 6 elements"]
    assert reshard_problems(new, plan + plan[:1])  # twice is wrong too


def test_in_place_with_replicas_moves_only_what_no_survivor_holds():
    # HSDP-like: 2 replica groups x 2 shards; old ranks 0,1 = shards 0,1 of replica A; 2,3 = replica B
    held = {0: {"w@0": (4,)}, 1: {"w@4": (4,)}, 2: {"w@0": (4,)}, 3: {"w@4": (4,)}}
    old = layout_from_keys(0, 4, held, {"w@0": 0, "w@4": 1})
    assert old.replicas() == {"w@0": [0, 2], "w@4": [1, 3]}
    new = layout_from_keys(1, 3, {0: {"w@0": (4,)}, 1: {"w@4": (4,)}, 2: {"w@4": (4,)}})
    survivors = {0: 0, 2: 2, 3: 1}  # old rank 1 is lost
    plan = plan_reshard(old, new, survivors=survivors, in_memory=True)
    assert reshard_problems(new, plan) == []
    by = {(t.to_rank, t.old_key): (t.source, t.from_rank) for t in plan}
    assert by[(0, "w@0")] == ("local", 0)
    assert by[(1, "w@4")] == ("local", 1)  # old rank 3, now 1, holds the lost rank's shard
    assert by[(2, "w@4")] == ("replica", 1)  # sent from the surviving replica, not read from disk
    words = describe_reshard(old, new, plan, step=41, survivors=survivors, lost=[1])
    assert words[1] == "rank 0 (now rank 0)'s shards of 1 tensors: kept in memory by rank 0"
    assert (
        words[2]
        == "rank 1 (lost)'s shards of 1 tensors: sent from a surviving replica to rank 2; kept in memory by rank 1"
    )
    # without replicas in memory the same change is a checkpoint read
    plan = plan_reshard(old, new, survivors={0: 0, 2: 1}, in_memory=True)
    assert {t.source for t in plan if t.old_key == "w@4"} == {"checkpoint"}


def test_the_words_name_the_lost_rank_the_tensors_the_step_and_the_readers():
    shapes = {f"model.{i}.weight": (12, 3) for i in range(14)}
    old, new = fsdp_layout(shapes, 4), fsdp_layout(shapes, 3, 1, stored=False)
    words = describe_reshard(old, new, plan_reshard(old, new), step=41, lost=[2])
    assert words[0] == "world 4 -> 3 (ownership map v0 -> v1)"
    assert "rank 2 (lost)'s shards of 14 tensors: read from snapshot step 41 by ranks 1,2" in words
    # rows 0-2|3-5|6-8|9-11 -> 0-3|4-7|8-11: each new chunk overlaps two stored ones
    assert words[-1] == f"{14 * 6} chunk reads, {14 * 36} elements moved, {14 * 36} in all"


def test_layout_round_trips_and_refuses_bad_ranks():
    lay = fsdp_layout({"w": (5, 2), "b": (5,)}, 2, version=3)
    assert ShardLayout.from_dict(lay.to_dict()) == lay
    own = lay.ownership()
    assert own.version == 3 and own.owners == {"b@0": 0, "b@3": 1, "w@0,0": 0, "w@3,0": 1}
    assert lay.tensors_of(1) == {"w", "b"}
    with pytest.raises(ValueError, match="outside world size 2"):
        layout_from_keys(0, 2, {2: {"w@0": (1,)}})
    with pytest.raises(ValueError, match="says sizes"):
        layout_from_keys(0, 2, {0: {"w@0": (1,)}, 1: {"w@0": (2,)}})
    with pytest.raises(ValueError, match="held by no rank"):
        layout_from_keys(0, 2, {0: {"w@0": (1,)}}, {"w@1": 1})


def test_the_object_level_plan_agrees_when_the_layout_does_not_change():
    # an unchanged layout (a replacement rank): plan_transfer on the layout's ownership map and replicas
    held = {0: {"w@0": (4,)}, 1: {"w@4": (4,)}, 2: {"w@0": (4,)}, 3: {"w@4": (4,)}}
    old = layout_from_keys(0, 4, held, {"w@0": 0, "w@4": 1})
    new_map, plan = plan_transfer(
        old.ownership(), new_world_size=3, survivors={0: 0, 2: 2, 3: 1}, replicas=old.replicas()
    )
    assert {t.object: t.source for t in plan} == {"w@0": "local", "w@4": "local"}
    assert new_map.version == 1


@given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20), st.integers(0, 20))
def test_overlap_is_the_intersection(a, n, b, k):
    x, y = Chunk("t", (a,), (n,)), Chunk("t", (b,), (k,))
    got = x.overlap(y)
    both = set(range(a, a + n)) & set(range(b, b + k))
    assert (got is None) == (not both)
    if got is not None:
        assert set(range(got.offsets[0], got.offsets[0] + got.sizes[0])) == both
    assert Chunk("t", (), ()).overlap(Chunk("t", (), ())) == Chunk("t", (), ())
