"""Issue 28 finding 9: a Flight Recorder dump whose format version is outside the known 2.0-2.10 is
read, and reported (one warning per rank), never silently accepted."""

from __future__ import annotations

import json
import pickle

import pytest

from gpuguard.collectors.flight_recorder import unknown_version_notes
from gpuguard.foundation.traces import RankTrace
from tests.support import contract_job as jh
from tests.support.cli import run_cli


@pytest.mark.parametrize(
    ("version", "known"),
    [("2.0", True), ("2.4", True), ("2.10", True), ("1.9", False), ("2.11", False), ("3.0", False), ("x\u202e", False)],
)
def test_a_version_outside_the_known_range_is_one_note(version, known):
    trace = RankTrace(rank=3, source="d", format="fr-pickle", streams=(), version=version)
    notes = unknown_version_notes([trace])
    assert notes == [] if known else len(notes) == 1 and "rank 3" in notes[0] and "2.0-2.10" in notes[0]
    assert unknown_version_notes([RankTrace(rank=0, source="g", format="gpuguard", streams=(), version="x")]) == []


def test_the_contract_reports_an_unknown_version(tmp_path):
    for rank, version in enumerate(("2.10", "2.12")):
        entries = [jh.fr_entry(i + 1, version="2.10") for i in range(3)]
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(
            pickle.dumps(jh.fr_doc(entries, version=version), protocol=2)
        )
    r = run_cli("gpu-doctor", "contract", str(tmp_path), "--json")
    warnings = json.loads(r.stdout)["warnings"]
    assert [w for w in warnings if "Flight Recorder format version" in w] == [
        "rank 1: Flight Recorder format version '2.12' is outside the known 2.0-2.10: read as 2.10, the comparison may be wrong"
    ]
