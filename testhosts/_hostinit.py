"""PID 1 of one simulated host: sets up its mounts and hostname, then reaps orphans until killed.

Run by the harness as `python -I -S _hostinit.py PREFIX HOST SPEC_JSON` inside `ip netns exec NS
unshare --fork --pid --mount --uts --mount-proc`, so it already sits in the host's network, PID,
mount and UTS namespaces. Standalone on purpose (stdlib only, no `gpuguard` import, no site): it
starts once per host and again on every power-on, and it must not depend on the import path.

Killing this process with SIGKILL is a power-off: the kernel kills every process of the PID
namespace with it. When the harness that owns the cluster dies (even by SIGKILL), the owner pipe
reaches EOF and this process exits, so no host outlives a crashed test.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import sys
from typing import Any

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
O_PATH = getattr(os, "O_PATH", 0o10000000)

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind_fd(fd: int, target: str) -> None:
    """Bind a directory opened before any overmount (so a hidden path can still be the source)."""
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)


def _setup(spec: dict[str, Any]) -> None:
    # Open every source before the first overmount hides it.
    fds = {key: os.open(str(spec[key]), O_PATH | os.O_DIRECTORY) for key in ("tmp_src", "job_src")}
    shared_src = spec.get("shared_src")
    if shared_src:
        fds["shared_src"] = os.open(str(shared_src), O_PATH | os.O_DIRECTORY)
    # Software the harness runs from that lives under /tmp (a CI clone, a venv): seen through the
    # private /tmp at the same path, opened now because the overmount hides it.
    keep = {str(p): os.open(str(p), O_PATH | os.O_DIRECTORY) for p in spec.get("keep") or ()}
    # Other hosts' private directories live under hosts_root: hide them all.
    _mount("tmpfs", str(spec["hosts_root"]), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    _bind_fd(fds["tmp_src"], "/tmp")
    for path, fd in keep.items():
        os.makedirs(path, exist_ok=True)  # inside this host's private /tmp
        _bind_fd(fd, path)
        os.close(fd)
    _bind_fd(fds["job_src"], str(spec["job_dir"]))
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    shared_path = str(spec["shared_path"])
    if shared_src:
        os.makedirs(shared_path, exist_ok=True)  # under the private /tmp when the shared dir was there
        _bind_fd(fds["shared_src"], shared_path)
    elif os.path.isdir(shared_path):
        # The control host: the checkpoint storage is not its business.
        _mount("tmpfs", shared_path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    _mount(str(spec["hosts_file"]), "/etc/hosts", None, MS_BIND)
    for fd in fds.values():
        os.close(fd)
    for name in ("all", "default", "lo"):
        try:  # IPv6 link-local chatter is traffic outside the cluster's range: none of it
            with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            pass
    socket.sethostname(str(spec["hostname"]))


def _reap() -> None:
    for _ in range(100_000):  # bounded: at most that many exits per wake-up
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    _prefix, _host, spec_json = argv[1], argv[2], argv[3]
    spec = json.loads(spec_json)
    ready_fd = int(spec["ready_fd"])
    owner_fd = spec.get("owner_fd")
    try:
        _setup(spec)
    except Exception as exc:  # reported to the harness on the ready pipe, then this host ends
        os.write(ready_fd, f"error: {exc}\n".encode())
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.write(ready_fd, b"ok\n")
    os.close(ready_fd)
    watched = [wake_r] + ([int(owner_fd)] if owner_fd is not None else [])
    while True:  # a host lives until it is powered off; each wake-up is bounded work
        readable, _, _ = select.select(watched, [], [], 60.0)
        if owner_fd is not None and int(owner_fd) in readable and not os.read(int(owner_fd), 64):
            return 0  # the owning harness is gone: power off
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
