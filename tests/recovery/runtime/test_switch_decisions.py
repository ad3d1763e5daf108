"""The in-place coordinator's decisions (recovery.runtime.switch): liveness, eviction, admission, the plan."""

from __future__ import annotations

from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.generation.records import Certificate, Frontier, Member
from gpuguard.recovery.runtime import switch as sw
from gpuguard.recovery.snapshots.store import Selection
from tests.support.generation import numbered, started
from tests.support.generation import snapshot_info as snap

HOST = "h"
inc = partial(numbered, pid=100, start=10.0)  # inc0 is pid 100 started at 10.0 on HOST, inc1 pid 101 at 11.0...
parent = partial(started, incarnation=inc)  # generation 1 with one member per entry of a list of hosts (rank = index)


def rep(
    r: int,
    committed: int | None = 5,
    digests: dict[int, str] | None = None,
    *,
    host: str = HOST,
    failure: str = "closed",
    incarnation_id: str | None = None,
    pid: int | None = None,
) -> sw.Report:
    """Rank r's report of generation 1 (by default: its own incarnation and pid, state of step 5 "a")."""
    return sw.Report(
        1,
        r,
        incarnation_id or f"inc{r}",
        100 + r if pid is None else pid,
        host,
        committed,
        {5: "a"} if digests is None else digests,
        failure,
        1.0,
    )


def facts(
    p: Certificate,
    reports: dict[int, sw.Report],
    status: dict[str, str] | None = None,
    *,
    waited: float = 0.0,
    grace: float = 1.0,
    killed_before: dict[str, str] | None = None,
) -> sw.EvictionFacts:
    """Local members default to 'running'; `status` overrides by incarnation id."""
    local = {m.incarnation.id: "running" for m in p.members if m.incarnation.host == HOST}
    local.update(status or {})
    return sw.EvictionFacts(
        generation=p.generation,
        members=p.members,
        reports=reports,
        host=HOST,
        status=local,
        killed_before=killed_before or {},
        waited_s=waited,
        grace_s=grace,
    )


# ---------------------------------------------------------------------- liveness and probes
@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("gone", "gone"),
        ("zombie", "gone"),
        ("reused", "gone"),  # same pid, another start time: not this member any more
        ("unknown", "gone"),  # no access: never waited for
        ("stopped", "stopped"),
        ("running", "running"),
        ("sleeping", "running"),
        ("disk-sleep", "running"),
    ],
)
def test_liveness_of_a_recorded_process(status, expected):
    assert sw.liveness(status) == expected


def test_only_reporters_on_this_host_are_probed_with_their_recorded_start_time():
    p = parent([HOST, "other", HOST])
    reports = {0: rep(0), 1: rep(1, host="other"), 2: rep(2, pid=999), 7: rep(7)}
    probes = sw.coordinator_probes(reports, p.ranks, HOST)
    assert probes == {0: (100, 10.0), 2: (999, 12.0), 7: (107, 0.0)}  # rank 7 was no member: start time 0.0


def test_the_switch_is_the_operators_when_anyone_saw_the_abort():
    assert sw.operator_requested(True, [])
    assert sw.operator_requested(False, [rep(0), rep(1, failure=sw.OPERATOR_ABORT)])
    assert not sw.operator_requested(False, [rep(0), rep(1)])


# ---------------------------------------------------------------------- decide_eviction
def test_every_member_reported_and_running_all_are_kept():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0), 1: rep(1)}))
    assert ev.kept == (0, 1) and ev.lost == () and ev.kill == () and ev.waiting == () and not ev.give_up
    assert ev.evidence == (
        "rank 0 incarnation inc0: reported, tore down generation 1's group",
        "rank 1 incarnation inc1: reported, tore down generation 1's group",
    )


def test_a_gone_member_is_dead_at_once_even_before_the_grace():
    p = parent([HOST, HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0), 2: rep(2)}, {"inc1": "gone"}))
    assert ev.dead == (1,) and ev.killed == () and ev.kept == (0, 2)
    assert ev.evidence[1] == "rank 1 incarnation inc1: pid 101 on h gone"


def test_a_member_whose_pid_was_reused_is_dead_not_running():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0)}, {"inc1": "reused"}))
    assert ev.dead == (1,) and ev.kill == () and ev.waiting == ()


