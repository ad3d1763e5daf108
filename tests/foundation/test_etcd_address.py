"""etcd URLs and endpoint lists: parsing, printing, refusing, and credentials that are never shown."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpuguard.foundation.errors import GpuguardError, UsageError
from gpuguard.foundation.etcd import (
    DEFAULT_MAX_REQUEST_BYTES,
    EtcdClient,
    EtcdUrl,
    TlsFiles,
    etcd_ports,
    parse_endpoints,
    parse_etcd_url,
    redact,
    request_bytes,
    split_endpoints,
)

hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z0-9]{1,5}){0,2}", fullmatch=True)
ports = st.integers(1, 65535)
prefixes = st.from_regex(r"(/[a-z0-9_-]{1,8}){1,3}", fullmatch=True)
NO_ENV: dict[str, str] = {}


@given(st.lists(st.tuples(hosts, ports), min_size=1, max_size=5), prefixes)
def test_an_etcd_url_round_trips(endpoints, prefix):
    url = EtcdUrl(tuple(endpoints), prefix)
    assert parse_etcd_url(str(url), NO_ENV) == url


@given(st.text(max_size=40))
def test_any_text_is_a_url_or_one_usage_error(text):
    try:
        got = parse_etcd_url(text, NO_ENV)
    except UsageError as exc:
        assert "\n" not in str(exc)
        return
    assert got.endpoints and all(0 < p < 65536 for _, p in got.endpoints)


def test_every_member_needs_its_port_and_the_scheme_is_checked():
    assert parse_etcd_url("etcd://a:1,[::1]:2/p/q", NO_ENV).endpoints == (("a", 1), ("::1", 2))
    assert parse_etcd_url("etcd://a:1", NO_ENV).prefix == "/gpuguard"
    for bad in ("etcd://a,b:2/p", "etcd://a:0/p", "redis://a:1/p", "etcd:///p", "a:1/p", "etcd://a:1/p?nope=1"):
        with pytest.raises(UsageError):
            parse_etcd_url(bad, NO_ENV)
    assert split_endpoints("a, b:7") == [("a", 2379), ("b", 7)]
    assert [str(e) for e in parse_endpoints("[::1]:5,h")] == ["[::1]:5", "h:2379"]


def test_tls_and_limits_come_from_the_url_or_the_environment():
    u = parse_etcd_url("etcd://h:1/p?cacert=/ca.pem&cert=/c.pem&key=/k.pem&max_request_bytes=4096", NO_ENV)
    assert u.tls == TlsFiles(True, "/ca.pem", "/c.pem", "/k.pem") and u.max_request_bytes == 4096
    assert parse_etcd_url(str(u), NO_ENV) == u
    assert parse_etcd_url("etcds://h:1/p", NO_ENV).tls == TlsFiles(True)
    assert parse_etcd_url("etcd://h:1/p", NO_ENV).tls == TlsFiles(False)
    env = {"GPUGUARD_ETCD_CACERT": "/env-ca.pem"}
    assert parse_etcd_url("etcd://h:1/p", env).tls == TlsFiles(True, "/env-ca.pem")
    assert parse_etcd_url("etcd://h:1/p?cacert=/u.pem", env).tls.cacert == "/u.pem"  # the URL wins
    assert parse_etcd_url("etcd://h:1/p", NO_ENV).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    with pytest.raises(UsageError, match="max_request_bytes"):
        parse_etcd_url("etcd://h:1/p?max_request_bytes=12", NO_ENV)
    with pytest.raises(UsageError, match="cannot load the CA file"):
        EtcdClient.from_url(parse_etcd_url("etcd://h:1/p?cacert=/nonexistent.pem", NO_ENV))


def test_the_ports_of_a_ledger_url():
    assert etcd_ports("etcd://u:pw@a:1,[::1]:2379/x") == [1, 2379]
    assert etcd_ports("etcds://a:7/x?cacert=/c") == [7]
    for other in (None, "", "/some/dir", "file:///x", "etcd://broken", "dir"):
        assert etcd_ports(other) == []


def test_request_size_counts_decoded_keys_and_values():
    from gpuguard.foundation.etcd import put_op

    body = {"compare": [], "success": [put_op(b"k" * 10, b"v" * 1000), put_op("x", "")]}
    assert request_bytes(body) == 1011


# -- credentials ---------------------------------------------------------------------------------

SECRET = "Zq9SECRET"  # every generated password holds it, nothing else does
passwords = st.text(min_size=0, max_size=12).map(lambda t: SECRET + t)
users = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=8)


def _outputs(url: str) -> list[str]:
    """Everything gpuguard may print about this URL: the parsed URL, its repr, JSON, the client's
    name and repr, or the one-line error of a URL that does not parse."""
    out = [redact(url)]
    try:
        u = parse_etcd_url(url, NO_ENV)
    except GpuguardError as exc:
        return [*out, str(exc), repr(exc)]
    client = EtcdClient.from_url(u)
    return [*out, str(u), repr(u), json.dumps({"ledger": str(u)}), client.name, repr(client), repr(u.endpoints)]


@given(users, passwords, st.lists(st.tuples(hosts, ports), min_size=1, max_size=3), prefixes, st.booleans())
def test_no_output_of_a_url_with_credentials_holds_the_password(user, password, members, prefix, encode):
    netloc = ",".join(f"{h}:{p}" for h, p in members)
    shown_password = quote(password, safe="") if encode else password
    url = f"etcd://{user}:{shown_password}@{netloc}{prefix}"
    for text in _outputs(url):
        assert SECRET not in text, text
    if encode:  # a well-formed URL keeps its user and shows the password as ***
        u = parse_etcd_url(url, NO_ENV)
        assert u.password == password and u.user == user
        assert str(u).startswith(f"etcd://{quote(user, safe='')}:***@")


@given(st.text(max_size=30), passwords, st.text(max_size=30))
def test_no_error_of_a_malformed_url_holds_the_password(before, password, after):
    assume("@" not in after)
    token = password.replace(":", "")  # a lone name (a token) holds no ':', else it is user:password
    for url in (f"etcd://{before}:{password}@{after}", f"{before}:{password}@{after}", f"etcd://{token}@{after}"):
        for text in _outputs(url):
            assert SECRET not in text, text


def test_redaction_of_plain_text():
    assert redact("etcd://u:p@h:1/x") == "etcd://u:***@h:1/x"
    assert redact("etcd://tok3n@h:1/x") == "etcd://***@h:1/x"  # a lone name may be a token
    assert str(parse_etcd_url("etcd://tok3n@h:1/x", NO_ENV)) == "etcd://***@h:1/x"
    assert redact("etcd://h:1/x") == "etcd://h:1/x"
    assert redact("etcd://u:pa/ss@h:1/x") == "etcd://u:***@h:1/x"
    assert redact("u:p@h:1") == "u:***@h:1"
