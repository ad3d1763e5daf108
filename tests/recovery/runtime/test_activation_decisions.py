"""The restart path's coordinator decisions (recovery.runtime.activation): bound, unrestorable skips, the plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.generation.records import Certificate, Frontier
from gpuguard.generation.rules import PROOF_LEASE
from gpuguard.recovery.runtime import activation as act
from gpuguard.recovery.snapshots.store import Rejection, Selection
from tests.support.generation import genesis
from tests.support.generation import numbered as inc
from tests.support.generation import snapshot_info as snap
from tests.support.generation import started as parent


def hellos(n: int, *, first: int = 10, gone: tuple[str, ...] = (), alive: tuple[str, ...] = ()) -> tuple:
    """n new incarnations on ranks 0..n-1; rank 0 reports what it saw of the old ones."""
    return tuple(
        act.Hello(r, inc(first + r).to_dict(), "h", gone if r == 0 else (), alive if r == 0 else ()) for r in range(n)
    )


def facts(
    p: Certificate, hs: tuple, *, committed=None, selection=None, pin=None, world=None, expired=frozenset()
) -> act.ActivationFacts:
    return act.ActivationFacts(
        parent=p,
        hellos=hs,
        committed_by_all=committed,
        selection=selection if selection is not None else Selection(None),
        restore_pin=pin,
        world_size=len(hs) if world is None else world,
        attempt_token="r3",
        attempt_source="rendezvous round",
        restart_count=2,
        rendezvous_round=3,
        lease_expired=frozenset(expired),
    )


# ---------------------------------------------------------------------- restore_bound
@given(frontier=st.integers(0, 50), committed=st.none() | st.integers(0, 100), pin=st.none() | st.integers(0, 100))
def test_the_bound_is_the_frontier_limit_lowered_by_a_pin_never_raised(frontier, committed, pin):
    p = parent(2, frontier)
    bound = act.restore_bound(p, committed, pin)
    limit = act.frontier_limit(p, committed)
    assert bound == (limit if pin is None else min(limit, pin))
    assert bound <= limit


def test_a_first_start_has_bound_zero_whatever_the_pin():
    assert act.restore_bound(None, None, None) == 0
    assert act.restore_bound(None, 5, 9) == 0


# ---------------------------------------------------------------------- skip_unrestorable
def test_skipping_an_unrestorable_state_takes_the_older_one_and_says_why():
    newest = Selection(snap(8, "m8"), (Rejection(9, Path("/x/step-9"), "after the frontier (step 8)"),), 8)
    older = Selection(
        snap(6, "m6"),
        (
            Rejection(9, Path("/x/step-9"), "after the frontier (step 7)"),
            Rejection(8, Path("/x/step-8"), "after the frontier (step 7)"),
            Rejection(7, Path("/x/step-7"), "corrupt: digest"),
        ),
        7,
    )
    sel = act.skip_unrestorable(newest, older)
    assert sel.chosen == snap(6, "m6")
    assert sel.limit == 8  # still the coordinator's bound, not the older search's
    assert [(r.step, r.reason) for r in sel.rejected] == [
        (9, "after the frontier (step 8)"),
        (8, "unrestorable: a member failed to load it"),
        (7, "corrupt: digest"),
    ]


def test_skipping_the_last_state_leaves_no_choice():
    sel = act.skip_unrestorable(Selection(snap(3), (), 3), Selection(None, (), 2))
    assert sel.chosen is None
    assert [r.step for r in sel.rejected] == [3]
    choice = act.choose_frontier(parent(2, 0), 3, sel)
    assert choice.frontier == Frontier(0, "") and "no verified state" in choice.note


def test_nothing_chosen_nothing_to_skip():
    sel = Selection(None, (Rejection(4, Path("/x"), "corrupt: z"),), 4)
    assert act.skip_unrestorable(sel, Selection(snap(1))) == sel


# ---------------------------------------------------------------------- members and log lines
def test_every_hello_is_admitted_on_its_own_rank_with_its_own_incarnation():
    hs = hellos(3)
    members = act.admitted_members(hs)
    assert [m.rank for m in members] == [0, 1, 2]
    assert [m.incarnation for m in members] == [inc(10), inc(11), inc(12)]


def test_newer_than_the_frontier_is_not_logged_as_a_rejection():
    choice = act.FrontierChoice(Frontier(0), 0, "n", ("step 9: after the frontier (step 5)", "step 4: corrupt: z"))
    assert act.rejections_to_log(choice) == ("step 4: corrupt: z",)


# ---------------------------------------------------------------------- plan_activation
def test_first_start_plans_generation_one_from_the_initial_state():
    plan = act.plan_activation(facts(genesis(), hellos(2)))
    assert plan.reason == "start"
    assert plan.choice.frontier == Frontier(0, "") and plan.choice.note == "first start"
    assert plan.quiescence == "proved" and plan.quiescence_evidence == ("no previous members",)
    assert [m.incarnation.id for m in plan.members] == ["inc10", "inc11"]
    assert plan.consume_pin is False
    assert plan.extra == {
        "switch": "restart",
        "attempt": "r3",
        "attempt_source": "rendezvous round",
        "rendezvous_round": 3,
        "rendezvous_participants": [],
        "restart_count": 2,
        "committed_by_all": None,
        "frontier_note": "first start",
        "rejected": [],
        "world_size": 2,
        "restore_pin": None,
    }


def test_restart_resumes_from_the_verified_state_all_members_committed():
    old = ("inc0", "inc1")
    plan = act.plan_activation(facts(parent(2), hellos(2, gone=old), committed=7, selection=Selection(snap(7), (), 7)))
    assert plan.reason == "rank-failure"
    assert plan.choice.frontier == Frontier(7, "m")
    assert plan.quiescence == "proved"
    assert plan.extra["committed_by_all"] == 7


def test_a_state_past_what_all_committed_is_never_certified():
    plan = act.plan_activation(facts(parent(2, 3), hellos(2), committed=5, selection=Selection(snap(6))))
    assert plan.choice.frontier == Frontier(0, "")
    assert plan.choice.limit == 5


def test_fewer_members_is_a_scale_down_and_more_a_scale_up():
    assert act.plan_activation(facts(parent(4), hellos(3))).reason == "scale-down"
    assert act.plan_activation(facts(parent(2), hellos(3))).reason == "scale-up"


def test_an_old_incarnation_still_running_leaves_quiescence_unknown():
    plan = act.plan_activation(facts(parent(2), hellos(2, gone=("inc0",), alive=("inc1",))))
    assert plan.quiescence == "unknown"
    assert any("inc1" in e and "still running" in e for e in plan.quiescence_evidence)


def test_an_old_incarnation_nobody_could_check_leaves_quiescence_unknown():
    plan = act.plan_activation(facts(parent(2), hellos(2, gone=("inc0",))))
    assert plan.quiescence == "unknown"
    assert any("inc1" in e and "no member on that host" in e for e in plan.quiescence_evidence)


def test_an_expired_lease_proves_an_incarnation_on_a_lost_host_quiet_and_the_certificate_says_so():
    plan = act.plan_activation(facts(parent(3), hellos(2, gone=("inc0", "inc1")), expired={"inc2"}))
    assert plan.quiescence == "proved", plan.quiescence_evidence
    assert plan.extra["quiescence_by"] == {"inc0": "process gone", "inc1": "process gone", "inc2": PROOF_LEASE}
    assert any("inc2" in e and PROOF_LEASE in e for e in plan.quiescence_evidence)
    assert act.unvouched(parent(3), hellos(2, gone=("inc0", "inc1"))) == ("inc2",)


def test_a_lease_never_outranks_a_process_seen_running_nor_stands_in_for_a_missing_one():
    running = act.plan_activation(facts(parent(2), hellos(2, gone=("inc0",), alive=("inc1",)), expired={"inc1"}))
    assert running.quiescence == "unknown" and "quiescence_by" not in running.extra
    missing = act.plan_activation(facts(parent(3), hellos(2, gone=("inc0",)), expired={"inc2"}))
    assert missing.quiescence == "unknown"
    assert any("inc1" in e and "no expired lease" in e for e in missing.quiescence_evidence)


def test_the_certificate_names_the_rounds_agents():
    f = facts(parent(2), hellos(2, gone=("inc0", "inc1")))
    plan = act.plan_activation(replace(f, rendezvous_participants=("10.0.0.1_7_0", "10.0.0.2_9_0")))
    assert plan.extra["rendezvous_participants"] == ["10.0.0.1_7_0", "10.0.0.2_9_0"]
    assert plan.extra["rendezvous_round"] == 3


def test_a_restore_pin_is_recorded_and_used_once():
    plan = act.plan_activation(facts(parent(2), hellos(2), committed=9, selection=Selection(snap(4), (), 4), pin=4))
    assert plan.choice.frontier == Frontier(4, "m")
    assert plan.extra["restore_pin"] == 4
    assert plan.consume_pin is True


def test_the_certificate_lists_at_most_16_rejections_but_every_one_is_logged():
    rejected = tuple(Rejection(s, Path(f"/x/{s}"), "corrupt: z") for s in range(40, 20, -1))
    plan = act.plan_activation(facts(parent(2), hellos(2), committed=50, selection=Selection(None, rejected, 50)))
    assert len(plan.extra["rejected"]) == 16
    assert len(plan.log_rejected) == 20


# ---------------------------------------------------------------------- branch_problem
def test_a_state_on_the_chain_is_accepted_and_a_superseded_branch_refused_where_it_is_read():
    frontiers = {0: 0, 1: 0, 2: 8, 3: 12}  # gen 2 resumed from step 8, gen 3 from step 12
    assert act.branch_problem(3, 20, frontiers, 3) is None  # the parent's own states
    assert act.branch_problem(2, 12, frontiers, 3) is None  # gen 3's frontier state, written by gen 2
    assert act.branch_problem(1, 7, frontiers, 3) is None  # before every later generation took over
    stale = act.branch_problem(1, 10, frontiers, 3)  # gen 1's late write after gen 2 redid step 10
    assert stale and "generation 2 resumed from step 8" in stale and "superseded" in stale
    assert "superseded" in (act.branch_problem(2, 13, frontiers, 3) or "")
    assert "newer than the active" in (act.branch_problem(4, 1, frontiers, 3) or "")
    assert "names no generation" in (act.branch_problem(None, 1, frontiers, 3) or "")


@given(
    starts=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    gen=st.integers(0, 7),
    step=st.integers(0, 40),
)
def test_a_state_is_accepted_exactly_when_no_later_generation_resumed_before_it(starts, gen, step):
    frontiers = dict(enumerate(starts))
    parent = len(starts) - 1
    ok = act.branch_problem(gen, step, frontiers, parent) is None
    assert ok == (gen <= parent and all(frontiers[h] >= step for h in frontiers if gen < h <= parent))
