"""`gpu-doctor diagnose node`: the real console script, offline inputs, formats, bad input, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.cli import BIN, REAL_LOGS, run_cli
from tests.support.node import (
    SAMPLE_LOG,
    SAMPLE_NVML,
    fake_env,
    healthy_gpu,
    snapshot,
    write_json,
)

OFFLINE = ("--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML))


def _no_traceback(result):
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout


def test_demo_json_document():
    r = run_cli("gpu-doctor", "diagnose", "node", "--demo", "--json")
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuguard.node/1" and doc["verdict"] == "drain"
    gpus = {g["pci_bus_id"]: g for g in doc["gpus"]}
    assert {k: g["verdict"] for k, g in gpus.items()} == {
        "0000:10:1c.0": "reset",
        "0000:2b:00.0": "drain",
        "0000:61:00.0": "healthy",
        "0000:cb:00.0": "reset",
    }
    for g in doc["gpus"]:
        assert g["evidence"] and g["action"]
    lost = [e for e in gpus["0000:2b:00.0"]["evidence"] if e["source"] == "kernel_log"]
    assert lost[0]["check"] == "xid.79" and lost[0]["line"] == 17
    assert doc["sections"]["nvml"]["status"] == "ok" and doc["sections"]["kernel_log"]["status"] == "ok"
    assert doc["sections"]["kernel_log"]["lines_read"] == 19


def test_human_output_names_each_gpu_and_the_action():
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE)
    assert r.returncode == 2
    assert "DRAIN" in r.stdout and "GPU1 0000:2b:00.0" in r.stdout and "action:" in r.stdout
    _no_traceback(r)


def test_npd_and_nagios_formats():
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--format", "npd")
    assert r.returncode == 1 and len(r.stdout.strip().splitlines()) == 1 and len(r.stdout.strip()) <= 80
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--format", "nagios")
    assert r.returncode == 2 and r.stdout.startswith("GPU CRITICAL - ")
    assert "| gpus=4;;;0" in r.stdout.splitlines()[0]


def test_kernel_log_from_stdin_and_since(tmp_path):
    r = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--kernel-log",
        "-",
        "--nvml-snapshot",
        str(SAMPLE_NVML),
        "--json",
        input=SAMPLE_LOG.read_text(),
    )
    assert json.loads(r.stdout)["counts"]["events_in_window"] > 0
    # the sample is from 2024: --since narrows it to the fallen-off-bus lines at 13:02
    r = run_cli(
        "gpu-doctor", "diagnose", "node", *OFFLINE, "--since", "2024-08-30T13:00:00", "--json", env={"TZ": "UTC"}
    )
    doc = json.loads(r.stdout)
    kinds = sorted({e.get("xid", e["kind"]) for e in doc["events"]}, key=str)
    assert doc["counts"]["events_in_window"] == 3 and 109 not in kinds
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--since", "1h", "--json")
    assert json.loads(r.stdout)["counts"]["events_in_window"] == 0


def test_fake_nvml_healthy_node_exits_0(tmp_path):
    snap = write_json(tmp_path / "snap.json", snapshot(healthy_gpu(0), healthy_gpu(1)))
    empty = tmp_path / "kern.log"
    empty.write_text("[    1.0] Linux version 6.8.0\n")
    r = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--mode",
        "live",
        "--kernel-log",
        str(empty),
        "--json",
        "--no-processes",
        env=fake_env(snap),
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "healthy" and doc["sections"]["nvml"]["source"] == "live"
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-test-0", "GPU-test-1"]


def test_dump_nvml_replays_to_the_same_verdict(tmp_path):
    gpu = healthy_gpu(0)
    gpu["remapped_rows"]["failure"] = True
    snap = write_json(tmp_path / "snap.json", snapshot(gpu))
    r1 = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--mode",
        "live",
        "--kernel-log",
        str(SAMPLE_LOG),
        "--json",
        "--dump-nvml",
        str(tmp_path / "dump.json"),
        env=fake_env(snap),
    )
    r2 = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--kernel-log",
        str(SAMPLE_LOG),
        "--json",
        "--nvml-snapshot",
        str(tmp_path / "dump.json"),
    )
    a, b = json.loads(r1.stdout), json.loads(r2.stdout)
    assert a["verdict"] == b["verdict"] == "drain"
    assert [g["verdict"] for g in a["gpus"]] == [g["verdict"] for g in b["gpus"]]


def test_real_pynvml_without_driver_is_unknown_not_a_traceback(tmp_path):
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        driver = True
    except OSError:
        driver = False
    empty = tmp_path / "kern.log"
    empty.write_text("")
    r = run_cli("gpu-doctor", "diagnose", "node", "--mode", "live", "--kernel-log", str(empty), "--json")
    _no_traceback(r)
    doc = json.loads(r.stdout)
    assert doc["mode"] == "live"
    if driver:
        assert doc["sections"]["nvml"]["status"] in ("ok", "unknown", "failed")
        return
    assert r.returncode == 3
    assert doc["verdict"] == "unknown" and "NVML Shared Library Not Found" in doc["summary"]


def test_replay_judges_the_evidence_given_not_the_replaying_machine(tmp_path):
    """--kernel-log without --nvml-snapshot is a replay: this machine's NVML (absent here) is not evidence."""
    empty = tmp_path / "kern.log"
    empty.write_text("[    1.0] Linux version 6.8.0\n")
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(empty), "--json")
    _no_traceback(r)
    doc = json.loads(r.stdout)
    assert doc["mode"] == "replay" and doc["sections"]["nvml"]["status"] == "not_examined"
    assert r.returncode == 0 and doc["verdict"] == "healthy" and "not proof of health" in doc["summary"]
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(REAL_LOGS / "013-xid.log"), "--json")
    assert json.loads(r.stdout)["verdict"] == "drain" and r.returncode == 2
    human = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(empty))
    assert "read (replay): kernel log" in human.stdout and "NVML: not examined" in human.stdout
    assert "no evidence of a fault in what was read; that is not proof of health" in human.stdout
    helptext = run_cli("gpu-doctor", "diagnose", "node", "--help").stdout
    assert "replay" in helptext and "--mode" in helptext and "--log" in helptext


