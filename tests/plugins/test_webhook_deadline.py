"""The webhook's `--budget` is a wall-clock deadline, held against a server that trickles its answer.

requests' timeout is per socket read: a server that sends one byte a second resets it forever, so
before the total deadline a sweep hung on such a webhook, kept the state dir's lock, and every later
cron sweep exited 75. The servers here are real sockets on loopback.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest

from gpuguard.foundation.errors import UnavailableError
from gpuguard.plugins.outputs import post_webhook
from tests.support.cli import run_cli
from tests.support.node import SAMPLE_LOG, SAMPLE_NVML

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000


class Trickler:
    """Accepts every connection, reads the request, then answers one byte per `pause` seconds."""

    def __init__(self, pause: float = 1.0) -> None:
        self.pause = pause
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                for i in range(len(ANSWER)):
                    if self.stop.wait(self.pause):
                        return
                    conn.sendall(ANSWER[i : i + 1])
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def trickler():
    t = Trickler()
    try:
        yield t
    finally:
        t.close()


def test_post_webhook_returns_within_its_budget_against_a_trickling_server(trickler):
    start = time.monotonic()
    with pytest.raises(UnavailableError, match="gave up") as info:
        post_webhook(f"http://127.0.0.1:{trickler.port}/x", {"a": 1}, timeout=5, retries=3, budget=2)
    took = time.monotonic() - start
    assert took < 2.5, took
    assert "no complete answer within" in str(info.value)
    assert "\n" not in str(info.value)


def test_each_try_has_a_total_deadline_too(trickler):
    start = time.monotonic()
    with pytest.raises(UnavailableError):
        post_webhook(f"http://127.0.0.1:{trickler.port}/x", {"a": 1}, timeout=0.5, retries=1, budget=30)
    took = time.monotonic() - start
    assert took < 2.0, took  # two tries of 0.5 s and a 0.5 s pause, not 30 s
    assert trickler.connections == 2


def test_sweep_against_a_trickling_webhook_keeps_its_budget_and_frees_the_lock(tmp_path, trickler):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)

    def sweep(*extra: str):
        start = time.monotonic()
        r = run_cli(
            "gpu-doctor",
            "sweep",
            "--kernel-log",
            str(log),
            "--nvml-snapshot",
            str(SAMPLE_NVML),
            "--state-dir",
            str(tmp_path / "state"),
            "--json",
            *extra,
            timeout=60,
        )
        return r, time.monotonic() - start

    _, baseline = sweep()  # start-up and the sweep itself, without a webhook
    r, took = sweep("--webhook", f"http://127.0.0.1:{trickler.port}/alert", "--budget", "2")
    assert took < baseline + 2 + 1, (took, baseline)
    assert r.returncode == 2  # the verdict's code: the notifier's failure is a warning
    doc = json.loads(r.stdout)
    assert doc["outputs"][0]["status"] == "failed" and "no complete answer" in doc["outputs"][0]["message"]
    again, _ = sweep("--webhook", f"http://127.0.0.1:{trickler.port}/alert", "--budget", "2")
    assert again.returncode != 75 and again.returncode == 2, again.stderr
