"""`gpu-doctor sweep --quiet` (nothing on stdout when healthy: cron mails any output) and `--format npd`'s
exit codes on errors (node-problem-detector knows 0 ok, 1 problem, 2 unknown only), for real (issue 15)."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from tests.support.cli import run_cli
from tests.support.node import healthy_gpu, snapshot, write_json

XID48 = "[Fri Aug 30 14:00:00 2024] NVRM: Xid (PCI:0000:61:00): 48, pid=99, name=python, An uncorrectable ECC error\n"


def _node(tmp_path: Path, log_text: str = "") -> tuple[Path, Path]:
    log = tmp_path / "kern.log"
    log.write_text(log_text)
    return log, write_json(tmp_path / "healthy.json", snapshot(healthy_gpu(0, "0000:61:00.0"), healthy_gpu(1)))


def _sweep(tmp_path: Path, log: Path, snap: Path, *args: str):
    return run_cli(
        "gpu-doctor", "sweep", "--kernel-log", str(log), "--nvml-snapshot", str(snap),
        "--state-dir", str(tmp_path / "state"), *args,
    )  # fmt: skip


def test_quiet_prints_nothing_when_healthy_and_still_does_its_work(tmp_path: Path) -> None:
    log, snap = _node(tmp_path)
    prom = tmp_path / "gpu.prom"
    r = _sweep(tmp_path, log, snap, "--quiet", "--textfile", str(prom))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r
    assert (
        'gpudoctor_node_verdict{verdict="healthy"} 1' in prom.read_text()
        and (tmp_path / "state" / "sweep-state.json").exists()
    )
    for fmt in ("json", "npd", "nagios"):
        r = _sweep(tmp_path, log, snap, "-q", "--format", fmt)
        assert r.returncode == 0 and r.stdout == "", (fmt, r)
    loud = _sweep(tmp_path, log, snap)  # without it: the full report every run
    assert loud.returncode == 0 and "healthy" in loud.stdout


def test_quiet_still_reports_a_problem(tmp_path: Path) -> None:
    log, snap = _node(tmp_path, XID48)
    r = _sweep(tmp_path, log, snap, "--quiet", "--json")
    assert r.returncode != 0 and json.loads(r.stdout)["verdict"] != "healthy", r
    r = _sweep(tmp_path, log, snap, "--quiet", "--format", "npd")  # the event is retained: still a problem
    assert r.returncode == 1 and r.stdout.count("\n") == 1, r


def test_npd_errors_exit_2_with_one_line_and_the_real_code_on_stderr(tmp_path: Path) -> None:
    log, snap = _node(tmp_path)
    cases = [
        (("--retain", "soon"), 64),  # a usage error found once the options are parsed
        (("--nvml-snapshot", str(tmp_path / "missing.json")), 66),  # missing input
    ]
    for extra, code in cases:
        plain = _sweep(tmp_path, log, snap, *extra)
        assert plain.returncode == code, (extra, plain)
        r = _sweep(tmp_path, log, snap, *extra, "--format", "npd")
        assert r.returncode == 2, (extra, r)
        assert r.stdout.startswith("unknown: ") and r.stdout.count("\n") == 1 and len(r.stdout) <= 81, r.stdout
        assert r.stderr.count("\n") == 1 and f"exit {code}" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "state").mkdir(exist_ok=True)
    with open(tmp_path / "state" / "sweep.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = _sweep(tmp_path, log, snap, "--format", "npd", "--budget", "0.5")
    assert r.returncode == 2 and "another sweep holds" in r.stderr and r.stdout.startswith("unknown: "), r
    r = run_cli("gpu-doctor", "diagnose", "node", "--format", "npd", "--nvml-snapshot", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stdout.startswith("unknown: ") and "exit 66" in r.stderr, r
    r = run_cli("gpu-doctor", "diagnose", "node", "--format", "npd", "--json", "--nvml-snapshot", str(snap))
    assert r.returncode == 2 and "exclusive" in r.stderr, r  # --json with --format: a usage error, still 0/1/2