def test_a_gone_member_that_had_reported_is_still_dead():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0), 1: rep(1)}, {"inc1": "zombie"}))
    assert ev.dead == (1,) and ev.kept == (0,)


def test_a_stopped_member_is_killed_even_if_it_reported():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0), 1: rep(1)}, {"inc1": "stopped"}))
    assert ev.killed == (1,) and ev.kept == (0,)
    assert ev.kill == (
        sw.Kill(1, "inc1", 101, 11.0, "rank 1 incarnation inc1: stopped (SIGSTOP), killed (pid 101 on h gone)"),
    )
    assert ev.evidence[1] == ev.kill[0].evidence


def test_a_silent_local_member_is_awaited_within_the_grace_then_killed():
    p = parent([HOST, HOST])
    early = sw.decide_eviction(facts(p, {0: rep(0)}, waited=0.5, grace=1.0))
    assert early.waiting == (1,) and early.kill == () and not early.give_up
    late = sw.decide_eviction(facts(p, {0: rep(0)}, waited=1.5, grace=1.0))
    assert late.waiting == () and late.killed == (1,)
    assert late.kill[0].evidence == "rank 1 incarnation inc1: no report within 1 s, killed (pid 101 on h gone)"


def test_a_member_killed_in_an_earlier_pass_is_killed_with_that_evidence_and_not_killed_again():
    p = parent([HOST, HOST])
    said = "rank 1 incarnation inc1: stopped (SIGSTOP), killed (pid 101 on h gone)"
    ev = sw.decide_eviction(facts(p, {0: rep(0)}, {"inc1": "gone"}, killed_before={"inc1": said}))
    assert ev.killed == (1,) and ev.dead == () and ev.kill == ()
    assert ev.evidence == ("rank 0 incarnation inc0: reported, tore down generation 1's group", said)


def test_a_report_from_another_incarnation_on_the_rank_does_not_count():
    p = parent([HOST, HOST])
    impostor = rep(1, incarnation_id="new-process-on-rank-1")
    assert sw.decide_eviction(facts(p, {0: rep(0), 1: impostor})).waiting == (1,)
    assert sw.decide_eviction(facts(p, {0: rep(0), 1: impostor}, waited=2.0)).killed == (1,)


def test_a_remote_member_is_never_probed_and_is_awaited_until_the_remote_wait():
    p = parent([HOST, "other"])
    # its process-table status (if any) does not matter: another host's pid means nothing here
    within = sw.decide_eviction(facts(p, {0: rep(0)}, {"inc1": "gone"}, waited=sw.REMOTE_WAIT_S - 0.1, grace=1.0))
    assert within.waiting == (1,) and within.lost == () and not within.give_up
    past = sw.decide_eviction(facts(p, {0: rep(0)}, waited=sw.REMOTE_WAIT_S + 0.1, grace=1.0))
    assert past.waiting == (1,)
    assert past.give_up == "ranks [1] on other hosts neither reported nor can be proved gone from here"


def test_the_remote_wait_is_at_least_the_grace():
    p = parent([HOST, "other"])
    assert not sw.decide_eviction(facts(p, {0: rep(0)}, waited=8.0, grace=10.0)).give_up
    assert sw.decide_eviction(facts(p, {0: rep(0)}, waited=10.5, grace=10.0)).give_up


def test_a_remote_member_that_reported_is_kept():
    p = parent([HOST, "other"])
    ev = sw.decide_eviction(facts(p, {0: rep(0), 1: rep(1, host="other")}, waited=100.0))
    assert ev.kept == (0, 1) and ev.waiting == () and not ev.give_up


def test_only_local_members_awaited_never_gives_up():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {0: rep(0)}, waited=7.0, grace=10.0))
    assert ev.waiting == (1,) and not ev.give_up


def test_no_survivors_everyone_lost():
    p = parent([HOST, HOST])
    ev = sw.decide_eviction(facts(p, {}, {"inc0": "gone", "inc1": "stopped"}))
    assert ev.dead == (0,) and ev.killed == (1,) and ev.kept == ()
    adm = sw.admit_survivors(sw.Layout(dp=2), ev)
    assert adm.layout is None and adm.refused == "no complete data-parallel replica survives"


