"""Error rates over a labelled set (`diagnostics.calibration`): the definitions, by example and by property."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.diagnostics.calibration import CLASSES, calibrate


def test_precision_recall_and_false_alarms_by_example():
    pairs = [("healthy", "healthy")] * 8 + [("healthy", "degraded"), ("healthy", "drain")]
    pairs += [("drain", "drain")] * 3 + [("drain", "reset"), ("reset", "reset")]
    cal = calibrate(pairs)
    by = {s.verdict: s for s in cal.classes}
    assert (by["drain"].support, by["drain"].predicted, by["drain"].true_positives) == (4, 4, 3)
    assert by["drain"].precision == 0.75 and by["drain"].recall == 0.75
    assert by["reset"].precision == 0.5 and by["reset"].recall == 1.0
    assert by["healthy"].precision == 1.0 and by["healthy"].recall == 0.8
    assert by["degraded"].fp_per_1000_healthy == 100.0 and by["drain"].fp_per_1000_healthy == 100.0
    assert by["unknown"].precision is None and by["unknown"].recall is None  # never seen
    assert (cal.files, cal.correct, cal.false_alarms, cal.fp_per_1000_healthy) == (15, 12, 2, 200.0)
    assert cal.confusion["healthy"]["drain"] == 1


def test_a_crash_is_its_own_column_and_wrong_for_every_label():
    cal = calibrate([("reset", "exit 70"), ("reset", "reset")])
    assert cal.confusion["reset"]["exit 70"] == 1 and cal.correct == 1


@given(st.lists(st.tuples(st.sampled_from(CLASSES), st.sampled_from(CLASSES)), max_size=60))
def test_the_matrix_accounts_for_every_file(pairs):
    cal = calibrate(pairs)
    assert sum(sum(row.values()) for row in cal.confusion.values()) == len(pairs) == cal.files
    assert sum(s.true_positives for s in cal.classes) == cal.correct
    for s in cal.classes:
        assert s.true_positives <= min(s.support, s.predicted)
        assert s.precision is None or 0 <= s.precision <= 1
        assert s.recall is None or 0 <= s.recall <= 1
