"""Remove every leftover of the harness by its name prefix: after a SIGKILLed test, a crashed CLI.

A harness killed by SIGKILL cannot run its teardown. Its hosts' PID 1s exit by themselves (the
owner pipe), but named network namespaces, the bridge and veths, and work dirs stay. Everything the
harness creates is named `PREFIX...`, so one scan finds it all; nothing else is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuguard.testhosts import _linux
from gpuguard.testhosts.boot import INIT_SCRIPT
from gpuguard.testhosts.cluster import DEFAULT_STATE, KILL_TIMEOUT_S
from gpuguard.testhosts.layout import PREFIX, RUN_ROOT


@dataclass(frozen=True)
class CleanupReport:
    """What `cleanup_all` removed: each list names the things, so `cleanup --all` can say them."""

    processes: list[int] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    workdirs: list[str] = field(default_factory=list)
    state_files: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.processes or self.netns or self.links or self.workdirs or self.state_files)


def leftovers(prefix: str = PREFIX) -> dict[str, list[str]]:
    """What of the harness exists now (netns, root-namespace links, host inits, work dirs), by prefix."""
    return {
        "netns": [n for n in _linux.netns_names() if n.startswith(prefix)],
        "links": [n for n in _linux.link_names() if n.startswith(prefix)],
        "processes": [str(p) for p in _init_pids(prefix)],
        "workdirs": [str(d) for d in _workdirs(prefix)],
    }


def _init_pids(prefix: str) -> list[int]:
    """Host PID 1s of the harness: `python -I -S .../_hostinit.py PREFIXxxxxxx HOST SPEC`."""
    found = []
    for pid in _linux.pids():
        argv = _linux.cmdline(pid)
        for i, arg in enumerate(argv[:-1]):
            if os.path.basename(arg) == INIT_SCRIPT.name and argv[i + 1].startswith(prefix):
                if _linux.proc_state(pid) not in (None, "Z", "X"):
                    found.append(pid)
                break
    return found


def _workdirs(prefix: str) -> list[Path]:
    if not RUN_ROOT.is_dir():
        return []
    return sorted(d for d in RUN_ROOT.iterdir() if d.is_dir() and d.name.startswith(prefix))


def cleanup_all(prefix: str = PREFIX) -> CleanupReport:
    """Kill, delete and remove everything whose name starts with `prefix` (default: every cluster)."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r}: cleanup never touches what the harness did not make")
    report = CleanupReport()
    netns = [n for n in _linux.netns_names() if n.startswith(prefix)]
    for pid in _init_pids(prefix):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            report.processes.append(pid)
    report.processes.extend(_linux.kill_in_netns({i for i in map(_linux.netns_inode, netns) if i}))
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for _ in range(10_000):
        if not _init_pids(prefix) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for name in netns:
        if _linux.run(["ip", "netns", "del", name], check=False).returncode == 0:
            report.netns.append(name)
    links = [n for n in _linux.link_names() if n.startswith(prefix)]
    for name in sorted(links, key=lambda n: n.endswith("br")):  # veths first, bridges last
        if _linux.run(["ip", "link", "del", name], check=False).returncode == 0:
            report.links.append(name)
    for d in _workdirs(prefix):
        _linux.remove_workdir(d)
        if not d.exists():
            report.workdirs.append(str(d))
    if DEFAULT_STATE.exists():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if str(json.loads(DEFAULT_STATE.read_text())["layout"]["prefix"]).startswith(prefix):
                DEFAULT_STATE.unlink()
                report.state_files.append(str(DEFAULT_STATE))
    return report
