"""Fixtures for the test-host tests: real namespaces on this machine, skipped only without root/tools."""

from __future__ import annotations

import pytest

from gpuguard.testhosts import Cluster, preflight, up


@pytest.fixture(scope="session")
def can_make_hosts() -> None:
    reason = preflight()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(can_make_hosts) -> Cluster:
    """Two training hosts and a control host running a real etcd: shared by the non-destructive tests."""
    with up(2) as c:
        yield c