def test_training_log_hardware_errors_are_node_evidence(tmp_path):
    log = tmp_path / "rank5.log"
    log.write_text("[rank5]: RuntimeError: CUDA error: uncorrectable ECC error encountered\n")
    r = run_cli("gpu-doctor", "diagnose", "node", "--log", str(log), "--json")
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "reset" and r.returncode == 2
    (finding,) = [f for f in doc["evidence"] if f["check"] == "fault.ecc_uncorrectable"]
    assert "rank 5" in finding["message"] and "ROW_REMAPPER" in finding["action"]
    nvlink = tmp_path / "nvlink.log"
    nvlink.write_text(
        "[E ProcessGroupNCCL.cpp:1182] [Rank 2] NCCL watchdog thread terminated with exception: CUDA error: "
        "uncorrectable NVLink error detected during the execution\n"
    )
    r = run_cli("gpu-doctor", "logs", str(nvlink))
    assert r.returncode == 2 and "nvidia-smi nvlink -e" in r.stdout


def test_gz_kernel_logs_in_diagnose_node_and_a_truncated_archive_is_65(tmp_path):
    import gzip

    gz = tmp_path / "kern.log.1.gz"
    gz.write_bytes(gzip.compress((REAL_LOGS / "013-xid.log").read_bytes()))
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(gz), "--json")
    assert json.loads(r.stdout)["verdict"] == "drain" and r.returncode == 2
    bad = tmp_path / "kern.log.2.gz"
    bad.write_bytes(gz.read_bytes()[:40])
    for args in (
        ["diagnose", "node", "--kernel-log", str(bad)],
        ["diagnose", "node", "--log", str(bad)],
        ["logs", str(bad)],
    ):
        r = run_cli("gpu-doctor", *args)
        _no_traceback(r)
        assert r.returncode == 65, (args, r.stdout, r.stderr)


def test_hung_probe_is_unknown_within_the_deadline(tmp_path):
    snap = write_json(tmp_path / "snap.json", snapshot(healthy_gpu(0), fake={"hang_s": 60}))
    start = time.monotonic()
    r = run_cli(
        "gpu-doctor",
        "diagnose",
        "node",
        "--mode",
        "live",
        "--kernel-log",
        str(SAMPLE_LOG),
        "--nvml-timeout",
        "1",
        "--format",
        "npd",
        env=fake_env(snap),
        timeout=60,
    )
    assert time.monotonic() - start < 30
    # the log alone proves GPU 0000:2b:00.0 fell off the bus: a problem (1), not unknown
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "did not answer within 1 s" in r.stderr


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (("--since", "yesterday-ish"), 64, "--since"),
        (("--format", "xml"), 64, "--format"),
        # with --format npd every error after parsing is node-problem-detector's "unknown" (2)
        (("--json", "--format", "npd"), 2, "exclusive"),
        (("--nvml-snapshot", "/nonexistent/snap.json"), 66, "no such file"),
        (("--kernel-log", "/nonexistent/kern.log"), 66, "no such file"),
    ],
)
def test_bad_input_one_line_documented_code(args, code, needle):
    r = run_cli(
        "gpu-doctor", "diagnose", "node", "--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML), *args
    )
    assert r.returncode == code, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    _no_traceback(r)


def test_bad_snapshot_and_config(tmp_path):
    bad = tmp_path / "snap.json"
    bad.write_text('{"schema": "gpuguard.nvml/1", "gpus": [{"index": "zero"}]}')
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(bad))
    assert r.returncode == 65 and "gpus[0].index" in r.stderr
    cfg = tmp_path / "t.yaml"
    cfg.write_text("row_remap:\n  pending: maybe\n")
    r = run_cli("gpu-doctor", "diagnose", "node", *OFFLINE, "--config", str(cfg))
    assert r.returncode == 64 and "row_remap.pending" in r.stderr
    _no_traceback(r)


def test_diagnose_node_never_imports_torch():
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import sys; from gpuguard.cli.doctor import app; from gpuguard.cli._app import run; "
            f"sys.exit(run(app, 'gpu-doctor', ['diagnose', 'node', '--json', *{list(OFFLINE)!r}]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(BIN),
    )
    assert proc.returncode == 2, proc.stderr[-500:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "gpuguard.diagnostics.node_verdict" in imported  # the measurement saw the real path
    assert not any(name == "torch" or name.startswith("torch.") for name in imported)


def test_logs_all_clear_says_it_is_not_proof_of_health(tmp_path):
    quiet = tmp_path / "quiet.log"
    quiet.write_text("[    1.0] Linux version 6.8.0\n")
    r = run_cli("gpu-doctor", "logs", str(quiet))
    assert r.returncode == 0 and "not proof of health" in r.stdout


def test_dump_nvml_needs_nvml(tmp_path):
    r = run_cli("gpu-doctor", "diagnose", "node", "--kernel-log", str(SAMPLE_LOG), "--dump-nvml", str(tmp_path / "d"))
    assert r.returncode == 64 and "--mode live" in r.stderr and not (tmp_path / "d").exists()
