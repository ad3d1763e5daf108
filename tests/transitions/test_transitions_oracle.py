"""The oracle catches every planted divergence and passes a clean run."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.transitions import model as m
from gpuguard.transitions.oracle import Applied, Effect, RankOutcome, RunOutcome, judge

SEED, N, WORLD = 3, 6, 3


def clean_rank(rank: int, n: int = N, generation: int = 1) -> RankOutcome:
    hist = tuple(Applied(s, generation, (s,), generation) for s in range(1, n + 1))
    return RankOutcome(rank, f"inc{rank}", generation, m.reference(SEED, n), 0, hist)


def clean_run(**kw) -> RunOutcome:
    ranks = tuple(clean_rank(r) for r in range(WORLD))
    return RunOutcome(**{"seed": SEED, "ranks": ranks, "claimed_steps": N, **kw})


def kinds(run: RunOutcome) -> set[str]:
    return {f.kind for f in judge(run).findings}


def test_clean_run_passes():
    v = judge(clean_run(durable=(3, m.reference(SEED, 3))))
    assert v.ok, v.detail
    assert v.detail == "legal serial history"


def test_clean_run_after_a_reload_passes():
    # rank 2 was restored at step 4 in generation 2 and applied 5, 6 there
    hist = tuple(Applied(s, 2, (s,), 2) for s in (5, 6))
    ranks = (clean_rank(0), clean_rank(1), RankOutcome(2, "new", 2, m.reference(SEED, N), 4, hist))
    assert judge(RunOutcome(SEED, ranks, N)).ok


def test_rank_one_step_ahead_is_caught():
    ahead = clean_rank(1, N + 1)
    run = clean_run(ranks=(clean_rank(0), ahead, clean_rank(2)), claimed_steps=None)
    assert "step-disagreement" in kinds(run)


def test_certified_count_must_match_the_ranks():
    assert "step-disagreement" in kinds(clean_run(claimed_steps=N - 1))


def test_step_applied_twice_is_caught():
    s = m.reference(SEED, 4)
    twice = m.apply_step(s, m.local_gradient(s, 1, 0))  # step 4's update again, from the same gradient
    hist = tuple(Applied(x, 1, (x,), 1) for x in (1, 2, 3, 4, 4))
    r = RankOutcome(0, "i", 1, twice, 0, hist)
    assert {"step-applied-twice"} <= kinds(RunOutcome(SEED, (r,), None))


def test_skipped_step_is_caught():
    s = m.reference(SEED, 2)
    s = m.finish_step(s)  # step 3 "happened" without its update
    s = m.apply_step(s, m.local_gradient(s, 1, 0))
    hist = tuple(Applied(x, 1, (x,), 1) for x in (1, 2, 4))
    found = kinds(RunOutcome(SEED, (RankOutcome(0, "i", 1, s, 0, hist),), None))
    assert "step-skipped" in found and "params-mismatch" in found


def test_stale_old_generation_write_made_visible_is_caught():
    run = clean_run(effects=(Effect("gradient", 1, 2, 1, 4, True),))
    assert "stale-effect-visible" in kinds(run)
    fenced = clean_run(effects=(Effect("gradient", 1, 2, 1, 4, False),))
    assert judge(fenced).ok  # a rejected (fenced) late result is what should happen


def test_stale_gradient_in_history_is_caught():
    hist = list(clean_rank(0).history)
    hist[-1] = Applied(N, 2, (N - 1,), 1)  # generation 2 applied generation 1's gradient of the previous step
    r = replace(clean_rank(0), history=tuple(hist), generation=2)
    assert {"wrong-gradient", "stale-effect-visible"} <= kinds(clean_run(ranks=(r, clean_rank(1), clean_rank(2))))


@pytest.mark.parametrize("field,kind", [("rng", "rng-mismatch"), ("data_pos", "data-position-mismatch")])
def test_wrong_rng_or_data_position_is_caught(field, kind):
    good = clean_rank(1)
    bad = replace(good, state=replace(good.state, **{field: getattr(good.state, field) + 1}))
    assert kinds(clean_run(ranks=(clean_rank(0), bad, clean_rank(2)))) == {kind}


def test_optimizer_state_and_lost_shard_are_caught():
    good = clean_rank(0)
    mom = list(good.state.momentum)
    mom[5] = (mom[5] + 1) % m.MOD
    bad = replace(good, state=replace(good.state, momentum=tuple(mom)))
    assert "optimizer-state-mismatch" in kinds(RunOutcome(SEED, (bad,), N))
    shard = replace(good, state=good.state.restricted(m.owned(2, 0)))  # nobody holds rank 1's shard
    assert kinds(RunOutcome(SEED, (shard,), N)) == {"state-lost"}


def test_durable_checkpoint_must_be_a_reference_state():
    s = m.reference(SEED, 3)
    assert any(k.startswith("durable-") for k in kinds(clean_run(durable=(3, replace(s, rng=s.rng ^ 1)))))


def test_an_incomplete_run_fails():
    assert "incomplete" in kinds(clean_run(aborted="hung"))
    assert "incomplete" in kinds(RunOutcome(SEED, (), None))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**20),
    st.integers(min_value=0, max_value=8),
    st.sampled_from(["params", "momentum", "rng", "data_pos", "step"]),
    st.integers(min_value=0, max_value=7),
    st.integers(min_value=1, max_value=1000),
)
def test_any_single_perturbation_is_caught(seed, n, field_, slot, delta):
    """Property: change any one value of a correct final state and the run no longer passes."""
    ref = m.reference(seed, n)
    if field_ in ("params", "momentum"):
        vals = list(getattr(ref, field_))
        vals[slot] = (vals[slot] + delta) % m.MOD
        bad = replace(ref, **{field_: tuple(vals)})
    else:
        bad = replace(ref, **{field_: getattr(ref, field_) + delta})
    hist = tuple(Applied(s, 1, (s,), 1) for s in range(1, n + 1))
    run = RunOutcome(seed, (RankOutcome(0, "i", 1, bad, 0, hist),), n)
    assert not judge(run).ok
    assert judge(RunOutcome(seed, (RankOutcome(0, "i", 1, ref, 0, hist),), n)).ok
