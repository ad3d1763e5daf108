"""A bounded CPU hog beside a benchmark's job: N busy loops that cannot outlive their deadline.

    with CpuHog(2 * os.cpu_count(), seconds=300):
        ...  # the trial runs on a crowded machine

Why bounded three ways: a bench that dies (Ctrl-C, OOM, a crash) must not leave the machine burning
for everyone else. Each loop checks its own deadline (monotonic, so a clock step cannot extend it), asks
the kernel to kill it when the bench dies (PR_SET_PDEATHSIG, checked against the parent it was started
by, so a parent that died before the request also ends it), and the bench kills and reaps every loop
when the trial ends. Nothing goes through a shell: each loop is `python -I -S -c LOOP` with its
arguments in argv.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import TracebackType

LOOP = (  # argv: deadline seconds from now, the pid that must stay our parent
    "import ctypes, os, signal, sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass  # not Linux: the deadline and the bench's kill still bound it\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit(0)  # the bench died before the request took hold\n"
    "x = 0\n"
    "while time.monotonic() < end:\n"
    "    for _ in range(20000):\n"
    "        x += 1\n"
)


class CpuHog:
    """`processes` busy loops for at most `seconds`; stopped and reaped on exit from the `with`."""

    def __init__(self, processes: int, seconds: float) -> None:
        if processes < 0 or not seconds > 0:
            raise ValueError(f"a hog needs processes >= 0 and seconds > 0, got {processes}, {seconds}")
        self.processes, self.seconds = processes, seconds
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> CpuHog:
        for _ in range(self.processes):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", LOOP, repr(float(self.seconds)), str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    close_fds=True,
                )
            )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Kill every loop this hog started (by the pid it holds a handle to) and reap it."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # unkillable (D state): its own deadline still ends it
        self.procs = []

    def __enter__(self) -> CpuHog:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def default_processes() -> int:
    """2 x the machine's cores: enough that the job's processes queue behind the hog on every core."""
    return 2 * (os.cpu_count() or 1)
