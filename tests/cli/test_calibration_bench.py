"""`python bench/heldout.py --calibrate --json`: the README's calibration table, through the real CLI over
the labelled set (tests/data/calibration.yaml): the gpuguard.bench/1 document and today's figures."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.cli import REPO


def test_the_calibration_table_of_the_readme():
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "heldout.py"), "--calibrate", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuguard.bench/1" and doc["bench"] == "calibration"
    *classes, summary = doc["results"]
    assert [c["verdict"] for c in classes] == ["healthy", "degraded", "reset", "drain", "unknown"]
    assert summary["files"] == sum(c["support"] for c in classes) == 41
    assert summary["false_alarms"] == 0 and summary["fp_per_1000_healthy"] == 0.0
    assert summary["correct"] == 41, doc["notes"]
    confusion = summary["confusion"]
    assert sum(sum(row.values()) for row in confusion.values()) == 41
