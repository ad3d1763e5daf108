"""Shared fixtures: where things are, how to run the real console scripts, a real etcd server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from tests.support.cli import free_port, run_cli


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session", autouse=True)
def host_lease_dir(tmp_path_factory):
    """The jobs the tests start share their host's etcd lease through files in a host-local
    directory (recovery/runtime/host_lease.py; /dev/shm by default, kept until reboot): here, one
    under the session's temporary directory, which pytest removes. Each host's directory is named
    by its hostname and PID namespace, so namespace hosts still get one each."""
    if os.environ.get("GPUGUARD_HOST_LEASE_DIR"):
        yield os.environ["GPUGUARD_HOST_LEASE_DIR"]
        return
    path = tmp_path_factory.mktemp("host-lease")
    os.environ["GPUGUARD_HOST_LEASE_DIR"] = str(path)
    try:
        yield str(path)
    finally:
        os.environ.pop("GPUGUARD_HOST_LEASE_DIR", None)


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory) -> str:
    """A real etcd server on loopback: the one .ci/run started, or one started here."""
    url = os.environ.get("GPUGUARD_TEST_ETCD")
    if url:
        yield url  # a generator fixture must yield, even when the server is not ours
        return
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.fail("etcd is not installed: run .ci/setup (Debian package etcd-server)")
    data = tmp_path_factory.mktemp("etcd")
    port, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            etcd,
            "--name",
            "t",
            "--data-dir",
            str(data),
            "--listen-client-urls",
            f"http://127.0.0.1:{port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"t=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("etcd did not start within 20 s")
    os.environ["GPUGUARD_TEST_ETCD"] = f"http://127.0.0.1:{port}"
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)
