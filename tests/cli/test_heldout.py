"""The held-out real-log set (tests/data/heldout, expectations written before the tool was run):
every node verdict acceptable, every Xid pair and watchdog timeout found, nothing invented.

In process (the readers and the judge `diagnose node` uses); `python bench/heldout.py` scores the
same set through the real CLI, and `--root` an older version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuguard.collectors import kernel_log, logscan
from gpuguard.diagnostics import node_thresholds
from gpuguard.diagnostics.node_verdict import judge

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout"
CASES = yaml.safe_load((HELDOUT / "expectations.yaml").read_text())["cases"]
T = node_thresholds.load()


@pytest.mark.parametrize("case", CASES, ids=[c["file"] for c in CASES])
def test_heldout_excerpt(case):
    path = HELDOUT / case["file"]
    if case["input"] == "kernel-log":
        log = kernel_log.read_file(path)
        events, unread = list(log.events), log.unread_lines
    else:
        events, _ = logscan.read_log(path)
        unread = ()
    result = judge(None, events, T, mode="replay", unread_lines=unread)
    assert result.verdict in case["acceptable"], [f.to_json() for g in result.gpus for f in g.evidence]
    xids = {(e.fields.get("pci_bus_id"), e.fields.get("xid")) for e in events if e.kind == "xid"}
    assert {tuple(x) for x in case["xids"]} <= xids
    explained, _ = logscan.read_log(path)  # what `gpu-doctor logs` reads
    watchdog = sorted([e.fields["seq"], e.fields["op"]] for e in explained if e.kind == "watchdog_timeout")
    assert watchdog == sorted(map(list, case["watchdog"]))
    assert {e.line for e in explained} <= set(case["event_lines"]), "an event on a line that carries none"
