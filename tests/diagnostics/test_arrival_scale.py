"""Arrival order at 100,000-rank scale: no quadratic membership tests, the same answers."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.diagnostics.arrival import _median_without, stragglers
from gpuguard.diagnostics.jobstats import median
from tests.diagnostics.test_arrival import ob, synchronous


@given(st.lists(st.floats(min_value=0.0, max_value=1e3), min_size=1, max_size=60), st.data())
def test_the_median_without_one_value_is_the_median_of_the_others(values: list[float], data: st.DataObject) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(values) - 1))
    others = values[:i] + values[i + 1 :]
    assert _median_without(sorted(values), values[i]) == (median(others) if others else 0.0)


def test_many_ranks_late_together_are_judged_in_linear_time() -> None:
    """Half of 40,000 ranks late together at every collective: `lasts` and `others` both 20,000 long. With
    tuple membership that is 4e8 comparisons per collective (minutes); with sets, a few seconds."""
    world = 40_000
    per = synchronous(8, {r: 0.3 for r in range(0, world, 2)}, world=world)
    obs = [ob(r, e) for r, e in per.items()]
    t0 = time.perf_counter()
    out = stragglers(obs)
    took = time.perf_counter() - t0
    assert out == {}  # half the job late together is the job's pace: nobody to blame
    assert took < 60, f"{took:.1f} s for {world} ranks"


def test_a_single_straggler_among_many_is_still_named_with_its_peers_compute() -> None:
    world = 5_000
    per = synchronous(8, {17: 0.3}, world=world)
    obs = [ob(r, e, compute=0.05 if r != 17 else 0.3) for r, e in per.items()]
    out = stragglers(obs)
    assert list(out) == [17] and out[17].peer_compute_s == 0.05
