"""`gpu-generation bench transitions` and bench/transitions.py: the gpuguard.bench/1 schema and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ROW_KEYS = {"strategy", "fault", "boundary", "semantic_failure", "detail", "recovery_s", "steps_lost"}


def test_json_schema_and_exit_code(cli):
    res = cli(
        "gpu-generation",
        "bench",
        "transitions",
        "--json",
        "--layout",
        "dp",
        "--strategy",
        "restart-all",
        "--strategy",
        "communicator-only",
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gpuguard.bench/1" and doc["bench"] == "transitions" and doc["mode"] == "sim"
    rows = doc["results"]
    assert len(rows) == 2 * 7 * 6
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["strategy"] in ("restart-all", "communicator-only")
        assert isinstance(row["semantic_failure"], bool) and isinstance(row["detail"], str)
        assert row["recovery_s"] is None or row["recovery_s"] >= 0
        assert row["steps_lost"] is None or row["steps_lost"] >= 0
    assert doc["summary"]["communicator-only"]["semantic_failures"] > 0  # exit 0 all the same: gpuguard not run
    assert doc["summary"]["restart-all"]["median_recovery_s"] > doc["summary"]["communicator-only"]["median_recovery_s"]


def test_usage_errors(cli):
    res = cli("gpu-generation", "bench", "transitions", "--strategy", "nope")
    assert res.returncode == 64 and "unknown strategy" in res.stderr and "Traceback" not in res.stderr


def test_bench_wrapper_prints_the_same_document():
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "transitions.py"),
            "--json",
            "--layout",
            "zero1",
            "--strategy",
            "restart-all",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr  # gpuguard not run: it has no failure
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpuguard.bench/1"
    assert {r["strategy"] for r in doc["results"]} == {"restart-all"}
    assert doc["summary"]["restart-all"]["semantic_failures"] > 0  # partial / corrupted checkpoints
