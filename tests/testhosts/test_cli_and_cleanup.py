"""The CLI across separate invocations (one state file), and teardown when the harness is killed."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from gpuguard.testhosts import SCHEMA, cleanup_all, leftovers
from tests.testhosts.helpers import wait_for


def cli_run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard.testhosts", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_drives_one_cluster_across_invocations(can_make_hosts, tmp_path) -> None:
    state = str(tmp_path / "cluster.json")
    up = cli_run("up", "--hosts", "2", "--state", state, "--json")
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    prefix = doc["prefix"]
    try:
        assert doc["schema"] == SCHEMA and [h["name"] for h in doc["hosts"]] == ["ctl", "h1", "h2"]
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
        # The hosts outlive the `up` process: another invocation runs a command on one.
        ran = cli_run("--state", state, "exec", "h2", "--", "hostname")
        assert (ran.returncode, ran.stdout.strip()) == (0, "h2")
        assert cli_run("--state", state, "exec", "h1", "--", "false").returncode == 1
        assert cli_run("--state", state, "partition", "h2").returncode == 0
        assert cli_run("--state", state, "freeze", "h1").returncode == 0
        status = json.loads(cli_run("--state", state, "status", "--json").stdout)
        by_name = {h["name"]: h for h in status["hosts"]}
        assert by_name["h2"]["partitioned"] and by_name["h1"]["frozen"] and not by_name["ctl"]["frozen"]
        assert cli_run("--state", state, "heal", "h2").returncode == 0
        assert cli_run("--state", state, "thaw", "h1").returncode == 0
        slow = cli_run("--state", state, "slow", "h1", "--delay-ms", "5")
        if status["capabilities"]["netem"]:
            assert slow.returncode == 0
        else:
            assert slow.returncode == 69 and "netem" in slow.stderr  # said, not silently ignored
        assert cli_run("--state", state, "slow", "h1", "--clear").returncode == 0
        off = cli_run("--state", state, "power-off", "--role", "rendezvous", "--json")
        assert json.loads(off.stdout)["host"] == "h1"
        human = cli_run("--state", state, "status").stdout
        assert "h1" in human and "power off" in human
        assert cli_run("--state", state, "exec", "h1", "--", "true").returncode == 75  # powered off
        assert cli_run("--state", state, "power-on", "h1").returncode == 0
        assert cli_run("--state", state, "exec", "h1", "--", "hostname").stdout.strip() == "h1"
        down = cli_run("--state", state, "down")
        assert down.returncode == 0, down.stderr
        assert not os.path.exists(state)
        assert not any(leftovers(prefix).values())
    finally:
        cleanup_all(prefix)


HARNESS = textwrap.dedent(
    """
    import signal, sys, time
    # the default disposition, as for a job a shell started: under `nohup` (how CI may be run)
    # SIGHUP is inherited ignored, and the harness then rightly leaves it ignored
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from gpuguard.testhosts import up
    cluster = up(1, etcd=False)
    cluster.exec("h1", [sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"])
    end = time.monotonic() + 30
    while len(cluster.pids("h1")) < 2 and time.monotonic() < end:  # its command runs inside the host
        time.sleep(0.02)
    print(cluster.prefix, flush=True)
    time.sleep(60)
    """
)


def _harness() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, text=True)
    prefix = proc.stdout.readline().strip()
    assert prefix, "the harness printed its cluster prefix"
    return proc, prefix


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_harness_removes_its_cluster(can_make_hosts, sig) -> None:
    proc, prefix = _harness()
    try:
        assert any(leftovers(prefix).values())
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == -sig  # it died of the signal, after tearing down
        assert leftovers(prefix) == {"netns": [], "links": [], "processes": [], "workdirs": []}
    finally:
        proc.kill()
        proc.wait(timeout=10)
        cleanup_all(prefix)


def test_a_sigkilled_harness_takes_its_hosts_down_and_cleanup_all_removes_the_rest(can_make_hosts) -> None:
    proc, prefix = _harness()
    try:
        proc.kill()
        proc.wait(timeout=10)
        # The owner pipe closed: every host's PID 1 (and so every process on it) exits by itself.
        assert wait_for(lambda: not leftovers(prefix)["processes"], 10)
        assert leftovers(prefix)["netns"]  # what only a teardown removes is still there ...
        report = cleanup_all(prefix)
        assert report.netns and report.links and report.workdirs
        assert leftovers(prefix) == {"netns": [], "links": [], "processes": [], "workdirs": []}  # ... until now
    finally:
        cleanup_all(prefix)
