"""`python -m tests.support.measure OUT.json LIMIT_S ARGV...`: run ARGV as our own child and write what
it cost to OUT.json: exit code, wall seconds, its own max RSS (KiB). Killed past LIMIT_S.

Why a launcher of its own: a child forked from pytest (torch imported: ~300 MiB) starts out with the
parent's pages, so its max RSS says nothing about the command; forked from this small process it
does."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(out: str, limit_s: str, argv: list[str]) -> int:
    t0 = time.monotonic()
    pid = os.posix_spawnp(argv[0], argv, dict(os.environ))
    deadline = t0 + float(limit_s)
    killed = False
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            got, status, usage = os.wait4(pid, 0)
            killed = True
            break
        time.sleep(0.005)
    doc = {
        "code": os.waitstatus_to_exitcode(status),
        "seconds": time.monotonic() - t0,
        "maxrss_kib": usage.ru_maxrss,
        "killed": killed,
    }
    with open(out, "w") as fh:
        json.dump(doc, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
