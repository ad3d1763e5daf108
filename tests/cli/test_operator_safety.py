"""Issue 15, operator safety: outputs that cannot lie and operator commands on-call can trust.

Real files, real processes and the installed console scripts (`run_cli`), no mocks.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.generation.job import init_job, open_job_ledger
from gpuguard.generation.records import Incarnation, Member
from gpuguard.recovery.operator.actions import drain_command, drain_command_line
from tests.support.cli import BIN, run_cli
from tests.support.generation import child
from tests.support.processes import reap, record, spawn

ESC_PAYLOAD = "\x1b]0;owned\x07\x1b[2J\x9b31m"  # retitle the terminal, clear the screen, a C1 CSI


def _job_with_generations(tmp_path: Path, n: int = 1, *, reason: str = "rank-failure") -> tuple[Path, object]:
    jd = tmp_path / "job"
    init_job(jd)
    led = open_job_ledger(jd)
    cert = led.require_active()
    for _ in range(n):
        cert = child(cert, (), key=led.key, reason=reason)
        led.activate(cert)
    return jd, cert


# --- A. outputs that cannot lie ------------------------------------------------------------------


def test_show_with_a_corrupt_newest_certificate_says_so_and_exits_2(tmp_path):
    """It used to report generation 1 as active, exit 0, while generation 2 lay corrupt on disk."""
    jd, _ = _job_with_generations(tmp_path, 1)
    (jd / "ledger" / "gen-2.json").write_text('{"generation": 2, "truncated')
    r = run_cli("gpu-generation", "show", "--job-dir", str(jd))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CORRUPT OR UNVERIFIABLE: generation(s) [2]" in r.stdout
    assert "active generation 1" not in r.stdout and "NOT VERIFIED" in r.stdout
    doc = json.loads(run_cli("gpu-generation", "show", "--job-dir", str(jd), "--json").stdout)
    assert doc["active"] is False and doc["unverified_after_active"] == [2]
    hist = run_cli("gpu-generation", "history", "--job-dir", str(jd))
    assert hist.returncode == 2 and "CORRUPT OR UNVERIFIABLE" in hist.stdout


def test_control_characters_from_records_are_escaped_in_human_output(tmp_path):
    jd, _ = _job_with_generations(tmp_path, 1, reason=f"rank-failure{ESC_PAYLOAD}")
    for cmd in ("show", "history"):
        r = run_cli("gpu-generation", cmd, "--job-dir", str(jd))
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\x9b" not in r.stdout and "\x07" not in r.stdout
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in run_cli("gpu-generation", "show", "--job-dir", str(jd)).stdout
    # the machine output keeps the record as it is (JSON escapes it)
    doc = json.loads(run_cli("gpu-generation", "show", "--job-dir", str(jd), "--json").stdout)
    assert doc["certificate"]["reason"].endswith(ESC_PAYLOAD)


@pytest.mark.parametrize(
    "argv",
    [
        ("gpu-doctor", "plan", "checkpoint", "--cost", "nan", "--failures-per-hour", "1"),
        ("gpu-doctor", "plan", "checkpoint", "--cost", "inf", "--failures-per-hour", "1"),
        ("gpu-doctor", "plan", "checkpoint", "--cost", "10", "--failures-per-hour", "-inf"),
        (
            "gpu-doctor",
            "plan",
            "collective",
            "--ranks",
            "8",
            "--bytes",
            "1e9",
            "--bandwidth",
            "1e9",
            "--latency",
            "nan",
        ),
        ("gpu-recover", "abort", "--job-dir", "/nonexistent", "--grace", "inf", "--dry-run"),
        ("gpu-doctor", "plan", "checkpoint", "--cost", "1e999", "--failures-per-hour", "1"),
        ("gpu-doctor", "plan", "collective", "--ranks", "8", "--bytes", "1e999", "--bandwidth", "1e9"),
    ],
)
def test_nan_and_infinity_are_usage_errors(argv):
    r = run_cli(*argv)
    assert r.returncode == 64, r.stdout + r.stderr
    assert "not a finite number" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_sigint_exits_130_with_one_line(tmp_path):
    jd = tmp_path / "job"
    init_job(jd)
    proc = subprocess.Popen(
        [str(BIN / "gpu-recover"), "verify", "--job-dir", str(jd), "--newer-than", "5", "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "GPUGUARD_DEBUG"},
    )
    try:
        time.sleep(3.0)  # started, and waiting for a certificate that will not come
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["gpu-recover: interrupted"] and "Traceback" not in err


def test_a_closed_stdout_ends_quietly_with_the_verdicts_exit_code(tmp_path):
    """`gpu-doctor diagnose node --demo | head -0`: the verdict (drain, 2) stays the exit code; it was 0."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    try:
        proc = subprocess.run(
            [str(BIN / "gpu-doctor"), "diagnose", "node", "--demo"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)
    assert proc.returncode == 2 and proc.stderr == ""


def test_an_output_write_error_is_74():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [str(BIN / "gpu-doctor"), "plan", "checkpoint", "--cost", "10", "--failures-per-hour", "1"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 74
    assert proc.stderr.strip().splitlines() == ["gpu-doctor: error: cannot write the output: No space left on device"]


# --- B. operator commands on-call can trust ----------------------------------------------------


def _active_with(jd: Path, procs: list[subprocess.Popen]) -> int:
    """Activate a generation whose members are `procs` (this host, real pids and start times)."""
    import psutil

    led = open_job_ledger(jd)
    parent = led.require_active()
    mem = tuple(
        Member(r, Incarnation(f"inc-{p.pid}", os.uname().nodename, p.pid, psutil.Process(p.pid).create_time()))
        for r, p in enumerate(procs)
    )
    cert = child(parent, mem, key=led.key, step=parent.frontier.step)
    led.activate(cert)
    return cert.generation


def test_abort_leaves_the_active_generation_alone_unless_include_active(tmp_path):
    jd = tmp_path / "job"
    init_job(jd)
    old, current = spawn(), spawn()
    try:
        record(jd, old, 0, generation=0)
        active = _active_with(jd, [current])
        record(jd, current, 0, generation=active)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(jd), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [old.pid] and old.wait(10) == -15
        assert current.poll() is None  # the running job's worker: never signalled by default
        (spared,) = details["left_alone"]
        assert f"pid {current.pid}" in spared and "ACTIVE generation" in spared and "--include-active" in spared
        assert details["quiescence"] == "active-running"  # never "proved" while the active generation runs
        r = run_cli("gpu-recover", "abort", "--job-dir", str(jd), "--yes", "--grace", "1", "--include-active", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["details"]["terminated"] == [current.pid] and current.wait(10) == -15
    finally:
        reap(old, current)


def test_abort_finds_the_active_generation_in_an_etcd_ledger(tmp_path, etcd_url):
    """The ledger is where `init` put it (ledger.url), not only <job-dir>/ledger/."""
    from urllib.parse import urlsplit

    u = urlsplit(etcd_url)
    jd = tmp_path / "job"
    init_job(jd, url=f"etcd://{u.hostname}:{u.port}/abort-{os.getpid()}-{time.time_ns()}")
    current = spawn()
    try:
        active = _active_with(jd, [current])
        record(jd, current, 0, generation=active)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(jd), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [] and current.poll() is None
        assert "ACTIVE generation" in details["left_alone"][0]
    finally:
        reap(current)


def test_abort_with_an_unreadable_ledger_leaves_generation_records_alone(tmp_path):
    """Which generation is active cannot be read (etcd down): a worker that may be the running job's
    is not signalled without --include-active."""
    from tests.support.cli import free_port

    jd = tmp_path / "job"
    jd.mkdir()
    (jd / "ledger.url").write_text(f"etcd://127.0.0.1:{free_port()}/gone\n")
    worker = spawn()
    try:
        record(jd, worker, 0, generation=4)
        r = run_cli("gpu-recover", "abort", "--job-dir", str(jd), "--yes", "--grace", "1", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        details = json.loads(r.stdout)["details"]
        assert details["terminated"] == [] and worker.poll() is None
        assert "may be the active one (ledger:" in details["left_alone"][0]
        r = run_cli("gpu-recover", "abort", "--job-dir", str(jd), "--yes", "--grace", "1", "--include-active")
        assert r.returncode == 0, r.stderr
        assert worker.wait(10) == -15
    finally:
        reap(worker)


def test_abort_confirmation_lists_host_pid_rank_generation_and_the_signal_plan(tmp_path):
    jd = tmp_path / "job"
    init_job(jd)
    current = spawn()
    try:
        active = _active_with(jd, [current])
        record(jd, current, 3, generation=active)
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            [str(BIN / "gpu-recover"), "abort", "--job-dir", str(jd), "--include-active", "--grace", "7"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "COLUMNS": "200"},
        )
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 60
        while b"[y/N]" not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        os.write(master, b"n\n")
        proc.wait(30)
        os.close(master)
        text = seen.decode(errors="replace").replace("\r", "")
        assert "abort will send SIGTERM to 1 process(es), then SIGKILL to any still alive after 7 s:" in text
        assert f"host {os.uname().nodename}  pid {current.pid}  rank 3  generation {active}  (ACTIVE generation)" in (
            text
        )
        assert "{" not in text  # not a Python dict
        assert proc.returncode == 4 and current.poll() is None  # answered no: nothing signalled
    finally:
        reap(current)


def _empty(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


@pytest.mark.parametrize(
    "argv",
    [
        ("gpu-recover", "abort", "--yes"),
        ("gpu-recover", "restore", "--yes"),
        ("gpu-recover", "verify"),
        ("gpu-recover", "status"),
        ("gpu-recover", "runbook", "run", "hang", "--yes"),
        ("gpu-recover", "rendezvous", "--state"),
        ("gpu-generation", "show"),
        ("gpu-generation", "history"),
        ("gpu-generation", "verify"),
        ("gpu-generation", "explain"),
    ],
)
@pytest.mark.parametrize("which", ["missing", "empty"])
def test_a_directory_that_is_no_job_fails_fast_with_66_and_writes_nothing(tmp_path, argv, which):
    """A typo'd job dir was answered with "run `gpu-generation init`"; `verify` waited 60 s and wrote
    an audit.log into the empty dir; `runbook run hang` reported "done"."""
    jd = tmp_path / "tpyo" if which == "missing" else _empty(tmp_path)
    t0 = time.monotonic()
    r = run_cli(*argv[:2], *argv[2:], "--job-dir", str(jd), timeout=60)
    assert r.returncode == 66, r.stdout + r.stderr
    assert f"no gpuguard job at {jd}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "init" not in r.stderr and time.monotonic() - t0 < 20
    assert not jd.exists() if which == "missing" else list(jd.iterdir()) == []


def test_drain_command_line_is_shell_quoted():
    summary = "drain: Xid 79 on GPU 0; $(reboot) `id` 'quoted'"
    line = drain_command_line("gpu17", summary)
    import shlex

    assert shlex.split(line) == drain_command("gpu17", summary)
    assert "'Reason=gpu-doctor: drain: Xid 79" in line
