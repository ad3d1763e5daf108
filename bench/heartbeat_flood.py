"""A UDP flood at a worker's peer-heartbeat port: does anyone suspect a live peer?

    python bench/heartbeat_flood.py [--json] [--runs 10] [--seconds 3] [--interval 0.1]

Three detectors on loopback (one process, real sockets, the ring of `recovery.runtime.heartbeat`),
every `--interval` s, 5 misses. In each run two threads flood rank 0's port with small junk and
forged heartbeats for `--seconds` (bounded; loopback only). A run fails when any detector suspects
a live peer. The baseline, in the same run, is the receiver before issue 28 (one `recvfrom` and one
HMAC per loop turn, no source filter, silence counted while the socket overflowed): it is a
subclass defined here, not product code.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, wants_json  # noqa: E402

from gpuguard.recovery.runtime import heartbeat as hb  # noqa: E402

KEY = hb.derive_key(os.urandom(32))


def _arg(name: str, default: float) -> float:
    argv = sys.argv[1:]
    return float(argv[argv.index(name) + 1]) if name in argv else default


class BeforeIssue28(hb.PeerHeartbeat):
    """The receiver as it was: one datagram per turn, every one hashed, every silence counted."""

    def _receive(self, wait_s: float) -> None:
        try:
            self.sock.settimeout(wait_s)
            packet, _ = self.sock.recvfrom(hb.MAX_PACKET + 1)
        except (TimeoutError, OSError):
            return
        self.accept(packet, self.clock())


def _ring(kind: type[hb.PeerHeartbeat], cfg: hb.HeartbeatConfig) -> tuple[list[Any], dict[int, list[Any]]]:
    socks = [hb.open_socket("127.0.0.1") for _ in range(3)]
    peers = {r: hb.Peer(r, f"inc-{r}", s.getsockname()) for r, s in enumerate(socks)}
    suspects: dict[int, list[Any]] = {r: [] for r in range(3)}
    dets = [
        kind(
            s,
            key=KEY,
            job_id="job",
            generation=1,
            rank=r,
            incarnation_id=f"inc-{r}",
            peers=peers,
            config=cfg,
            on_suspect=lambda rank, silent, r=r: suspects[r].append((rank, round(silent, 3))),
        )
        for r, s in enumerate(socks)
    ]
    return dets, suspects


def _flood(target: tuple[str, int], seconds: float, counter: list[int]) -> None:
    end = time.monotonic() + seconds
    forged = hb.encode(hb.derive_key(b"x" * 32), "job", 1, 1, "inc-1", 10**9)
    junk = os.urandom(200)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while time.monotonic() < end:
            for packet in (junk, forged) * 64:
                try:
                    s.sendto(packet, target)
                except OSError:
                    pass
            counter[0] += 128


def one_run(kind: type[hb.PeerHeartbeat], cfg: hb.HeartbeatConfig, seconds: float) -> dict[str, Any]:
    dets, suspects = _ring(kind, cfg)
    for d in dets:
        d.start()
    try:
        time.sleep(0.3)
        sent = [0]
        threads = [threading.Thread(target=_flood, args=(dets[0].sock.getsockname(), seconds, sent)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.2)
    finally:
        for d in dets:
            d.stop()
    return {
        "suspected": any(suspects.values()),
        "packets_sent": sent[0],
        "dropped_unhashed": getattr(dets[0], "dropped", 0),
        "kernel_drops": getattr(dets[0], "kernel_drops", 0),
    }


def main() -> None:
    runs, seconds = int(_arg("--runs", 10)), _arg("--seconds", 3.0)
    cfg = hb.HeartbeatConfig(_arg("--interval", 0.1), 5)
    results = []
    for name, kind in (("gpuguard", hb.PeerHeartbeat), ("before-issue-28", BeforeIssue28)):
        rows = [one_run(kind, cfg, seconds) for _ in range(runs)]
        results.append(
            {
                "receiver": name,
                "runs": runs,
                "flood_s": seconds,
                "interval_s": cfg.interval_s,
                "runs_with_a_false_suspicion": sum(r["suspected"] for r in rows),
                "packets_sent_per_run": round(sum(r["packets_sent"] for r in rows) / runs),
                "dropped_unhashed_per_run": round(sum(r["dropped_unhashed"] for r in rows) / runs),
                "kernel_drops_per_run": round(sum(r["kernel_drops"] for r in rows) / runs),
            }
        )
    emit("heartbeat_flood", results, wants_json())


if __name__ == "__main__":
    main()
