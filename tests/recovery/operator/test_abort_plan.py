"""`plan_abort` is pure: facts in, the plan out. Properties over any mix of records, probes, filters
and ledger states: only a proven worker is ever a target, the active generation is spared, every
record is accounted for once, and nothing unverified turns into a quiescence proof."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.identity import JobProcessCheck
from gpuguard.foundation.jobdir import IncarnationRecord
from gpuguard.recovery.operator.abort import AbortFacts, AbortRequest, RecordFacts, is_active, plan_abort

VERDICTS = ("job", "gone", "not-the-job", "unknown")
NOT_PROVEN = {"unverified", "not-the-job", "unreadable"}


@st.composite
def record_facts(draw: st.DrawFn, index: int) -> RecordFacts:
    if draw(st.integers(0, 9)) == 0:
        return RecordFacts(None, f"incarnations/bad-{index}.json: malformed JSON")
    here = draw(st.booleans())
    rec = IncarnationRecord(
        incarnation={"id": f"inc-{index}", "host": "here" if here else "there", "pid": 1000 + index, "start_time": 1.0},
        rank=draw(st.integers(0, 3)),
        local_rank=0,
        world_size=4,
        generation=draw(st.none() | st.integers(0, 5)),
        agent_pid=1,
        run_id=draw(st.sampled_from(["none", "job", ""])),
        master_addr="h",
        master_port=1,
        restart_count=0,
    )
    verdict = draw(st.sampled_from(VERDICTS))
    check = JobProcessCheck(
        verdict, f"{verdict} because" + (" pid now belongs to a newer process" if verdict == "gone" else "")
    )
    return RecordFacts(rec, None, here, check if here or draw(st.booleans()) else None)


@st.composite
def abort_facts(draw: st.DrawFn) -> AbortFacts:
    n = draw(st.integers(0, 12))
    records = tuple(draw(record_facts(i)) for i in range(n))
    request = AbortRequest(
        generation=draw(st.none() | st.integers(0, 5)),
        ranks=tuple(draw(st.lists(st.integers(0, 3), max_size=3, unique=True))),
        grace_s=draw(st.floats(0, 30)),
        include_active=draw(st.booleans()),
    )
    active = draw(st.none() | st.integers(0, 5))
    problem = draw(st.none() | st.just("etcd unreachable")) if active is None else None
    return AbortFacts(request, records, active, problem, "here")


def _selected(facts: AbortFacts, rec: IncarnationRecord) -> bool:
    req = facts.request
    if req.generation is not None and rec.generation is not None and rec.generation > req.generation:
        return False
    return not req.ranks or rec.rank in req.ranks


@given(abort_facts())
@settings(max_examples=150, deadline=None)
def test_only_a_proven_worker_of_an_old_generation_on_this_host_is_a_target(facts: AbortFacts) -> None:
    plan = plan_abort(facts)
    by_id = {f.record.incarnation_id: f for f in facts.records if f.record is not None}
    for rec in plan.targets:
        found = by_id[rec.incarnation_id]
        assert found.here and found.check is not None and found.check.verdict == "job"
        assert _selected(facts, rec)
        if not facts.request.include_active:
            assert not is_active(rec.generation, facts.active)
            assert facts.ledger_problem is None or rec.generation is None


@given(abort_facts())
@settings(max_examples=150, deadline=None)
def test_every_record_is_accounted_for_once_and_nothing_unproven_is_quiescence(facts: AbortFacts) -> None:
    plan = plan_abort(facts)
    listed = [r.incarnation for r in plan.rows if r.incarnation is not None]
    listed += [t.incarnation_id for t in plan.targets]
    selected = [f.record.incarnation_id for f in facts.records if f.record is not None and _selected(facts, f.record)]
    assert sorted(listed) == sorted(selected)
    unreadable = sum(1 for f in facts.records if f.record is None)
    assert sum(1 for r in plan.rows if r.outcome == "unreadable") == unreadable
    unproven = [r for r in plan.rows if r.outcome in NOT_PROVEN]
    assert bool(plan.unverified) == bool(unproven)
    assert {r.incarnation for r in unproven if r.incarnation} == set(plan.unverified_ids)
    assert plan_abort(facts) == plan  # pure: the same facts, the same plan


@given(abort_facts())
@settings(max_examples=200, deadline=None)
def test_the_dry_run_is_the_plan_and_signals_nothing(facts: AbortFacts) -> None:
    plan = plan_abort(facts)
    dry = plan.to_dry_run()
    assert dry.outcome == "dry-run" and dry.dry_run and dry.exit_code == 0
    assert [t["pid"] for t in dry.details["targets"]] == [t.pid for t in plan.targets]
    would = [p for p in dry.details["processes"] if p["outcome"] == "would-terminate"]
    assert len(would) == len(plan.targets) and all(p["signal"] is None for p in dry.details["processes"])
    assert len(dry.details["processes"]) == len(plan.rows) + len(plan.targets)
