"""Unpickling a Flight Recorder dump is bounded in time and memory.

A pickle's memo lets a tiny file name one object many times: a list holding the same list twice,
nested 60 levels, is under 2 KB on disk and 2**60 elements to `repr`, `==` or `hash`. The reader
measures the loaded object by id (linear in the file) and refuses it with one line (exit 65); it
never builds a repr of a loaded object for an error message.
"""

from __future__ import annotations

import pickle
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.flight_recorder import MAX_BYTES, load_dump
from gpuguard.foundation.errors import DataError
from gpuguard.foundation.traces import Interner
from gpuguard.foundation.unpickle import MAX_NODES, Unbounded, check_bounded


def _dag(levels: int, leaf: object = 1) -> list:
    x: list = [leaf]
    for _ in range(levels):
        x = [x, x]
    return x


def _entry(**over: object) -> dict:
    e = {
        "collective_seq_id": 1,
        "process_group": ("0", "default_pg"),
        "profiling_name": "nccl:all_reduce",
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "output_dtypes": ["Float"],
        "state": "completed",
        "frames": [],
    }
    e.update(over)
    return e


PLACES = {
    "top": lambda d: d,
    "entries": lambda d: {"version": "2.10", "entries": d},
    "state": lambda d: {"version": "2.10", "entries": [_entry(state=d)]},
    "process_group": lambda d: {"version": "2.10", "entries": [_entry(process_group=[d, "x"])]},
    "frames": lambda d: {"version": "2.10", "entries": [_entry(frames=[{"filename": d, "line": 1, "name": "f"}])]},
    "sizes": lambda d: {"version": "2.10", "entries": [_entry(input_sizes=d)]},
    "pg_status": lambda d: {"version": "2.10", "entries": [_entry()], "pg_status": {"0": d}},
    "pg_config": lambda d: {"version": "2.10", "entries": [_entry()], "pg_config": {"0": {"ranks": d}}},
}


@pytest.mark.parametrize("place", sorted(PLACES))
def test_a_60_level_shared_reference_dag_is_refused_at_once(tmp_path, place):
    data = pickle.dumps(PLACES[place](_dag(60)), protocol=4)
    assert len(data) < 2000
    path = tmp_path / "rank_0"
    path.write_bytes(data)
    start = time.monotonic()
    with pytest.raises(DataError, match="unfolds into more than") as info:
        load_dump(path, Interner())
    assert time.monotonic() - start < 1.0
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 300


def test_cycles_and_deep_nesting_are_refused(tmp_path):
    cyclic: list = []
    cyclic.append(cyclic)
    deep: list = [1]
    for _ in range(200):
        deep = [deep]
    for doc, why in ((cyclic, "cycle"), (deep, "deeper than")):
        path = tmp_path / "rank_0"
        path.write_bytes(pickle.dumps({"version": "2.10", "entries": [_entry(state=doc)]}))
        with pytest.raises(DataError, match=why):
            load_dump(path, Interner())


def test_the_walk_is_linear_in_distinct_objects():
    assert check_bounded({"a": [1, 2, (3, 4)], "b": "x"}) == 10
    shared = [list(range(100))] * 1000  # one list, named 1000 times: 101 unfolded, 1000 times
    assert check_bounded(shared) == 1 + 1000 * 101
    with pytest.raises(Unbounded):
        check_bounded(_dag(30), max_nodes=MAX_NODES)


def test_an_oversize_dump_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "rank_0"
    with open(path, "wb") as fh:
        fh.truncate(MAX_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(DataError, match="too large"):
        load_dump(path, Interner())


# Random shared-reference pickles: nodes built from earlier nodes, each named one or more times.
_node_specs = st.lists(
    st.tuples(
        st.sampled_from(["list", "tuple", "dict", "set"]),
        st.lists(st.integers(min_value=0, max_value=10_000), min_size=0, max_size=4),
    ),
    min_size=1,
    max_size=70,
)


def _build(specs: list[tuple[str, list[int]]]) -> object:
    nodes: list[object] = ["leaf", 7, None]
    for kind, refs in specs:
        kids = [nodes[r % len(nodes)] for r in refs]
        if kind == "list":
            nodes.append(kids)
        elif kind == "tuple":
            nodes.append(tuple(kids))
        elif kind == "dict":
            nodes.append({f"k{i}": v for i, v in enumerate(kids)})
        else:
            nodes.append({k for k in kids if isinstance(k, (str, int))})
    return nodes[-1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=_node_specs, place=st.sampled_from(sorted(PLACES)), protocol=st.sampled_from([2, 4, 5]))
def test_random_dag_pickles_return_or_raise_one_line_within_a_time_bound(tmp_path, specs, place, protocol):
    data = pickle.dumps(PLACES[place](_build(specs)), protocol=protocol)
    path = tmp_path / "rank_0"
    path.write_bytes(data)
    start = time.monotonic()
    try:
        load_dump(path, Interner())
    except DataError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 500
    assert time.monotonic() - start < 5.0
