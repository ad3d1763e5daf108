"""`gpu-doctor logs` through the installed console script: files, stdin, JSON schema, exit codes, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.cli import BIN, REAL_LOGS


def test_kernel_log_file_human_output_and_critical_exit(cli):
    res = cli("gpu-doctor", "logs", str(REAL_LOGS / "013-xid.log"))
    assert res.returncode == 2, res.stderr
    out = res.stdout
    assert "013-xid.log:2: critical xid xid=79 pci_bus_id=0000:2b:00.0" in out
    assert "013-xid.log:3: critical gpu_lost pci_bus_id=0000:2b:00.0" in out
    assert "fallen off the bus" in out and "Drain the node" in out
    # the per-GPU summary from the catalog, with the UUID the driver printed before the Xid
    assert "GPU 0000:2b:00.0 [GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae]: drain" in out
    assert res.stderr == ""


def test_json_schema_and_fields(cli):
    res = cli("gpu-doctor", "logs", "--json", str(REAL_LOGS / "015-xid.log"), str(REAL_LOGS / "051-watchdog.log"))
    assert res.returncode == 2, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gpuguard.events/1"
    assert [f["path"].rsplit("/", 1)[1] for f in doc["files"]] == ["015-xid.log", "051-watchdog.log"]
    assert [f["lines"] for f in doc["files"]] == [9, 4]
    xids = [e for e in doc["events"] if e["kind"] == "xid"]
    assert [e["xid"] for e in xids] == [149, 154, 149, 154, 149, 149, 149, 154, 154]
    assert xids[1]["pci_bus_id"] == "0009:01:00.0" and xids[1]["recovery_action_to"] == 4
    wt = [e for e in doc["events"] if e["kind"] == "watchdog_timeout"]
    assert [(e["seq"], e["op"], e["timeout_ms"], e["elapsed_ms"], e["rank"]) for e in wt] == [
        (1580, "ALLREDUCE", 600000, 600060, 0),
        (1580, "ALLREDUCE", 600000, 600067, 4),
    ]
    for event in doc["events"]:
        assert {"kind", "line", "severity", "diagnosis", "source", "text"} <= set(event)
    summary = doc["summary"]
    assert summary["worst"] == "critical" and summary["by_kind"]["xid"] == 9
    assert summary["gpus"]["0008:01:00.0"]["recovery_action"] == "gpu_reset"
    assert doc["exit_code"] == 2


def test_stdin_dash_and_warning_exit(cli):
    text = (REAL_LOGS / "073-torchrun.log").read_text()
    res = cli("gpu-doctor", "logs", "--json", "-", input=text)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    failures = [(e["local_rank"], e["exitcode"], e["signal"]) for e in doc["events"] if e["kind"] == "worker_failure"]
    assert failures == [(1, -6, "SIGABRT"), (2, -6, "SIGABRT"), (0, -6, "SIGABRT")]
    assert doc["files"] == [{"path": "-", "bytes": len(text.encode()), "lines": 27, "events": 3, "unreadable_lines": 0}]


def test_healthy_log_exits_zero_and_min_severity_filters(cli, tmp_path):
    res = cli("gpu-doctor", "logs", str(REAL_LOGS / "079-torchrun.log"))
    assert res.returncode == 0, res.stderr
    assert "rendezvous" in res.stdout
    res = cli("gpu-doctor", "logs", "--json", "--min-severity", "critical", str(REAL_LOGS / "001-xid.log"))
    doc = json.loads(res.stdout)
    assert [e["xid"] for e in doc["events"]] == [109] and res.returncode == 2
    empty = tmp_path / "quiet.log"
    empty.write_text("nothing to see\nhere\n")
    res = cli("gpu-doctor", "logs", "--json", str(empty))
    assert res.returncode == 0 and json.loads(res.stdout)["events"] == []


def test_missing_file_and_directory_are_one_line_errors(cli, tmp_path):
    res = cli("gpu-doctor", "logs", str(tmp_path / "nope.log"))
    assert res.returncode == 66
    assert res.stderr.strip().count("\n") == 0 and "no such file" in res.stderr and "Traceback" not in res.stderr
    res = cli("gpu-doctor", "logs", str(tmp_path))
    assert res.returncode == 66 and "is a directory" in res.stderr and res.stderr.count("\n") == 1
    # A bad path among good ones fails before anything is printed.
    res = cli("gpu-doctor", "logs", str(REAL_LOGS / "013-xid.log"), str(tmp_path / "nope.log"))
    assert res.returncode == 66 and res.stdout == ""


def test_usage_errors_are_64(cli):
    res = cli("gpu-doctor", "logs")
    assert res.returncode == 64 and "Traceback" not in res.stderr
    res = cli("gpu-doctor", "logs", "--min-severity", "loud", str(REAL_LOGS / "013-xid.log"))
    assert res.returncode == 64 and "min-severity" in res.stderr


def test_unreadable_file_is_permission_denied():
    """Root reads anything, so as root the CLI runs as `nobody` (setpriv) on a mode-000 file."""
    d = Path(tempfile.mkdtemp(prefix="gpuguard-perm-"))
    try:
        d.chmod(0o755)
        f = d / "secret.log"
        f.write_text("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n")
        f.chmod(0)
        cmd = [str(BIN / "gpu-doctor"), "logs", str(f)]
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            assert setpriv, "setpriv (util-linux) is needed to drop root for this test"
            cmd = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 77, proc
        assert "permission denied" in proc.stderr and proc.stderr.count("\n") == 1 and proc.stdout == ""
    finally:
        shutil.rmtree(d)


def test_streams_a_generated_log_with_invalid_bytes(cli, tmp_path):
    log = tmp_path / "kern.log"
    noise = b"[ 1.0] eth0: link up \xff\xfe garbage\n" * 20000
    with open(log, "wb") as fh:
        fh.write(noise)
        fh.write(b"[ 2.0] NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=python, DBE\r\n")
        fh.write(noise)
        fh.write(
            b"[ 3.0] NVRM: Xid (PCI:0000:3b:00): 63, pid=77, name=python, Row Remapper: New row marked for "
            b"remapping, reset gpu to activate."
        )  # no final newline
    res = cli("gpu-doctor", "logs", "--json", str(log))
    assert res.returncode == 2, res.stderr
    doc = json.loads(res.stdout)
    assert [(e["line"], e["xid"], e["pid"], e["process"]) for e in doc["events"]] == [
        (20001, 48, 77, "python"),
        (40002, 63, 77, "python"),
    ]
    assert doc["summary"]["gpus"]["0000:3b:00.0"]["severity"] == "drain"


def test_rotated_gzip_logs_are_read_and_corrupt_ones_are_data_errors(cli, tmp_path):
    import gzip

    plain = REAL_LOGS / "015-xid.log"
    gz = tmp_path / "kern.log.2.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a = json.loads(cli("gpu-doctor", "logs", "--json", str(plain)).stdout)["events"]
    res = cli("gpu-doctor", "logs", "--json", str(gz))
    assert res.returncode == 2, res.stderr
    b = json.loads(res.stdout)["events"]
    assert [{k: v for k, v in e.items() if k != "source"} for e in a] == [
        {k: v for k, v in e.items() if k != "source"} for e in b
    ]
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gz.read_bytes()[:40])
    res = cli("gpu-doctor", "logs", str(cut))
    assert res.returncode == 65 and "corrupt" in res.stderr and res.stderr.count("\n") == 1


def test_logs_never_imports_torch():
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "gpuguard.cli.doctor",
            "logs",
            "--json",
            str(REAL_LOGS / "051-watchdog.log"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-500:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "gpuguard.collectors.logscan" in imported  # the measurement sees our modules...
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}  # ...and no torch


def test_an_unreadable_marker_line_is_counted_and_said(cli, tmp_path):
    log = tmp_path / "kern.log"
    log.write_bytes(
        b"\xff\xfe NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception\n"
        b"NVRM: Xid (PCI:0000:3c:00): 13, pid=2, Graphics Exception\n"
    )
    res = cli("gpu-doctor", "logs", str(log), "--json")
    doc = json.loads(res.stdout)
    assert sum(f.get("unreadable_lines", 0) for f in doc["files"]) == 1, doc["files"]
    human = cli("gpu-doctor", "logs", str(log))
    assert "1 unreadable line skipped" in human.stderr, human.stderr
    clean = tmp_path / "clean.log"
    clean.write_bytes(b"NVRM: Xid (PCI:0000:3c:00): 13, pid=2, Graphics Exception\n")
    assert "unreadable" not in cli("gpu-doctor", "logs", str(clean)).stderr
