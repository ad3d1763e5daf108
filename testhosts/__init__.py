"""Test hosts on one machine: N simulated hosts (Linux namespaces) and a control host running etcd.

For tests, benches and a developer at a shell: real processes on real network stacks, with the
faults a training job meets (power-off, partition, freeze, slow link, rendezvous-host loss), and a
teardown that happens even when a test fails. README.md ("Development: test hosts") shows the CLI.

    with up(2) as cluster:
        proc = cluster.exec("h1", ["hostname"], stdout=subprocess.PIPE)
        cluster.partition("h2"); cluster.heal("h2"); cluster.power_off("h1")
"""

from gpuguard.testhosts._linux import HostsUnavailableError, NetemUnavailableError
from gpuguard.testhosts.cleanup import CleanupReport, cleanup_all, leftovers
from gpuguard.testhosts.cluster import SCHEMA, Cluster, HostPopen, preflight, up
from gpuguard.testhosts.layout import ADDRESS_RANGE, CONTROL, PREFIX, TRAIN, Host, HostState, Layout

__all__ = [
    "ADDRESS_RANGE",
    "CONTROL",
    "PREFIX",
    "SCHEMA",
    "TRAIN",
    "CleanupReport",
    "Cluster",
    "Host",
    "HostPopen",
    "HostState",
    "HostsUnavailableError",
    "Layout",
    "NetemUnavailableError",
    "cleanup_all",
    "leftovers",
    "preflight",
    "up",
]
