"""The host lease (recovery.runtime.host_lease) with real rank processes against a real etcd.

Each rank is `tests.support.lease_rank`: it joins the host lease through
`EtcdCoordination.hold_lease` and checks the lease before every (pretend) write, as the runtime
does. Signals are real (SIGKILL, SIGSTOP/SIGCONT); keepalives are counted by etcd itself
(`etcd_debugging_lease_renewed_total`), not timed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from gpuguard.foundation.env import HOST_LEASE_DIR_ENV
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.host_lease import HostState
from tests.support.etcd_cluster import SingleEtcd

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

TTL = 3.0  # interval 1 s, margin 1.5 s: the project's loaded-host tests use 3-4 s
ROOT = Path(__file__).resolve().parents[3]


class Host:
    """N rank processes sharing one host directory and one job prefix."""

    def __init__(self, etcd_url: str, base: Path, ranks: int) -> None:
        u = urlsplit(etcd_url)
        self.etcd_url = etcd_url
        self.url = f"etcd://{u.hostname}:{u.port}/hostlease-{uuid.uuid4().hex}"
        self.base = base
        self.env = {**os.environ, HOST_LEASE_DIR_ENV: str(base)}
        self.coord = EtcdCoordination.from_url(self.url)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, dict] = {}
        for i in range(ranks):
            self.start(f"inc{i}")

    def start(self, inc: str) -> dict:
        p = subprocess.Popen(
            [sys.executable, "-m", "tests.support.lease_rank", self.url, inc, str(TTL)],
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=ROOT,
        )
        self.procs[inc] = p
        self.ready[inc] = self.line(inc, 30.0)
        assert self.ready[inc]["event"] == "ready", self.ready[inc]
        return self.ready[inc]

    def line(self, inc: str, timeout: float) -> dict:
        out = self.procs[inc].stdout
        assert out is not None
        r, _, _ = select.select([out], [], [], timeout)
        assert r, f"{inc}: nothing said within {timeout} s"
        raw = out.readline()
        assert raw, f"{inc}: exited (status {self.procs[inc].wait(5)}) without a word"
        return json.loads(raw)

    def state(self) -> HostState:
        (d,) = list(self.base.glob("gpuguard-lease-*"))
        st = HostState.from_json((d / "lease.json").read_bytes())
        assert st is not None
        return st

    def renewer(self) -> str:
        """The rank that wrote the last renewal (a beat after start: the joiner may have granted)."""
        by = self.state().by
        return next(inc for inc, r in self.ready.items() if r["pid"] == by)

    def alive(self) -> set[str]:
        return {inc for inc, p in self.procs.items() if p.poll() is None}

    def stop_all(self) -> dict[str, dict]:
        done = {}
        for inc, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                done[inc] = self.line(inc, 15.0)
                assert p.wait(15) == 0
        return done

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.coord.close()

    def renewed(self) -> float:
        """etcd's own count of lease renewals, server-wide: exact only on an etcd of this test's own."""
        with urllib.request.urlopen(self.etcd_url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("etcd_debugging_lease_renewed_total "):
                    return float(line.split()[1])
        raise AssertionError("etcd /metrics has no etcd_debugging_lease_renewed_total")


def _hosts(etcd_url: str, base: Path):
    made: list[Host] = []

    def make(ranks: int) -> Host:
        made.append(Host(etcd_url, base, ranks))
        return made[-1]

    try:
        yield make
    finally:
        for h in made:
            h.close()


@pytest.fixture
def host(etcd_url, tmp_path):
    yield from _hosts(etcd_url, tmp_path)


@pytest.fixture
def alone_host(tmp_path):
    """A host on an etcd of its own: etcd's renewal count is server-wide, and a lease some earlier
    test's process still keeps alive on the shared server would be counted as this host's (seen in CI)."""
    server = SingleEtcd(tmp_path / "etcd").wait(
        lambda ep: requests.post(f"http://{ep}/v3/kv/range", json={"key": "eA=="}, timeout=1).raise_for_status()
    )
    try:
        (tmp_path / "host").mkdir()
        yield from _hosts(f"http://{server.endpoint}", tmp_path / "host")
    finally:
        server.stop()


def test_one_lease_one_renewer_and_the_hosts_keepalives_are_one_renewers(alone_host):
    h = alone_host(0)
    before, t_before = h.renewed(), time.monotonic()
    h.start("inc0")  # grants the lease
    t0 = time.monotonic()
    for i in range(1, 4):
        h.start(f"inc{i}")
    assert len({r["lease"] for r in h.ready.values()}) == 1  # one lease for the host
    assert sum(r["renewer"] for r in h.ready.values()) == 1  # one renewer, elected by the flock
    assert h.coord.expired(h.procs) == frozenset()  # every rank's key rides on it
    writers = set()
    while time.monotonic() - t0 < 6 * TTL / 3:  # six keepalive intervals
        time.sleep(0.25)
        writers.add(h.state().by)
    done = h.stop_all()
    t1 = time.monotonic()
    renewals, sent = h.renewed() - before, sum(d["sent"] for d in done.values())
    assert writers == {next(r["pid"] for r in h.ready.values() if r["renewer"])}  # the elected one renewed
    # one renewer's share (plus a beat for the intervals' edges), not four ranks' (about 4 x 6)
    assert renewals <= (t1 - t_before) / (TTL / 3) + 2, (renewals, t1 - t_before, done)
    assert renewals >= (t1 - t0) / (TTL / 3) - 2, (renewals, t1 - t0, done)
    assert sent == renewals or sent == renewals + 1, (sent, renewals)  # the last may be in flight at exit


@pytest.mark.parametrize("who", ["renewer", "another rank"])
def test_a_rank_killed_on_a_live_host_fences_nobody_and_its_key_goes(host, who):
    h = host(3)
    time.sleep(TTL / 3 + 0.3)  # one renewal: `by` names the renewer
    renewer = h.renewer()
    victim = renewer if who == "renewer" else next(i for i in h.procs if i != renewer)
    h.procs[victim].send_signal(signal.SIGKILL)
    h.procs[victim].wait(10)
    time.sleep(3 * TTL)  # the dead rank's own lease would have expired twice over
    assert h.alive() == set(h.procs) - {victim}  # nobody fenced: the host's lease lives on
    st = h.state()
    assert st.by != h.ready[victim]["pid"]  # someone else renews now
    # its key went on the proof its own host gives (process gone), others' stay
    assert h.coord.expired(h.procs) == frozenset({victim})
    assert all(d["event"] == "done" and d["valid"] for d in h.stop_all().values())


def test_a_frozen_host_loses_the_lease_for_every_rank_which_fence_on_waking(host):
    h = host(3)
    for p in h.procs.values():
        p.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + TTL + 5.0  # expiry, plus etcd's sweep, on a loaded host
    while h.coord.expired(h.procs) != frozenset(h.procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert h.coord.expired(h.procs) == frozenset(h.procs)  # all at once: one lease
    for p in h.procs.values():
        p.send_signal(signal.SIGCONT)
    for inc, p in h.procs.items():
        said = h.line(inc, 10.0)
        assert said["event"] == "fenced", said
        assert p.wait(10) == 4


@pytest.mark.parametrize("who", ["renewer", "another rank"])
def test_a_rank_frozen_alone_loses_its_key_fences_on_waking_and_nobody_else_fences(host, who):
    h = host(3)
    time.sleep(TTL / 3 + 0.3)
    renewer = h.renewer()
    victim = renewer if who == "renewer" else next(i for i in h.procs if i != renewer)
    h.procs[victim].send_signal(signal.SIGSTOP)  # a renewer keeps its flock: a host-mate renews for it
    deadline = time.monotonic() + 3 * TTL
    while h.coord.expired(h.procs) != {victim} and time.monotonic() < deadline:
        time.sleep(0.2)
    # its host-mates deleted its key (it did not run for the margin) and still hold theirs
    assert h.coord.expired(h.procs) == frozenset({victim})
    time.sleep(TTL)
    assert h.alive() == set(h.procs) and h.coord.expired(h.procs) == frozenset({victim})
    h.procs[victim].send_signal(signal.SIGCONT)
    said = h.line(victim, 10.0)
    assert said["event"] == "fenced" and "did not run for" in said["why"], said
    assert h.procs[victim].wait(10) == 4
    done = h.stop_all()
    assert all(d["event"] == "done" and d["valid"] for d in done.values()), done
    if who == "renewer":
        assert sum(d["backups"] for d in done.values()) >= 2  # renewals sent while the renewer was overdue
