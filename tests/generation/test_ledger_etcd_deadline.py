"""The etcd ledger's `--timeout` is a total deadline per call, not per socket read.

A real etcd sits behind a local TCP proxy; the proxy passes the request on and then stalls the
answer, or trickles it one byte per half second (each byte resets requests' per-read timeout of 1 s). Before
the deadline per call, `gpu-generation init` and `verify` hung on such an etcd.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.errors import UnavailableError
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import run_cli
from tests.support.generation import KEY, genesis

pytestmark = pytest.mark.etcd


class StallingProxy:
    """Loopback TCP proxy to etcd: requests pass; answers pass, stall, or trickle (a byte per 0.5 s)."""

    def __init__(self, upstream: tuple[str, int], mode: str = "pass") -> None:
        self.upstream, self.mode = upstream, mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.open: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "pass"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.mode), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, mode: str) -> None:
        try:
            while not self.stop.is_set():
                data = src.recv(65536)
                if not data:
                    return
                if mode == "stall":
                    self.stop.wait()
                    return
                if mode == "trickle":
                    for i in range(len(data)):  # faster than the 1 s per-read timeout, forever
                        dst.sendall(data[i : i + 1])
                        if self.stop.wait(0.5):
                            return
                else:
                    dst.sendall(data)
        except OSError:
            return

    def url(self, prefix: str) -> str:
        return f"etcd://127.0.0.1:{self.port}/{prefix}"

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for s in self.open:
            s.close()


@pytest.fixture
def upstream(etcd_url):
    u = urlsplit(etcd_url)
    return (u.hostname, u.port)


@pytest.fixture(params=["stall", "trickle"])
def proxy(request, upstream):
    p = StallingProxy(upstream, request.param)
    try:
        yield p
    finally:
        p.close()


def test_every_ledger_call_has_a_total_deadline(tmp_path, proxy):
    led = open_ledger(tmp_path, proxy.url(f"t-{uuid.uuid4().hex}"), key=KEY, timeout=1.0)
    start = time.monotonic()
    # a stall can be seen first by the socket read (1 s) or by the call's deadline (1 s): both are
    # "within 1 s"; a trickle only by the deadline, which is what the trickle case proves
    with pytest.raises(UnavailableError, match="within 1 s") as info:
        led.initialize(genesis())
    assert time.monotonic() - start < 2.0
    assert "\n" not in str(info.value)


def _cli(*args: str):
    start = time.monotonic()
    r = run_cli("gpu-generation", *args, timeout=60)
    return r, time.monotonic() - start


def test_init_and_verify_exit_75_within_the_timeout(tmp_path, upstream, proxy):
    prefix = f"t-{uuid.uuid4().hex}"
    direct = f"etcd://{upstream[0]}:{upstream[1]}/{prefix}"
    jd = tmp_path / "job"
    r, _ = _cli("init", "--job-dir", str(jd), "--ledger", direct)
    assert r.returncode == 0, r.stderr
    r, baseline = _cli("verify", "--job-dir", str(jd), "--ledger", direct, "--timeout", "1")
    assert r.returncode == 0, r.stderr  # start-up and a verify that etcd answers
    r, took = _cli("verify", "--job-dir", str(jd), "--ledger", proxy.url(prefix), "--timeout", "1")
    assert r.returncode == 75, r.stderr
    assert took < baseline + 1 + 1, (took, baseline)
    assert "within 1 s" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if proxy.mode == "trickle":  # every byte comes within the socket timeout: only the deadline can end it
        assert "did not answer within 1 s" in r.stderr, r.stderr
    r, took = _cli("init", "--job-dir", str(tmp_path / "job2"), "--ledger", proxy.url(prefix + "x"), "--timeout", "1")
    assert r.returncode == 75, r.stderr
    assert took < baseline + 1 + 1, (took, baseline)
