"""Soundness: measured in the digest pass, judged into one record, bound into the manifest, refused at
selection, never certified. Real DCP snapshots for the replicated writer; the judge on hand-made
measurements (every rank's, as `digests.measure` gives them) and, for the measure itself, real
tensors. Each check fails without its rule (the record would say sound; selection would take it)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.generation import manifest as m
from gpuguard.generation import rules
from gpuguard.recovery.snapshots import digests
from gpuguard.recovery.snapshots import store as snap
from gpuguard.recovery.snapshots.measure import nonfinite_counts
from gpuguard.recovery.snapshots.soundness import (
    Expect,
    Policy,
    Soundness,
    certificate_line,
    expect_problem,
    judge,
    of_extra,
)
from tests.support.generation import child, genesis, members


def state(value: float = 1.0, **extra) -> dict:
    opt_state = {"0": {"step": torch.tensor(3.0), "exp_avg": torch.full((4,), value)}}
    return {
        "model": {"w": torch.full((4, 3), value), "b": torch.arange(3.0)},
        "optim": {"state": opt_state, "param_groups": [{"lr": 0.01, "params": ["w"]}]},
        "sched": {"_last_lr": [0.01], "last_epoch": 3},
        "rng": {"torch": torch.get_rng_state()},
        **extra,
    }


def test_a_replicated_snapshot_records_its_soundness_and_an_unsound_one_is_never_selected(tmp_path):
    sound = snap.save_snapshot(tmp_path, 1, state(), generation=1, owner="x")
    assert sound.unsound is None
    record = of_extra(m.load_manifest(sound.path).extra)
    assert record.sound and record.checked == ("finite", "non-tensor") and record.optimizer_step == 3
    bad = state()
    bad["model"]["w"][2, 1] = float("nan")
    bad["optim"]["state"]["0"]["exp_avg"][0] = float("inf")
    unsound = snap.save_snapshot(tmp_path, 2, bad, generation=1, owner="x")
    assert unsound.unsound == "1 tensor with NaN values (model.w) (+1 more)"
    record = of_extra(m.load_manifest(unsound.path).extra)
    assert (record.nan_tensors, record.inf_tensors, record.nonfinite_elements) == (1, 1, 2)
    assert record.problems[1] == "1 tensor with infinite values (optim.state.0.exp_avg)"
    sel = snap.select_restorable(tmp_path)
    assert sel.chosen.step == 1
    assert [r.reason for r in sel.rejected] == ["unsound: 1 tensor with NaN values (model.w) (+1 more)"]


def test_a_declared_infinity_is_sound_and_a_policy_can_turn_checks_off(tmp_path):
    s = state(extra={"scaler": {"scale": torch.tensor(float("inf"))}})
    allowed = snap.save_snapshot(tmp_path, 1, s, generation=1, owner="x", policy=Policy(allow_inf=("extra.scaler.*",)))
    assert allowed.unsound is None and of_extra(m.load_manifest(allowed.path).extra).allowed_tensors == 1
    strict = snap.save_snapshot(tmp_path, 2, s, generation=1, owner="x")
    assert strict.unsound.startswith("1 tensor with infinite values (extra.scaler.scale)")


def test_non_tensor_state_must_be_present_and_consistent(tmp_path):
    lost = state(dataloader={})
    info = snap.save_snapshot(
        tmp_path, 1, lost, generation=1, owner="x", expect=Expect(data_keys=("epoch", "position"), scheduler=True)
    )
    assert info.unsound == "no data-loader state (a data loader is registered)"
    behind = state()
    behind["optim"]["state"]["1"] = {"step": torch.tensor(2.0)}
    behind["sched"]["_last_lr"] = [0.02]
    info = snap.save_snapshot(tmp_path, 2, behind, generation=1, owner="x")
    record = of_extra(m.load_manifest(info.path).extra)
    assert record.problems == (
        "optimizer state at 2 different steps (2, 3)",
        "LR scheduler's last lr [0.02] is not the optimizer's [0.01]",
    )


def test_the_selection_refuses_a_state_without_what_the_job_needs():
    assert expect_problem(["model", "optimizer"], Expect(data_keys=("epoch",))) == (
        "no data-loader state (a data loader is registered)"
    )
    assert (
        expect_problem(["model", "lr-scheduler", "data-loader"], Expect(data_keys=("epoch",), scheduler=True)) is None
    )
    assert "LR scheduler" in expect_problem(["model"], Expect(scheduler=True))


def measured(rank: int, *, nonfinite=None, sums=None, facts=None) -> dict:
    return {"tensors": 2, "elements": 10, "nonfinite": nonfinite or {}, "sums": sums or {}, "facts": facts or {}}


def test_hsdp_nan_in_one_replica_group_is_named_with_the_primaries_clean_and_the_replicas_disagree():
    facts = {"fingerprint": "f", "optimizer_steps": [7], "rng": True}
    ranks = [
        measured(0, sums={"model.w@0": [0, "aa"], "model.v@0": [0, "cc"]}, facts=facts),
        measured(1, nonfinite={"model.w": {"1": [4668, 0]}}, sums={"model.w@0": [1, "bb"], "model.v@0": [1, "cc"]},
                 facts=facts),
    ]  # fmt: skip
    verdict = judge(ranks, Policy(), Expect(rng=True))
    assert not verdict.sound
    assert verdict.problems == (
        "1 tensor with NaN values in replica group 1 (primaries clean: model.w)",
        "replica group 1 disagrees with the primaries on 1 chunk (model.w)",
    )
    assert (verdict.replica_chunks, verdict.replica_disagreements, verdict.nonfinite_elements) == (2, 1, 4668)
    assert verdict.optimizer_step == 7
    both = [measured(0, nonfinite={"model.w": {"0": [1, 0]}}), measured(1, nonfinite={"model.w": {"1": [1, 0]}})]
    assert "(primaries too: model.w)" in judge(both, Policy(replicas=False)).problems[1]


def test_ranks_whose_non_tensor_state_differs_or_lacks_rng_are_unsound():
    ranks = [measured(0, facts={"fingerprint": "a", "rng": True}), measured(1, facts={"fingerprint": "b"})]
    verdict = judge(ranks, Policy(), Expect(rng=True))
    assert verdict.problems == (
        "non-tensor state differs between ranks (rank 1 is not rank 0's: optimizer groups, scheduler or extra)",
        "no RNG state for rank 1",
    )


_counts = st.integers(0, 3)


@settings(max_examples=200, deadline=None)
@given(
    groups=st.dictionaries(st.integers(0, 3), st.dictionaries(st.sampled_from(["a", "b.c", "s.scale"]),
                                                              st.tuples(_counts, _counts), max_size=3), max_size=3),
    allow=st.booleans(),
)  # fmt: skip
def test_the_verdict_is_sound_exactly_when_no_undeclared_value_is_non_finite_and_its_record_round_trips(groups, allow):
    nonfinite: dict = {}
    for g, paths in groups.items():
        for p, (nan, inf) in paths.items():
            if nan or inf:
                nonfinite.setdefault(p, {})[str(g)] = [nan, inf]
    policy = Policy(allow_inf=("s.*",) if allow else (), replicas=False, non_tensor=False)
    verdict = judge([measured(0, nonfinite=nonfinite)], policy)
    undeclared = any(
        nan or (inf and not (allow and path.startswith("s.")))
        for path, per in nonfinite.items()
        for nan, inf in per.values()
    )
    assert verdict.sound == (not undeclared)
    assert Soundness.from_dict(verdict.to_dict()) == verdict
    assert "\n" not in verdict.line()


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(st.sampled_from(sorted(Soundness(True, ()).to_dict()) + ["x"]),
                           st.none() | st.booleans() | st.integers(-2, 5) | st.text(max_size=5)
                           | st.lists(st.text(max_size=3), max_size=2)))  # fmt: skip
def test_a_malformed_soundness_record_is_a_value_error(doc):
    try:
        back = Soundness.from_dict(doc)
    except ValueError:
        return
    assert back.to_dict() == doc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_non_finite_counts_take_the_fast_path_only_when_the_sum_is_finite(dtype):
    t = torch.ones(1000, dtype=dtype)
    assert nonfinite_counts(t) == (0, 0)
    t[3], t[7], t[9] = float("nan"), float("inf"), float("-inf")
    assert nonfinite_counts(t) == (1, 2)
    big = torch.full((10,), torch.finfo(dtype).max, dtype=dtype)  # its sum overflows: counted, none found
    assert nonfinite_counts(big) == (0, 0)
    assert nonfinite_counts(torch.arange(5)) == (0, 0)


def test_the_measure_gives_the_digest_share_unchanged_and_the_counts_in_the_same_walk():
    s = {"model": {"w": torch.randn(30, 4), "b": torch.randn(4)}, "extra": {"n": 3}}
    plain = digests.digest_contributions(s, 0)
    s["model"]["w"][5, 2] = math.nan
    got = digests.measure(s, 0, sums="all")
    assert got["nonfinite"] == {"model.w": {"0": [1, 0]}}
    assert got["contrib"]["model.b"] == plain["model.b"] and set(got["sums"]) == {"model.w@0,0", "model.b@0"}
    assert got["tensors"] == 2 and got["elements"] == 124


def test_the_soundness_rule_refuses_a_certificate_naming_an_unsound_state():
    g0 = genesis()
    bad = Soundness(False, ("finite",), nan_tensors=1, problems=("1 tensor with NaN values (model.w)",)).to_dict()
    cert = child(g0, members(1), step=4, digest="d" * 64, extra={"soundness": {"step": 4, **bad}})
    [v] = rules.sound_frontier(cert)
    assert v.rule == "soundness" and "not sound: 1 tensor with NaN values (model.w)" in v.message
    other = child(g0, members(1), step=5, digest="d" * 64, extra={"soundness": {"step": 4, **bad, "sound": True}})
    assert "of step 4, the frontier is 5" in rules.sound_frontier(other)[0].message
    good = Soundness(True, ("finite",), tensors=3).to_dict()
    fine = child(g0, members(1), step=4, digest="d" * 64, extra={"soundness": {"step": 4, **good}})
    assert rules.sound_frontier(fine) == []
    assert certificate_line(fine.extra["soundness"]).startswith("step 4: sound: 3 tensors")


def test_an_unsound_snapshot_never_pushes_the_newest_sound_one_out_of_the_kept_ones(tmp_path):
    """`SnapshotOutcomes` protects the newest sound step from pruning (keep 1 here)."""
    from gpuguard.recovery.runtime.writers import SnapshotOutcomes

    class Ctx:
        snapshot_root, frontier_step, generation = tmp_path, 0, 1

        class counters:
            snapshots = snapshot_errors = fenced_snapshots = 0

        seen: list[str] = []

        def log(self, msg: str) -> None:
            self.seen.append(msg)

    ctx, told = Ctx(), []
    outcomes = SnapshotOutcomes(ctx, checkpoint_every=0, keep_snapshots=1)  # type: ignore[arg-type]
    outcomes.on_unsound = lambda step, why: told.append((step, why))
    outcomes(1, snap.save_snapshot(tmp_path, 1, state(), generation=1, owner="x"), None)
    bad = state()
    bad["model"]["b"][0] = float("nan")
    for step in (2, 3):
        outcomes(step, snap.save_snapshot(tmp_path, step, bad, generation=1, owner="x"), None)
    assert sorted(p.name for p in (tmp_path / "snapshots").glob("step-*")) == ["step-1", "step-3"]
    assert [s for s, _ in told] == [2, 3] and snap.select_restorable(tmp_path).chosen.step == 1
    assert ctx.seen[0] == "snapshot of step 2 is unsound (never restored): 1 tensor with NaN values (model.b)"
