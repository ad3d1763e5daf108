"""The torch-free TCPStore client against a real c10d TCPStore server (torch's own)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation.errors import DataError, UnavailableError
from gpuguard.recovery.rendezvous.tcpstore import StoreClient, parse_endpoint


@pytest.fixture(scope="module")
def server():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store


def test_reads_and_writes_interoperate_with_torchs_client(server):
    server.set("tcp/a", "hello")
    with StoreClient("127.0.0.1", server.port, 5.0) as c:
        assert c.check("tcp/a") and not c.check("tcp/missing")
        assert c.get("tcp/a") == b"hello"
        assert c.get("tcp/missing") is None  # never blocks like torch's get
        assert c.compare_set("tcp/a", b"hello", b"world") == b"world"
        assert server.get("tcp/a") == b"world"
        assert c.compare_set("tcp/a", b"stale", b"x") == b"world"  # lost the race: current value back
        assert c.compare_set("tcp/new", b"", b"v1") == b"v1" and server.get("tcp/new") == b"v1"
        assert c.compare_set("tcp/absent", b"expected", b"v") == b"expected" and not server.check(["tcp/absent"])
        assert c.add("tcp/n", 3) == 3 and c.add("tcp/n", -1) == 2 and server.add("tcp/n", 0) == 2
        assert c.delete("tcp/new") and not c.delete("tcp/new")
        assert c.num_keys() >= 2


@settings(max_examples=40, deadline=None)
@given(key=st.text(min_size=1, max_size=40), value=st.binary(max_size=2048))
def test_any_key_and_value_round_trip(server, key, value):
    with StoreClient("127.0.0.1", server.port, 5.0) as c:
        cur = c.get(key) or b""
        c.compare_set(key, cur, value)
        assert c.get(key) == value
        assert server.get(key) == value


def test_unreachable_and_silent_servers_time_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UnavailableError):  # nothing listens
        StoreClient("127.0.0.1", port, 1.0).connect()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    conns = []
    threading.Thread(target=lambda: conns.append(silent.accept()), daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="timed out"):
            with StoreClient("127.0.0.1", silent.getsockname()[1], 0.5) as c:
                c.get("k")
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()


@given(st.text(max_size=60))
def test_parse_endpoint_never_crashes(text):
    try:
        host, port = parse_endpoint(text)
    except DataError:
        return
    assert host and 0 < port < 65536


def test_parse_endpoint_forms():
    assert parse_endpoint("node1:1234") == ("node1", 1234)
    assert parse_endpoint("node1") == ("node1", 29400)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    with pytest.raises(DataError):
        parse_endpoint("host:99999")
