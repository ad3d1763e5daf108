"""`python -m tests.support.lease_rank URL INCARNATION TTL`: one rank holding the host lease, as a real process.

It joins the host lease through `EtcdCoordination.hold_lease` (GPUGUARD_HOST_LEASE_DIR from the
environment) and prints JSON lines: `ready` (the lease id, whether it is the renewer), `fenced`
(then exit 4, as the runtime's fence does) or, on SIGTERM, `done` with the keepalives it sent.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.host_lease import HostHeartbeat
from gpuguard.recovery.runtime.lease import LeaseTiming


def say(**doc: object) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> int:
    url, incarnation, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    coord = EtcdCoordination.from_url(url)

    def fenced(why: str) -> None:
        say(event="fenced", why=why, pid=os.getpid())
        os._exit(4)

    hb = coord.hold_lease(incarnation, {"rank": incarnation, "pid": os.getpid()}, LeaseTiming(ttl), fenced)
    assert isinstance(hb, HostHeartbeat)
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    say(event="ready", lease=hb.lease, renewer=hb.renewer, pid=os.getpid())
    while not term.wait(0.05):
        hb.require("a write")  # what a rank does before each write: fences when the host lease is stale
    say(event="done", sent=hb.beats + hb.failures, backups=hb.backups, renewer=hb.renewer, valid=hb.valid())
    coord.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
