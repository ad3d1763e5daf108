"""The compact step columns (foundation/step_columns.py) and the decoder that fills them hold exactly what
the tuples of objects held: properties against the straightforward computation, on hostile lines too."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import gpuguard.foundation.steplog as steplog
from gpuguard.collectors.step_records import _summarised
from gpuguard.diagnostics.jobstats import observe
from gpuguard.foundation import observations as ob
from gpuguard.foundation.observations import Phase, StepSample
from gpuguard.foundation.step_columns import CollectiveEntries, StepSamples, computes_of, periods_of
from gpuguard.foundation.step_summary import QuantileSketch, StepSummary

BIG = st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**30])
INTS = st.one_of(st.integers(min_value=-5, max_value=300), BIG)
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.floats(min_value=0, max_value=1e4))
SAMPLES = st.builds(StepSample, INTS, FLOATS, FLOATS, FLOATS, FLOATS, INTS, st.one_of(st.none(), FLOATS, st.just(0.0)))
ENTRIES = st.tuples(INTS, FLOATS, FLOATS, st.one_of(st.just(-1.0), FLOATS))


@given(st.lists(SAMPLES, max_size=30), st.integers(-40, 40), st.integers(-40, 40))
def test_step_samples_are_the_tuple_they_replace(samples: list[StepSample], a: int, b: int) -> None:
    ref, cols = tuple(samples), StepSamples(samples)
    assert cols == ref and ref == cols and len(cols) == len(ref) and tuple(cols) == ref
    assert bool(cols) == bool(ref) and hash(cols) == hash(ref) and cols != list(ref)
    assert cols[a:b] == ref[a:b] and cols[a:] == ref[a:] and cols[::2] == ref[::2]
    for i in (a, b):
        assert (cols[i] if -len(ref) <= i < len(ref) else None) == (ref[i] if -len(ref) <= i < len(ref) else None)
    assert computes_of(cols) == computes_of(ref) == [s.compute_s for s in ref]
    assert periods_of(cols) == periods_of(ref) == [s.interval_s for s in ref if s.interval_s]
    assert periods_of(cols[a:b]) == periods_of(ref[a:b]) and computes_of(cols[a:]) == computes_of(ref[a:])


@given(st.lists(ENTRIES, max_size=30), st.integers(-40, 40), st.integers(-40, 40))
def test_collective_entries_are_the_tuple_they_replace(
    entries: list[tuple[int, float, float, float]], a: int, b: int
) -> None:
    cols, ref = CollectiveEntries(entries), tuple(entries)
    assert cols == ref and tuple(cols) == ref and cols[a:b] == ref[a:b] and hash(cols) == hash(ref)
    times, straight = cols.times(), tuple((s, w, wait) for s, w, _, wait in ref)
    assert times == straight and times[a:b] == straight[a:b] and times[a:b][a:b] == straight[a:b][a:b]
    assert tuple(cols[a:b].times()) == straight[a:b]


def test_a_nan_period_is_refused_rather_than_read_back_as_none() -> None:
    try:
        StepSamples([StepSample(1, 0.0, 0.0, 0.0, 0.0, 0, float("nan"))])
    except ValueError:
        return
    raise AssertionError("a NaN period was stored")


# -- the decoder against a straightforward fold over tuples and Phase objects -------------------------
def reference_decode(lines: Sequence[str], max_steps: int, max_entries: int) -> dict[str, Any]:
    """The decoder as it was before the columns: every record an object, the phase rebuilt per record."""
    got: dict[str, Any] = {"header": {}, "steps": [], "entries": [], "errors": [], "bad": 0, "jumps": 0}
    phase, last_seq, prev, prev_end, last = Phase(ob.STARTING), -1, None, None, (0.0, 0.0)

    def num(tok: str) -> float:
        v = float(tok)
        if v - v != 0:  # inf - inf and nan - nan are nan
            raise ValueError(tok)
        return v

    for line in lines:
        if not line:
            continue
        try:
            if line[0] == "H":
                h = json.loads(line[2:])
                if not isinstance(h, dict):
                    raise ValueError
                if not got["header"]:
                    got["header"] = h
                elif isinstance(h.get("generation"), int):
                    got["header"] = {**got["header"], "generation": h["generation"]}
                when = (num(str(h.get("wall", 0))), num(str(h.get("mono", 0))))
                if phase.kind in (ob.STARTING, ob.CLOSED):
                    phase = Phase(ob.STARTING, since_wall=when[0], since_mono=when[1])
            else:
                t = line[2:].split(" ")
                arity = {"S": 3, "C": 6, "X": 4, "E": 6, "B": 2, "Z": 2}.get(line[0], 2)
                if line[0] not in "SCXEBFZ" or (len(t) != arity if line[0] != "F" else len(t) < 2):
                    raise ValueError
                at = {"S": 1, "C": 2}.get(line[0], 1 if line[0] in "XE" else 0)
                when = (num(t[at]), num(t[at + 1]))
                if line[0] == "S":
                    phase = Phase(ob.COMPUTING, step=int(t[0]), seq=last_seq, since_wall=when[0], since_mono=when[1])
                elif line[0] == "C":
                    seq, step, nb = int(t[0]), int(t[1]), int(t[4])
                    phase = Phase(ob.COLLECTIVE, step, seq, t[5], nb, when[0], when[1])
                    got["entries"].append((seq, *when, -1.0))  # unbounded here: only the last ones count
                elif line[0] == "X":
                    seq, waited = int(t[0]), num(t[3])
                    e = got["entries"]
                    if e and e[-1][0] == seq and e[-1][3] < 0:
                        e[-1] = (*e[-1][:3], max(0.0, waited))
                    last_seq = max(last_seq, seq)
                    phase = Phase(ob.COMPUTING, step=phase.step, seq=last_seq, since_wall=when[0], since_mono=when[1])
                elif line[0] == "E":
                    step, comp, wait, nb = int(t[0]), num(t[3]), num(t[4]), int(t[5])
                    if min(comp, wait) < 0:
                        raise ValueError
                    interval = when[1] - prev_end if prev_end is not None and when[1] > prev_end else None
                    got["steps"].append(StepSample(step, when[0], when[1], comp, wait, nb, interval))
                    prev_end = when[1]
                    phase = Phase(ob.BETWEEN, step=step, seq=last_seq, since_wall=when[0], since_mono=when[1])
                elif line[0] == "F":
                    got["errors"] = (got["errors"] + [" ".join(t[2:])])[-steplog.MAX_ERRORS :]
                elif line[0] == "Z":
                    phase = Phase(ob.CLOSED, step=phase.step, seq=last_seq, since_wall=when[0], since_mono=when[1])
                if prev is not None and abs((when[0] - prev[0]) - (when[1] - prev[1])) > steplog.CLOCK_JUMP_S:
                    got["jumps"] += 1
                prev = last = when  # a header is no record of progress
        except (ValueError, IndexError, TypeError, OverflowError):
            got["bad"] += 1
    got.update(phase=phase, last=last, steps=tuple(got["steps"][-max_steps:]))
    got["entries"] = tuple(got["entries"][-max_entries:])
    return got


_TOKENS = st.one_of(
    st.integers(-3, 400).map(str),
    BIG.map(str),
    st.floats(min_value=-10, max_value=1e5, allow_nan=False).map(lambda v: f"{v:.6f}"),
    st.sampled_from(["nan", "inf", "-inf", "", "x", "1_0", "1e999", "all_reduce", "+7"]),
)
_HEADERS = st.fixed_dictionaries(
    {"v": st.just(1), "host": st.sampled_from(["h0", "h1"]), "pid": st.integers(0, 9)},
    optional={
        "generation": st.one_of(st.integers(0, 3), st.just("2")),
        "wall": st.one_of(st.floats(0, 1e4), st.just("nan"), st.just(True)),
        "mono": st.floats(0, 1e4),
        "world_size": st.integers(0, 9),
    },
).map(lambda h: "H " + json.dumps(h))
_ARITY = {"S": 3, "C": 6, "X": 4, "E": 6, "B": 2, "F": 3, "Z": 2, "Q": 2}
LINES = st.lists(
    st.one_of(
        _HEADERS,
        st.sampled_from(sorted(_ARITY)).flatmap(
            lambda k: st.lists(_TOKENS, min_size=_ARITY[k] - 1, max_size=_ARITY[k] + 1).map(lambda t: " ".join([k, *t]))
        ),
        st.sampled_from(["", "S", "E 1", "H [1]", "H {"]),
    ),
    max_size=60,
)


@contextmanager
def entries_bound(n: int) -> Iterator[None]:
    was = steplog.MAX_ENTRIES
    steplog.MAX_ENTRIES = n
    try:
        yield
    finally:
        steplog.MAX_ENTRIES = was


@settings(max_examples=300, deadline=None)
@given(LINES, st.integers(1, 6), st.integers(1, 4))
def test_the_decoder_keeps_what_the_straightforward_fold_keeps(lines: list[str], max_steps: int, bound: int) -> None:
    with entries_bound(bound):
        got = steplog.decode_lines(lines, rank=1, incarnation="inc", max_steps=max_steps)
    ref = reference_decode(lines, max_steps, bound)
    assert (got.steps, got.entries, got.phase) == (ref["steps"], ref["entries"], ref["phase"])
    assert tuple(got.steps) == ref["steps"] and tuple(got.entries) == ref["entries"]
    assert (got.bad_lines, got.clock_jumps, got.errors) == (ref["bad"], ref["jumps"], tuple(ref["errors"]))
    starting = ref["phase"].kind == ob.STARTING
    assert got.last_wall == (ref["last"][0] or (ref["phase"].since_wall if starting else 0.0))
    assert got.last_mono == (ref["last"][1] or (ref["phase"].since_mono if starting else 0.0))
    assert got.host == str(ref["header"].get("host", ""))

    # what the vote reads of it: the same observation as from plain tuples, the same summary
    plain = replace(got, steps=tuple(got.steps), entries=tuple(got.entries))
    assert observe(got, now_wall=1e4) == observe(plain, now_wall=1e4)
    summary, straight = _summarised(got, 3, 2)["summary"], StepSummary()
    for s in tuple(got.steps)[-3:]:
        straight.add(s.interval_s, s.compute_s)
    assert summary is not None and state(summary.periods) == state(straight.periods)
    assert state(summary.computes) == state(straight.computes)


def state(s: QuantileSketch) -> tuple[Any, ...]:
    """Everything a sketch answers with, and what it holds."""
    return (s.n, s.exact, list(s.ordered()), s.nbytes())


VALUES = st.lists(st.one_of(st.floats(-1, 1e9, allow_nan=False), st.just(0.0), st.floats(1e-300, 1e-290)), max_size=120)


@given(VALUES, VALUES, st.integers(1, 80))
def test_extend_is_add_after_add(first: list[float], more: list[float], cap: int) -> None:
    one, bulk = QuantileSketch(cap), QuantileSketch(cap)
    for v in first + more:
        one.add(v)
    bulk.extend(first)
    bulk.extend(iter(more))
    assert state(one) == state(bulk) and one._sorted == bulk._sorted and sorted(one._top) == sorted(bulk._top)
    assert (one._zeros, one._offset, list(one._counts)) == (bulk._zeros, bulk._offset, list(bulk._counts))
