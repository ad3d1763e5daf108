"""The pure contract checker: consistent traces hold; every planted divergence is found at exactly
its sequence id, with its kind and culprit; generations never mix; partial input is labelled."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.diagnostics.contract import (
    COMPLETED,
    DTYPE_MISMATCH,
    MISSING_PARTICIPANT,
    OP_MISMATCH,
    REDUCE_OP_MISMATCH,
    SCHEDULED,
    SIZE_MISMATCH,
    STATE_MISMATCH,
    Interner,
    RankTrace,
    Signature,
    Stream,
    around,
    check,
    format_ranks,
    report_to_json,
)

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
DTYPES = ("float32", "bfloat16", "int64")
REDUCE = ("sum", "max", "avg")

signatures = st.builds(
    lambda op, n, dt, red: Signature(op=op, in_dtypes=(dt,), count=n, reduce_op=red),
    st.sampled_from(OPS),
    st.integers(1, 1 << 20),
    st.sampled_from(DTYPES),
    st.sampled_from(REDUCE),
)


def make(
    program_by_rank: dict[int, list[Signature]],
    *,
    start: int = 1,
    states=None,
    sites=None,
    generation: int = 0,
    pg: str = "default",
    world: int | None = None,
    interner=None,
):
    interner = interner or Interner()
    traces = []
    for rank, program in program_by_rank.items():
        n = len(program)
        seqs = list(range(start, start + n))
        st_ = (states or {}).get(rank, [COMPLETED] * n)
        si = (sites or {}).get(rank)
        stream = Stream(
            pg=pg,
            generation=generation,
            seqs=seqs,
            sig_ids=[interner.sig(s) for s in program],
            states=st_,
            site_ids=[interner.site(x) for x in si] if si else None,
            times_ns=[1000 + i for i in range(n)],
        )
        traces.append(RankTrace(rank=rank, source=f"rank{rank}", format="test", streams=(stream,), world_size=world))
    return traces, interner


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(signatures, min_size=1, max_size=30), st.integers(2, 9), st.integers(1, 500))
def test_consistent_traces_hold(program, world, start):
    traces, interner = make({r: list(program) for r in range(world)}, start=start, world=world)
    report = check(traces, interner)
    assert report.holds and not report.partial
    assert report.first_divergence is None
    (timeline,) = report.timelines
    assert timeline.checked == len(program)
    assert report_to_json(report)["first_divergence"] is None


def _plant(sig: Signature, kind: str) -> Signature:
    if kind == OP_MISMATCH:
        return sig._replace(op=next(o for o in OPS if o != sig.op))
    if kind == SIZE_MISMATCH:
        return sig._replace(count=sig.count + 1)
    if kind == DTYPE_MISMATCH:
        return sig._replace(in_dtypes=(next(d for d in DTYPES if (d,) != sig.in_dtypes),))
    if kind == REDUCE_OP_MISMATCH:
        return sig._replace(reduce_op=next(r for r in REDUCE if r != sig.reduce_op))
    raise AssertionError(kind)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(signatures, min_size=1, max_size=25),
    st.integers(3, 9),
    st.data(),
    st.sampled_from(
        (MISSING_PARTICIPANT, OP_MISMATCH, SIZE_MISMATCH, DTYPE_MISMATCH, REDUCE_OP_MISMATCH, STATE_MISMATCH)
    ),
)
def test_planted_divergence_is_found_exactly(program, world, data, kind):
    culprit = data.draw(st.integers(0, world - 1), label="culprit")
    at = data.draw(st.integers(0, len(program) - 1), label="index")
    start = data.draw(st.integers(1, 100), label="start")
    programs = {r: list(program) for r in range(world)}
    states = {r: [COMPLETED] * at + [SCHEDULED] * (len(program) - at) for r in range(world)}
    if kind == MISSING_PARTICIPANT:
        programs[culprit] = program[:at]
        states[culprit] = states[culprit][:at]
    elif kind == STATE_MISMATCH:
        states = {r: [COMPLETED] * len(program) for r in range(world)}
        states[culprit] = [COMPLETED] * at + [SCHEDULED] * (len(program) - at)
    else:
        programs[culprit][at] = _plant(program[at], kind)
    traces, interner = make(programs, start=start, states=states, world=world)
    report = check(traces, interner)
    div = report.first_divergence
    assert div is not None
    assert div.seq == start + at
    assert div.kind == kind
    assert div.ranks == (culprit,)
    assert culprit not in div.majority.ranks and len(div.majority.ranks) == world - 1
    doc = div.to_json()
    assert doc["kind"] == kind and doc["ranks"] == [culprit] and doc["seq"] == start + at
    if kind == MISSING_PARTICIPANT:
        assert doc["actual"] is None and doc["missing_ranks"] == [culprit]
    else:
        assert doc["expected"] != doc["actual"]


def test_generations_are_separate_timelines():
    a = Signature("all_reduce", in_dtypes=("float32",), count=8, reduce_op="sum")
    b = Signature("all_gather", in_dtypes=("int64",), count=3)
    interner = Interner()
    old, _ = make({0: [a, a], 1: [a, a]}, generation=3, interner=interner)
    new, _ = make({2: [b, b, b], 3: [b, b, b]}, generation=4, interner=interner)
    report = check(old + new, interner)
    assert report.holds
    assert sorted((t.generation, t.ranks) for t in report.timelines) == [(3, (0, 1)), (4, (2, 3))]
    assert any("generation" in w for w in report.warnings)


def test_ring_windows_compare_only_the_common_part():
    a = Signature("all_reduce", count=8)
    b = Signature("broadcast", count=8)
    interner = Interner()
    t0, _ = make({0: [b] + [a] * 5}, start=10, interner=interner)  # rank 0 still holds #10
    t1, _ = make({1: [a] * 4}, start=12, interner=interner)  # rank 1's ring dropped #10-#11
    t1b, _ = make({2: [a] * 4}, start=12, interner=interner)
    report = check(t0 + t1 + t1b, interner)
    assert report.holds, report.first_divergence
    assert report.timelines[0].first_seq == 12


def test_missing_dump_and_duplicate_rank_are_partial():
    a = Signature("all_reduce", count=8)
    traces, interner = make({0: [a, a], 1: [a, a], 3: [a, a]}, world=4)
    dup, _ = make({1: [a]}, interner=interner)
    report = check(traces + dup, interner)
    assert report.partial
    assert any("rank(s) 2" in w for w in report.warnings)
    assert any("two dumps" in w for w in report.warnings)
    assert report.holds  # the ranks we have agree; the rest is unknown, and labelled so
    wider = check(traces, interner, world_size=6)
    assert wider.partial and any("rank(s) 2,4-5" in w for w in wider.warnings)
    assert check(traces[:2], interner, world_size=2).partial is False


def test_missing_participant_explains_the_later_call_with_call_sites():
    a = Signature("all_reduce", count=1024, in_dtypes=("float32",), reduce_op="sum")
    m = Signature("all_reduce", count=1024, in_dtypes=("float32",), reduce_op="sum")
    main, metrics = "train.py:100 main", "train.py:78 sync_metrics"
    majority = [a, a, a, m, a, a]
    sites_major = [main, main, main, metrics, main, main]
    skipper = [a, a, a, a, a]  # skipped the metrics call at #4
    sites = {0: sites_major, 1: sites_major, 2: [main] * 5, 3: sites_major}
    traces, interner = make({0: majority, 1: majority, 2: skipper, 3: majority}, sites=sites)
    div = check(traces, interner).first_divergence
    assert div.kind == MISSING_PARTICIPANT and div.seq == 6 and div.ranks == (2,)
    assert any("ahead" in h and "#4" in h and "sync_metrics" in h for h in div.hints), div.hints
    rows = around(traces, interner, div)
    assert rows[-1][0] == 6 and rows[-1][1][1] == "-"


def test_extra_collective_is_reported_as_behind():
    a, x = Signature("all_reduce", count=4), Signature("broadcast", count=1)
    b, c = Signature("all_gather", count=2), Signature("reduce_scatter", count=8)
    good = [a, b, c, a, b, c]
    extra = [a, x, b, c, a, b, c]
    traces, interner = make({0: good, 1: good, 2: extra})
    div = check(traces, interner).first_divergence
    assert div.seq == 2 and div.kind == OP_MISMATCH and div.ranks == (2,)
    assert any("behind" in h and "extra collective at #2" in h for h in div.hints), div.hints


def test_no_strict_majority_is_flagged_ambiguous():
    a, b = Signature("all_reduce", count=4), Signature("all_reduce", count=5)
    traces, interner = make({0: [a], 1: [a], 2: [b], 3: [b]})
    div = check(traces, interner).first_divergence
    assert div.ambiguous and div.kind == SIZE_MISMATCH
    assert div.majority.ranks == (0, 1) and div.ranks == (2, 3)


def test_rank_that_issued_nothing_is_a_missing_participant():
    a = Signature("all_reduce", count=4)
    traces, interner = make({0: [a], 1: [a], 2: []}, world=3)
    div = check(traces, interner).first_divergence
    assert div.kind == MISSING_PARTICIPANT and div.ranks == (2,) and div.seq == 1


def test_several_process_groups_checked_independently():
    a, b = Signature("all_reduce", count=4), Signature("all_reduce", count=6)
    interner = Interner()
    t_default, _ = make({0: [a, a], 1: [a, a]}, interner=interner)
    t_pair, _ = make({0: [a, b], 1: [a, a]}, pg="tp", interner=interner)
    merged = [
        RankTrace(rank=x.rank, source=x.source, format="test", streams=x.streams + y.streams)
        for x, y in zip(t_default, t_pair)
    ]
    report = check(merged, interner)
    div = report.first_divergence
    assert div.pg == "tp" and div.seq == 2 and div.kind == SIZE_MISMATCH
    assert check(merged, interner, pg="default").holds


def test_format_ranks_is_compact():
    assert format_ranks([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert format_ranks([]) == ""


def test_gap_in_one_rank_is_found_by_the_general_path():
    a, b = Signature("all_reduce", count=4), Signature("broadcast", count=2)
    interner = Interner()
    ia, ib = interner.sig(a), interner.sig(b)
    full = Stream(pg="dp", generation=0, seqs=[1, 2, 3, 4], sig_ids=[ia, ib, ia, ib], states=[COMPLETED] * 4)
    gap = Stream(pg="dp", generation=0, seqs=[1, 2, 4], sig_ids=[ia, ib, ib], states=[COMPLETED] * 3)
    traces = [RankTrace(rank=r, source=str(r), format="test", streams=(gap if r == 1 else full,)) for r in range(3)]
    div = check(traces, interner).first_divergence
    assert (div.seq, div.kind, div.ranks, div.missing_ranks) == (3, MISSING_PARTICIPANT, (1,), (1,))
    assert div.majority.signature == a and div.others[0].signature is None