def test_a_local_member_without_a_process_fact_is_a_bug_in_the_caller():
    p = parent([HOST, HOST])
    bad = sw.EvictionFacts(1, p.members, {0: rep(0)}, HOST, {"inc0": "running"}, {}, 0.0, 1.0)
    with pytest.raises(KeyError):
        sw.decide_eviction(bad)


@given(st.lists(st.sampled_from(["running", "gone", "reused", "stopped", "sleeping"]), min_size=1, max_size=6))
def test_every_member_lands_in_exactly_one_bucket_with_evidence_unless_awaited(statuses):
    p = parent([HOST] * len(statuses))
    status = {f"inc{r}": s for r, s in enumerate(statuses)}
    ev = sw.decide_eviction(facts(p, {r: rep(r) for r in range(len(statuses))}, status))
    buckets = [*ev.dead, *ev.killed, *ev.waiting, *ev.kept]
    assert sorted(buckets) == list(range(len(statuses)))
    assert len(ev.evidence) == len(statuses) - len(ev.waiting)
    assert {k.rank for k in ev.kill} == {r for r, s in enumerate(statuses) if s == "stopped"}


# ---------------------------------------------------------------------- admission
def test_dp_survivors_are_admitted_in_a_smaller_layout():
    adm = sw.admit_survivors(sw.Layout(dp=3, global_batch=12), sw.Eviction(dead=(1,), kept=(0, 2)))
    assert adm.layout == sw.Layout(dp=2, global_batch=12) and adm.kept == (0, 2) and not adm.refused


def test_a_tp_group_missing_a_member_cannot_switch_in_place():
    adm = sw.admit_survivors(sw.Layout(dp=2, tp=2), sw.Eviction(killed=(3,), kept=(0, 1, 2)))
    assert adm.layout is None and "replica 1" in adm.refused and "tp=2" in adm.refused


def test_a_whole_tp_replica_lost_leaves_the_other_replica():
    adm = sw.admit_survivors(sw.Layout(dp=2, tp=2), sw.Eviction(dead=(2,), killed=(3,), kept=(0, 1)))
    assert adm.layout == sw.Layout(dp=1, tp=2) and adm.kept == (0, 1)


def test_a_reporter_outside_the_layout_is_not_admitted():
    adm = sw.admit_survivors(sw.Layout(dp=2), sw.Eviction(kept=(0, 1, 2)))
    assert adm.kept == (0, 1)


def test_keeping_the_hsdp_layout_drops_the_damaged_replica_whole():
    # HSDP 3 replicas x 2 shards loses rank 3: replica 1 goes, rank 2 (its survivor) leaves
    adm = sw.admit_survivors(sw.Layout(dp=6, global_batch=12), sw.Eviction(dead=(3,), kept=(0, 1, 2, 4, 5)), 2)
    assert adm.kept == (0, 1, 4, 5) and adm.dropped == (2,) and adm.replica == 2
    assert adm.layout == sw.Layout(dp=4, global_batch=12)


def test_without_a_whole_replica_the_layout_is_not_kept_and_every_survivor_stays():
    # HSDP 2 x 2 loses ranks 1 and 3: no replica is whole, so the state is re-partitioned over 0 and 2
    adm = sw.admit_survivors(sw.Layout(dp=4), sw.Eviction(dead=(1, 3), kept=(0, 2)), 2)
    assert adm.kept == (0, 2) and adm.dropped == () and adm.replica is None


def test_the_layout_is_kept_only_when_it_applies():
    lost = sw.Eviction(dead=(3,), kept=(0, 1, 2))
    assert sw.admit_survivors(sw.Layout(dp=4), lost).replica is None  # no policy: re-partition
    assert sw.admit_survivors(sw.Layout(dp=3), sw.Eviction(dead=(2,), kept=(0, 1)), 2).replica is None  # 3 = 2 + 1
    abort = sw.admit_survivors(sw.Layout(dp=4), sw.Eviction(kept=(0, 1, 2, 3)), 2)  # nobody lost
    assert abort.replica is None and abort.kept == (0, 1, 2, 3)
    assert "not whole replicas" in sw.keep_layout_shrink(5, 2, [4]).refused
    assert "every replica" in sw.keep_layout_shrink(4, 2, [0, 3]).refused


