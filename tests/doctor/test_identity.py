"""Identity on every verdict and marker (issue 25): the boot and the GPU (UUID, serial) evidence was seen
with; evidence of an earlier boot or of a GPU replaced since is stale, reported, and never drains."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpuguard.collectors.kernel_log import boot_id
from gpuguard.diagnostics import node_thresholds
from gpuguard.diagnostics.node_identity import SEEN_BOOT, SEEN_SERIAL, GpuIdentity, stale_reason
from gpuguard.diagnostics.node_verdict import judge
from gpuguard.doctor import sweep as state_store
from gpuguard.doctor.publish import PublishOptions
from gpuguard.doctor.sweeper import SweepOptions, sweep
from gpuguard.foundation.events import Event
from gpuguard.plugins.outputs import npd_line
from tests.support.node import healthy_gpu, snapshot, write_json

T = node_thresholds.load()
PCI = "0000:2b:00.0"
XID79 = "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:2b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


def _xid(**seen) -> Event:
    return Event("xid", 1, "NVRM: Xid 79", {"xid": 79, "pci_bus_id": PCI, **seen})


def test_stale_needs_proof_another_boot_or_another_gpu():
    now = {PCI: GpuIdentity("GPU-b", "222")}
    assert stale_reason(_xid(), "boot-1", now) is None  # nothing recorded: not stale
    assert stale_reason(_xid(**{SEEN_BOOT: "boot-1", SEEN_SERIAL: "222"}), "boot-1", now) is None
    assert "earlier boot" in stale_reason(_xid(**{SEEN_BOOT: "boot-0"}), "boot-1", now)
    assert "replaced since" in stale_reason(_xid(**{SEEN_SERIAL: "111"}), "boot-1", now)
    assert stale_reason(_xid(**{SEEN_SERIAL: "111"}), "boot-1", {}) is None  # no serial known now


def test_a_stale_xid_79_is_reported_and_not_counted():
    snap = snapshot(dict(healthy_gpu(0, PCI), serial="222"))
    verdict = judge(snap, [_xid(**{SEEN_SERIAL: "111"})], T, mode="live", boot_id="boot-1")
    assert verdict.verdict == "healthy" and verdict.counts["stale_events"] == 1
    assert any(f.check == "stale" and "replaced since" in f.message for f in verdict.evidence)
    fresh = judge(snap, [_xid(**{SEEN_SERIAL: "222"})], T, mode="live", boot_id="boot-1")
    assert fresh.verdict == "drain" and fresh.identity["boot_id"] == "boot-1"


def _options(tmp_path: Path, snap: dict, **kw) -> SweepOptions:
    return SweepOptions(
        state_dir=tmp_path / "state",
        kernel_log=str(tmp_path / "kern.log"),
        nvml_snapshot=str(write_json(tmp_path / "nvml.json", snap)),
        publish=PublishOptions(textfile=str(tmp_path / "gpu.prom")),
        drain=True,
        node="gpu17",
        **kw,
    )


def _sweep(tmp_path: Path, serial: str) -> dict:
    snap = snapshot(dict(healthy_gpu(0, PCI), serial=serial))
    (tmp_path / "state").mkdir(exist_ok=True)
    return sweep(_options(tmp_path, snap), T, started=time.monotonic())


def test_a_replaced_gpus_old_verdict_does_not_drain_the_node(tmp_path):
    (tmp_path / "kern.log").write_text(XID79)
    first = _sweep(tmp_path, "1324020011111")
    assert first["verdict"] == "drain"
    reason = first["drain"]["command"][4]
    assert "serial 1324020011111" in reason and f"boot {boot_id()[:8]}" in reason and "evidence 2024-08-30" in reason
    again = _sweep(tmp_path, "1324020011111")  # the same GPU: the retained Xid 79 still drains
    assert again["verdict"] == "drain" and again["sections"]["state"]["new_events"] == 0
    swapped = _sweep(tmp_path, "1324020099999")  # a new board at the same address
    assert swapped["verdict"] == "healthy" and "drain" not in swapped
    assert any(e["check"] == "stale" and "replaced since" in e["message"] for e in swapped["evidence"])
    prom = (tmp_path / "gpu.prom").read_text()
    assert 'gpudoctor_gpu_info{gpu="0",pci_bus_id="0000:2b:00.0"' in prom and 'serial="1324020099999"' in prom


def test_evidence_from_an_earlier_boot_does_not_drain(tmp_path):
    (tmp_path / "kern.log").write_text(XID79)
    assert _sweep(tmp_path, "1324020011111")["verdict"] == "drain"
    state_file = tmp_path / "state" / state_store.STATE_FILE
    doc = json.loads(state_file.read_text())
    assert doc["events"][0]["fields"][SEEN_BOOT] == boot_id()  # kept with the boot it was seen in
    assert doc["last_identity"]["boot_id"] == boot_id()
    for rec in doc["events"]:
        rec["fields"][SEEN_BOOT] = "00000000-dead-beef-0000-000000000000"  # as if the node had rebooted since
    state_file.write_text(json.dumps(doc))
    after = _sweep(tmp_path, "1324020011111")
    assert after["verdict"] == "healthy" and "drain" not in after
    assert any("earlier boot (00000000" in e["message"] for e in after["evidence"])


def test_short_messages_say_whose_verdict_they_are(tmp_path):
    (tmp_path / "kern.log").write_text(XID79)
    doc = _sweep(tmp_path, "1324020011111")
    code, line = npd_line(doc)
    assert code == 1 and len(line) <= 80
    assert line.endswith(f"[b:{boot_id()[:8]} s:1324020011111 t:11:43Z]")
