"""The verdicts an on-call engineer expects on evidence beyond the Xid (issue 25), through the doctor's
join (`doctor.node_diagnosis.diagnose`, what `gpu-doctor diagnose node` runs) on real formats
(tests/data/node-evidence): GSP lines by GPU index, pasted `nvidia-smi -q` judged like live NVML,
the table's `ERR!`, job-level evidence counted and pointed to, the log's own host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuguard.collectors import nvidia_smi
from gpuguard.diagnostics import node_thresholds
from gpuguard.diagnostics.node_verdict import judge
from gpuguard.doctor.node_diagnosis import NodeRequest, diagnose
from tests.support.node import sample_snapshot, snapshot

DATA = Path(__file__).resolve().parents[1] / "data" / "node-evidence"
T = node_thresholds.load()


def _replay(kernel_log: str | None = None, *logs: str, **kw) -> dict:
    request = NodeRequest(
        mode="replay",
        kernel_log=str(DATA / kernel_log) if kernel_log else None,
        logs=tuple(str(DATA / p) for p in logs),
        **kw,
    )
    return diagnose(request, T, started=time.monotonic()).document


def _gpu(doc: dict, index: int) -> dict:
    return next(g for g in doc["gpus"] if g["index"] == index)


def test_gsp_timeouts_without_an_xid_reset_the_gpu_they_name():
    doc = _replay("gsp-gh100.log")
    assert doc["verdict"] == "reset"
    gpu6 = _gpu(doc, 6)
    assert gpu6["verdict"] == "reset"
    assert {e["check"] for e in gpu6["evidence"]} == {"fault.gsp_timeout", "fault.memsys_error"}
    assert "reset it (nvidia-smi -r" in gpu6["action"]


def test_gsp_lines_land_on_the_gpu_nvml_knows_by_that_index():
    snap = sample_snapshot()
    events = list(nvidia_smi.table_events(""))  # none
    from gpuguard.collectors import kernel_log

    events = list(kernel_log.read_file(DATA / "gsp-heartbeat-journal.log").events)
    verdict = judge(snap, events, T, mode="replay")
    gpu0 = next(g for g in verdict.gpus if g.index == 0)
    assert gpu0.pci_bus_id == snap["gpus"][0]["pci_bus_id"]  # index 0 -> its PCI address, not `index:0`
    assert any(f.check == "fault.gsp_timeout" for f in gpu0.evidence)


def test_a_pasted_nvidia_smi_q_gives_the_verdict_live_nvml_would():
    doc = _replay("smi-q-remap-pending.txt")
    assert doc["sections"]["nvml"]["source"].startswith("nvidia-smi -q text in ")
    (gpu,) = [g for g in doc["gpus"] if g["pci_bus_id"] == "0000:10:1c.0"]
    assert gpu["verdict"] == "reset" and "row_remap.pending" in {e["check"] for e in gpu["evidence"]}
    # the same GPU as live NVML reports it (the sample snapshot's GPU 0 is this A100): the same NVML checks
    live = judge(snapshot(sample_snapshot()["gpus"][0]), [], T, mode="live")
    assert {f.check for f in live.gpus[0].evidence if f.source == "nvml"} == {
        e["check"] for e in gpu["evidence"] if e["source"] == "nvml"
    }


@pytest.mark.parametrize(
    "name,checks",
    [
        ("smi-q-uncorrectable.txt", {"ecc.volatile_uncorrected", "recovery_action"}),
        ("smi-q-v100-retired.txt", {"retired_pages.pending"}),
    ],
)
def test_pasted_reports_with_uncorrectable_errors_or_pending_retirement(name, checks):
    doc = _replay(name)
    assert doc["verdict"] == "reset"
    assert checks <= {e["check"] for g in doc["gpus"] for e in g["evidence"]}


def test_nvidia_smi_err_fields():
    assert _replay("smi-table-err-power.txt")["verdict"] == "healthy"  # one transient sensor reading
    doc = _replay("smi-table-err-gpu.txt")
    assert doc["verdict"] == "reset" and _gpu(doc, 1)["verdict"] == "reset"


def test_job_level_events_are_counted_and_pointed_to():
    doc = _replay("watchdog-five-ranks.log")
    assert doc["verdict"] == "healthy" and doc["counts"]["job_events"] == 5
    assert doc["summary"] == (
        "no node/GPU fault in the given files (not proof of health); 5 job-level events, see `gpu-doctor logs`"
    )
    mlx = _replay("mlx5-reg-mr.log")
    assert mlx["verdict"] == "healthy" and mlx["counts"]["job_events"] == 3


def test_the_replay_names_the_logs_host_or_says_it_is_unknown(tmp_path):
    assert _replay("gsp-heartbeat-journal.log")["node"] == "host unknown"  # journalctl --no-hostname
    log = tmp_path / "kern.log"
    log.write_text(
        "Nov 29 08:22:38 gpu-node-17 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
    )
    doc = diagnose(NodeRequest(mode="replay", kernel_log=str(log)), T, started=time.monotonic()).document
    assert doc["node"] == "gpu-node-17"


def test_xid_43_says_restart_the_application():
    log_line = "NVRM: Xid (PCI:0000:3b:00): 43, pid=2187, name=python3, Ch 00000008"
    from gpuguard.collectors.logparse import parse_line

    e = parse_line(log_line, 1)
    assert "restart the application" in e.diagnosis and "No action needed" not in e.diagnosis
