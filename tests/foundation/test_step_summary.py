"""The bounded step summary: exact while small, within its documented bound beyond, and of a size that
does not grow with the steps (what lets `diagnose job` read 100,000 ranks)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.diagnostics.jobstats import quantile, robust_tail, sorted_distribution
from gpuguard.foundation.step_summary import MAX_BUCKETS, RELATIVE_ERROR, TOP_VALUES, QuantileSketch, StepSummary

# the records' resolution is 1 µs (%.6f): 0, or 1e-6 up to a day and more
TIMES = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False))
VALUES = st.lists(TIMES, max_size=400)
QS = (0.0, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0)


def sketch_of(values: list[float], cap: int) -> QuantileSketch:
    s = QuantileSketch(cap)
    for v in values:
        s.add(v)
    return s


def assert_within_bound(sketch: QuantileSketch, values: list[float]) -> None:
    """Every order statistic: equal while exact or among the top values; else within RELATIVE_ERROR."""
    true, got = sorted(values), sketch.ordered()
    assert len(got) == len(true) == sketch.n
    for k, v in enumerate(true):
        if sketch.exact or k >= len(true) - TOP_VALUES:
            assert got[k] == v, (k, got[k], v)
        else:
            assert abs(got[k] - v) <= RELATIVE_ERROR * v * (1 + 1e-9), (k, got[k], v)
    for q in QS:  # an interpolated quantile is a convex combination: the same bound
        assert abs(quantile(got, q) - quantile(true, q)) <= RELATIVE_ERROR * quantile(true, q) * (1 + 1e-9) + 1e-12


@given(VALUES, st.integers(min_value=1, max_value=80))
def test_order_statistics_are_exact_while_small_and_within_the_bound_beyond(values: list[float], cap: int) -> None:
    sketch = sketch_of(values, cap)
    assert sketch.exact == (len(values) <= cap)
    assert_within_bound(sketch, values)


@settings(max_examples=20, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_bucket_estimates_are_within_the_bound_on_a_spread_of_step_times(seed: int) -> None:
    """Thousands of heavy-tailed values, most of them answered by their bucket: each within 1 %."""
    rng = random.Random(seed)
    values = [round(rng.lognormvariate(-2, 1.5), 6) for _ in range(3000)]
    sketch = sketch_of(values, 64)
    assert not sketch.exact
    assert_within_bound(sketch, values)


@given(VALUES, VALUES, st.integers(min_value=1, max_value=80), st.integers(min_value=1, max_value=80))
def test_a_merge_is_a_sketch_of_both_streams(a: list[float], b: list[float], cap_a: int, cap_b: int) -> None:
    merged = sketch_of(a, cap_a)
    merged.merge(sketch_of(b, cap_b))
    assert_within_bound(merged, a + b)


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.integers(min_value=65, max_value=2300))
def test_the_tail_the_vote_reads_is_exact_up_to_the_history(seed: int, n: int) -> None:
    """p99, p99.9 and the outlier cap (the two largest) of up to 2,300 steps (24 kept: floor(0.99 (n - 1)) >= n - 24): exactly the full series'."""
    rng = random.Random(seed)
    values = [rng.lognormvariate(-2, 0.5) * (50 if rng.random() < 0.002 else 1) for _ in range(n)]
    view, true = sketch_of(values, 64).ordered(), sorted(values)
    for q in (0.99, 0.999):
        assert quantile(view, q) == quantile(true, q)
        assert robust_tail(view, q, 4.0) == robust_tail(true, q, 4.0)
    assert sorted_distribution(view)["max"] == max(values)


@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.floats(min_value=-1.0, max_value=100.0)), TIMES),
        max_size=200,
    )
)
def test_a_step_summary_holds_the_computes_and_the_positive_periods(steps: list) -> None:
    s = StepSummary(cap=16)
    for interval, compute in steps:
        s.add(interval, compute)
    assert s.n == len(steps)
    assert_within_bound(s.computes, [c for _, c in steps])
    assert_within_bound(s.periods, [i for i, _ in steps if i is not None and i > 0])


def test_memory_per_rank_does_not_grow_with_its_steps() -> None:
    """The summary of 100,000 steps holds no more than that of 1,000 (the same distribution): bounded."""
    rng = random.Random(7)

    def summary(steps: int) -> StepSummary:
        s = StepSummary()
        for _ in range(steps):
            s.add(rng.lognormvariate(-2, 0.3), rng.lognormvariate(-2.5, 0.3))
        return s

    small, large = summary(1_000).nbytes(), summary(100_000).nbytes()
    assert large <= 2 * small <= 8 * 1024, (small, large)  # a few KiB at most, whatever the steps
    # and the worst case: values over every order of magnitude still fit the bucket bound
    wide = QuantileSketch()
    for i in range(100_000):
        wide.add(10 ** rng.uniform(-15, 15) if i % 7 else 0.0)
    assert wide.nbytes() <= 8 * (MAX_BUCKETS + TOP_VALUES) and wide.n == 100_000
