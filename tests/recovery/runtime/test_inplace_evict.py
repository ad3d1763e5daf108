"""Eviction evidence with real processes: gone / stopped / running by pid + start time; kill and confirm."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil

from gpuguard.foundation.identity import kill_confirmed
from gpuguard.foundation.inplace_files import inplace_dir, read_reports, request_abort
from gpuguard.recovery.runtime.switch import Report
from gpuguard.recovery.runtime.switch_coordinator import member_liveness


def test_a_stopped_process_is_seen_stopped_then_killed_and_confirmed_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = psutil.Process(proc.pid).create_time()
        assert member_liveness(proc.pid, start) == "running"
        assert member_liveness(proc.pid, start + 5.0) == "gone"  # same pid, another start time: not this process
        proc.send_signal(signal.SIGSTOP)
        for _ in range(200):
            if member_liveness(proc.pid, start) == "stopped":
                break
            time.sleep(0.01)
        assert member_liveness(proc.pid, start) == "stopped"
        assert kill_confirmed(proc.pid, start + 5.0)  # another start time: another process, never signalled
        assert member_liveness(proc.pid, start) == "stopped"
        assert kill_confirmed(proc.pid, start)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        assert member_liveness(proc.pid, start) == "gone"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_reports_skip_partial_and_foreign_files(tmp_path):
    d = inplace_dir(tmp_path) / "g3"
    d.mkdir(parents=True)
    good = Report(3, 1, "inc1", 10, "h", 7, {6: "a", 7: "b"}, "closed", 1.5)
    (d / "report-1-inc1.json").write_text(json.dumps(good.to_dict()))
    (d / "report-2-inc2.json").write_text('{"schema": "gpuguard.inplace-report/1", "generation": 3')  # torn
    (d / "report-0-inc0.json").write_text(json.dumps({"schema": "other"}))
    (d / "refused.json").write_text("{}")
    assert read_reports(tmp_path, 3) == {1: good}
    assert read_reports(tmp_path, 4) == {}


def test_request_abort_names_the_generation(tmp_path):
    path = request_abort(tmp_path, 5, "drain node-7")
    doc = json.loads(path.read_text())
    assert doc["generation"] == 5 and doc["why"] == "drain node-7"
