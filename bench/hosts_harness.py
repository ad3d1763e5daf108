"""Test hosts on one machine: what a cluster costs to bring up and down, and what its network adds.

    python bench/hosts_harness.py [--json] [--runs N] [--round-trips N]

`up`/`down`: wall time of `testhosts.up(N)` (namespaces, bridge, veths, one PID 1 per host, a real
etcd on the control host answering /health) and of `down()` (every process, netns, link and work dir
gone), for 3 and 8 training hosts; the median of `--runs`. `tcp_rtt`: a ping-pong of 64-byte messages
(TCP_NODELAY, one connection) between two processes, each on its host: h1 -> h2 over veth + bridge,
against both processes on h1 over its loopback. Needs root (it makes real namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from gpuguard.testhosts import preflight, up  # noqa: E402

ECHO = (  # serves connections one after another (the readiness probe's, then the client's)
    "import socket, sys\n"
    "srv = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "srv.settimeout(30)\n"
    "for _ in range(10):\n"
    "    conn, _ = srv.accept()\n"
    "    conn.settimeout(30)\n"
    "    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "    for _ in range(10_000_000):\n"
    "        data = conn.recv(64)\n"
    "        if not data:\n"
    "            break\n"
    "        conn.sendall(data)\n"
    "    conn.close()\n"
)

PINGPONG = (
    "import json, socket, sys, time\n"
    "n = int(sys.argv[3])\n"
    "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
    "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "msg = b'x' * 64\n"
    "rtts = []\n"
    "for i in range(n + 100):\n"
    "    t = time.perf_counter_ns()\n"
    "    s.sendall(msg)\n"
    "    got = 0\n"
    "    while got < 64:\n"
    "        got += len(s.recv(64 - got))\n"
    "    if i >= 100:\n"
    "        rtts.append(time.perf_counter_ns() - t)\n"
    "s.close()\n"
    "rtts.sort()\n"
    "print(json.dumps({'p50_us': rtts[len(rtts) // 2] / 1e3, 'p99_us': rtts[int(len(rtts) * 0.99)] / 1e3,\n"
    "                  'mean_us': sum(rtts) / len(rtts) / 1e3}))\n"
)


def bench_up_down(hosts: int, runs: int) -> list[dict[str, object]]:
    ups, downs = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        cluster = up(hosts)
        t1 = time.perf_counter()
        cluster.down()
        t2 = time.perf_counter()
        ups.append(t1 - t0)
        downs.append(t2 - t1)
    return [
        {
            "case": "up",
            "hosts": hosts,
            "etcd": True,
            "median_s": statistics.median(ups),
            "max_s": max(ups),
            "runs": runs,
        },
        {"case": "down", "hosts": hosts, "median_s": statistics.median(downs), "max_s": max(downs), "runs": runs},
    ]


def bench_rtt(round_trips: int) -> list[dict[str, object]]:
    py = [sys.executable, "-I", "-S", "-c"]
    rows = []
    with up(2, etcd=False) as cluster:
        h1, h2 = cluster.host("h1"), cluster.host("h2")
        for path, server_host, address, port in (
            ("h1 -> h2 (veth + bridge)", h2, h2.address, 7201),
            ("h1 loopback", h1, "127.0.0.1", 7202),
        ):
            server = cluster.exec(server_host, [*py, ECHO, address, str(port)])
            try:
                if not cluster.wait_tcp(h1, address, port, timeout=10):
                    raise SystemExit(f"echo server on {server_host.name} did not listen on {address}:{port}")
                out = cluster.run(h1, [*py, PINGPONG, address, str(port), str(round_trips)], timeout=120, check=True)
                rows.append({"case": "tcp_rtt", "path": path, "round_trips": round_trips, **json.loads(out.stdout)})
            finally:
                if server.poll() is None:
                    server.kill()
                server.wait(timeout=10)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--round-trips", type=int, default=5000)
    args = ap.parse_args()
    reason = preflight()
    if reason:
        print(f"hosts_harness: {reason}", file=sys.stderr)
        return 69
    results = bench_up_down(3, args.runs) + bench_up_down(8, args.runs) + bench_rtt(args.round_trips)
    notes = [
        "up includes etcd answering /health on the control host; down includes removing every netns, link and process",
        "tcp_rtt: Python ping-pong, 64-byte messages, TCP_NODELAY; 100 warm-up round trips not counted",
    ]
    emit("hosts_harness", results, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