@given(
    st.integers(1, 4).flatmap(
        lambda per: st.tuples(
            st.just(per),
            st.integers(1, 5),
            st.sets(st.integers(0, 19)),
        )
    )
)
def test_a_kept_layout_keeps_whole_replicas_at_their_shard_position(case):
    per, replicas, lost_any = case
    world = per * replicas
    lost = {r for r in lost_any if r < world}
    shrink = sw.keep_layout_shrink(world, per, lost)
    damaged = {r // per for r in lost}
    if len(damaged) == replicas:
        assert shrink.layout is None and shrink.refused
        return
    assert shrink.layout is not None and shrink.layout.world == len(shrink.kept_ranks)
    assert not lost & set(shrink.kept_ranks)
    assert {r // per for r in shrink.kept_ranks} == set(range(replicas)) - damaged  # whole replicas only
    for new, old in enumerate(shrink.kept_ranks):  # the dense renumbering keeps every shard where it was
        assert new % per == old % per


# ---------------------------------------------------------------------- frontier and manifest
def test_disagreeing_survivors_cannot_certify_the_frontier():
    split = sw.agree_on_state([rep(0, 5, {5: "a"}), rep(1, 5, {5: "b"})], 5)
    assert split.digest is None and "disagree" in split.problems[0]
    behind = sw.agree_on_state([rep(0, 6, {5: "a", 6: "c"}), rep(1, 4, {3: "x", 4: "y"})], 5)
    assert behind.digest is None and "rank 1 holds no local state of step 5" in behind.problems[0]


def test_the_manifest_is_bound_only_for_a_snapshot_of_exactly_the_frontier():
    assert sw.certified_manifest(Selection(snap(5, "m5")), 5) == "m5"
    assert sw.certified_manifest(Selection(snap(4, "m4")), 5) == ""
    assert sw.certified_manifest(Selection(snap(5, None)), 5) == ""
    assert sw.certified_manifest(Selection(None), 5) == ""


# ---------------------------------------------------------------------- plan_switch
def switch_facts(p: Certificate, ev: sw.Eviction, adm: sw.Admission, reports, **kw) -> sw.SwitchFacts:
    assert adm.layout is not None
    return sw.SwitchFacts(
        parent=p,
        previous_layout=kw.get("previous", sw.Layout(dp=len(p.members))),
        layout=adm.layout,
        kept=adm.kept,
        eviction=ev,
        reports=reports,
        committed_by_all=kw.get("committed", 5),
        frontier=kw.get("frontier", 5),
        manifest=kw.get("manifest", "m5"),
        state_digest="a",
        operator=kw.get("operator", False),
        phases=kw.get("phases", {"detect": 100.0, "reported": 100.25, "evicted": 100.5}),
        since=kw.get("since", 100.1),
        coordinator_rank=0,
        coordinator_incarnation="inc0",
    )


def test_the_plan_renumbers_survivors_densely_and_keeps_their_incarnations():
    p = parent([HOST] * 4)
    reports = {0: rep(0, 6, {5: "a", 6: "b"}), 2: rep(2), 3: rep(3)}
    ev = sw.Eviction(dead=(1,), kept=(0, 2, 3), evidence=("e0", "e1", "e2", "e3"))
    adm = sw.admit_survivors(sw.Layout(dp=4, global_batch=8), ev)
    plan = sw.plan_switch(switch_facts(p, ev, adm, reports, previous=sw.Layout(dp=4, global_batch=8)))
    assert plan.members == (Member(0, inc(0)), Member(1, inc(2)), Member(2, inc(3)))
    assert plan.reason == "rank-failure"
    assert plan.frontier == Frontier(5, "m5")
    assert plan.quiescence_evidence == ("e0", "e1", "e2", "e3")
    x = plan.extra
    assert x["switch"] == "in-place"
    assert x["rank_map"] == {"0": 0, "2": 1, "3": 2}
    assert x["evicted"] == {"dead": [1], "killed": []}
    assert x["layout"] == sw.Layout(dp=3, global_batch=8).to_dict()
    assert x["previous_layout"] == sw.Layout(dp=4, global_batch=8).to_dict()
    assert x["rolled_back"] == [0]  # rank 0 committed step 6, past the frontier
    assert x["committed_by_all"] == 5 and x["replicated_state_digest"] == "a"
    assert x["coordinator"] == {"rank": 0, "incarnation": "inc0"}
    assert "layout_kept" not in x


def test_the_plan_of_a_kept_layout_names_who_leaves():
    p = parent([HOST] * 4)
    reports = {0: rep(0), 1: rep(1), 2: rep(2)}
    ev = sw.Eviction(dead=(3,), kept=(0, 1, 2))
    adm = sw.admit_survivors(sw.Layout(dp=4), ev, 2)
    plan = sw.plan_switch(sw.SwitchFacts(**{**switch_facts(p, ev, adm, reports).__dict__, "admission": adm}))
    assert plan.members == (Member(0, inc(0)), Member(1, inc(1)))
    assert plan.extra["layout_kept"] == {"replica_ranks": 2, "dropped": [2], "dropped_incarnations": ["inc2"]}


def test_phases_count_from_detection_or_from_when_the_coordinator_started():
    p = parent([HOST, HOST])
    ev, reports = sw.Eviction(dead=(1,), kept=(0,)), {0: rep(0)}
    adm = sw.admit_survivors(sw.Layout(dp=2), ev)
    assert sw.plan_switch(switch_facts(p, ev, adm, reports)).extra["phases"] == {
        "detect": 0.0,
        "reported": 0.25,
        "evicted": 0.5,
    }
    undetected = switch_facts(p, ev, adm, reports, phases={"evicted": 101.0}, since=100.0)
    assert sw.plan_switch(undetected).extra["phases"] == {"evicted": 1.0}


def test_the_reason_is_hang_for_a_kill_and_operator_for_a_clean_abort():
    p = parent([HOST, HOST])
    reports = {0: rep(0), 1: rep(1)}
    killed = sw.Eviction(killed=(1,), kept=(0,))
    assert sw.plan_switch(switch_facts(p, killed, sw.admit_survivors(sw.Layout(dp=2), killed), reports)).reason == (
        "hang"
    )
    nobody = sw.Eviction(kept=(0, 1))
    adm = sw.admit_survivors(sw.Layout(dp=2), nobody)
    assert sw.plan_switch(switch_facts(p, nobody, adm, reports, operator=True)).reason == "operator"
    assert sw.plan_switch(switch_facts(p, nobody, adm, reports)).reason == "hang"


def test_no_durable_snapshot_leaves_the_frontier_without_a_manifest():
    p = parent([HOST, HOST])
    ev = sw.Eviction(dead=(1,), kept=(0,))
    plan = sw.plan_switch(switch_facts(p, ev, sw.admit_survivors(sw.Layout(dp=2), ev), {0: rep(0)}, manifest=""))
    assert plan.frontier == Frontier(5, "")


# ---------------------------------------------------------------------- the race
def test_a_refused_activation_follows_a_racer_only_past_the_parent():
    assert sw.follow_racer(2, 1)
    assert not sw.follow_racer(1, 1)  # still the parent: the refusal is real
    assert not sw.follow_racer(None, 1)  # no valid chain at all


# ---------------------------------------------------------------------- leases (remote members)
def lease_facts(p: Certificate, reports: dict[int, sw.Report], expired: set[str], **kw) -> sw.EvictionFacts:
    import dataclasses

    return dataclasses.replace(facts(p, reports, **kw), lease_expired=frozenset(expired), remote_wait_s=7.0)


def test_a_remote_member_whose_lease_expired_is_dead_with_that_proof():
    p = parent([HOST, "other"])
    ev = sw.decide_eviction(lease_facts(p, {0: rep(0)}, {"inc1"}))
    assert ev.dead == (1,) and ev.waiting == () and ev.kept == (0,)
    assert ev.proof == {"inc0": "reported, left its group", "inc1": "lease expired, self-fenced"}
    assert "on other: lease expired, self-fenced" in ev.evidence[1]


def test_a_remote_reporter_whose_lease_expired_since_is_dead_not_kept():
    p = parent([HOST, "other"])
    ev = sw.decide_eviction(lease_facts(p, {0: rep(0), 1: rep(1, host="other")}, {"inc1"}))
    assert ev.dead == (1,) and ev.kept == (0,)


def test_with_leases_a_remote_member_is_awaited_past_its_ttl_then_given_up():
    p = parent([HOST, "other"])
    assert not sw.decide_eviction(lease_facts(p, {0: rep(0)}, set(), waited=6.9)).give_up
    assert sw.decide_eviction(lease_facts(p, {0: rep(0)}, set(), waited=7.1)).give_up


def test_a_lease_never_overrides_the_local_process_table():
    p = parent([HOST, "other"])
    ev = sw.decide_eviction(lease_facts(p, {1: rep(1, host="other")}, {"inc0"}, status={"inc0": "stopped"}))
    assert ev.killed == (0,) and ev.proof["inc0"] == "killed, process gone"


def test_the_plan_records_each_old_incarnations_proof():
    p = parent([HOST, "other", "other"])
    ev = sw.decide_eviction(lease_facts(p, {0: rep(0), 1: rep(1, host="other")}, {"inc2"}))
    adm = sw.admit_survivors(sw.Layout(dp=3), ev)
    plan = sw.plan_switch(
        sw.SwitchFacts(
            parent=p,
            previous_layout=sw.Layout(dp=3),
            layout=adm.layout,
            kept=adm.kept,
            eviction=ev,
            reports={0: rep(0), 1: rep(1, host="other")},
            committed_by_all=5,
            frontier=5,
            manifest="",
            state_digest="a",
            operator=False,
            phases={"detect": 1.0},
            since=1.0,
            coordinator_rank=0,
            coordinator_incarnation="inc0",
        )
    )
    assert plan.extra["quiescence_by"] == {
        "inc0": "reported, left its group",
        "inc1": "reported, left its group",
        "inc2": "lease expired, self-fenced",
    }


# ---------------------------------------------------------------------- committed by all, from the reports
def _rep(rank: int, committed: int | None) -> sw.Report:
    return sw.Report(1, rank, f"inc{rank}", 100 + rank, "h", committed, {}, "x", 0.0)


def test_every_member_reporting_proves_the_smallest_commit_exactly():
    reports = {r: _rep(r, c) for r, c in enumerate([7, 8, 8])}
    assert sw.committed_by_all_from_reports(range(3), reports) == 7


def test_a_lost_member_committed_at_least_the_step_before_the_newest_survivor_commit():
    """Rank 2 is lost: survivors at 8 completed step 8's collective, which rank 2 entered after
    committing 7; nothing proves it committed 8."""
    assert sw.committed_by_all_from_reports(range(3), {0: _rep(0, 8), 1: _rep(1, 8)}) == 7
    assert sw.committed_by_all_from_reports(range(3), {0: _rep(0, 7), 1: _rep(1, 8)}) == 7


def test_nothing_is_proved_by_a_survivor_that_committed_nothing_or_by_no_report():
    assert sw.committed_by_all_from_reports(range(2), {0: _rep(0, None)}) is None
    assert sw.committed_by_all_from_reports(range(2), {}) is None
    assert sw.committed_by_all_from_reports(range(3), {0: _rep(0, 0)}) is None  # step -1: nothing


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(0, 3))
def test_what_the_reports_prove_never_passes_any_survivor_or_the_lost_bound(committed, lost):
    n = len(committed) + lost
    reports = {r: _rep(r, c) for r, c in enumerate(committed)}
    got = sw.committed_by_all_from_reports(range(n), reports)
    bound = min(committed) if lost == 0 else min(min(committed), max(committed) - 1)
    assert got == (None if max(committed) <= 0 else max(bound, 0))


def test_a_generation_that_completed_no_step_proves_nothing_past_its_certificate():
    """Generation 2 began at step 4 and a member hung before any step: the survivors' 4 is where the
    generation began, not a collective they completed: nothing is proved (never 3)."""
    reports = {0: _rep(0, 4), 1: _rep(1, 4)}
    assert sw.committed_by_all_from_reports(range(3), reports, start=4) is None
    assert sw.committed_by_all_from_reports(range(3), {0: _rep(0, 6), 1: _rep(1, 5)}, start=4) == 5
