"""A real 3-member etcd cluster on loopback, for the tests that lose etcd members.

Members are plain `etcd` processes (the Debian etcd-server binary) with data under a temporary
directory; `leader()` asks the members which of them leads. Every start and stop is bounded.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests.support.cli import free_port


@dataclass
class Member:
    name: str
    client: int
    peer: int
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client}"


@dataclass
class EtcdCluster:
    root: Path
    members: list[Member] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, size: int = 3, timeout: float = 30) -> EtcdCluster:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed: run .ci/setup (Debian package etcd-server)")
        c = cls(root, [Member(f"m{i}", free_port(), free_port()) for i in range(size)])
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in c.members)
        for m in c.members:
            m.proc = subprocess.Popen(
                [
                    etcd,
                    f"--name={m.name}",
                    f"--data-dir={root / m.name}",
                    f"--listen-client-urls=http://127.0.0.1:{m.client}",
                    f"--advertise-client-urls=http://127.0.0.1:{m.client}",
                    f"--listen-peer-urls=http://127.0.0.1:{m.peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{m.peer}",
                    f"--initial-cluster={initial}",
                    "--initial-cluster-state=new",
                    f"--initial-cluster-token=t{c.members[0].client}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        end = time.monotonic() + timeout
        while c.leader() is None:
            if time.monotonic() > end:
                c.stop()
                raise RuntimeError(f"the etcd cluster elected no leader within {timeout} s")
            time.sleep(0.2)
        # a write that commits on the quorum: every member serves from here on
        for m in c.members:
            while True:
                try:
                    r = requests.post(
                        f"http://{m.endpoint}/v3/kv/range", json={"key": base64.b64encode(b"x").decode()}, timeout=2
                    )
                    if r.ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > end:
                    c.stop()
                    raise RuntimeError(f"etcd member {m.name} does not serve within {timeout} s")
                time.sleep(0.2)
        return c

    def endpoints(self, first: Member | None = None) -> str:
        ordered = ([first] if first else []) + [m for m in self.members if m is not first]
        return ",".join(m.endpoint for m in ordered)

    def leader(self) -> Member | None:
        """The member that leads, as the live members report it (None while there is none)."""
        ids: dict[str, Member] = {}
        lead = None
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            try:
                st = requests.post(f"http://{m.endpoint}/v3/maintenance/status", json={}, timeout=1).json()
            except (requests.RequestException, json.JSONDecodeError):
                continue
            ids[st["header"]["member_id"]] = m
            if st.get("leader") not in (None, "0"):
                lead = st["leader"]
        return ids.get(lead) if lead else None

    def kill(self, m: Member) -> None:
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait(timeout=10)

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(timeout=10)


class SingleEtcd:
    """One etcd member on loopback with its own flags (TLS, auth token TTL): `endpoint` is
    127.0.0.1:PORT. `ready` is called with the endpoint until it returns without an exception."""

    def __init__(self, root: Path, *, scheme: str = "http", flags: tuple[str, ...] = ()) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed: run .ci/setup (Debian package etcd-server)")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                etcd,
                "--name=s",
                f"--data-dir={root}",
                f"--listen-client-urls={scheme}://{self.endpoint}",
                f"--advertise-client-urls={scheme}://{self.endpoint}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=s=http://127.0.0.1:{peer}",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self, ready, timeout: float = 30) -> SingleEtcd:
        end = time.monotonic() + timeout
        while True:
            try:
                ready(self.endpoint)
                return self
            except Exception:  # noqa: BLE001 - not serving yet
                if time.monotonic() > end or self.proc.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_plain_etcd(root: Path) -> SingleEtcd:
    """A single etcd on loopback (http), serving: for a test that changes the server for everyone
    on it (a compaction) or reads a server-wide count, never done on the shared test etcd."""
    from gpuguard.foundation.etcd import EtcdClient, parse_endpoints

    def ready(endpoint: str) -> None:
        with EtcdClient(parse_endpoints(endpoint), timeout=2.0) as client:
            client.get(b"/ready")

    return SingleEtcd(root).wait(ready)


def start_tls_etcd(root: Path):
    """A single etcd serving https only to clients with a certificate of a throw-away CA
    (`--client-cert-auth`): (the server, its `tls_certs.Certs`, the client's `TlsFiles`)."""
    from gpuguard.foundation.etcd import EtcdClient, TlsFiles, parse_endpoints
    from tests.support.tls_certs import make_certs

    certs = make_certs(root / "certs")
    tls = TlsFiles(True, str(certs.ca), str(certs.client_cert), str(certs.client_key))
    srv = SingleEtcd(
        root / "etcd",
        scheme="https",
        flags=(
            f"--cert-file={certs.server_cert}",
            f"--key-file={certs.server_key}",
            f"--trusted-ca-file={certs.ca}",
            "--client-cert-auth",
        ),
    )
    srv.wait(lambda ep: EtcdClient(parse_endpoints(ep), timeout=2, tls=tls).get(b"/ready"))
    return srv, certs, tls
