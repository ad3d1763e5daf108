"""Records and the canonical encoding: exact round trips, one byte string per value."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.generation.canonical import canonical_bytes, parse_canonical
from gpuguard.generation.ledger import decode_certificate, encode_certificate
from gpuguard.generation.records import INLINE_SCHEMA, Certificate, Frontier, Incarnation, Member
from tests.support.generation import KEY, child, chunk_store, genesis, members


def test_canonical_is_sorted_compact_and_integral():
    assert canonical_bytes({"b": 1.0, "a": [1, 2.5]}) == b'{"a":[1,2.5],"b":1}'
    with pytest.raises(ValueError):
        canonical_bytes({"x": float("nan")})


def test_parse_canonical_refuses_non_canonical_bytes():
    assert parse_canonical(b'{"a":1}') == {"a": 1}
    for bad in (b'{"a": 1}', b'{"b":1,"a":2}', b'{"a":1.0}', b'{"a":"\\u0041"}', b'{"a":1'):
        with pytest.raises(ValueError):
            parse_canonical(bad)


def test_current_incarnation_identifies_this_process():
    import os

    a, b = Incarnation.current(), Incarnation.current()
    assert a.pid == os.getpid() and a.id != b.id and a.start_time > 0


def test_certificate_roundtrip_keeps_digest_and_has_no_float_times():
    g0 = genesis()
    g1 = child(g0, members(3), step=0, extra={"switch": "restart", "phases": {"abort_s": 0.25}})
    raw = encode_certificate(g1)
    assert b'"activation_time":"' in raw
    back = decode_certificate(raw, chunk_store(g1))
    assert back == g1 and back.digest() == g1.digest()
    assert back.extra["phases"]["abort_s"] == 0.25
    assert tuple(back.members) == tuple(g1.members) and back.admitted == g1.admitted == (0, 1, 2)


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**60), 2**60),
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(value=json_value)
def test_canonical_encoding_roundtrips(value):
    data = canonical_bytes(value)
    assert canonical_bytes(parse_canonical(data)) == data


@settings(max_examples=60, deadline=None)
@given(
    step=st.integers(0, 2**40),
    ranks=st.integers(0, 5),
    host=st.text(min_size=1, max_size=10),
    t=st.floats(0, 4e9, allow_nan=False),
    seq=st.dictionaries(st.text(max_size=5), st.integers(0, 2**40), max_size=3),
    extra=st.dictionaries(st.text(max_size=5), json_value, max_size=3),
)
def test_certificate_roundtrip_property(step, ranks, host, t, seq, extra):
    mem = tuple(Member(r, Incarnation(f"id{r}", host, r + 1, t, None)) for r in range(ranks))
    cert = Certificate(
        "job",
        1,
        0,
        "ab" * 32,
        mem,
        "scale-up",
        Frontier(step, "d", seq),
        "proved",
        ("e",),
        False,
        3,
        t,
        "me",
        extra,
        "sig",
        tuple(range(ranks)),
    )
    back = Certificate.from_dict(parse_canonical(cert.canonical()), load=chunk_store(cert))
    assert back.canonical() == cert.canonical()
    assert tuple(back.members) == mem and dict(back.extra) == dict(cert.extra) and back.admitted == cert.admitted
    inline = replace(cert, schema=INLINE_SCHEMA)  # the old form: everything inline, no chunk to read
    assert Certificate.from_dict(parse_canonical(inline.canonical())).canonical() == inline.canonical()


def test_from_dict_refuses_wrong_types_and_unknown_fields():
    d = replace(child(genesis(), members(1)), schema=INLINE_SCHEMA).to_dict()
    for mutate in (
        lambda x: x.update(generation="1"),
        lambda x: x.update(bogus=1),
        lambda x: x.update(schema="other/1"),
        lambda x: x["members"][0].update(rank=True),
        lambda x: x.update(activation_time=1.5),
    ):
        bad = {**d, "members": [dict(m, incarnation=dict(m["incarnation"])) for m in d["members"]]}
        mutate(bad)
        with pytest.raises(ValueError):
            Certificate.from_dict(bad)
    assert KEY


@settings(max_examples=300, deadline=None)
@given(value=json_value, spaced=st.booleans(), unsorted=st.booleans())
def test_parse_canonical_accepts_exactly_the_canonical_bytes(value, spaced, unsorted):
    """Whatever way a value is written, it parses only when written exactly as `canonical_bytes` does."""
    import json

    text = json.dumps(
        value, sort_keys=not unsorted, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=False
    ).encode()
    try:
        back = parse_canonical(text)
    except ValueError:
        assert text != canonical_bytes(value)
    else:
        assert text == canonical_bytes(value) == canonical_bytes(back)


class _Pid(int):
    """An int subclass: the checked path takes it as an int, the one-step path must not skip it."""


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.builds(_Pid, st.integers(0, 99)),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.sampled_from(["1.5", "1700000000.25", "nan", "x"]),
)


_well_formed = {"id": st.text(max_size=6), "host": st.text(max_size=6), "pid": st.integers(0, 10**6)}


@st.composite
def _incarnation_dicts(draw):
    """A well-formed incarnation dict with one field or the key set changed (or none)."""
    d = {k: draw(v) for k, v in _well_formed.items()}
    d["start_time"] = draw(st.sampled_from(["1.5", "1700000000.25"]))
    d["gpu_uuid"] = draw(st.one_of(st.none(), st.text(max_size=4)))
    change = draw(st.sampled_from(["none", "value", "drop", "add"]))
    if change == "value":
        d[draw(st.sampled_from(sorted(d)))] = draw(_values)
    elif change == "drop":
        del d[draw(st.sampled_from(sorted(d)))]
    elif change == "add":
        d["extra"] = 1
    return d


@settings(max_examples=400)
@given(_incarnation_dicts())
def test_incarnation_from_dict_takes_the_one_step_path_only_where_the_checks_agree(d):
    """Incarnation.from_dict's one-step path (100,000 hellos at a restart) accepts and builds
    exactly what the field-by-field checks do; every other dict is refused by those checks."""

    def outcome(parse):
        try:
            return parse(d)
        except (ValueError, TypeError) as exc:
            return type(exc)

    got, want = outcome(Incarnation.from_dict), outcome(Incarnation.checked_from_dict)
    assert got == want or (
        isinstance(got, Incarnation) and isinstance(want, Incarnation) and got.to_dict() == want.to_dict()
    )
