"""The in-place report format: the sharded `chunks` field round-trips, and a malformed one is refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.inplace_files import Report, read_reports, write_report

sizes = st.lists(st.integers(0, 50), min_size=0, max_size=3)
entry = sizes.flatmap(
    lambda shape: st.tuples(
        st.sampled_from(["torch.float32", "torch.int64"]),
        st.just(shape),
        st.just(shape),
        st.text("0123456789abcdef", min_size=16, max_size=16),
    )
)
chunks = st.dictionaries(
    st.integers(0, 1000),
    st.dictionaries(st.from_regex(r"[a-z.0-9]{1,12}@[0-9,]{0,6}", fullmatch=True), entry.map(list), max_size=4),
    max_size=3,
)


def _report(ch) -> Report:
    return Report(2, 1, "inc", 123, "host", 7, {7: "d"}, "boom", 1.5, ch)


@settings(max_examples=60, deadline=None)
@given(chunks)
def test_a_report_with_chunks_round_trips(ch):
    rep = _report(ch)
    back = Report.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert back == rep


def test_a_replicated_report_has_no_chunks_field(tmp_path):
    doc = _report({}).to_dict()
    assert "chunks" not in doc and Report.from_dict(doc).chunks == {}


@pytest.mark.parametrize(
    "bad",
    [
        {"4": {"w@0": ["torch.float32", [4], [4]]}},  # 3 fields
        {"4": {"w@0": ["torch.float32", [4], [4], "xyz"]}},  # not 16 hex digits
        {"4": {"w@0": ["torch.float32", [4], [4, 1], "0" * 16]}},  # sizes of another rank
        {"4": {"w@0": ["torch.float32", [-1], [1], "0" * 16]}},  # a negative size
        {"4": {"w": ["torch.float32", [4], [4], "0" * 16]}},  # no chunk offsets
        {"4": ["w@0"]},
        ["w@0"],
    ],
)
def test_a_malformed_chunks_field_is_a_survivor_that_did_not_report(tmp_path, bad):
    write_report(tmp_path, _report({}))
    good = _report({4: {"w@0": ["torch.float32", [4], [4], "0" * 16]}})
    path = write_report(tmp_path, Report(2, 2, "inc2", 124, "host", 7, {}, "", 1.0, good.chunks))
    doc = json.loads(path.read_text())
    doc["chunks"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError):
        Report.from_dict(doc)
    assert sorted(read_reports(tmp_path, 2)) == [1]
