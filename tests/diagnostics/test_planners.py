"""Planners against the seed's worked examples (seeds/004): Young/Daly, 8192 = 64 × 16 × 8, ring vs tree."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.diagnostics.planners import (
    checkpoint_plan,
    collective_plan,
    failure_rate_per_hour,
    layout_plan,
    parse_quantity,
)
from gpuguard.foundation.errors import UsageError


def test_seed_example_sync_checkpoint() -> None:
    p = checkpoint_plan(60, 1 / 3)  # c = 60 s, λ = 1/3 per hour
    assert p.interval_s / 60 == pytest.approx(19.0, abs=0.1)  # Δt* ≈ 19 min
    assert p.overhead_fraction == pytest.approx(0.105, abs=0.001)  # ≈ 10.5 %
    assert p.checkpoint_overhead_fraction == pytest.approx(p.rework_fraction)  # the two terms are equal at Δt*
    assert p.interval_daly_s < p.interval_s


def test_seed_example_cheap_checkpoint() -> None:
    p = checkpoint_plan(1, 1 / 3)  # c → ~1 s: Δt* ≈ 2.5 min, overhead ≈ 1.4 %
    assert p.interval_s / 60 == pytest.approx(2.45, abs=0.1)
    assert p.overhead_fraction == pytest.approx(0.0136, abs=0.001)


def test_async_only_the_blocking_part_counts_and_the_background_extends_rework() -> None:
    sync = checkpoint_plan(60, 1 / 3)
    a = checkpoint_plan(60, 1 / 3, async_blocking_s=2)
    assert a.interval_s == pytest.approx(math.sqrt(2 * 2 / (1 / 3 / 3600)))
    assert a.overhead_fraction < sync.overhead_fraction
    assert a.rework_fraction == pytest.approx((1 / 3 / 3600) * (a.interval_s / 2 + 58))
    zero = checkpoint_plan(60, 1 / 3, async_blocking_s=0)
    assert zero.interval_s == 60 and zero.checkpoint_overhead_fraction == 0


def test_failure_rate_from_mtbf_and_gpus() -> None:
    assert failure_rate_per_hour(mtbf_hours=30000, gpus=10000) == pytest.approx(1 / 3)
    with pytest.raises(UsageError):
        failure_rate_per_hour()
    with pytest.raises(UsageError):
        checkpoint_plan(60, 1, async_blocking_s=61)


def test_seed_layout_8192() -> None:
    p = layout_plan(8, 16, 64, 1000, global_batch=4096)
    assert p.world == 8192 == 64 * 16 * 8
    assert p.coords == {"tp": 0, "pp": 13, "dp": 7}
    assert p.tp_group == tuple(range(1000, 1008))
    assert len(p.pp_group) == 16 and all(r % 8 == 0 and 896 <= r < 1024 for r in p.pp_group)
    assert len(p.dp_group) == 64 and all(r % 128 == 1000 % 128 for r in p.dp_group)
    assert p.replica == tuple(range(896, 1024))
    assert p.hot_spare["world_after"] == 8192 and p.hot_spare["gpus_needed"] == 1
    assert p.shrink["gpus_lost"] == 128 and p.shrink["world_after"] == 8064 and p.shrink["dp_after"] == 63
    assert "63/64" in p.shrink["batch"]["keep_per_replica_batch"]
    with pytest.raises(UsageError):
        layout_plan(8, 16, 64, 8192)
    assert layout_plan(2, 2, 1, 0).shrink["possible"] is False


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.data())
@settings(max_examples=100, deadline=None)
def test_layout_groups_partition_the_ranks(tp: int, pp: int, dp: int, data) -> None:
    r = data.draw(st.integers(0, tp * pp * dp - 1))
    p = layout_plan(tp, pp, dp, r)
    assert r in p.tp_group and r in p.pp_group and r in p.dp_group and r in p.replica
    assert set(p.tp_group) & set(p.pp_group) == {r} == set(p.pp_group) & set(p.dp_group)
    assert set(p.tp_group) | set(p.pp_group) <= set(p.replica)
    assert len(p.replica) == tp * pp


def test_collective_ring_vs_tree() -> None:
    big = collective_plan(8, 1e9, 100e9, 5e-6)
    assert big.ring_bandwidth_term_s == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)  # T_ring ≈ 2(N−1)/N · S/BW
    assert big.best == "ring"
    small = collective_plan(1024, 1e3, 100e9, 5e-6)
    assert small.best == "tree"
    c = collective_plan(64, 1, 100e9, 5e-6)
    at = collective_plan(64, c.crossover_bytes, 100e9, 5e-6)
    assert at.ring_s == pytest.approx(at.tree_s, rel=1e-6)
    # the (N−1)/N factor: the bandwidth term is almost independent of N
    assert collective_plan(1024, 1e9, 1e11, 0).ring_s / collective_plan(8, 1e9, 1e11, 0).ring_s < 1.15


def test_quantities() -> None:
    assert parse_quantity("4GiB", what="x") == 4 * 2**30
    assert parse_quantity("100GB/s", what="x") == 100e9
    assert parse_quantity("200Gb/s", what="x") == 25e9
    assert parse_quantity("1e6", what="x") == 1e6
    with pytest.raises(UsageError):
        parse_quantity("fast", what="--bandwidth")
