"""bench/scale.py --quick against a real etcd: every metric at every quick size ran, rows in the
`gpuguard.bench/1` schema, and what the current design must hold holds (the certificate activates
in one small request per part; the decisions certify their plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scale.py"
METRICS = [
    "activation",
    "inplace_decision",
    "restart_decision",
    "frontier_read",
    "commit_path",
    "etcd_growth",
    "keepalive_load",
]
QUICK_SIZES = [64, 512]

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180)]


def test_quick_run_has_every_row_in_the_schema(etcd_url):
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "GPUGUARD_TEST_ETCD": etcd_url},
    )
    took = time.monotonic() - t
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuguard.bench/1" and doc["bench"] == "scale" and doc["notes"]
    rows = doc["results"]
    assert not [row for row in rows if "crashed" in row]
    for row in rows:
        assert row["metric"] in METRICS and row["ranks"] in QUICK_SIZES, row
        assert isinstance(row["ok"], bool) and isinstance(row["seconds"], (int, float)) and row["seconds"] >= 0, row
        assert isinstance(row["design"], str), row
    assert {(row["metric"], row["ranks"]) for row in rows} == {(m, n) for m in METRICS for n in QUICK_SIZES}
    assert took < 120, took  # < 60 s on 2 loaded cores is the budget; twice that fails the test

    by = {(row["metric"], row["ranks"], row["design"], row.get("steps")): row for row in rows}
    for n in QUICK_SIZES:
        act = by[("activation", n, "chunked", None)]
        assert act["ok"] and act["request_bytes_max"] < 512 << 10 and act["certificate_bytes"] < 4 << 10, act
        cur = by[("inplace_decision", n, "current", None)]
        assert cur["ok"] and cur["lease_keys"] == n - 8, cur
        assert cur["reread_keys"] == 0 and "lease_reread_seconds" in cur, cur  # a later pass reads what changed
        assert by[("restart_decision", n, "current", None)]["ok"]
        commit = by[("commit_path", n, "per-rank-step", None)]
        assert commit["etcd_writes_per_rank_step"] >= 1 and not commit["ok"]  # today's baseline: a write per rank-step
        assert by[("keepalive_load", n, "lease-per-rank", None)]["requests_per_s"] == n / 2
        host = by[("keepalive_load", n, "lease-per-host", None)]  # 8 ranks, one renewer: about 1/8 of that
        assert 0.5 <= host["per_host_per_interval"] <= 1.5 and host["requests_per_s"] <= n / 2 / 5, host
