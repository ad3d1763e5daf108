"""The one etcd client against real etcd: a lost reply is "outcome unknown" (never re-sent), every
call ends by its total deadline, a request too large says so, TLS with client certificates, auth.

The double-CAS test runs on a real 3-member cluster: a loopback proxy in front of the first member
passes the compare-and-swap on, waits for etcd's answer and resets the client's connection. A
client that re-sent on any error (the old rendezvous client's policy) would apply the CAS on the
second member too, or report a CAS it won as lost.
"""

from __future__ import annotations

import json
import time
import uuid
from urllib.parse import urlsplit

import pytest

from gpuguard.foundation.errors import EXIT_DATAERR, EXIT_NOPERM, GpuguardError, UnavailableError
from gpuguard.foundation.etcd import (
    EtcdClient,
    EtcdOutcomeUnknown,
    EtcdRequestFailed,
    EtcdRequestTooLarge,
    EtcdUnavailable,
    compare,
    parse_endpoints,
    put_op,
)
from gpuguard.generation.ledger_open import open_ledger
from tests.support.cli import run_cli
from tests.support.etcd_cluster import EtcdCluster, SingleEtcd, start_tls_etcd
from tests.support.generation import KEY, genesis
from tests.support.tcp_faults import ReplyDroppingProxy, TricklingServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EtcdCluster.start(tmp_path_factory.mktemp("etcd3"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def endpoint(etcd_url) -> str:
    u = urlsplit(etcd_url)
    return f"{u.hostname}:{u.port}"


def _client(endpoints: str, **kw) -> EtcdClient:
    return EtcdClient(parse_endpoints(endpoints), **{"timeout": 5.0, **kw})


# -- one failover policy --------------------------------------------------------------------------


def test_a_cas_whose_reply_was_lost_is_applied_once_and_reported_unknown(cluster):
    first, second, third = cluster.members
    direct = _client(second.endpoint)
    key, guard, log = (f"/t/{uuid.uuid4().hex}/{k}".encode() for k in ("cas", "guard", "log"))
    direct.put(key, "v0")
    direct.put(guard, "ok")
    proxy = ReplyDroppingProxy(("127.0.0.1", first.client))
    client = _client(f"{proxy.endpoint},{second.endpoint},{third.endpoint}")
    try:
        # a compare-and-swap on the key's version: etcd applies it, the reply is lost
        with pytest.raises(EtcdOutcomeUnknown, match=r"outcome unknown; not re-sent") as info:
            client.txn("test cas", [compare(key, "VERSION", 1)], [put_op(key, "v1")])
        assert "\n" not in str(info.value) and proxy.endpoint in str(info.value)
        kv = direct.get(key)
        assert (kv.value, kv.version) == (b"v1", 2), kv  # applied exactly once
        # a write whose guard would still hold on a second member: applied once, not twice
        with pytest.raises(EtcdOutcomeUnknown):
            client.txn("test append", [compare(guard, "VALUE", "ok")], [put_op(log, "entry")])
        assert direct.get(log).version == 1
        with pytest.raises(EtcdOutcomeUnknown):
            client.put(log, "again")
        assert direct.get(log).version == 2
        assert proxy.requests == proxy.answered == 3  # each reached etcd once, through the proxy only
        # a read is idempotent: the same lost reply sends it on to the next member
        assert client.get(key).value == b"v1" and proxy.requests == 4
        assert isinstance(info.value, UnavailableError) and info.value.exit_code == 75
    finally:
        proxy.close()
        client.close()
        direct.close()


def test_a_member_that_refuses_connections_is_skipped_for_writes_too(cluster):
    _, second, _ = cluster.members
    dead = f"127.0.0.1:{_closed_port()}"
    client = _client(f"{dead},{second.endpoint}")
    key = f"/t/{uuid.uuid4().hex}".encode()
    got = client.txn("test create", [compare(key, "CREATE", 0)], [put_op(key, "x")])
    assert got["succeeded"] and _client(second.endpoint).get(key).version == 1


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a total deadline per call ------------------------------------------------------------------------


@pytest.fixture
def trickler():
    srv = TricklingServer(interval=1.0)
    yield srv
    srv.close()


@pytest.mark.parametrize("call", ["read", "write"])
def test_a_trickling_member_ends_every_call_by_its_deadline(trickler, call):
    client = _client(trickler.endpoint, timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="within 2 s") as info:
        if call == "read":
            client.get(b"/k")
        else:
            client.txn("test write", [], [put_op(b"/k", b"v")])
    took = time.monotonic() - t0
    assert 1.9 < took < 4.0, took  # 2 s, and the slack a loaded 2-core host needs to wake
    assert isinstance(info.value, EtcdOutcomeUnknown) == (call == "write")
    assert trickler.requests == 1  # the write was not re-sent; the read had no other member


def test_the_ledger_on_a_trickling_member_fails_within_its_timeout(tmp_path, trickler):
    led = open_ledger(tmp_path, f"etcd://{trickler.endpoint}/p", key=KEY, timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match="did not answer within 2 s"):
        led.initialize(genesis())
    assert time.monotonic() - t0 < 4.0  # 2 s and the slack of a loaded host
    r = run_cli("gpu-generation", "init", "--job-dir", str(tmp_path / "job"), "--ledger",
                f"etcd://{trickler.endpoint}/p", "--timeout", "2", timeout=60)  # fmt: skip
    assert r.returncode == 75 and r.stderr.count("\n") == 1 and "did not answer within 2 s" in r.stderr, r.stderr
    assert not (tmp_path / "job").exists()


# -- sizes ---------------------------------------------------------------------------------------------------


def test_a_request_too_large_for_etcd_says_so_with_the_limit_and_the_size(endpoint):
    key = f"/t/{uuid.uuid4().hex}".encode()
    value = b"x" * (2 << 20)
    with _client(endpoint) as client:
        with pytest.raises(EtcdRequestTooLarge) as info:  # refused here, before it is sent
            client.put(key, value)
        text = str(info.value)
        assert "too large" in text and "1,572,864" in text and f"{len(key) + len(value):,}" in text
        assert "Bad Request" not in text and info.value.exit_code == EXIT_DATAERR
    # a client that believes the limit is higher: etcd's own refusal reads the same
    with _client(endpoint, max_request_bytes=64 << 20) as client:
        for big in (b"x" * (1536 << 10), b"x" * (3 << 20)):  # etcd's request limit, then gRPC's
            with pytest.raises(EtcdRequestTooLarge, match="too large for etcd") as info:
                client.txn("test put", [], [put_op(key, big)])
            assert "Bad Request" not in str(info.value) and "etcd said" in str(info.value)
        assert client.get(key) is None
    with _client(endpoint, max_answer_bytes=1024) as client:
        client.put(key, b"y" * 2000)
        with pytest.raises(EtcdRequestFailed, match="over the 1,024-byte cap"):
            client.get(key)


# -- TLS and auth ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    srv, certs, _ = start_tls_etcd(tmp_path_factory.mktemp("tls"))
    yield srv, certs
    srv.stop()


def test_the_ledger_over_tls_with_a_client_certificate(tls_etcd, tmp_path):
    srv, certs = tls_etcd
    url = f"etcd://{srv.endpoint}/tls?cacert={certs.ca}&cert={certs.client_cert}&key={certs.client_key}"
    job = tmp_path / "job"
    r = run_cli("gpu-generation", "init", "--job-dir", str(job), "--ledger", url, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    show = run_cli("gpu-generation", "show", "--job-dir", str(job), "--json", timeout=60)
    assert show.returncode == 0 and json.loads(show.stdout)["certificate"]["generation"] == 0, show.stderr
    led = open_ledger(job, url)
    assert led.require_active().generation == 0 and led.url.startswith("etcds://")
    # no client certificate, or a CA that did not sign etcd's: refused, one line, nothing re-sent
    for bad, why in (
        (f"etcd://{srv.endpoint}/tls?cacert={certs.ca}", "TLS"),
        (f"etcd://{srv.endpoint}/tls?cacert={certs.other_ca}&cert={certs.client_cert}&key={certs.client_key}",
         "certificate not accepted"),
    ):  # fmt: skip
        r = run_cli("gpu-generation", "show", "--job-dir", str(job), "--ledger", bad, "--timeout", "3", timeout=60)
        assert r.returncode == 75 and why in r.stderr and r.stderr.count("\n") == 1, r.stderr
    plain = run_cli("gpu-generation", "show", "--job-dir", str(job), "--ledger", f"etcd://{srv.endpoint}/tls",
                    "--timeout", "3", timeout=60)  # fmt: skip
    assert plain.returncode == 75, plain.stderr  # http to an https member never gets an answer


def _auth(endpoint: str, password: str) -> None:
    """root with `password`, auth enabled (etcd's own v3 API, through our client)."""
    c = _client(endpoint)
    c.call("auth/user/add", {"name": "root", "password": password}, "test")
    c.call("auth/user/grant", {"user": "root", "role": "root"}, "test")
    c.call("auth/enable", {}, "test")


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    srv = SingleEtcd(tmp_path_factory.mktemp("etcd-auth"), flags=("--auth-token=simple", "--auth-token-ttl=2"))
    srv.wait(lambda ep: _client(ep, timeout=2).get(b"/ready"))
    _auth(srv.endpoint, "s3cr3t-Pass")
    yield srv
    srv.stop()


def test_user_and_password_authenticate_and_a_stale_token_is_renewed(auth_etcd, tmp_path):
    url = f"etcd://root:s3cr3t-Pass@{auth_etcd.endpoint}/auth"
    led = open_ledger(tmp_path, url, key=KEY)
    led.initialize(genesis())
    assert led.require_active().generation == 0
    assert "s3cr3t" not in led.url and "root:***@" in led.url
    time.sleep(3.5)  # past the token's TTL: etcd says "invalid auth token", the client logs in again
    assert open_ledger(tmp_path, url, key=KEY).require_active().generation == 0
    assert led.require_active().generation == 0  # the same client, its token renewed once
    with pytest.raises(GpuguardError) as info:
        open_ledger(tmp_path, f"etcd://{auth_etcd.endpoint}/auth", key=KEY).require_active()
    assert info.value.exit_code == EXIT_NOPERM and "credentials" in str(info.value)
    r = run_cli("gpu-generation", "init", "--job-dir", str(tmp_path / "job"), "--ledger",
                f"etcd://root:wrong-Pass@{auth_etcd.endpoint}/auth", timeout=60)  # fmt: skip
    assert r.returncode == EXIT_NOPERM and "wrong-Pass" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "refused the credentials of user 'root'" in r.stderr


def test_no_command_shows_the_password_and_ledger_url_is_owner_only(auth_etcd, tmp_path):
    """`init --ledger URL-with-a-password`: every later output names the ledger as `root:***@`."""
    job = tmp_path / "job"
    url = f"etcd://root:s3cr3t-Pass@{auth_etcd.endpoint}/cli-{uuid.uuid4().hex[:6]}"
    outputs = []
    for prog, *args in (
        ("gpu-generation", "init", "--ledger", url),
        ("gpu-generation", "show"),
        ("gpu-generation", "show", "--json"),
        ("gpu-generation", "history", "--json"),
        ("gpu-generation", "verify", "--json"),
        ("gpu-generation", "explain", "--json"),
        ("gpu-recover", "status", "--json"),
        ("gpu-recover", "verify", "--json", "--ledger", url, "--timeout", "1"),
    ):
        r = run_cli(prog, *args, "--job-dir", str(job), timeout=60)
        outputs.append((args, r.returncode, r.stdout + r.stderr))
    assert outputs[0][1] == 0 and outputs[2][1] == 0, outputs[:3]
    for args, _, text in outputs:
        assert "s3cr3t" not in text, (args, text)
    assert "root:***@" in outputs[2][2]
    assert (job / "ledger.url").stat().st_mode & 0o077 == 0  # it holds the password
    audit = job / "audit.log"  # `gpu-recover verify` records its arguments: the URL redacted
    assert not audit.exists() or "s3cr3t" not in audit.read_text(errors="replace")
