"""`gpu-recover abort --json`: the evidence as objects (details.processes), one per incarnation record,
beside the sentences: rank, incarnation, pid, host, generation, whether it is the active generation,
what happened (outcome), the signal that ended it and why. Real processes, real records."""

from __future__ import annotations

import json
from typing import Any

from tests.support.cli import run_cli
from tests.support.processes import reap, record, spawn

KEYS = {"rank", "incarnation", "pid", "host", "generation", "active", "outcome", "signal", "reason"}


def _by_pid(details: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    procs = details["processes"]
    assert all(set(p) == KEYS for p in procs), procs
    return {p["pid"]: p for p in procs}


def test_abort_evidence_is_one_object_per_record(tmp_path) -> None:
    victim, stubborn, reused, stranger = spawn(), spawn(ignore_term=True), spawn(), spawn(run_id=None)
    try:
        inc = record(tmp_path, victim, 0)
        record(tmp_path, stubborn, 1)
        record(tmp_path, reused, 2, start_shift=-100.0)  # the pid now belongs to a newer process
        record(tmp_path, stranger, 3)  # right pid and start time, not the job's environment
        (tmp_path / "incarnations" / "garbage.json").write_text("{not json")

        dry = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--dry-run", "--json", timeout=60)
        assert dry.returncode == 0, dry.stderr
        plan = _by_pid(json.loads(dry.stdout)["details"])
        assert plan[victim.pid]["outcome"] == plan[stubborn.pid]["outcome"] == "would-terminate"
        assert plan[victim.pid]["signal"] is None and victim.poll() is None

        r = run_cli("gpu-recover", "abort", "--job-dir", str(tmp_path), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        details = json.loads(r.stdout)["details"]
        got = _by_pid(details)
        assert got[victim.pid] | {"reason": None} == {
            "rank": 0,
            "incarnation": inc,
            "pid": victim.pid,
            "host": got[victim.pid]["host"],
            "generation": None,
            "active": False,
            "outcome": "terminated",
            "signal": "SIGTERM",
            "reason": None,
        }
        assert got[stubborn.pid]["outcome"] == "terminated" and got[stubborn.pid]["signal"] == "SIGKILL"
        assert got[reused.pid]["outcome"] == "gone" and "newer process" in got[reused.pid]["reason"]
        assert got[stranger.pid]["outcome"] == "not-the-job" and "TORCHELASTIC_RUN_ID" in got[stranger.pid]["reason"]
        (bad,) = [p for p in details["processes"] if p["outcome"] == "unreadable"]
        assert bad["pid"] is None and "garbage.json" in bad["reason"]
        assert len(details["processes"]) == 5 and details["quiescence"] == "unknown"
        assert reused.poll() is None and stranger.poll() is None  # never signalled
    finally:
        reap(victim, stubborn, reused, stranger)
