"""bench/cpu_hog.py, the bounded CPU hog of `bench/hosts.py --load`: each busy loop is a child of
the bench itself (no shell between them), ends by itself at its deadline, dies with a bench that dies
without stopping it, and is killed and reaped by `stop()`. No namespaces needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from cpu_hog import CpuHog, default_processes  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status waits for whoever adopted it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_each_loop_ends_by_itself_at_its_deadline():
    hog = CpuHog(2, seconds=0.5).start()
    try:
        deadline = time.monotonic() + 20  # generous: the machine may be crowded
        while time.monotonic() < deadline and any(p.poll() is None for p in hog.procs):
            time.sleep(0.05)
        assert [p.poll() for p in hog.procs] == [0, 0]  # exited on its own, cleanly, nobody killed it
    finally:
        hog.stop()


def test_loops_are_the_benchs_own_children_started_without_a_shell():
    with CpuHog(2, seconds=30) as hog:
        for p in hog.procs:
            assert isinstance(p.args, list) and p.args[0] == sys.executable
            proc = psutil.Process(p.pid)
            assert proc.ppid() == os.getpid()  # no shell (nor anything else) in between
            assert proc.cmdline()[:4] == [sys.executable, "-I", "-S", "-c"]
        pids = [p.pid for p in hog.procs]
    assert hog.procs == []
    assert _gone(pids, 5)


def test_stop_kills_and_reaps_loops_that_would_run_for_minutes():
    hog = CpuHog(3, seconds=300).start()
    pids = [p.pid for p in hog.procs]
    procs = list(hog.procs)
    assert all(p.poll() is None for p in procs)
    hog.stop()
    assert all(p.returncode is not None for p in procs)  # reaped: no zombie left behind
    assert _gone(pids, 5)


PARENT = (  # a bench that starts a hog and dies without stopping it
    "import json, os, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from cpu_hog import CpuHog\n"
    "hog = CpuHog(2, seconds=300).start()\n"
    "print(json.dumps([p.pid for p in hog.procs]), flush=True)\n"
    "sys.stdin.readline()\n"  # wait until the test has seen the loops running
    "os._exit(9)\n"
)


def test_loops_die_with_a_bench_that_dies_without_stopping_them():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(BENCH)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pids = json.loads(parent.stdout.readline())
    try:
        time.sleep(0.5)  # each loop asks for its parent-death signal first thing
        assert all(_running(p) for p in pids)
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.wait(timeout=10) == 9
        assert _gone(pids, 10)  # long before their 300 s deadline
    finally:
        for p in pids:  # only if the test failed: end what it started, by pid and only if it is still a loop
            try:
                if psutil.Process(p).cmdline()[:2] == [sys.executable, "-I"]:
                    os.kill(p, 9)
            except (psutil.Error, OSError):
                pass


@pytest.mark.parametrize(("processes", "seconds"), [(-1, 1.0), (1, 0.0), (1, -5.0), (1, float("nan"))])
def test_a_hog_without_bounds_is_refused(processes, seconds):
    with pytest.raises(ValueError):
        CpuHog(processes, seconds)


def test_default_is_two_loops_per_core():
    assert default_processes() == 2 * (os.cpu_count() or 1)
