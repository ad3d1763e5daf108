"""The collective semantics table end to end: synthetic Flight Recorder dumps (pickle and JSON, nccl
and gloo prefixes, format versions 2.0-2.10) through the reader and the contract judge. Per kind a
matched case; every legitimate asymmetry (gather/scatter roots, uneven all_to_all, `_v` variants,
same-named disjoint groups) raises no alarm; every real divergence is caught with its culprit, or
marked ambiguous where the ranks may legitimately differ."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.flight_recorder import load_all
from gpuguard.diagnostics.collective_semantics import (
    COALESCED,
    GATHER_V,
    IDENTICAL,
    OP_ONLY,
    P2P,
    ROOTED_GATHER,
    ROOTED_SCATTER,
    SCATTER_V,
    TABLE,
    TOTALS,
    semantics,
)
from gpuguard.diagnostics.contract import Interner, RankTrace, Signature, Stream, check
from tests.support import contract_job as jh

VERSIONS = ("2.0", "2.2", "2.4", "2.10")
MATRIX = [(fmt, prefix, v) for fmt in ("pickle", "json") for prefix in ("nccl", "gloo") for v in VERSIONS]


def entry(
    seq,
    op,
    ins,
    outs,
    *,
    dtype="Float",
    out_dtype=None,
    pg=("0", "default_pg"),
    prefix="nccl",
    version="2.10",
    p2p=False,
    state="completed",
):
    e = jh.fr_entry(seq, op=op, pg=pg, prefix=prefix, version=version, p2p=p2p, state=state, frames=[])
    e["input_sizes"] = [list(s) for s in ins]
    e["output_sizes"] = [list(s) for s in outs]
    if "input_dtypes" in e:
        e["input_dtypes"] = [dtype] * len(ins)
        e["output_dtypes"] = [out_dtype or dtype] * len(outs)
    return e


def write(tmp_path, docs: dict[int, dict], fmt: str):
    for rank, doc in docs.items():
        if fmt == "pickle":
            (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(doc, protocol=2))
        else:
            (tmp_path / f"rank_{rank}.json").write_text(json.dumps(doc))


def judge_dir(tmp_path, **kw):
    """What `gpu-doctor contract DIR` decides (the CLI's wiring, in-process)."""
    it = Interner()
    loaded, refused = load_all(sorted(p for p in tmp_path.iterdir() if p.is_file()), it)
    return check(
        [x.trace for x in loaded],
        it,
        warnings=[str(e) for e in refused],
        partial=bool(refused),
        p2p={x.trace.rank: x.p2p for x in loaded if x.p2p},
        completed={x.trace.rank: x.completed for x in loaded if x.completed},
        **kw,
    )


def program(per_rank, *, prefix="nccl", version="2.10", world=4, gloo=None, members=None, tail=True):
    """{rank: doc}: per_rank(rank) gives (op, ins, outs[, dtype[, out_dtype]]) for seq 1; seq 2 is an all_reduce."""
    gloo = prefix == "gloo" if gloo is None else gloo
    docs = {}
    for r in range(world):
        spec = per_rank(r)
        op, ins, outs = spec[:3]
        dt = spec[3] if len(spec) > 3 else "Float"
        odt = spec[4] if len(spec) > 4 else None
        es = [entry(1, op, ins, outs, dtype=dt, out_dtype=odt, prefix=prefix, version=version)]
        if tail:
            es.append(entry(2, "all_reduce", [[8]], [[8]], prefix=prefix, version=version))
        docs[r] = jh.fr_doc(es, version=version, ranks=tuple(members or range(world)), gloo=gloo)
    return docs


# ---------------------------------------------------------------- the table itself


def test_table_covers_every_collective_flight_recorder_records():
    fr = {
        "broadcast", "_broadcast_oop", "reduce", "_reduce_oop", "all_gather", "all_gather_single", "all_gather_v",
        "all_reduce", "_all_gather_base", "all_gather_into_tensor_coalesced", "reduce_scatter",
        "reduce_scatter_single", "reduce_scatter_v", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
        "gather", "scatter", "all_to_all", "all_to_all_single", "all_to_all_v_single", "all_reduce_barrier",
        "barrier", "allreduce_coalesced", "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced", "send", "recv",
        "coalesced", "all_to_allv",
    }  # fmt: skip
    assert fr <= set(TABLE)
    rules = {
        "all_reduce": IDENTICAL, "reduce": IDENTICAL, "broadcast": IDENTICAL, "all_gather": IDENTICAL,
        "_all_gather_base": IDENTICAL, "all_gather_into_tensor_coalesced": IDENTICAL, "all_gather_v": GATHER_V,
        "reduce_scatter": IDENTICAL, "_reduce_scatter_base": IDENTICAL, "reduce_scatter_tensor_coalesced": IDENTICAL,
        "reduce_scatter_v": SCATTER_V, "gather": ROOTED_GATHER, "scatter": ROOTED_SCATTER, "all_to_all": TOTALS,
        "all_to_all_single": TOTALS, "all_to_all_v_single": TOTALS, "barrier": OP_ONLY, "send": P2P, "recv": P2P,
        "coalesced": COALESCED,
    }  # fmt: skip
    assert {op: TABLE[op].rule for op in rules} == rules
    assert semantics("coalesced[all_reduce,all_reduce]").rule == COALESCED
    assert semantics("some_new_op").rule == IDENTICAL  # unknown: everything must agree


def test_table_and_its_document_agree():
    from tests.support.cli import REPO

    doc = (REPO / "docs" / "formats" / "collective-semantics.md").read_text()
    for op, row in TABLE.items():
        assert f"`{op}`" in doc, op
        assert f"`{row.rule}`" in doc, row.rule


# ---------------------------------------------------------------- matched and legitimate asymmetries

LEGIT_CASES = {
    "all_reduce": lambda r: ("all_reduce", [[16]], [[16]]),
    "reduce": lambda r: ("reduce", [[16]], [[16]]),
    "broadcast": lambda r: ("broadcast", [[2, 3]], [[2, 3]]),
    "all_gather": lambda r: ("all_gather", [[4]], [[4]] * 4),
    "_all_gather_base": lambda r: ("_all_gather_base", [[4]], [[16]]),
    "all_gather_into_tensor_coalesced": lambda r: ("all_gather_into_tensor_coalesced", [[4], [2]], [[16], [8]]),
    "all_gather_v": lambda r: ("all_gather_v", [[r + 1]], [[10]]),
    "reduce_scatter": lambda r: ("reduce_scatter", [[4]] * 4, [[4]]),
    "_reduce_scatter_base": lambda r: ("_reduce_scatter_base", [[16]], [[4]]),
    "reduce_scatter_tensor_coalesced": lambda r: ("reduce_scatter_tensor_coalesced", [[16], [8]], [[4], [2]]),
    "reduce_scatter_v": lambda r: ("reduce_scatter_v", [[10]], [[r + 1]]),
    "gather_root0": lambda r: ("gather", [[4]], [[4, 4]] if r == 0 else []),
    "gather_nccl_placeholder": lambda r: ("gather", [[4]], [[4]] * 4 if r == 2 else [[]]),
    "scatter_root1": lambda r: ("scatter", [[4, 3]] if r == 1 else [], [[3]]),
    "all_to_all_single_uneven": lambda r: ("all_to_all", [[4 * (r + 1)]], [[10]]),
    "all_to_allv_moe": lambda r: ("all_to_allv", [[6]] if r % 2 == 0 else [[2]], [[4]]),
    "all_to_all_list": lambda r: ("all_to_all", [[2]] * 4, [[2]] * 4),
    "barrier": lambda r: ("barrier", [] if r else [[1]], [] if r else [[1]]),
    "coalesced_all_reduce": lambda r: ("allreduce_coalesced", [[4], [8]], [[4], [8]]),
}


@pytest.mark.parametrize("fmt,prefix,version", MATRIX)
@pytest.mark.parametrize("case", sorted(LEGIT_CASES))
def test_matched_and_legitimate_asymmetries_raise_no_alarm(tmp_path, case, fmt, prefix, version):
    write(tmp_path, program(LEGIT_CASES[case], prefix=prefix, version=version), fmt)
    report = judge_dir(tmp_path)
    assert report.holds, report.first_divergence and report.first_divergence.explanation
    assert not report.partial, report.warnings
    assert sum(t.checked for t in report.timelines) == 2


def test_three_rank_gather_does_not_blame_the_outnumbered_root(tmp_path):
    write(tmp_path, program(lambda r: ("gather", [[16]], [[3, 16]] if r == 0 else []), world=3), "pickle")
    assert judge_dir(tmp_path).holds


# ---------------------------------------------------------------- real divergences

DIVERGENT = {
    # name: (per_rank, kind, culprits, ambiguous, text in the explanation)
    "gather_nonroot_input": (
        lambda r: ("gather", [[5]] if r == 2 else [[4]], [[4, 4]] if r == 0 else []),
        "size_mismatch",
        (2,),
        False,
        "[[5]]",
    ),
    "gather_root_total": (
        lambda r: ("gather", [[4]], [[2, 4]] if r == 0 else []),
        "size_mismatch",
        (0,),
        False,
        "[[2,4]]",
    ),
    "gather_two_roots": (
        lambda r: ("gather", [[4]], [[4, 4]] if r in (0, 3) else []),
        "root_mismatch",
        (0, 3),
        True,
        "root",
    ),
    "scatter_output_dtype": (
        lambda r: ("scatter", [[4, 3]] if r == 1 else [], [[3]], "Float", "Half" if r == 3 else "Float"),
        "dtype_mismatch",
        (3,),
        False,
        "dtype",
    ),
    "all_to_all_totals": (
        lambda r: ("all_to_all", [[6]] if r % 2 == 0 else [[2]], [[5]] if r == 3 else [[4]]),
        "totals_mismatch",
        None,
        True,
        "sends 16",
    ),
    "all_to_all_dtype": (
        lambda r: ("all_to_all", [[4 * (r + 1)]], [[10]], "BFloat16" if r == 1 else "Float"),
        "dtype_mismatch",
        (1,),
        False,
        "BFloat16",
    ),
    "all_gather_v_output": (
        lambda r: ("all_gather_v", [[r + 1]], [[11]] if r == 0 else [[10]]),
        "size_mismatch",
        (0,),
        False,
        "[[11]]",
    ),
    "reduce_scatter_v_totals": (
        lambda r: ("reduce_scatter_v", [[10]], [[r + 2]]),
        "totals_mismatch",
        (0, 1, 2, 3),
        True,
        "add up to 14",
    ),
    "all_reduce_shape": (
        lambda r: ("all_reduce", [[4, 4]] if r == 1 else [[16]], [[4, 4]] if r == 1 else [[16]]),
        "size_mismatch",
        (1,),
        False,
        "in=[[4,4]]",
    ),
    "all_reduce_dtype": (
        lambda r: ("all_reduce", [[16]], [[16]], "Half" if r == 2 else "Float"),
        "dtype_mismatch",
        (2,),
        False,
        "Half",
    ),
    "broadcast_size": (
        lambda r: ("broadcast", [[3]] if r == 0 else [[2]], [[3]] if r == 0 else [[2]]),
        "size_mismatch",
        (0,),
        False,
        "count=3",
    ),
    "coalesced_record": (
        lambda r: ("allreduce_coalesced", [[4], [9] if r == 3 else [8]], [[4], [9] if r == 3 else [8]]),
        "size_mismatch",
        (3,),
        False,
        "in=[[4],[9]]",
    ),
}


@pytest.mark.parametrize("fmt,prefix,version", MATRIX)
@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_real_divergences_are_caught_with_their_culprit(tmp_path, case, fmt, prefix, version):
    per_rank, kind, culprits, ambiguous, text = DIVERGENT[case]
    write(tmp_path, program(per_rank, prefix=prefix, version=version), fmt)
    report = judge_dir(tmp_path)
    if kind == "dtype_mismatch" and version in ("2.0", "2.1"):
        assert report.holds  # formats 2.0/2.1 record no dtypes: nothing to compare, and no false alarm
        return
    d = report.first_divergence
    assert d is not None and d.seq == 1
    assert d.kind == kind, d.explanation
    if culprits is not None:
        assert d.ranks == culprits, d.explanation
    assert d.ambiguous is ambiguous
    assert text in d.explanation, d.explanation


def test_a_divergence_after_a_legitimate_asymmetry_is_still_found(tmp_path):
    docs = {}
    for r in range(4):
        es = [
            entry(1, "gather", [[4]], [[4, 4]] if r == 0 else []),
            entry(2, "all_to_all", [[r + 1]], [[r + 1]]),
            entry(3, "all_reduce", [[7]] if r == 1 else [[8]], [[7]] if r == 1 else [[8]]),
        ]
        docs[r] = jh.fr_doc(es)
    write(tmp_path, docs, "json")
    d = judge_dir(tmp_path).first_divergence
    assert (d.seq, d.kind, d.ranks) == (3, "size_mismatch", (1,))


def test_coalesced_group_names_the_record_inside(tmp_path):
    docs = {}
    for r in range(3):
        es = [
            entry(5, "all_reduce", [[4]], [[4]]),
            entry(5, "all_reduce", [[9]] if r == 2 else [[8]], [[9]] if r == 2 else [[8]]),
            entry(5, "coalesced", [], []),
        ]
        docs[r] = jh.fr_doc(es, ranks=(0, 1, 2))
    write(tmp_path, docs, "pickle")
    d = judge_dir(tmp_path).first_divergence
    assert (d.seq, d.kind, d.ranks) == (5, "size_mismatch", (2,))
    assert d.record == "record 2 of 2 (all_reduce)" and "record 2 of 2" in d.explanation


# ---------------------------------------------------------------- groups: name AND member set


def _group_docs(views: dict[int, tuple[int, ...]], size_of, name="1", desc="half"):
    docs = {}
    for r, members in views.items():
        es = [entry(1, "all_reduce", [[size_of(r)]], [[size_of(r)]], pg=(name, desc))]
        doc = jh.fr_doc(es, ranks=members)
        doc["pg_config"] = {name: {"name": name, "desc": desc, "ranks": json.dumps(list(members))}}
        docs[r] = doc
    return docs


@pytest.mark.parametrize("fmt", ("pickle", "json"))
def test_disjoint_groups_sharing_a_name_are_separate_timelines(tmp_path, fmt):
    views = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    write(tmp_path, _group_docs(views, lambda r: 8 if r < 2 else 6), fmt)
    report = judge_dir(tmp_path)
    assert report.holds and not report.partial, report.warnings
    assert sorted((t.pg, t.members, t.ranks) for t in report.timelines) == [
        ("1", (0, 1), (0, 1)),
        ("1", (2, 3), (2, 3)),
    ]


def test_per_rank_one_member_groups_hold(tmp_path):
    write(tmp_path, _group_docs({r: (r,) for r in range(4)}, lambda r: r + 1), "json")
    report = judge_dir(tmp_path)
    assert report.holds and not report.partial and len(report.timelines) == 4


def test_same_named_group_with_a_real_mismatch_is_caught_in_its_own_group(tmp_path):
    views = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    write(tmp_path, _group_docs(views, lambda r: 5 if r == 3 else (8 if r < 2 else 6)), "pickle")
    d = judge_dir(tmp_path).first_divergence
    assert d.kind == "size_mismatch" and d.members == (2, 3) and set(d.ranks) <= {2, 3}


def test_ranks_disagreeing_about_a_groups_members_is_reported(tmp_path):
    views = {0: (0, 1), 1: (0, 1, 2), 2: (0, 1, 2)}
    write(tmp_path, _group_docs(views, lambda r: 8), "json")
    report = judge_dir(tmp_path)
    (d,) = [t.divergence for t in report.timelines if t.scope == "membership"]
    assert d.kind == "membership_mismatch" and d.ranks == (0,) and "[0-2]" in d.explanation
    assert "[0,1]" in d.explanation or "[0-1]" in d.explanation


# ---------------------------------------------------------------- point-to-point


def _p2p_docs(pairs, *, prefix="nccl", version="2.10", members=(0, 1, 2, 3), pg=("0", "default_pg")):
    """pairs: {rank: [(seq, "send 0->1", n, dtype), ...]} plus one all_reduce each."""
    docs = {}
    for r, ops in pairs.items():
        es = [entry(1, "all_reduce", [[8]], [[8]], prefix=prefix, version=version, pg=pg)]
        for seq, op, n, dt in ops:
            sizes = [[n]]
            e = entry(seq, op, sizes if op.startswith("send") else [], [] if op.startswith("send") else sizes,
                      dtype=dt, prefix=prefix, version=version, p2p=True, pg=pg)  # fmt: skip
            if op.startswith("recv") and "output_dtypes" in e:
                e["output_dtypes"] = [dt]
            es.append(e)
        doc = jh.fr_doc(es, version=version, ranks=members)
        if pg[0] != "0":
            doc["pg_config"] = {pg[0]: {"name": pg[0], "desc": pg[1], "ranks": json.dumps(list(members))}}
        docs[r] = doc
    return docs


@pytest.mark.parametrize("fmt,prefix,version", MATRIX)
def test_matching_send_and_recv_hold(tmp_path, fmt, prefix, version):
    pairs = {0: [(1, "send 0->1", 4, "Float")], 1: [(1, "recv 1<-0", 4, "Float")], 2: [], 3: []}
    write(tmp_path, _p2p_docs(pairs, prefix=prefix, version=version), fmt)
    report = judge_dir(tmp_path)
    assert report.holds and not report.partial, report.warnings
    (p2p,) = [t for t in report.timelines if t.scope == "p2p"]
    assert p2p.checked == 1


@pytest.mark.parametrize("fmt,prefix,version", MATRIX)
def test_send_recv_size_mismatch_names_both_sides(tmp_path, fmt, prefix, version):
    pairs = {0: [(1, "send 0->1", 4, "Float")], 1: [(1, "recv 1<-0", 5, "Float")], 2: [], 3: []}
    write(tmp_path, _p2p_docs(pairs, prefix=prefix, version=version), fmt)
    d = judge_dir(tmp_path).first_divergence
    assert (d.kind, d.field, d.ranks, d.ambiguous) == ("p2p_mismatch", "size", (0, 1), True)
    assert "rank 0 sent send 0->1 count=4" in d.explanation and "count=5" in d.explanation


def test_send_recv_dtype_mismatch(tmp_path):
    pairs = {0: [(1, "send 0->1", 4, "Float")], 1: [(1, "recv 1<-0", 4, "Half")], 2: [], 3: []}
    write(tmp_path, _p2p_docs(pairs), "json")
    d = judge_dir(tmp_path).first_divergence
    assert (d.kind, d.field) == ("p2p_mismatch", "dtype")


def test_send_without_recv_blames_the_receiver(tmp_path):
    pairs = {0: [(1, "send 0->1", 4, "Float"), (2, "send 0->1", 4, "Float")], 1: [(1, "recv 1<-0", 4, "Float")]}
    write(tmp_path, _p2p_docs(pairs, members=(0, 1)), "pickle")
    d = judge_dir(tmp_path).first_divergence
    assert (d.kind, d.ranks, d.seq) == ("missing_participant", (1,), 2) and "never posted its recv" in d.explanation


def test_p2p_peers_are_group_ranks_mapped_through_the_member_set(tmp_path):
    """In group [2, 3], rank 2's `send 0->1` goes to global rank 3."""
    pairs = {2: [(1, "send 0->1", 4, "Float")], 3: [(1, "recv 1<-0", 6, "Float")]}
    write(tmp_path, _p2p_docs(pairs, members=(2, 3), pg=("7", "pp")), "json")
    d = judge_dir(tmp_path, world_size=None).first_divergence
    assert d.kind == "p2p_mismatch" and d.ranks == (2, 3) and d.members == (2, 3)


# ---------------------------------------------------------------- every valid dump


def test_json_dump_without_entries_is_read(tmp_path):
    docs = program(lambda r: ("all_reduce", [[4]], [[4]]), world=2)
    del docs[1]["entries"]  # PyTorch's JSON writer leaves an empty list out
    write(tmp_path, docs, "json")
    report = judge_dir(tmp_path)
    d = report.first_divergence
    assert d is not None and d.kind == "missing_participant" and d.ranks == (1,)


def test_only_active_dump_of_a_rank_that_completed_everything_agrees(tmp_path):
    docs = {}
    for r in range(2):
        es = [entry(6, "all_reduce", [[4]], [[4]], state="scheduled")] if r == 0 else []
        doc = jh.fr_doc(es, ranks=(0, 1))
        doc["pg_status"] = {"0": {"last_enqueued_collective": 6, "last_started_collective": 6,
                                  "last_completed_collective": 5 if r == 0 else 6}}  # fmt: skip
        if not es:
            del doc["entries"]
        docs[r] = doc
    write(tmp_path, docs, "json")
    assert judge_dir(tmp_path).holds
    docs[1]["pg_status"]["0"]["last_completed_collective"] = 5  # rank 1 never issued #6: the hang
    write(tmp_path, docs, "json")
    d = judge_dir(tmp_path).first_divergence
    assert (d.seq, d.kind, d.ranks) == (6, "missing_participant", (1,))


def test_string_sequence_ids_are_read(tmp_path):
    docs = program(lambda r: ("all_reduce", [[4]] if r else [[5]], [[4]] if r else [[5]]), world=2)
    for doc in docs.values():
        for e in doc["entries"]:
            e["collective_seq_id"] = str(e["collective_seq_id"])
            e["pg_id"] = str(e["pg_id"])
    write(tmp_path, docs, "json")
    d = judge_dir(tmp_path).first_divergence
    assert (d.seq, d.kind) == (1, "size_mismatch")


def test_a_refused_file_leaves_the_rest_analysed_and_partial(tmp_path):
    write(tmp_path, program(lambda r: ("all_reduce", [[4]], [[4]]), world=3), "json")
    (tmp_path / "rank_1.json").write_text('{"version": "2.10", "entries": 7}')
    report = judge_dir(tmp_path)
    assert report.holds and report.partial
    assert any("rank_1.json" in w and "'entries' is not a list" in w for w in report.warnings)


def test_nothing_compared_is_unknown_not_holds(tmp_path):
    docs = {r: jh.fr_doc([], ranks=(0, 1)) for r in range(2)}
    write(tmp_path, docs, "pickle")
    report = judge_dir(tmp_path)
    assert report.partial and any("nothing compared" in w for w in report.warnings)


def test_gloo_same_named_groups_without_member_sets_are_a_guess_not_an_alarm(tmp_path):
    """gloo's pg_config names no members: halves that never issue one matching entry are taken as
    two groups sharing the name, and the verdict is unknown (partial), never a false divergence."""
    docs = {}
    for r in range(4):
        n = 8 if r < 2 else 6
        es = [entry(s, "all_reduce", [[n + s]], [[n + s]], pg=("9", "half"), prefix="gloo") for s in (1, 2)]
        docs[r] = jh.fr_doc(es, gloo=True)
    write(tmp_path, docs, "json")
    report = judge_dir(tmp_path)
    assert report.holds and report.partial
    assert sorted(t.ranks for t in report.timelines) == [(0, 1), (2, 3)]
    assert any("separate groups sharing the name" in w for w in report.warnings)


def test_gloo_two_against_two_after_agreeing_is_a_divergence(tmp_path):
    docs = {}
    for r in range(4):
        es = [
            entry(1, "all_reduce", [[4]], [[4]], pg=("9", "x"), prefix="gloo"),
            entry(2, "all_reduce", [[8]] if r < 2 else [[6]], [[8]] if r < 2 else [[6]], pg=("9", "x"), prefix="gloo"),
        ]
        docs[r] = jh.fr_doc(es, gloo=True)
    write(tmp_path, docs, "pickle")
    d = judge_dir(tmp_path).first_divergence
    assert d is not None and (d.seq, d.kind, d.ambiguous) == (2, "size_mismatch", True)


# ---------------------------------------------------------------- properties (hypothesis)


def _traces(sigs: dict[int, Signature], members: tuple[int, ...]):
    it = Interner()
    out = []
    for r, sig in sigs.items():
        stream = Stream(pg="5", generation=0, seqs=[1], sig_ids=[it.sig(sig)], states=["completed"])
        out.append(RankTrace(rank=r, source=f"r{r}", format="test", streams=(stream,), pg_ranks={"5": members}))
    return out, it


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8).flatmap(
        lambda w: st.lists(st.lists(st.integers(0, 9), min_size=w, max_size=w), min_size=w, max_size=w)
    ),
    st.data(),
)
def test_any_uneven_all_to_all_whose_totals_match_holds_and_any_leak_is_caught(splits, data):
    w = len(splits)
    members = tuple(range(w))
    sigs = {
        r: Signature(
            "all_to_all", ((sum(splits[r]),),), ("Float",), ((sum(splits[i][r] for i in range(w)),),), ("Float",)
        )
        for r in range(w)
    }
    traces, it = _traces(sigs, members)
    assert check(traces, it).holds
    bad = data.draw(st.integers(0, w - 1))
    s = sigs[bad]
    sigs[bad] = s._replace(out_sizes=((s.out_sizes[0][0] + data.draw(st.integers(1, 5)),),))
    traces, it = _traces(sigs, members)
    d = check(traces, it).first_divergence
    assert d is not None and d.kind == "totals_mismatch" and d.ambiguous


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.data())
def test_any_gather_root_holds_and_a_non_roots_wrong_input_names_it(world, data):
    root = data.draw(st.integers(0, world - 1))
    n = data.draw(st.integers(1, 64))
    members = tuple(range(world))
    sigs = {
        r: Signature("gather", ((n,),), ("Float",), ((world, n),) if r == root else (), ("Float",) if r == root else ())
        for r in range(world)
    }
    traces, it = _traces(sigs, members)
    assert check(traces, it).holds
    bad = data.draw(st.sampled_from([r for r in range(world) if r != root]))
    sigs[bad] = sigs[bad]._replace(in_sizes=((n + 1,),))
    traces, it = _traces(sigs, members)
    d = check(traces, it).first_divergence
    assert d is not None and (d.kind, d.ranks) == ("size_mismatch", (bad,))


def test_an_all_to_all_every_rank_issued_identically_with_unequal_totals_is_caught(tmp_path):
    write(tmp_path, program(lambda r: ("all_to_all_single", [[4]], [[8]])), "json")
    d = judge_dir(tmp_path).first_divergence
    assert d is not None and (d.seq, d.kind, d.ranks, d.ambiguous) == (1, "totals_mismatch", (0, 1, 2, 3), True)
    assert d.others == () and "sends 4 and receives 8" in d.explanation
