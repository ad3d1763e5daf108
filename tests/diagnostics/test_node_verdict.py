"""Node verdict (pure) and its thresholds loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.logparse import iter_events
from gpuguard.diagnostics import node_thresholds
from gpuguard.diagnostics.node_verdict import judge
from gpuguard.foundation.errors import UsageError
from tests.support.cli import REAL_LOGS
from tests.support.node import REPO, healthy_gpu, sample_snapshot, snapshot

T = node_thresholds.load()
DEFAULTS = node_thresholds.validate(yaml.safe_load(node_thresholds.DEFAULTS_PATH.read_text()), complete=True)


def _events(text: str):
    return list(iter_events(text.splitlines(), source="test"))


def _gpu_verdicts(result):
    return {g.pci_bus_id: g.verdict for g in result.gpus}


def test_all_healthy():
    result = judge(snapshot(healthy_gpu(0), healthy_gpu(1)), [], T)
    assert result.verdict == "healthy"
    assert [g.verdict for g in result.gpus] == ["healthy", "healthy"]
    assert result.summary == "2 GPUs healthy"


@pytest.mark.parametrize(
    "change,verdict,check",
    [
        (lambda g: g["remapped_rows"].update(pending=True), "reset", "row_remap.pending"),
        (lambda g: g["remapped_rows"].update(failure=True), "drain", "row_remap.failure"),
        (lambda g: g["ecc"].update(aggregate_uncorrected_sram=5), "drain", "ecc.aggregate_uncorrected_sram"),
        (lambda g: g["ecc"].update(volatile_uncorrected=1), "reset", "ecc.volatile_uncorrected"),
        (lambda g: g.update(lost=True, error="GPU is lost"), "drain", "gpu_lost"),
        (lambda g: g.update(recovery_action=1), "reset", "recovery_action"),
        (lambda g: g.update(recovery_action=2), "drain", "recovery_action"),
        (lambda g: g["pcie"].update(width=8), "degraded", "pcie.width"),
        (lambda g: g.update(temperature_c=86), "degraded", "temperature"),
        (lambda g: g.update(clock_event_reason_names=["HwSlowdown"]), "degraded", "clock_events"),
        (lambda g: g["nvlink"][1].update(active=False), "degraded", "nvlink.inactive"),
        (lambda g: g["nvlink"][0].update(crc_flit=60, crc_data=40), "degraded", "nvlink.crc"),
        (
            lambda g: g.update(retired_pages={"single_bit": 30, "double_bit": 30, "pending": False}),
            "drain",
            "retired_pages.total",
        ),
    ],
)
def test_nvml_rules(change, verdict, check):
    gpu = healthy_gpu(0)
    change(gpu)
    result = judge(snapshot(gpu, healthy_gpu(1)), [], T)
    assert result.verdict == verdict
    bad = result.gpus[0]
    assert bad.verdict == verdict and result.gpus[1].verdict == "healthy"
    assert any(f.check == check and f.verdict == verdict for f in bad.evidence)
    assert bad.action


def test_below_thresholds_stays_healthy():
    gpu = healthy_gpu(0)
    gpu["ecc"]["aggregate_uncorrected_sram"] = 4  # "> 4 is usually RMA": 4 is not
    gpu["pcie"]["gen"] = 1  # idle power management
    gpu["clock_event_reason_names"] = ["SwPowerCap", "GpuIdle"]
    assert judge(snapshot(gpu), [], T).verdict == "healthy"


def test_xid79_from_the_real_log_drains_the_gpu():
    text = (REAL_LOGS / "013-xid.log").read_text()
    result = judge(snapshot(healthy_gpu(0, "0000:2b:00.0"), healthy_gpu(1)), _events(text), T)
    assert result.verdict == "drain"
    assert _gpu_verdicts(result) == {"0000:2b:00.0": "drain", "0000:11:00.0": "healthy"}
    assert any(f.check == "xid.79" for f in result.gpus[0].evidence)


def test_xid154_recovery_action_is_authoritative():
    # 015: Xid 149 fatal NVLink errors, then 154 "... to 0x1 (GPU Reset Required)" on 0008:01:00.
    events = _events((REAL_LOGS / "015-xid.log").read_text())
    gpus = [healthy_gpu(i, pci) for i, pci in enumerate(["0008:01:00.0", "0009:01:00.0", "0018:01:00.0"])]
    result = judge(snapshot(*gpus), events, T)
    verdicts = _gpu_verdicts(result)
    assert verdicts["0008:01:00.0"] == "reset"
    assert verdicts["0018:01:00.0"] == "reset"
    ev = next(g for g in result.gpus if g.pci_bus_id == "0008:01:00.0").evidence
    assert any(f.check == "xid.154" and "gpu_reset" in f.message for f in ev)


def test_a_later_154_none_clears_what_came_before():
    lines = [
        "NVRM: Xid (PCI:0000:10:00): 109, pid=1, name=python, Ch 00000008, errorString CTX SWITCH TIMEOUT",
        "NVRM: Xid (PCI:0000:10:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
    ]
    result = judge(snapshot(healthy_gpu(0, "0000:10:00.0")), _events("\n".join(lines)), T)
    assert result.verdict == "healthy"
    without = judge(snapshot(healthy_gpu(0, "0000:10:00.0")), _events(lines[0]), T)
    assert without.verdict == "reset"


def test_application_xids_degrade_only_when_they_repeat():
    line = "NVRM: Xid (PCI:0000:10:00): 13, pid=7, name=python, Graphics SM Warp Exception on (GPC 1, TPC 1, SM 0)"
    gpu = healthy_gpu(0, "0000:10:00.0")
    assert judge(snapshot(gpu), _events(line), T).verdict == "healthy"
    # five incidents (five processes) repeat: degraded
    result = judge(snapshot(gpu), _events("\n".join(line.replace("pid=7", f"pid={p}") for p in range(5))), T)
    assert result.verdict == "degraded"
    assert any(f.check == "xid.repeat" for f in result.gpus[0].evidence)
    # one incident printed as five lines (same GPU, code, pid; untimed and adjacent): not a repeat
    assert judge(snapshot(gpu), _events("\n".join([line] * 5)), T).verdict == "healthy"
    stamped = [f"[Mon Apr  1 12:00:0{s} 2024] {line}" for s in (1, 1, 2, 3, 4, 5, 6, 7)]
    assert judge(snapshot(gpu), _events("\n".join(stamped)), T).verdict == "healthy"  # 8 lines, one 10 s window


def test_unknown_xid_code_needs_review_never_healthy():
    result = judge(
        snapshot(healthy_gpu(0, "0000:10:00.0")), _events("NVRM: Xid (PCI:0000:10:00): 9999, something new"), T
    )
    assert result.verdict == "degraded"


def test_no_driver_is_unknown_but_kernel_evidence_still_counts():
    snap = snapshot(status="unknown", reason="NVMLError_LibraryNotFound: NVML Shared Library Not Found")
    assert judge(snap, [], T).verdict == "unknown"
    assert "NVML Shared Library Not Found" in judge(snap, [], T).summary
    events = _events((REAL_LOGS / "013-xid.log").read_text())
    assert judge(snap, events, T).verdict == "drain"


def test_version_mismatch_drains_and_no_gpus_is_unknown():
    snap = snapshot(
        status="failed",
        reason="NVMLError_LibRmVersionMismatch: RM has detected a mismatch",
        nvml_error="NVMLError_LibRmVersionMismatch",
    )
    assert judge(snap, [], T).verdict == "drain"
    assert judge(snapshot(), [], T).verdict == "unknown"


def test_since_drops_older_stamped_events():
    events = _events(Path(REPO / "collectors/data/sample-kern.log").read_text())
    snap = sample_snapshot()
    assert judge(snap, events, T).verdict == "drain"
    late = judge(snap, events, T, since=events[-1].timestamp + 1)
    assert late.counts["events_in_window"] == 0
    # NVML still says GPU 1 is lost: the verdict does not depend on the log alone
    assert late.verdict == "drain"
    ids = {g.pci_bus_id: g.verdict for g in late.gpus}
    assert ids["0000:cb:00.0"] == "degraded"  # the PCIe x8 link; the Xid 109 is outside the window


def test_config_overrides(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("xid:\n  ignore: [79]\nnode:\n  gpu_lost: degraded\nrow_remap:\n  pending: degraded\n")
    t = node_thresholds.load(cfg)
    events = _events((REAL_LOGS / "013-xid.log").read_text())
    # ignoring the code 79 does not hide the separate "fallen off the bus" line: still a drain
    result = judge(snapshot(healthy_gpu(0, "0000:2b:00.0")), events, t)
    assert result.verdict == "drain"
    assert not any(f.check == "xid.79" and "x2" in f.message for f in result.gpus[0].evidence)
    lost = healthy_gpu(0)
    lost.update(lost=True, error="GPU is lost")
    assert judge(snapshot(lost), [], t).verdict == "degraded"  # node.gpu_lost governs NVML's GPU_IS_LOST
    gpu = healthy_gpu(0)
    gpu["remapped_rows"]["pending"] = True
    assert judge(snapshot(gpu), [], t).verdict == "degraded"
    cfg.write_text("node:\n  expected_gpus: 8\n")
    result = judge(snapshot(healthy_gpu(0)), [], node_thresholds.load(cfg))
    assert result.verdict == "drain" and result.evidence[0].check == "node.expected_gpus"


def test_bundled_defaults_are_complete_and_documented():
    raw = yaml.safe_load(node_thresholds.DEFAULTS_PATH.read_text())
    for section, keys in node_thresholds.SPEC.items():
        assert set(raw[section]) == set(keys), section
    text = node_thresholds.DEFAULTS_PATH.read_text()
    assert text.count("#") > 20  # every section explains itself


@pytest.mark.parametrize(
    "text,needle",
    [
        ("ecc:\n  volatile_uncorrected_reset: -1\n", "ecc.volatile_uncorrected_reset"),
        ("ecc:\n  volatile_uncorrected_reset: many\n", "whole number"),
        ("xid:\n  drain: 79\n", "xid.drain"),
        ("xid:\n  drian: [79]\n", "unknown key xid.drian"),
        ("gpu:\n  x: 1\n", "unknown section"),
        ("row_remap:\n  pending: reboot\n", "expected one of healthy"),
        ("clock_events:\n  degraded: [Hot]\n", "clock-event reasons"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("a: [1,\n", "not valid YAML"),
        ("schema: other/1\n", "schema"),
    ],
)
def test_bad_config_is_one_clear_usage_error(tmp_path, text, needle):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(text)
    with pytest.raises(UsageError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        node_thresholds.load(cfg)


_yamlish = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 200) | st.floats(allow_nan=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=120, deadline=None)
@given(
    doc=st.dictionaries(
        st.sampled_from([*node_thresholds.SPEC, "schema", "other"]),
        st.dictionaries(
            st.sampled_from(
                [
                    "drain",
                    "pending",
                    "volatile_uncorrected_reset",
                    "degraded",
                    "slowdown_margin_c",
                    "expected_gpus",
                    "x",
                ]
            ),
            _yamlish,
            max_size=3,
        )
        | _yamlish,
        max_size=3,
    )
)
def test_validate_accepts_or_raises_usage_error(doc):
    try:
        merged = node_thresholds.validate(doc, DEFAULTS)
    except UsageError:
        return
    judge(snapshot(healthy_gpu(0)), [], node_thresholds._freeze(merged, "x"))


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200))
def test_loader_on_random_bytes(tmp_path_factory, raw):
    cfg = tmp_path_factory.mktemp("c") / "t.yaml"
    cfg.write_bytes(raw)
    try:
        node_thresholds.load(cfg)
    except UsageError:
        pass


def test_kernel_identity_names_a_gpu_nvml_lost():
    # 013: "NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014-..." then Xid 79; NVML no longer lists that GPU
    events = _events((REAL_LOGS / "013-xid.log").read_text())
    result = judge(snapshot(healthy_gpu(0)), events, T)
    lost = next(g for g in result.gpus if g.pci_bus_id == "0000:2b:00.0")
    assert lost.uuid == "GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae" and lost.verdict == "drain"


def test_redacted_addresses_become_node_evidence():
    events = _events((REAL_LOGS / "009-xid.log").read_text())  # "NVRM: Xid (PCI:...): 145, ..."
    result = judge(snapshot(healthy_gpu(0)), events, T)
    assert {f.check for f in result.evidence} >= {"xid.145", "xid.137"}
    assert [g.pci_bus_id for g in result.gpus] == ["0000:10:00.0"]


def test_replay_judges_the_evidence_and_reports_nvml_not_examined():
    result = judge(None, _events((REAL_LOGS / "013-xid.log").read_text()), T, mode="replay")
    assert result.verdict == "drain" and result.mode == "replay"
    assert any(f.check == "nvml.not_examined" and f.verdict == "healthy" for f in result.evidence)
    clear = judge(None, [], T, mode="replay")
    assert clear.verdict == "healthy" and "not proof of health" in clear.summary
    assert clear.to_json()["mode"] == "replay"
    # live: no NVML is a finding
    assert judge(None, [], T).verdict == "unknown"
    with pytest.raises(ValueError):
        judge(None, [], T, mode="sometimes")


def test_gpu_faults_without_an_xid():
    text = "\n".join(
        [
            "[ 5521.0] NVRM: Xid (PCI:0000:b1:00): 48, pid=1, name=python, An uncorrectable double bit error",
            "[ 5633.8] NVRM: GPU 0000:b2:00.0: RmInitAdapter failed! (0x62:0x55:2477)",
            "[ 5633.9] NVRM: GPU 0000:b2:00.0: rm_init_adapter failed, device minor number 5",
        ]
    )
    result = judge(None, _events(text), T, mode="replay")
    by_gpu = {g.pci_bus_id: g for g in result.gpus}
    assert by_gpu["0000:b1:00.0"].verdict == "drain" and by_gpu["0000:b2:00.0"].verdict == "drain"
    (init,) = [f for f in by_gpu["0000:b2:00.0"].evidence if f.check == "fault.init_failed"]
    assert "x2" in init.message and "RMA" in init.action


def test_a_port_error_is_mapped_to_the_gpu_below_it():
    text = "\n".join(
        [
            "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error",
            "pcieport 0000:3a:00.0: AER: Uncorrected (Non-Fatal) error received: 0000:3b:00.0",
            "pcieport 0000:00:03.1: AER: Corrected error received: 0000:00:00.0",
        ]
    )
    result = judge(None, _events(text), T, mode="replay")
    (gpu,) = result.gpus
    assert gpu.pci_bus_id == "0000:3b:00.0" and gpu.verdict == "drain"
    assert any(f.check == "fault.pcie_nonfatal" and "0000:3a:00.0" in f.message for f in gpu.evidence)
    # the root port's corrected error names no GPU: node evidence, healthy
    assert any(f.check == "fault.pcie_corrected" and f.verdict == "healthy" for f in result.evidence)


def test_training_log_evidence_and_unread_lines():
    ev = _events("[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered")
    result = judge(None, ev, T, mode="replay")
    assert result.verdict == "reset" and any("rank 5" in f.message for f in result.evidence)
    # lines that look like an Xid but were not read: a warning, never an all clear
    result = judge(None, [], T, mode="replay", unread_lines=(4, 9))
    assert result.verdict == "degraded" and result.evidence[0].check == "kernel_log.unread"


def test_calibration_in_the_node_verdict():
    gpu = healthy_gpu(0, "0000:4e:00.0")
    line63 = "NVRM: Xid (PCI:0000:4e:00): 63, pid=1, name=p, Row Remapper: New row marked for remapping, reset gpu to activate."
    assert judge(snapshot(gpu), _events(line63), T).verdict == "reset"
    line154 = "NVRM: Xid (PCI:0000:4e:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)"
    assert judge(snapshot(gpu), _events(line154), T).verdict == "drain"
    line94 = "NVRM: Xid (PCI:0000:4e:00): 94, pid=5, name=python3, Contained: SM (0x1). RST: No, D-RST: No"
    assert judge(snapshot(gpu), _events(line94), T).verdict == "degraded"
    line45 = "NVRM: Xid (PCI:0000:4e:00): 45, pid=9, name=p, Ch 00000003 caused by previous Xid 149"
    result = judge(snapshot(gpu), _events(line45), T)
    assert result.verdict == "reset" and any("inferred" in f.message for f in result.gpus[0].evidence)
    odd = "NVRM: Xid (PCI:0000:4e:00): 0x1F, pid=9, name=p, what"
    result = judge(snapshot(gpu), _events(odd), T)
    assert result.verdict == "degraded" and result.gpus[0].evidence[0].check == "xid.unreadable"


def test_lines_that_imply_a_fault_without_naming_one():
    cases = {
        "[ 5.1] NVRM: GPU1 nvAssertFailed: status NV_ERR_RESET_REQUIRED": "reset",
        "Failed to initialize NVML: Driver/library version mismatch": "drain",
        "kernel: {7}[Hardware Error]: event severity: fatal": "drain",
        "kernel: {7}[Hardware Error]: event severity: recoverable": "healthy",
        "Failed to initialize NVML: Unknown Error": "healthy",  # not a claim about the node on its own
    }
    for line, verdict in cases.items():
        assert judge(None, _events(line), T, mode="replay").verdict == verdict, line
    # the same ECC error seen twice by the same rank is one finding
    text = "\n".join(["[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered"] * 2)
    result = judge(None, _events(text), T, mode="replay")
    (finding,) = [f for f in result.evidence if f.check == "fault.ecc_uncorrectable"]
    assert "x2" in finding.message and result.summary == "reset: fault.ecc_uncorrectable"


def test_a_port_error_maps_to_the_gpu_below_it_by_bus():
    text = "\n".join(
        [
            "[    0.512] pci 0000:3a:00.0: PCI bridge to [bus 3b]",
            "[    9.100] NVRM: GPU at PCI:0000:3b:00: GPU-aaaa",
            "[ 8921.442] pcieport 0000:3a:00.0: AER: Uncorrected (Fatal) error received: 0000:3a:00.0",
        ]
    )
    (gpu,) = judge(None, _events(text), T, mode="replay").gpus
    assert (gpu.pci_bus_id, gpu.verdict) == ("0000:3b:00.0", "drain")
