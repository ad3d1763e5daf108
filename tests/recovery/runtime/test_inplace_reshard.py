"""The sharded in-place agreement (pure): replicas agree, the survivors cover every tensor, one digest.

Chunks here are 1-D row ranges of tensors split as FSDP2 splits them, over `shard` ranks, repeated
in `replicas` replica groups (HSDP); the sums are arbitrary but equal across replicas. The digest of
the survivors' chunks must not depend on which replica's copy is counted, nor on the layout: the same
tensors split over another shard count give the same digest (the additive sums of a split add up).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.inplace_files import Report
from gpuguard.recovery.runtime.reshard import agree_on_sharded_state, digest_of

M64 = (1 << 64) - 1


def _value(path: str, row: int) -> int:
    """A per-row contribution (any function of the global element works: sums are additive)."""
    return (hash((path, row)) * 0x9E3779B97F4A7C15) & M64


def layout(tensors: dict[str, int], shard: int, replicas: int) -> dict[int, dict[str, list]]:
    """rank -> chunk key -> entry, ranks numbered replica-major (rank = replica * shard + index)."""
    out: dict[int, dict[str, list]] = {r: {} for r in range(shard * replicas)}
    for path, n in tensors.items():
        step = -(-n // shard)
        for i in range(shard):
            lo, hi = min(n, i * step), min(n, (i + 1) * step)
            total = sum(_value(path, row) for row in range(lo, hi)) & M64
            e = ["torch.float32", [n], [hi - lo], format(total, "016x")]
            for rep in range(replicas):
                out[rep * shard + i][f"{path}@{lo}"] = e
    return out


def reports(held: dict[int, dict[str, list]], keep, step: int = 4) -> list[Report]:
    return [Report(1, r, f"i{r}", 100 + r, "h", step, {}, "x", 0.0, {step: held[r]}) for r in sorted(keep)]


tensors = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.integers(1, 40), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(tensors, st.integers(1, 4), st.integers(1, 3), st.data())
def test_in_place_is_possible_exactly_when_every_shard_keeps_a_surviving_holder(ts, shard, replicas, data):
    held = layout(ts, shard, replicas)
    world = shard * replicas
    lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1))
    keep = set(range(world)) - lost
    got = agree_on_sharded_state(reports(held, keep), 4)
    # a shard index survives when some replica's rank of that index survives; an empty chunk needs none
    needed = {i for i in range(shard) if any(held[i][k][2][0] for k in held[i])}
    covered = {r % shard for r in keep}
    if needed <= covered:
        assert got.digest is not None and not got.problems
        # the same digest as the whole world's chunks, and as the same tensors split over one rank
        assert got.digest == agree_on_sharded_state(reports(held, range(world)), 4).digest
        assert got.digest == agree_on_sharded_state(reports(layout(ts, 1, 1), [0]), 4).digest
    else:
        assert got.digest is None
        assert any("no replica of the lost shards survives" in p for p in got.problems)


def test_replicas_that_diverged_are_refused_and_named():
    held = layout({"w": 8, "b": 4}, 2, 2)
    held[2] = {k: list(v) for k, v in held[2].items()}
    key = "w@0"
    held[2][key] = [*held[2][key][:3], format((int(held[2][key][3], 16) + 1) & M64, "016x")]
    got = agree_on_sharded_state(reports(held, [0, 1, 2]), 4)
    assert got.digest is None
    assert "different copies of 1 chunks of step 4 (e.g. w@0 on ranks [0] and 2)" in got.problems[0]


def test_a_survivor_without_the_frontier_step_is_named():
    held = layout({"w": 8}, 2, 2)
    reps = reports(held, [0, 1, 2])
    reps[1] = Report(1, 1, "i1", 101, "h", 3, {}, "x", 0.0, {3: held[1]})
    got = agree_on_sharded_state(reps, 4)
    assert got.digest is None and got.problems[0] == "rank 1 holds no sharded state of step 4 (has [3])"


def test_overlapping_chunks_are_not_one_layout():
    held = layout({"w": 8}, 2, 1)
    held[1]["w@2"] = ["torch.float32", [8], [6], "0" * 16]  # rows 2..7 over rank 0's 0..3
    got = agree_on_sharded_state(reports(held, [0, 1]), 4)
    assert got.digest is None and "overlap" in got.problems[-1]


def test_the_digest_counts_each_chunk_once_whoever_holds_it():
    held = layout({"w": 6}, 3, 2)
    one = {k: v for r in (0, 1, 2) for k, v in held[r].items()}
    assert agree_on_sharded_state(reports(held, range(6)), 4).digest == digest_of(one)
    doubled = {**one, "w@0x": one["w@0"]}  # not a chunk key of the layout: counted again
    assert digest_of(doubled) != digest_of(one)
