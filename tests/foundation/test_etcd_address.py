"""etcd URLs with several members: parsing, printing, refusing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.foundation.errors import UsageError
from gpuguard.foundation.etcd_url import EtcdUrl, parse_etcd_url, split_endpoints

hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z0-9]{1,5}){0,2}", fullmatch=True)
ports = st.integers(1, 65535)
prefixes = st.from_regex(r"(/[a-z0-9_-]{1,8}){1,3}", fullmatch=True)


@given(st.lists(st.tuples(hosts, ports), min_size=1, max_size=5), prefixes)
def test_an_etcd_url_round_trips(endpoints, prefix):
    url = EtcdUrl(tuple(endpoints), prefix)
    assert parse_etcd_url(str(url)) == url


@given(st.text(max_size=40))
def test_any_text_is_a_url_or_one_usage_error(text):
    try:
        got = parse_etcd_url(text)
    except UsageError as exc:
        assert "\n" not in str(exc)
        return
    assert got.endpoints and all(0 < p < 65536 for _, p in got.endpoints)


def test_every_member_needs_its_port_and_the_scheme_is_checked():
    assert parse_etcd_url("etcd://a:1,[::1]:2/p/q").endpoints == (("a", 1), ("::1", 2))
    assert parse_etcd_url("etcd://a:1").prefix == "/gpuguard"
    for bad in ("etcd://a,b:2/p", "etcd://a:0/p", "redis://a:1/p", "etcd:///p", "a:1/p"):
        with pytest.raises(UsageError):
            parse_etcd_url(bad)
    assert split_endpoints("a, b:7") == [("a", 2379), ("b", 7)]
