"""The node judge's steps one by one (`diagnostics.node_verdict`): the window, where each event belongs,
NVSwitch and NVML node findings, one GPU's verdict and the node's level, each a pure function."""

from __future__ import annotations

from gpuguard.diagnostics import node_thresholds
from gpuguard.diagnostics.node_verdict import (
    event_window,
    gpu_verdict,
    node_level,
    nvml_node_findings,
    place_events,
    sxid_findings,
)
from gpuguard.foundation.events import Event
from tests.support.node import healthy_gpu, snapshot

T = node_thresholds.load()


def ev(kind: str, line: int = 1, text: str = "", timestamp: float | None = None, **fields) -> Event:
    return Event(kind, line, text, fields, timestamp, "kern.log")


def test_event_window_keeps_untimed_events_and_counts_what_it_dropped():
    events = [ev("xid", 1, timestamp=10.0), ev("xid", 2, timestamp=100.0), ev("xid", 3)]
    window, counts = event_window(events, since=50.0)
    assert [e.line for e in window] == [2, 3]
    assert counts == {"events": 3, "events_in_window": 2, "events_untimed": 1}
    assert event_window(events, None)[0] == events


def test_place_events_puts_each_event_on_its_gpu_the_node_or_nowhere():
    window = [
        ev("xid", 1, xid=79, pci_bus_id="0000:3b:00.0"),
        ev("xid", 2, xid=13, pci_bus_id=None),  # a redacted address: the node's
        ev("gpu_identity", 3, pci_bus_id="0000:3b:00.0", uuid="GPU-1234"),
        ev("gpu_fault", 4, fault="init_failed", pci_bus_id="0000:5e:00.0"),
        ev("cuda_error", 5, fault="ecc_uncorrectable", rank=3),  # training log: names a rank, not a GPU
        ev("sxid", 6, sxid=12028),
        ev("nccl_warn", 7),  # no fault: not node evidence
    ]
    placed = place_events(window, known_gpus=())
    assert [e.line for e in placed.gpu_events["0000:3b:00.0"]] == [1]
    assert [e.line for e in placed.gpu_faults["0000:5e:00.0"]] == [4]
    assert [e.line for e in placed.unplaced] == [2]
    assert [e.line for e in placed.node_faults] == [5]
    assert [e.line for e in placed.sxids] == [6]
    assert placed.identities == {"0000:3b:00.0": "GPU-1234"}


def test_a_ports_aer_error_goes_to_the_one_gpu_below_it():
    port = ev("gpu_fault", 10, fault="pcie_fatal", pci_bus_id="0000:3a:00.0", device="port", buses_below=[0x3B, 0x3B])
    placed = place_events([port], known_gpus=("0000:3b:00.0", "0000:86:00.0"))
    assert [e.line for e in placed.gpu_faults["0000:3b:00.0"]] == [10] and not placed.node_faults
    alone = place_events([ev("gpu_fault", 10, fault="pcie_fatal", pci_bus_id="0000:3a:00.0", device="port")], ())
    assert [e.line for e in alone.node_faults] == [10]  # the log does not say which GPU: the node's


def test_sxid_findings_drain_only_on_a_fatal_line():
    fatal = ev("sxid", 1, "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 33", sxid=12028)
    mild = ev("sxid", 2, "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 11004, Non-fatal, Link 1", sxid=11004)
    assert [(f.verdict, f.check) for f in sxid_findings([fatal, mild])] == [
        ("drain", "sxid.12028"),
        ("degraded", "sxid.11004"),
    ]


def test_nvml_node_findings_a_driver_upgraded_without_reboot():
    snap = snapshot(status="failed", nvml_error="NVMLError_LibRmVersionMismatch", reason="version mismatch")
    assert [f.check for f in nvml_node_findings(snap, T)] == ["nvml.version_mismatch"]
    assert nvml_node_findings(snapshot(healthy_gpu()), T) == []
    assert nvml_node_findings(None, T) == []


def test_gpu_verdict_is_unknown_when_nvml_is_silent_and_nothing_else_speaks():
    meta = {"pci_bus_id": "0000:3b:00.0", "index": 0}
    v = gpu_verdict("0000:3b:00.0", meta, [], [], [], T, nvml_silent="NVML timed out")
    assert v.verdict == "unknown" and v.evidence[-1].message == "NVML did not report on this GPU: NVML timed out"
    lost = [ev("xid", 1, xid=79, pci_bus_id="0000:3b:00.0")]
    assert gpu_verdict("0000:3b:00.0", meta, [], lost, [], T, nvml_silent="NVML timed out").verdict == "drain"


def test_node_level_explains_an_all_clear_that_is_not_one():
    healthy = gpu_verdict("k", {"pci_bus_id": "k", "index": 0}, [], [], [], T)
    level, why = node_level([healthy], [], None, examined=False, expected_gpus=None)
    assert (level, [f.check for f in why]) == ("healthy", ["nvml.not_examined"])
    level, why = node_level([], [], snapshot(), examined=True, expected_gpus=None)
    assert (level, [f.check for f in why]) == ("unknown", ["nvml.no_gpus"])
    level, why = node_level(
        [healthy], [], snapshot(status="failed", reason="no driver"), examined=True, expected_gpus=None
    )
    assert (level, why[0].message) == ("unknown", "no driver")
