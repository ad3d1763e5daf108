"""`gpu-doctor watch node` (doctor.watcher) for real: a FIFO and a pty fed here stand in for /dev/kmsg;
the textfile must show each new Xid within a second (p99 over 100 events), an NVML event re-judges at
once, SIGTERM leaves a consistent state, idle costs no CPU, and a regular file is followed across a
rotation."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.doctor import sweep as state_store
from tests.support.cli import BIN
from tests.support.node import healthy_gpu, snapshot, write_json

XID13 = "[Fri Aug 30 11:43:{s:02d} 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid={pid}, name=python3, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter\n"
EVENTS = 100


def _xid_count(prom: Path) -> int:
    try:
        text = prom.read_text()
    except FileNotFoundError:
        return -1
    m = re.search(r'gpudoctor_gpu_xid_events_total\{pci_bus_id="0000:cb:00.0",xid="13"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def _wait_for(check, timeout: float = 10.0, step: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("timed out waiting")


class WatchProcess:
    """The watcher as a child process: healthy NVML (a recorded snapshot), a textfile, npd lines on stdout."""

    def __init__(self, tmp: Path, kernel_log: str, *extra: str, env: dict | None = None) -> None:
        self.state = tmp / "state"
        self.state.mkdir(exist_ok=True)
        self.prom = tmp / "gpu.prom"
        snap = write_json(tmp / "nvml.json", snapshot(healthy_gpu(0, "0000:cb:00.0")))
        nvml = () if "--no-snapshot" in extra else ("--nvml-snapshot", str(snap))
        args = [a for a in extra if a != "--no-snapshot"]
        cmd = [str(BIN / "gpu-doctor"), "watch", "node", "--kernel-log", kernel_log, "--state-dir", str(self.state)]
        cmd += ["--textfile", str(self.prom), "--format", "npd", *nvml, *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        _wait_for(lambda: self.prom.exists(), timeout=30)  # the first judgement is published

    def stop(self) -> tuple[int, str, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err


def _latencies(write, prom: Path, n: int) -> list[float]:
    out = []
    for i in range(1, n + 1):
        start = time.monotonic()
        write(XID13.format(s=i % 60, pid=1000 + i))
        _wait_for(lambda i=i: _xid_count(prom) >= i, timeout=10)
        out.append(time.monotonic() - start)
    return out


def test_a_fifo_fed_100_xids_updates_the_textfile_within_a_second(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    w = WatchProcess(tmp_path, str(fifo))
    try:
        fd = os.open(fifo, os.O_WRONLY)
        try:
            lat = _latencies(lambda line: os.write(fd, line.encode()), w.prom, EVENTS)
        finally:
            os.close(fd)
    finally:
        code, out, err = w.stop()
    p50, p99 = statistics.median(lat), sorted(lat)[int(0.99 * len(lat)) - 1]
    print(f"watch node FIFO: {EVENTS} Xids, evidence -> textfile p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    assert p99 <= 1.0, (p50, p99)
    assert code == 0, err  # SIGTERM: a clean exit
    assert len(out.splitlines()) >= EVENTS  # one NPD line per judgement
    state = json.loads((w.state / state_store.STATE_FILE).read_text())  # consistent, complete JSON
    assert state["xid_totals"] == {"0000:cb:00.0|13": EVENTS}


def test_a_pty_is_followed_like_a_terminal(tmp_path):
    master, slave = pty.openpty()
    os.set_blocking(master, True)
    w = WatchProcess(tmp_path, os.ttyname(slave))
    try:
        lat = _latencies(lambda line: os.write(master, line.encode()), w.prom, 10)
    finally:
        code, _, err = w.stop()
        os.close(master)
        os.close(slave)
    assert max(lat) <= 1.0 and code == 0, (lat, err)


def test_a_regular_file_is_followed_across_a_rotation(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    w = WatchProcess(tmp_path, str(log), "--poll", "0.05")
    try:
        with open(log, "a") as fh:
            fh.write(XID13.format(s=1, pid=1))
        _wait_for(lambda: _xid_count(w.prom) >= 1)
        log.rename(tmp_path / "kern.log.1")  # logrotate: rename, then a new file
        with open(log, "w") as fh:
            fh.write(XID13.format(s=2, pid=2))
        _wait_for(lambda: _xid_count(w.prom) >= 2)
    finally:
        code, _, err = w.stop()
    assert code == 0, err
    assert _xid_count(w.prom) == 2  # the new file's line, once; the old one not read twice


def test_sigterm_mid_stream_leaves_the_old_or_the_new_state(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    w = WatchProcess(tmp_path, str(fifo))
    fd = os.open(fifo, os.O_WRONLY)
    try:
        for i in range(200):  # a storm, and SIGTERM in the middle of it
            os.write(fd, XID13.format(s=i % 60, pid=i).encode())
        code, _, err = w.stop()
    finally:
        os.close(fd)
    assert code == 0, err
    state, notes = state_store.load_state(w.state / state_store.STATE_FILE)
    assert notes == [] and 0 <= sum(state["xid_totals"].values()) <= 200  # the old state or a newer one
    assert not list(w.state.glob("*.tmp*")), "no temporary file left behind"


def test_idle_costs_no_cpu(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    w = WatchProcess(tmp_path, str(fifo))
    try:
        time.sleep(1.0)
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = Path(f"/proc/{w.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks

        before, t0 = cpu(), time.monotonic()
        time.sleep(5.0)
        used, elapsed = cpu() - before, time.monotonic() - t0
    finally:
        w.stop()
    print(f"watch node idle: {100 * used / elapsed:.3f} % of a core over {elapsed:.1f} s")
    assert used / elapsed <= 0.01  # 1 % over 5 s here (the 60 s figure is bench/node.py's: <= 0.1 %)


def test_an_nvml_event_re_judges_at_once(tmp_path):
    """Live NVML (the fake), no kernel-log line: an NVML Xid event makes the watcher probe NVML again and
    publish the new state within a second, not at its 60 s NVML interval."""
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    snap_path = tmp_path / "fake-nvml.json"
    write_json(snap_path, snapshot(healthy_gpu(0, "0000:cb:00.0")))
    events = tmp_path / "nvml-events.jsonl"
    events.write_text("")
    fakes = str(Path(__file__).resolve().parents[1] / "support" / "fakes")
    env = {
        "PYTHONPATH": os.pathsep.join([fakes, os.environ.get("PYTHONPATH", "")]),
        "GPUGUARD_FAKE_NVML": str(snap_path),
        "GPUGUARD_FAKE_NVML_EVENTS": str(events),
    }
    w = WatchProcess(tmp_path, str(fifo), "--no-snapshot", env=env)
    try:
        assert 'gpudoctor_node_verdict{verdict="healthy"} 1.0' in w.prom.read_text()
        sick = healthy_gpu(0, "0000:cb:00.0")
        sick["remapped_rows"] = {**(sick.get("remapped_rows") or {}), "pending": True}
        write_json(snap_path, snapshot(sick))
        start = time.monotonic()
        with open(events, "a") as fh:
            fh.write(json.dumps({"type": 8, "data": 63, "index": 0}) + "\n")
        _wait_for(lambda: 'gpudoctor_node_verdict{verdict="reset"} 1.0' in w.prom.read_text(), timeout=10)
        took = time.monotonic() - start
    finally:
        code, _, err = w.stop()
    assert took <= 1.0 and code == 0, (took, err)


@pytest.mark.parametrize("args,code", [(("--poll", "0"), 64), (("--format", "nagios"), 64)])
def test_bad_options_are_usage_errors(tmp_path, args, code):
    r = subprocess.run(
        [str(BIN / "gpu-doctor"), "watch", "node", "--kernel-log", str(tmp_path / "x"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, r.stderr
