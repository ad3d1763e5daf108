"""The fast scanner's prefilter: it searches substrings of the markers (rarer fingerprints), so it finds
more records than the markers do; the parser drops the extra ones. The events must be exactly those of
the reference paths (the plain marker finder and the line parser) on any input."""

from __future__ import annotations

import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors import logscan
from gpuguard.collectors.logparse import MARKERS, RULES, has_marker, iter_events, parse_line
from gpuguard.collectors.logscan import PREFILTER, LogScan, prefilter
from tests.support.cli import REAL_LOGS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REAL_LINES = [
    line
    for path in sorted(REAL_LOGS.glob("*.log"))
    for line in path.read_text("utf-8", "replace").splitlines()
    if parse_line(line, 1) is not None
]
# Text that holds a prefilter pattern but (mostly) no marker: the records only the prefilter finds.
DECOYS = [f"x {p} y" for p in PREFILTER] + [p for p in PREFILTER] + [m[:-1] for m in MARKERS] + [m[1:] for m in MARKERS]
noise = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x85\u2028\u2029"), max_size=120)


def _events(data: bytes, chunk: int, accelerated: bool) -> list[dict]:
    return [e.to_json() for e in LogScan(io.BytesIO(data), chunk_size=chunk, accelerated=accelerated)]


def test_every_marker_holds_a_prefilter_pattern():
    patterns = logscan.PREFILTER_BYTES
    assert all(any(p in m.encode() for p in patterns) for m in MARKERS)
    assert all(any(p in m for m in MARKERS) for p in PREFILTER), "a pattern outside every marker only costs time"
    assert len(patterns) < len(MARKERS) and len(patterns) <= 64


def test_a_marker_no_pattern_covers_is_searched_as_it_is():
    assert prefilter(("NVRM: Xid", "brand new marker"), ("NVRM: ", "unused")) == [b"NVRM: ", b"brand new marker"]


def test_the_decoys_reach_the_parser_and_give_nothing_on_their_own():
    finder = logscan.bytes_finder(logscan.PREFILTER_BYTES)
    for decoy in DECOYS[: 2 * len(PREFILTER)]:
        data = bytearray(decoy.encode())
        assert finder(data, 0, len(data)), decoy
        if not has_marker(decoy):
            assert _events(bytes(data) + b"\n", 64, True) == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from(REAL_LINES) | st.sampled_from(DECOYS) | noise,
            noise,
            st.sampled_from(["\n", "\n", "\r", "\r\n"]),
        ),
        max_size=50,
    ),
    st.integers(min_value=1, max_value=2048),
)
@SETTINGS
def test_prefilter_path_equals_marker_path_and_line_parser(parts, chunk):
    data = "".join(a + " " + b + sep for a, b, sep in parts).encode("utf-8", "surrogatepass")
    fast = _events(data, chunk, accelerated=True)
    assert fast == _events(data, chunk, accelerated=False)
    assert fast == [e.to_json() for e in iter_events(io.BytesIO(data))]


@given(st.binary(max_size=3000), st.integers(min_value=1, max_value=512))
@SETTINGS
def test_random_bytes_give_the_same_events_on_both_paths(data, chunk):
    assert _events(data, chunk, True) == _events(data, chunk, False)


def test_rule_dispatch_matches_the_marker_test_of_every_rule():
    from gpuguard.collectors.logparse import _rules_of

    for text in REAL_LINES + DECOYS:
        assert _rules_of(text) == tuple(r for r in RULES if any(m in text for m in r.markers)), text
