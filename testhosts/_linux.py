"""The Linux calls the harness makes: `ip`/`tc` with argument lists and deadlines, /proc scans, netns sockets.

Kept apart from the cluster logic so every external command goes through one bounded runner
(no shell, a timeout, the stderr in the error) and every /proc read tolerates a process vanishing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from gpuguard.foundation.errors import EXIT_UNAVAILABLE, GpuguardError, UnavailableError

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT_S = 15.0
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


class CommandError(GpuguardError):
    """An `ip`/`tc`/`mount` call failed: its argv and stderr, so the reason is in the message."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        super().__init__(f"{' '.join(argv)}: exit {returncode}: {stderr.strip() or '(no stderr)'}")
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr


def run(argv: list[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run one command to completion within `timeout`; raise CommandError on failure when `check`."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise UnavailableError(f"{' '.join(argv)}: no answer within {timeout:g} s") from exc
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr)
    return proc


def missing_tools() -> list[str]:
    return [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]


def namespaces_refused() -> str | None:
    """Why this process may not create namespaces (root without CAP_SYS_ADMIN, a seccomp filter), or None."""
    argv = ["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "true"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


# -- /proc ---------------------------------------------------------------------------------------


def pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def proc_state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[0] if fields else None


def ppid(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def start_time(pid: int) -> int | None:
    """Clock ticks since boot at which PID started: with the pid, it names one process (no reuse)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def is_alive(pid: int, started: int | None) -> bool:
    """True when PID is the same process (same start time) and not yet a zombie."""
    if started is None or start_time(pid) != started:
        return False
    return proc_state(pid) not in (None, "Z", "X")


def ns_id(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def members(pid_ns: str) -> list[int]:
    """Outside-view pids of every live process in the PID namespace `pid_ns` (`pid:[inode]`)."""
    found = []
    for pid in pids():
        if ns_id(pid, "pid") == pid_ns and proc_state(pid) not in (None, "Z", "X"):
            found.append(pid)
    return found


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def wait_gone(pid: int, started: int | None, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not is_alive(pid, started):
            return True
        time.sleep(0.005)
    return not is_alive(pid, started)


# -- links, qdiscs, namespaces --------------------------------------------------------------------


def netns_names() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_names() -> list[str]:
    """Interfaces of the root network namespace (`veth@peer` reported as `veth`)."""
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


class HostsUnavailableError(GpuguardError):
    """This machine cannot make test hosts (not root, no `ip`/`unshare`/`nsenter`, no netns)."""

    exit_code = EXIT_UNAVAILABLE


class NetemUnavailableError(GpuguardError):
    """The kernel has no netem qdisc: a link delay cannot be emulated on this machine."""

    exit_code = EXIT_UNAVAILABLE


NETEM_MISSING = (
    "slow link: this kernel has no netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM; tc: 'Specified qdisc kind is "
    "unknown'), so a link delay cannot be emulated here; a bandwidth limit (rate_kbit / --rate-kbit, tbf) works"
)


def shape(device: str, netns: str | None, *, delay_ms: float, rate_kbit: int | None) -> None:
    """Replace the root qdisc of `device`: netem for a delay (and rate), tbf for a rate alone."""
    base = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "replace", "dev", device, "root"]
    if delay_ms > 0:
        argv = base + ["netem", "delay", f"{delay_ms:g}ms"] + (["rate", f"{rate_kbit}kbit"] if rate_kbit else [])
    elif rate_kbit:
        argv = base + ["tbf", "rate", f"{rate_kbit}kbit", "burst", "32kbit", "latency", "400ms"]
    else:
        unshape(device, netns)
        return
    proc = run(argv, check=False)
    if proc.returncode != 0:
        if "qdisc kind is unknown" in proc.stderr and "netem" in argv:
            raise NetemUnavailableError(NETEM_MISSING)
        raise CommandError(argv, proc.returncode, proc.stderr)


def unshape(device: str, netns: str | None) -> None:
    argv = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "del", "dev", device, "root"]
    run(argv, check=False)  # "no such qdisc" when none was set: nothing to undo


def qdisc_supported(kind: str, device: str) -> bool:
    """Probe a qdisc kind on `device` (an idle link of ours): add it, then remove it."""
    args = {"netem": ["delay", "1ms"], "tbf": ["rate", "1mbit", "burst", "32kbit", "latency", "400ms"]}[kind]
    ok = run(["tc", "qdisc", "add", "dev", device, "root", kind, *args], check=False).returncode == 0
    if ok:
        run(["tc", "qdisc", "del", "dev", device, "root"], check=False)
    return ok


def in_netns(netns: str, fn: Callable[[], T], timeout: float) -> T:
    """Call `fn` on a thread that has joined network namespace `netns`: sockets it creates live there.

    setns(CLONE_NEWNET) changes only the calling thread, so the harness can probe a host's ports
    without starting a process on it; the thread ends afterwards and the caller's namespace is untouched.
    """
    box: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise UnavailableError(f"network namespace {netns}: no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def disable_ipv6(names: list[str], netns: str | None = None) -> None:
    """No IPv6 on these links (link-local router solicitations and MLD are traffic outside the range).

    /proc/sys/net is the calling thread's network namespace: for `netns`, written from a thread in it.
    """

    def write() -> None:
        for name in names:
            path = f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6"
            if os.path.exists(path):
                with open(path, "w") as f:
                    f.write("1")

    if netns is None:
        write()
    else:
        in_netns(netns, write, COMMAND_TIMEOUT_S)


def connect(netns: str, address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection made from inside `netns` (the caller owns the socket)."""
    return in_netns(netns, lambda: socket.create_connection((address, port), timeout=timeout), timeout + 5)


# -- teardown: the processes, namespaces and folders a cluster leaves -------------------------------


def continue_stopped(pids: set[int | None]) -> None:
    for pid in pids:
        if pid and proc_state(pid) == "T":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def netns_inode(netns: str) -> str | None:
    try:
        return f"net:[{os.stat(Path(NETNS_DIR) / netns).st_ino}]"
    except OSError:
        return None


def kill_in_netns(netns_ids: set[str]) -> list[int]:
    """SIGKILL every process whose network namespace is one of `netns_ids` (`net:[inode]`)."""
    killed: list[int] = []
    if not netns_ids:
        return killed
    me = os.getpid()
    for pid in pids():
        if pid != me and ns_id(pid, "net") in netns_ids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def remove_workdir(workdir: Path) -> None:
    """Remove a cluster's work dir, never crossing a mount point (a bind left in our namespace)."""
    if not workdir.exists():
        return
    mounts = mount_points()
    inside = [m for m in mounts if m == str(workdir) or m.startswith(str(workdir) + "/")]
    if inside:
        return  # something is still mounted there: leave it rather than delete through the mount
    shutil.rmtree(workdir, ignore_errors=True)


def mount_points() -> list[str]:
    try:
        with open("/proc/self/mountinfo") as f:
            return [line.split()[4].replace("\\040", " ") for line in f if len(line.split()) > 4]
    except OSError:
        return []


def set_link(name: str, *, up: bool) -> None:
    """A link up or down (partition takes the bridge end of a host's veth down)."""
    run(["ip", "link", "set", "dev", name, "up" if up else "down"])
