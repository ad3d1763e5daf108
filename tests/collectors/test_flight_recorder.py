"""Flight Recorder / gpuguard trace loaders: real dumps from real gloo jobs, every format version we
know, the restricted unpickler, and hostile input (random bytes, truncations, wrong shapes)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.flight_recorder import (  # noqa: E402
    discover,
    load_all,
    load_dump,
    load_many,
    restricted_loads,
)
from gpuguard.diagnostics.contract import Interner, check  # noqa: E402
from gpuguard.foundation.errors import DataError, NoInputError  # noqa: E402
from tests.support import contract_job as jh


@pytest.fixture(scope="module")
def dumps():
    return jh.real_dumps()


def _columns(trace, interner, pg):
    (stream,) = [s for s in trace.streams if s.pg == pg]
    return [(seq, interner.signatures[i]) for seq, i in zip(stream.seqs, stream.sig_ids)], stream


def test_real_gloo_dumps_pickle_and_json_agree(dumps):
    it = Interner()
    for rank in range(4):
        pk = load_dump(dumps["size"] / "fr_pickle" / f"rank_{rank}", it)
        js = load_dump(dumps["size"] / "fr_json" / f"rank_{rank}.json", it)
        assert pk.trace.rank == js.trace.rank == rank
        assert pk.trace.version == "2.10" and pk.trace.format == "fr-pickle" and js.trace.format == "fr-json"
        cols_p, sp = _columns(pk.trace, it, "4")
        cols_j, sj = _columns(js.trace, it, "4")
        assert cols_p == cols_j
        assert [s.op for _, s in cols_p][:2] == ["broadcast", "all_reduce"]
        assert sp.site_ids is not None and sj.site_ids is None  # JSON dumps carry no frames
        assert sp.pg_desc == "size"
    # rank 3 all-reduced 512 elements at seq 6 and was SIGABRTed by gloo: its snapshot still shows it.
    cols, stream = _columns(load_dump(dumps["size"] / "fr_pickle" / "rank_3", it).trace, it, "4")
    assert cols[-1][0] == 6 and cols[-1][1].numel() == 512
    assert stream.states[-1] == "scheduled" and stream.states[0] == "completed"
    root = dumps["root"]
    assert (root / "done_clean_3").exists() and not (root / "done_size_3").exists()


def test_real_dumps_hold_several_process_groups(dumps):
    it = Interner()
    trace = load_dump(dumps["clean"] / "fr_pickle" / "rank_0", it).trace
    assert {(s.pg, s.pg_desc) for s in trace.streams} == {("1", "clean"), ("2", "clean_pair")}
    trace3 = load_dump(dumps["clean"] / "fr_pickle" / "rank_3", it).trace
    assert {s.pg for s in trace3.streams} == {"1"}  # rank 3 is not in the [0, 1] group
    whole = load_dump(dumps["all"] / "fr_pickle" / "rank_0", it).trace
    assert {s.pg for s in whole.streams} == {"0", "1", "2", "3", "4"}
    gg = load_dump(dumps["clean"] / "gg" / "rank_0.json", it).trace
    assert gg.format == "gpuguard" and gg.world_size == 4 and {s.pg for s in gg.streams} == {"default", "pair"}


def test_unsafe_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for proto in (0, 2, 4):
        p = tmp_path / f"rank_{proto}"
        p.write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}, protocol=proto))
        with pytest.raises(DataError) as info:
            load_dump(p, Interner())
        assert "unsafe pickle refused" in str(info.value) and "system" in str(info.value)
        assert info.value.exit_code == 65
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(pickle.dumps(Interner()))


def test_every_truncation_of_a_real_pickle_is_a_clear_error(dumps, tmp_path):
    data = (dumps["clean"] / "fr_pickle" / "rank_1").read_bytes()
    p = tmp_path / "rank_1"
    for cut in range(1, len(data), 7):
        p.write_bytes(data[:cut])
        with pytest.raises(DataError) as info:
            load_dump(p, Interner())
        assert "rank_1" in str(info.value)
    p.write_bytes(data)
    assert load_dump(p, Interner()).entries > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.sampled_from([b"", b"\x80\x02", b"\x80\x04", b"{", b"[", b'  {"entries": ']))
def test_random_bytes_load_or_fail_cleanly(tmp_path, blob, head):
    p = tmp_path / "rank_0"
    p.write_bytes(head + blob)
    try:
        load_dump(p, Interner())
    except DataError as exc:
        assert exc.exit_code == 65 and str(exc).startswith(str(p))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["all_reduce", "all_gather", "broadcast"]),
            st.lists(st.integers(1, 4096), min_size=1, max_size=3),
            st.sampled_from(["Float", "BFloat16", "Long"]),
        ),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["nccl", "gloo", "xccl"]),
)
def test_pickle_and_json_round_trip_to_the_same_trace(tmp_path, program, prefix):
    entries = [
        jh.fr_entry(i + 1, op=op, sizes=(tuple(shape),), dtype=dt, prefix=prefix)
        for i, (op, shape, dt) in enumerate(program)
    ]
    doc = jh.fr_doc(entries)
    (tmp_path / "rank_2").write_bytes(pickle.dumps(doc, protocol=2))
    (tmp_path / "rank_2.json").write_text(json.dumps(doc))
    it = Interner()
    a = load_dump(tmp_path / "rank_2", it).trace
    b = load_dump(tmp_path / "rank_2.json", it).trace
    assert a.rank == b.rank == 2
    assert a.streams[0].sig_ids == b.streams[0].sig_ids and a.streams[0].seqs == list(range(1, len(program) + 1))
    assert [it.signatures[i].op for i in a.streams[0].sig_ids] == [op for op, _, _ in program]


@pytest.mark.parametrize("version", ["2.0", "2.1", "2.2", "2.3", "2.4", "2.5", "2.7", "2.10"])
def test_every_known_format_version_loads(tmp_path, version):
    entries = [jh.fr_entry(i + 1, version=version) for i in range(5)]
    entries[3] = jh.fr_entry(4, version=version, sizes=((512,),))
    for rank in range(3):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(
            pickle.dumps(
                jh.fr_doc(
                    entries if rank == 1 else [jh.fr_entry(i + 1, version=version) for i in range(5)], version=version
                ),
                protocol=2,
            )
        )
    it = Interner()
    traces = [x.trace for x in load_many(sorted(tmp_path.iterdir()), it)]
    assert all(t.version == version for t in traces)
    div = check(traces, it, world_size=3).first_divergence
    assert (div.seq, div.kind, div.ranks) == (4, "size_mismatch", (1,))


def test_p2p_is_kept_apart_coalesced_is_merged_and_states_come_from_pg_status(tmp_path):
    entries = [
        jh.fr_entry(1),
        jh.fr_entry(1, op="send 0->1", p2p=True),
        jh.fr_entry(2, op="all_reduce"),
        jh.fr_entry(2, op="all_reduce", sizes=((8,),)),
        jh.fr_entry(2, op="coalesced", sizes=()),
        jh.fr_entry(3, state="scheduled", prefix="gloo"),
    ]
    doc = jh.fr_doc(entries, gloo=True)
    doc["pg_status"] = {
        "0": {"last_enqueued_collective": "3", "last_started_collective": "-1", "last_completed_collective": "2"}
    }
    (tmp_path / "rank_0.json").write_text(json.dumps(doc))
    it = Interner()
    loaded = load_dump(tmp_path / "rank_0.json", it)
    trace = loaded.trace
    (stream,) = trace.streams
    assert trace.skipped == 0 and trace.pg_ranks == {}  # gloo's '' pg_config is ignored
    # the send is a point-to-point record for the pairing, not a collective of the stream
    ((pg, desc, gen, p2p_seq, op, src, dst, sizes, dtypes, state, _t),) = loaded.p2p
    assert (pg, desc, gen, p2p_seq, op, src, dst, sizes, dtypes) == (
        "0",
        "default_pg",
        0,
        1,
        "send",
        0,
        1,
        ((1024,),),
        ("Float",),
    )
    assert loaded.completed["0"] == 2
    assert stream.seqs == [1, 2, 3]
    assert it.signatures[stream.sig_ids[1]].op == "coalesced[all_reduce,all_reduce]"
    assert stream.states == ["completed", "completed", "scheduled"]


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"[1, 2, 3]", "top level is not a mapping"),
        (b'{"version": "2.10"}', "no 'entries' key"),
        (b'{"version": "2.10", "entries": {"a": 1}}', "'entries' is not a list"),
        (b'{"version": "2.10", "entries": [7]}', "entry 0 is int"),
        (b'{"version": "2.10", "entries": [{"profiling_name": "nccl:all_reduce"}]}', "no integer collective_seq_id"),
        (
            b'{"version": "2.10", "entries": [{"collective_seq_id": 1, "profiling_name": "nccl:all_reduce", '
            b'"process_group": ["0", "x"], "input_sizes": "big", "input_dtypes": ["Float"], "output_sizes": [[1]], '
            b'"output_dtypes": ["Float"], "state": "completed"}]}',
            "bad sizes or dtypes",
        ),
        (b'{"schema": "gpuguard.collective-trace/1", "rank": "zero", "entries": []}', "'rank' is not"),
        (
            b'{"schema": "gpuguard.collective-trace/1", "rank": 0, "generation": 0, "entries": ['
            b'{"seq": 1, "pg": "d", "op": "all_reduce"}, {"seq": 1, "pg": "d", "op": "all_reduce"}]}',
            "duplicate sequence id 1",
        ),
        (b'{"schema": "gpuguard.node/1"}', "is not a collective trace"),
        (b"", "empty file"),
        (b"hello", "neither a Flight Recorder pickle nor JSON"),
    ],
)
def test_wrong_shapes_are_clear_data_errors(tmp_path, content, needle):
    p = tmp_path / "rank_0.json"
    p.write_bytes(content)
    with pytest.raises(DataError) as info:
        load_dump(p, Interner())
    assert needle in str(info.value)


def test_rank_must_be_in_the_name(tmp_path):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(jh.fr_doc([jh.fr_entry(1)])))
    with pytest.raises(DataError, match="cannot tell the rank"):
        load_dump(p, Interner())


def test_discover_walks_directories_and_skips_non_dumps(tmp_path, dumps):
    (tmp_path / "sub").mkdir()
    for r in range(2):
        (tmp_path / "sub" / f"rank_{r}").write_bytes((dumps["clean"] / "fr_pickle" / f"rank_{r}").read_bytes())
    (tmp_path / "sub" / "done_0").write_text("ok\n")
    files, notes = discover([tmp_path])
    assert [f.name for f in files] == ["rank_0", "rank_1"]
    assert any("done_0" in n for n in notes)
    with pytest.raises(NoInputError):
        discover([tmp_path / "nope"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoInputError):
        discover([empty])


def test_process_pool_gives_the_same_traces(tmp_path):
    for rank in range(6):
        entries = [
            jh.fr_entry(
                i + 1, sizes=((i % 3 + 1,),), frames=[{"name": f"f{i % 2}", "filename": "/a.py", "line": i % 2}]
            )
            for i in range(30)
        ]
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(jh.fr_doc(entries, ranks=range(6)), protocol=2))
    files = sorted(tmp_path.iterdir())
    it1, it2 = Interner(), Interner()
    one = load_many(files, it1, jobs=1)
    two = load_many(files, it2, jobs=2)
    for a, b in zip(one, two):
        sa, sb = a.trace.streams[0], b.trace.streams[0]
        assert [it1.signatures[i] for i in sa.sig_ids] == [it2.signatures[i] for i in sb.sig_ids]
        assert [it1.sites[i] for i in sa.site_ids] == [it2.sites[i] for i in sb.site_ids]
    assert check([x.trace for x in two], it2).holds


@pytest.mark.parametrize("jobs", (1, 2))
def test_load_all_refuses_bad_files_one_line_each_and_loads_the_rest(tmp_path, jobs):
    for rank in range(4):
        doc = jh.fr_doc([jh.fr_entry(1), jh.fr_entry(2, op="send 0->1", p2p=True)], ranks=range(4))
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    (tmp_path / "rank_1").write_bytes(b"\x80\x02}q\x00")  # truncated
    (tmp_path / "rank_3").write_text('{"version": "2.10", "entries": 3}')
    loaded, refused = load_all(sorted(tmp_path.iterdir()), Interner(), jobs=jobs)
    assert sorted(x.trace.rank for x in loaded) == [0, 2]
    assert all(len(x.p2p) == 1 for x in loaded)  # p2p records survive the process pool
    assert [type(e).__name__ for e in refused] == ["DataError", "DataError"]
    assert "rank_1" in str(refused[0]) and "truncated" in str(refused[0]) and "\n" not in str(refused[0])
    assert "rank_3" in str(refused[1]) and "'entries' is not a list" in str(refused[1])
    with pytest.raises(DataError):
        load_many(sorted(tmp_path.iterdir()), Interner(), jobs=jobs)


def test_reset_epochs_are_separate_timelines(tmp_path):
    """torchft resets Flight Recorder recording per quorum: seq ids restart; epochs never mix."""
    for rank in range(3):
        old = [dict(jh.fr_entry(i + 1), reset_epoch=0) for i in range(4)]
        new = [dict(jh.fr_entry(i + 1, sizes=((8,),)), reset_epoch=1) for i in range(2)]
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(jh.fr_doc(old + new, ranks=range(3)), protocol=2))
    it = Interner()
    traces = [x.trace for x in load_many(sorted(tmp_path.iterdir()), it)]
    report = check(traces, it)
    assert report.holds
    assert sorted((t.generation, t.first_seq, t.last_seq) for t in report.timelines) == [(0, 1, 4), (1, 1, 2)]


@pytest.mark.parametrize("prefix,holds", [("nccl", False), ("gloo", True)])
def test_state_mismatch_only_from_recorders_whose_states_mean_something(tmp_path, prefix, holds):
    """NCCL's recorder knows a rank never started a collective; gloo's completes entries late."""
    for rank in range(3):
        entries = [
            jh.fr_entry(i + 1, prefix=prefix, state="scheduled" if (rank == 2 and i == 2) else "completed")
            for i in range(3)
        ]
        doc = jh.fr_doc(entries, ranks=range(3))
        doc.pop("pg_status", None)
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    it = Interner()
    report = check([x.trace for x in load_many(sorted(tmp_path.iterdir()), it)], it)
    assert report.holds is holds
    if not holds:
        d = report.first_divergence
        assert (d.kind, d.seq, d.ranks, d.majority.state, d.others[0].state) == (
            "state_mismatch",
            3,
            (2,),
            "completed",
            "scheduled",
        )
