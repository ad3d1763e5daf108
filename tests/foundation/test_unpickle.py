"""The restricted unpickler's bound: shared-reference DAGs, cycles and deep nesting are refused
(`Unbounded`, a `Refused`) right after the C load, real dump shapes load unchanged, and a random
DAG is refused exactly when its unfolded tree passes the node budget or the depth limit."""

from __future__ import annotations

import io
import pickle
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.foundation import unpickle
from gpuguard.foundation.unpickle import (
    MAX_DEPTH,
    RestrictedUnpickler,
    Unbounded,
    brief,
    check_bounded,
    node_budget,
    restricted_loads,
)
from tests.support.cli import run_cli


def _list_dag(levels: int) -> list[Any]:
    x: list[Any] = []
    for _ in range(levels):
        x = [x, x]
    return x


def _tuple_dag(levels: int) -> tuple[Any, ...]:
    t: tuple[Any, ...] = ()
    for _ in range(levels):
        t = (t, t)
    return t


def _dict_dag(levels: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(levels):
        d = {"a": d, "b": d}
    return d


ATTACKS = {
    "list": lambda: _list_dag(60),
    "tuple": lambda: _tuple_dag(60),
    "dict values": lambda: _dict_dag(60),
    "list in a tuple in a dict value": lambda: {"k": (_list_dag(60), 1)},
    "inside an FR entry": lambda: {"version": "2.10", "entries": [{"frames": _list_dag(60), "state": "completed"}]},
    "as the version": lambda: {"version": _list_dag(60), "entries": []},
}


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("shape", sorted(ATTACKS))
def test_shared_reference_dags_under_2kb_are_refused(shape: str, protocol: int) -> None:
    data = pickle.dumps(ATTACKS[shape](), protocol=protocol)
    assert len(data) < 2048 or protocol == 0
    with pytest.raises(Unbounded, match="shared references"):
        restricted_loads(data, what="a Flight Recorder dump")
    with pytest.raises(unpickle.Refused):  # callers that catch Refused refuse it too (65)
        RestrictedUnpickler(io.BufferedReader(io.BytesIO(data))).load()


def test_hand_built_memoize_get_opcodes_are_refused() -> None:
    """The attack as an attacker writes it: EMPTY_LIST MEMOIZE, then each level GETs the previous twice."""
    out = bytearray(b"\x80\x04]\x94")  # PROTO 4, EMPTY_LIST, MEMOIZE (memo 0)
    for i in range(60):
        get = b"j" + i.to_bytes(4, "little")  # LONG_BINGET i
        out += b"(" + get + get + b"l\x94"  # MARK, GET, GET, LIST, MEMOIZE (memo i + 1)
    out += b"."
    assert len(out) < 2048
    with pytest.raises(Unbounded, match="more than 1,000,000 objects"):
        restricted_loads(bytes(out))


def test_cycles_and_deep_nesting_are_refused() -> None:
    a: list[Any] = []
    a.append(a)
    d: dict[str, Any] = {}
    d["self"] = d
    for obj in (a, d, [[a]]):
        with pytest.raises(Unbounded, match="reference cycle"):
            restricted_loads(pickle.dumps(obj, protocol=2))
    deep: list[Any] = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep, 1]
    with pytest.raises(Unbounded, match=f"deeper than {MAX_DEPTH} levels"):
        restricted_loads(pickle.dumps(deep, protocol=2))
    ok: list[Any] = []
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    assert restricted_loads(pickle.dumps(ok, protocol=2)) == ok


def test_refusal_is_fast_and_message_is_one_line() -> None:
    data = pickle.dumps(_list_dag(60), protocol=2)
    t0 = time.perf_counter()
    with pytest.raises(Unbounded) as info:
        restricted_loads(data, what="a Flight Recorder dump")
    assert time.perf_counter() - t0 < 5  # a deadline against a hang, not a speed assertion
    assert "\n" not in str(info.value) and str(info.value).startswith("a Flight Recorder dump unfolds")


def test_real_dump_shape_loads_unchanged() -> None:
    """2,000 entries with frame dicts shared like the C++ writer's: below the budget by far."""
    frames = [{"name": f"f{i}", "filename": "/job/train.py", "line": i} for i in range(12)]
    pg = ("0", "default_pg")
    entries = [
        {
            "collective_seq_id": i,
            "process_group": pg,
            "profiling_name": "nccl:all_reduce",
            "input_sizes": [[1024]],
            "input_dtypes": ["BFloat16"],
            "frames": [frames[i % 12], frames[(i + 1) % 12], frames[(i + 2) % 12]],
            "state": "completed",
        }
        for i in range(2000)
    ]
    doc = {"version": "2.10", "pg_config": {"0": {"ranks": str(list(range(1024)))}}, "entries": entries}
    data = pickle.dumps(doc, protocol=2)
    assert restricted_loads(data) == doc
    with io.BufferedReader(io.BytesIO(data)) as fh:
        assert RestrictedUnpickler(fh).load() == doc
    assert check_bounded(doc) < node_budget(len(data)) // 50


