"""foundation.identity.kill_confirmed / send_signal_checked on real processes: the recorded process and
no other is signalled (a start time that does not match is another process), a stopped one dies too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpuguard.foundation import identity

SLEEPER = "import time; print('ready', flush=True); time.sleep(300)"


@pytest.fixture(params=["pidfd", "psutil"])
def path(request, monkeypatch):
    """Both ways to the signal: a pidfd (Linux >= 5.3) and psutil's create-time re-check."""
    if request.param == "pidfd" and not identity._HAS_PIDFD:
        pytest.skip("no pidfd_open on this platform")
    monkeypatch.setattr(identity, "_HAS_PIDFD", request.param == "pidfd")
    return request.param


def _sleeper() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _start(proc: subprocess.Popen) -> float:
    return psutil.Process(proc.pid).create_time()


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_process_whose_start_time_differs_is_never_signalled(path):
    """The pid is the same, the start time is not: for the record it is a newer process (a reused pid)."""
    proc = _sleeper()
    try:
        assert identity.kill_confirmed(proc.pid, _start(proc) - 100.0, timeout=1.0)  # the recorded one is gone
        assert identity.send_signal_checked(proc.pid, _start(proc) + 100.0, signal.SIGTERM) == "gone"
        time.sleep(0.2)
        assert proc.poll() is None, "a process that is not the recorded one was signalled"
    finally:
        _reap(proc)


def test_the_matching_process_is_killed_and_confirmed_gone(path):
    proc = _sleeper()
    try:
        start = _start(proc)
        assert identity.kill_confirmed(proc.pid, start, timeout=5.0)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert identity.kill_confirmed(proc.pid, start, timeout=0.1)  # again: already gone, nothing sent
    finally:
        _reap(proc)


def test_a_stopped_process_dies_on_sigkill_too(path):
    proc = _sleeper()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while identity.process_status(proc.pid, _start(proc)) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert identity.process_status(proc.pid, _start(proc)) == "stopped"
        assert identity.kill_confirmed(proc.pid, _start(proc), timeout=5.0)
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        _reap(proc)


def test_sigterm_goes_to_the_recorded_process_only(path):
    proc = _sleeper()
    try:
        assert identity.send_signal_checked(proc.pid, _start(proc), signal.SIGTERM) == "sent"
        assert proc.wait(timeout=5) == -signal.SIGTERM
        assert identity.send_signal_checked(proc.pid, 0.0, signal.SIGTERM) == "gone"
    finally:
        _reap(proc)


def test_a_pid_nobody_holds_is_gone():
    pid = 2**22 + 12345  # above the usual pid_max: no such process
    assert identity.send_signal_checked(pid, 1.0, signal.SIGKILL) == "gone"
    assert identity.kill_confirmed(pid, 1.0, timeout=0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
def test_no_permission_is_not_a_kill(tmp_path):
    """Run as nobody, kill_confirmed of root's process: False (not signalled, not gone)."""
    victim = _sleeper()
    code = (
        "import sys; from gpuguard.foundation.identity import kill_confirmed; "
        f"print(kill_confirmed({victim.pid}, {_start(victim)!r}, timeout=0.5))"
    )
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
        if out.returncode != 0 and "Permission denied" in out.stderr:
            pytest.skip(f"nobody cannot run the interpreter here: {out.stderr.strip()[:120]}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False"
        assert victim.poll() is None
    finally:
        _reap(victim)
