"""The mini-training is deterministic and its reference is world-size independent (property tests)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.transitions import model as m

seeds = st.integers(min_value=0, max_value=2**32)


@settings(max_examples=40, deadline=None)
@given(seeds, st.integers(min_value=0, max_value=12))
def test_same_inputs_give_bit_identical_state(seed, n):
    a, b = m.reference(seed, n), m.reference(seed, n)
    assert a == b and a.digest() == b.digest()
    assert a.step == n and a.data_pos == n * m.GLOBAL_BATCH


@settings(max_examples=40, deadline=None)
@given(
    seeds,
    st.lists(st.integers(min_value=1, max_value=m.GLOBAL_BATCH), min_size=0, max_size=8),
    st.sampled_from(m.LAYOUTS),
)
def test_reference_two_ways_agree(seed, worlds, layout):
    """Serial on one rank == distributed with any world size per step, either layout."""
    assert m.distributed_reference(seed, worlds, layout) == m.reference(seed, len(worlds))


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=m.GLOBAL_BATCH))
def test_batch_slices_and_ownership_partition(world):
    covered = [i for r in range(world) for i in m.batch_slice(world, r)]
    assert covered == list(range(m.GLOBAL_BATCH))
    slots = sorted(j for r in range(world) for j in m.owned(world, r))
    assert slots == list(range(m.N_PARAMS))


@settings(max_examples=30, deadline=None)
@given(seeds, st.integers(min_value=1, max_value=8))
def test_every_divergence_changes_the_state(seed, n):
    """Twice, skipped, stale gradient: never equal to the reference (the oracle relies on it)."""
    prev = m.reference(seed, n - 1)
    ref = m.reference(seed, n)
    twice = m.apply_step(ref, m.local_gradient(prev, 1, 0))
    assert twice != m.reference(seed, n + 1)
    assert m.finish_step(prev) != ref
    assert m.apply_step(prev, m.local_gradient(m.reference(seed, max(0, n - 2)), 1, 0)) != ref or n == 1


@settings(max_examples=30, deadline=None)
@given(seeds, st.integers(min_value=0, max_value=6))
def test_state_round_trips(seed, n):
    s = m.reference(seed, n).restricted(m.owned(3, 1))
    assert m.TrainState.from_dict(s.to_dict()) == s
