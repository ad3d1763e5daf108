"""Test hosts, for real: namespaces, addresses, faults and a gloo all_reduce between two hosts (no mocks)."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpuguard.foundation.errors import UnavailableError
from gpuguard.testhosts import ADDRESS_RANGE, NetemUnavailableError, _linux, up
from tests.testhosts.helpers import ECHO_SERVER, FORKER, PING_CLIENT, SLEEPER, py, stop, wait_for

LIST_PROCS = (
    "import os, json\n"
    "procs = {}\n"
    "for p in os.listdir('/proc'):\n"
    "    if p.isdigit():\n"
    "        try:\n"
    "            procs[p] = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
    "        except OSError:\n"
    "            pass\n"
    "print(json.dumps(procs))\n"
)


def test_addresses_are_in_the_benchmarking_range_and_names_fit_ifnamsiz(cluster) -> None:
    assert ipaddress.ip_network(cluster.layout.subnet).subnet_of(ADDRESS_RANGE)
    for h in cluster.hosts:
        assert ipaddress.ip_address(h.address) in ADDRESS_RANGE
        assert len(h.ifname) <= 15 and len(h.peer) <= 15 and len(cluster.layout.bridge) <= 15
        assert h.netns.startswith(cluster.prefix) and h.peer.startswith(cluster.prefix)
        out = cluster.run(h, ["ip", "-o", "-4", "addr", "show"], check=True).stdout
        assert sorted(line.split()[3] for line in out.splitlines()) == sorted(["127.0.0.1/8", f"{h.address}/24"])
    assert cluster.env("h1")["GLOO_SOCKET_IFNAME"] == cluster.host("h1").ifname
    assert ipaddress.ip_address(cluster.env("h2")["MASTER_ADDR"]) in ADDRESS_RANGE


def test_each_host_sees_only_its_own_processes(cluster) -> None:
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    sleeper = cluster.exec("h2", py(SLEEPER, "30", marker))
    try:
        assert wait_for(lambda: sleeper.inner_pid() in cluster.pids("h2"), 5)
        on_h1 = json.loads(cluster.run("h1", py(LIST_PROCS), check=True).stdout)
        on_h2 = json.loads(cluster.run("h2", py(LIST_PROCS), check=True).stdout)
        assert not any(marker in cmd for cmd in on_h1.values())
        assert any(marker in cmd for cmd in on_h2.values())
        # h1 sees its PID 1 and the lister, nothing else of the machine.
        assert len(on_h1) == 2 and "_hostinit.py" in on_h1["1"]
        assert sleeper.inner_pid() not in cluster.pids("h1")
    finally:
        stop(sleeper)


def test_hostnames_differ(cluster) -> None:
    names = {
        h.name: cluster.run(h, py("import socket; print(socket.gethostname())")).stdout.strip() for h in cluster.hosts
    }
    assert names == {"ctl": "ctl", "h1": "h1", "h2": "h2"}
    assert socket.gethostname() not in names.values()


def test_tmp_and_job_dir_are_private_and_the_shared_dir_is_shared(cluster) -> None:
    name = f"gpth-test-{uuid.uuid4().hex[:8]}"
    write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    exists = "import os, sys; print(os.path.exists(sys.argv[1]))"
    tmp, job, shared = f"/tmp/{name}", f"{cluster.job_dir}/{name}", f"{cluster.shared_path}/{name}"
    for path in (tmp, job, shared):
        cluster.run("h1", py(write, path, "from h1"), check=True)
        assert cluster.run("h1", py(exists, path)).stdout.strip() == "True"
    assert cluster.run("h2", py(exists, tmp)).stdout.strip() == "False"
    assert cluster.run("h2", py(exists, job)).stdout.strip() == "False"
    assert not os.path.exists(tmp) and not os.path.exists(job)  # nor on the machine itself
    # ... nor through h1's backing store, which every other host has hidden.
    assert cluster.run("h2", py(exists, f"{cluster.host('h1').hostdir}/tmp/{name}")).stdout.strip() == "False"
    machine_tmp = Path("/tmp") / f"{name}-machine"
    machine_tmp.write_text("machine")
    try:
        assert cluster.run("h1", py(exists, str(machine_tmp))).stdout.strip() == "False"
    finally:
        machine_tmp.unlink()
    assert cluster.run("h2", py("import sys; print(open(sys.argv[1]).read())", shared)).stdout.strip() == "from h1"
    assert Path(shared).read_text() == "from h1"
    # The control plane never sees the checkpoint storage.
    assert cluster.run("ctl", py(exists, shared)).stdout.strip() == "False"


def test_tcp_between_hosts_fails_while_partitioned_and_works_after_heal(cluster) -> None:
    h1, h2 = cluster.host("h1"), cluster.host("h2")
    port = "7101"
    server = cluster.exec(h2, py(ECHO_SERVER, h2.address, port))
    try:
        assert cluster.wait_tcp(h1, h2.address, int(port), timeout=10)
        out = cluster.run(h1, py(PING_CLIENT, h2.address, port, "2")).stdout.split()
        assert out == ["ok", h1.address]  # h1 reached h2 from its own 198.18 address
        cluster.partition(h2)
        try:
            t0 = time.monotonic()
            out = cluster.run(h1, py(PING_CLIENT, h2.address, port, "1")).stdout.split()
            assert out[0] == "fail" and time.monotonic() - t0 < 5
            assert server.poll() is None  # the partitioned host's processes live on
        finally:
            cluster.heal(h2)
        healed = wait_for(lambda: cluster.run(h1, py(PING_CLIENT, h2.address, port, "1")).stdout.startswith("ok"), 10)
        assert healed
    finally:
        stop(server)


def test_freeze_stops_every_process_and_thaw_resumes_them(cluster) -> None:
    counter = Path(cluster.shared_path) / f"counter-{uuid.uuid4().hex[:8]}"
    count = "import sys, time\nfor i in range(100000):\n    open(sys.argv[1], 'w').write(str(i)); time.sleep(0.02)\n"
    worker = cluster.exec("h1", py(count, str(counter)))
    forker = cluster.exec("h1", py(FORKER), stdout=subprocess.PIPE, text=True)
    try:
        forker.stdout.readline()  # the grandchild exists
        assert wait_for(lambda: counter.exists() and counter.read_text() != "", 5)
        pids = cluster.pids("h1")
        assert len(pids) >= 4  # PID 1, the counter, the forker, its grandchild
        cluster.freeze("h1")
        assert {_linux.proc_state(p) for p in cluster.pids("h1")} == {"T"}
        assert _linux.proc_state(cluster.state("h2").init_pid) != "T"  # only h1
        before = counter.read_text()
        time.sleep(0.3)
        assert counter.read_text() == before
        cluster.thaw("h1")
        assert wait_for(lambda: "T" not in {_linux.proc_state(p) for p in cluster.pids("h1")}, 2)
        assert wait_for(lambda: counter.read_text() not in ("", before), 3)
    finally:
        cluster.thaw("h1")
        stop(worker)
        stop(forker)


def test_etcd_on_the_control_host_answers_from_training_hosts(cluster) -> None:
    client = (
        "import base64, json, sys, urllib.request\n"
        "def call(path, body=None):\n"
        "    req = urllib.request.Request(sys.argv[1] + path, data=None if body is None else json.dumps(body).encode())\n"
        "    return json.loads(urllib.request.urlopen(req, timeout=5).read())\n"
        "print(json.dumps({'health': call('/health'), 'put': call('/v3/kv/put', {'key': sys.argv[2], 'value': sys.argv[3]})\n"
        "    if sys.argv[3] else None, 'range': call('/v3/kv/range', {'key': sys.argv[2]})}))\n"
    )
    key = base64.b64encode(f"/gpth-test/{uuid.uuid4().hex[:8]}".encode()).decode()
    value = base64.b64encode(b"from h1").decode()
    first = json.loads(cluster.run("h1", py(client, cluster.etcd_url, key, value), check=True).stdout)
    assert first["health"]["health"] == "true"
    second = json.loads(cluster.run("h2", py(client, cluster.etcd_url, key, ""), check=True).stdout)
    assert [kv["value"] for kv in second["range"]["kvs"]] == [value]
    etcd = [p for p in cluster.pids("ctl") if "etcd" in " ".join(_linux.cmdline(p))]
    assert etcd, "etcd runs on the control host"


def test_gloo_all_reduce_across_two_hosts(cluster) -> None:
    worker = (
        "import datetime, json, os, socket, sys\n"
        "import torch, torch.distributed as dist\n"
        "rank = int(sys.argv[1])\n"
        "dist.init_process_group('gloo', init_method=sys.argv[2], rank=rank, world_size=2,\n"
        "                        timeout=datetime.timedelta(seconds=60))\n"
        "t = torch.tensor([float(rank + 1)])\n"
        "dist.all_reduce(t)\n"
        "remotes = {socket.inet_ntoa(bytes.fromhex(line.split()[2].split(':')[0])[::-1])\n"
        "           for line in open('/proc/net/tcp').read().splitlines()[1:]}\n"
        "print(json.dumps({'rank': rank, 'sum': t.item(), 'host': socket.gethostname(),\n"
        "                  'ifname': os.environ['GLOO_SOCKET_IFNAME'], 'remotes': sorted(remotes)}))\n"
        "dist.destroy_process_group()\n"
    )
    h1, h2 = cluster.host("h1"), cluster.host("h2")
    init = f"tcp://{h1.address}:29511"
    procs = [
        cluster.exec(
            h,
            [sys.executable, "-c", worker, str(rank), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, h in enumerate((h1, h2))
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    docs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [d["sum"] for d in docs] == [3.0, 3.0]
    assert [(d["host"], d["ifname"]) for d in docs] == [("h1", h1.ifname), ("h2", h2.ifname)]
    # The ranks talked over the namespace link, each to the other's 198.18 address.
    assert h2.address in docs[0]["remotes"] and h1.address in docs[1]["remotes"]


def test_slow_link_delays_traffic_or_says_netem_is_missing(cluster) -> None:
    h1 = cluster.host("h1")
    if not cluster.layout.capabilities.get("netem"):
        with pytest.raises(NetemUnavailableError, match="netem"):
            cluster.slow(h1, delay_ms=20)
        assert "netem" not in _qdiscs(h1) and cluster.state(h1).delay_ms == 0  # nothing half-applied
        cluster.slow(h1, rate_kbit=8000)  # the bandwidth limit works without netem
        try:
            assert _qdiscs(h1).count("tbf") == 2 and cluster.state(h1).rate_kbit == 8000  # both directions
        finally:
            cluster.unslow(h1)
        assert "tbf" not in _qdiscs(h1)
        return
    h2 = cluster.host("h2")
    server = cluster.exec(h2, py(ECHO_SERVER, h2.address, "7102"))
    try:
        assert cluster.wait_tcp(h1, h2.address, 7102, timeout=10)
        cluster.slow(h1, delay_ms=50)
        t0 = time.monotonic()
        assert cluster.run(h1, py(PING_CLIENT, h2.address, "7102", "5")).stdout.startswith("ok")
        assert time.monotonic() - t0 >= 0.2  # SYN/SYN-ACK and ping/pong: two round trips of >= 100 ms
    finally:
        cluster.unslow(h1)
        stop(server)


def test_power_off_kills_every_process_of_that_host_and_only_that_host(can_make_hosts) -> None:
    with up(2, etcd=False) as c:
        h1, h2 = c.host("h1"), c.host("h2")
        assert c.host_for_role("rendezvous") == h1
        on_h1 = [c.exec(h1, py(SLEEPER, "60")), c.exec(h1, py(FORKER), stdout=subprocess.PIPE, text=True)]
        on_h2 = c.exec(h2, py(SLEEPER, "60"))
        on_h1[1].stdout.readline()
        assert wait_for(lambda: len(c.pids(h1)) == 4 and len(c.pids(h2)) == 2, 5)
        victims = {p: _linux.start_time(p) for p in c.pids(h1)}
        survivors = {p: _linux.start_time(p) for p in c.pids(h2)}
        c.freeze(h1)  # a frozen host powers off all the same
        c.power_off(c.host_for_role("rendezvous"))  # rendezvous-host loss is power-off by role
        assert not any(_linux.is_alive(p, t) for p, t in victims.items())
        assert all(_linux.is_alive(p, t) for p, t in survivors.items())
        assert [p.wait(timeout=10) for p in on_h1] == [-9, -9]
        assert on_h2.poll() is None
        with pytest.raises(UnavailableError, match="powered off"):
            c.exec(h1, ["true"])
        # A powered-off host answers nothing: a connect times out (no reset from a live stack).
        with pytest.raises((TimeoutError, socket.timeout)):
            c.connect(h2, h1.address, 7103, timeout=0.5)
        c.power_on(h1)
        assert c.run(h1, py("import socket; print(socket.gethostname())")).stdout.strip() == "h1"
        assert len(c.pids(h1)) == 1  # a fresh process table
        stop(on_h2)


def test_down_leaves_no_netns_links_processes_or_work_dir(can_make_hosts) -> None:
    with up(2) as c:
        prefix, workdir = c.prefix, Path(c.layout.workdir)
        procs = [c.exec(h, py(SLEEPER, "60")) for h in c.training_hosts]
        assert wait_for(lambda: sum(len(c.pids(h)) for h in c.hosts) == 6, 5)  # 3 PID 1s, etcd, 2 sleepers
        pids = {p: _linux.start_time(p) for h in c.hosts for p in c.pids(h)}
    assert not any(_linux.is_alive(p, t) for p, t in pids.items())
    assert not [n for n in _netns_list() if n.startswith(prefix)]
    assert prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [p for p in _linux.pids() if prefix in " ".join(_linux.cmdline(p))]
    assert not workdir.exists()
    assert all(p.wait(timeout=10) < 0 for p in procs)


def _qdiscs(h) -> str:
    """The root qdiscs of both ends of a host's veth (bridge side, then host side)."""
    outside = subprocess.run(["tc", "qdisc", "show", "dev", h.peer], capture_output=True, text=True, timeout=10)
    inside = subprocess.run(["tc", "-n", h.netns, "qdisc", "show", "dev", h.ifname], capture_output=True, text=True)
    return outside.stdout + inside.stdout


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]
