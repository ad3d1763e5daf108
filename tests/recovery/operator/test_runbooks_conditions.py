"""The runbook condition language: a tiny parser, never eval; garbage is always one ConditionError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.recovery.operator.conditions import ConditionError, evaluate, parse, references

RESULTS = {
    "diagnose": {"verdict": "dead", "generation": 3, "outcome": "done", "exit_code": 2},
    "abort": {"outcome": "done", "exit_code": 0},
}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("diagnose.verdict == dead", True),
        ("diagnose.verdict == 'dead'", True),
        ("diagnose.verdict != dead", False),
        ("diagnose.verdict in [dead, hung]", True),
        ("diagnose.verdict not in [dead, hung]", False),
        ("diagnose.generation >= 3 and abort.outcome == done", True),
        ("diagnose.generation > 3 or not abort.exit_code == 0", False),
        ("(diagnose.verdict == healthy or diagnose.exit_code == 2) and abort.outcome == done", True),
        ("restore.outcome == done", False),  # a step that never ran reads as null
        ("restore.outcome == null", True),
        ("diagnose.verdict < 3", False),  # ordering between non-numbers is simply false
        ("abort.exit_code", False),
        ("diagnose.exit_code == '2'", True),
    ],
)
def test_evaluation(text, expected):
    assert evaluate(parse(text), RESULTS) is expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "diagnose.verdict ==",
        "== dead",
        "a.b == (c",
        "a.b in [c",
        "x.y $ z",
        "a.b == c d",
        "__import__('os').system('x')",
        "[a.b,",
        "not",
        "a.b.c == d",
    ],
)
def test_malformed_conditions_raise_one_clear_error(text):
    with pytest.raises(ConditionError):
        parse(text)


def test_references():
    assert references(parse("diagnose.verdict == dead or abort.outcome in [done, restore.outcome]")) == {
        "diagnose",
        "abort",
        "restore",
    }


def test_deep_nesting_is_refused():
    with pytest.raises(ConditionError):
        parse("(" * 200 + "a.b" + ")" * 200)
    with pytest.raises(ConditionError):
        parse("not " * 300 + "a.b")


@settings(max_examples=400)
@given(
    st.one_of(
        st.text(max_size=80),
        st.lists(
            st.sampled_from(
                [
                    "a.b",
                    "==",
                    "!=",
                    "in",
                    "not",
                    "and",
                    "or",
                    "(",
                    ")",
                    "[",
                    "]",
                    ",",
                    "'x'",
                    "3",
                    "dead",
                    "<",
                    ">=",
                    "true",
                    "null",
                ]
            ),
            max_size=14,
        ).map(" ".join),
    )
)
def test_garbage_never_crashes(text):
    try:
        tree = parse(text)
    except ConditionError as exc:
        assert str(exc)
        return
    assert evaluate(tree, RESULTS) in (True, False)