def test_admitted_classes_are_walked_but_types_are_not() -> None:
    """With classes admitted, their instances' attributes are walked (a DAG hidden there is refused)
    and the class objects themselves are leaves (never a walk into the type system)."""
    resolve = unpickle.admit({(Box.__module__, "Box"): Box})
    ok = restricted_loads(pickle.dumps(Box([1, 2]), protocol=2), resolve)
    assert isinstance(ok, Box) and ok.v == [1, 2]
    with pytest.raises(Unbounded, match="shared references"):
        restricted_loads(pickle.dumps(Box(_list_dag(60)), protocol=2), resolve)


class Box:
    def __init__(self, v: Any) -> None:
        self.v = v


def test_brief_never_builds_a_repr() -> None:
    dag = _list_dag(60)
    t0 = time.perf_counter()
    assert brief(dag) == "a list" and brief({"k": _tuple_dag(60)}) == "a dict"
    assert time.perf_counter() - t0 < 1
    assert brief("x" * 100) == repr("x" * 60 + "...") and brief(7) == "7" and brief(None) == "None"
    assert brief(1 << 200) == "a huge integer" and brief(1.5) == "1.5"


def test_refused_global_message_is_capped() -> None:
    data = b"\x80\x04\x8c\x04evil\x94\x8c" + bytes([200]) + b"x" * 200 + b"\x94\x93."
    with pytest.raises(unpickle.Refused) as info:
        restricted_loads(data)
    assert len(str(info.value)) < 200


# -- properties ------------------------------------------------------------------------------------

KINDS = ("list", "tuple", "dict", "tkeys", "set")


@st.composite
def dags(draw: st.DrawFn) -> list[Any]:
    """Nodes built bottom-up; node i's children are drawn from scalars and nodes < i (any sharing)."""
    n = draw(st.integers(1, 25))
    nodes: list[Any] = []
    for i in range(n):
        kind = draw(st.sampled_from(KINDS))
        k = draw(st.integers(0, 4))
        kids = [
            draw(st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none()))
            if not nodes or draw(st.booleans())
            else nodes[draw(st.integers(0, len(nodes) - 1))]
            for _ in range(k)
        ]
        if kind == "list":
            nodes.append(list(kids))
        elif kind == "tuple" or kind == "set":
            t = tuple(kids)
            flat = all(type(c) in (int, str, type(None)) for c in kids)  # never hash a shared tuple DAG
            nodes.append(frozenset({t, i}) if kind == "set" and flat else t)
        elif kind == "dict":
            nodes.append({f"k{j}": v for j, v in enumerate(kids)})
        else:  # tuple keys: keys are walked too
            nodes.append({(j, str(i)): v for j, v in enumerate(kids)})
    return nodes


def _children(x: Any) -> list[Any]:
    if type(x) in (list, tuple, set, frozenset):
        return list(x)
    if type(x) is dict:
        if all(type(k) is str for k in x):
            return list(x.values())  # what the interpreter's dict traversal visits for str keys
        return [*x.keys(), *x.values()]
    return []


def _unfolded(x: Any, memo: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nodes of the unfolded tree, its height), exactly, memoized by id (Python ints: no overflow)."""
    got = memo.get(id(x))
    if got is None:
        sub = [_unfolded(c, memo) for c in _children(x)]
        got = (1 + sum(s for s, _ in sub), 1 + max((h for _, h in sub), default=-1))
        memo[id(x)] = got
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(1, 400), st.integers(0, 12), st.sampled_from([0, 2, 4, 5]))
def test_random_dag_refused_exactly_when_over_budget(nodes: list[Any], budget: int, depth: int, proto: int) -> None:
    root = nodes[-1]
    size, height = _unfolded(root, {})
    data = pickle.dumps(root, protocol=proto)
    loaded = pickle.loads(data)  # sharing survives the pickle: the loaded object unfolds the same
    over = size > budget or height > depth
    try:
        got = check_bounded(loaded, max_nodes=budget, max_depth=depth)
    except Unbounded:
        assert over
    else:
        assert not over and got == size
    if size <= 10_000:  # loads through the restricted unpickler unchanged (protocol 5: sets are opcodes)
        assert restricted_loads(pickle.dumps(root, protocol=5)) == root


@settings(max_examples=200, deadline=None)
@given(dags(), st.data())
def test_random_cycle_is_always_refused(nodes: list[Any], data: st.DataObject) -> None:
    holder: list[Any] = [nodes[-1]]
    lists = [x for x in _reachable(holder) if type(x) is list]  # holder is one of them
    target = data.draw(st.sampled_from(lists))
    target.append(holder)  # a back edge: holder -> ... -> target -> holder
    with pytest.raises(Unbounded):
        restricted_loads(pickle.dumps(holder, protocol=5))


def _reachable(root: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    todo = [root]
    while todo:
        x = todo.pop()
        if id(x) not in seen:
            seen[id(x)] = x
            todo.extend(_children(x))
    return list(seen.values())


# -- end to end ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["inside an FR entry", "as the version", "list"])
def test_gpu_doctor_contract_refuses_a_dag_dump_with_one_line(tmp_path: Any, shape: str) -> None:
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "rank_0").write_bytes(pickle.dumps(ATTACKS[shape](), protocol=2))
    t0 = time.monotonic()
    r = run_cli("gpu-doctor", "contract", str(d), timeout=60)
    assert time.monotonic() - t0 < 60
    assert r.returncode == 65, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "shared references" in r.stderr
    assert "Traceback" not in r.stderr
