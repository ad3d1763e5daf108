"""Small programs the test-host tests run on hosts, as argument lists (no shell anywhere)."""

from __future__ import annotations

import subprocess
import sys
import time

ISOLATED = [sys.executable, "-I", "-S"]  # stdlib only, no site: starts in milliseconds


def py(code: str, *args: str) -> list[str]:
    return [*ISOLATED, "-c", code, *args]


SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"

# A parent that forks a grandchild and then sleeps: both are processes of the host.
FORKER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-I', '-S', '-c', 'import time; time.sleep(60)', 'grandchild'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)

ECHO_SERVER = (
    "import socket, sys\n"
    "srv = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "srv.settimeout(60)\n"
    "for _ in range(100):\n"
    "    conn, _ = srv.accept()\n"
    "    with conn:\n"
    "        conn.settimeout(5)\n"
    "        conn.sendall(conn.recv(64).replace(b'ping', b'pong'))\n"
)

# Prints `ok LOCAL_ADDR` or `fail ERROR` within about a second.
PING_CLIENT = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:\n"
    "        s.sendall(b'ping'); reply = s.recv(64)\n"
    "        print('ok' if reply == b'pong' else 'bad', s.getsockname()[0])\n"
    "except OSError as e:\n"
    "    print('fail', type(e).__name__)\n"
)


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until it holds or `timeout` runs out (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
