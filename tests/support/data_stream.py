"""The one check both data-position tests make (restart path and in place): the samples each step saw
follow the rule of docs/formats/sharded-snapshots.md ("Data position") across a 3 -> 2 world change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from gpuguard.recovery.runtime.data import reference_batches, share
from tests.support.jobs.data_job import BATCH, SEED, SIZE


def assert_follows_the_rule(steps: Mapping[int, Mapping[int, dict]], resumed_at: int, total: int) -> None:
    """`steps`: step -> rank -> {"world", "global", "ids"}; world 3 before `resumed_at`, 2 from it."""
    want = reference_batches(SIZE, BATCH, SEED, total)
    assert sorted(steps) == list(range(1, total + 1))
    for step, by_rank in steps.items():
        world = 3 if step < resumed_at else 2
        batch = want[step - 1]
        assert sorted(by_rank) == list(range(world)), (step, sorted(by_rank))
        assert all(r["world"] == world and r["global"] == batch for r in by_rank.values()), (step, by_rank)
        # each rank took exactly its positions of the fault-free global batch, in order
        assert [by_rank[r]["ids"] for r in range(world)] == [share(batch, r, world) for r in range(world)], step
    per_epoch = SIZE // BATCH
    first_epoch = Counter(i for step in range(1, per_epoch + 1) for r in steps[step].values() for i in r["ids"])
    assert first_epoch == Counter(range(SIZE))  # every sample once in the epoch the fault fell in
    assert sum(len(r["ids"]) for s in steps.values() for r in s.values()) == total * BATCH
