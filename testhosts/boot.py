"""Booting a test cluster: each host's PID 1 (`_hostinit.py` under `ip netns exec ... unshare`)
reports its mounts done on a pipe within a deadline, and a real etcd on the control host answers
/health within its own. `Cluster` runs these steps; here is what they start and how they wait."""

from __future__ import annotations

import json
import os
import select
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.foundation.errors import GpuguardError, UnavailableError
from gpuguard.testhosts import _linux
from gpuguard.testhosts.layout import TRAIN, Host, Layout

if TYPE_CHECKING:
    from gpuguard.testhosts.cluster import Cluster, HostPopen

INIT_SCRIPT = Path(__file__).resolve().with_name("_hostinit.py")
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
BOOT_TIMEOUT_S = 20.0
ETCD_TIMEOUT_S = 30.0


def init_argv(layout: Layout, host: Host, ready_fd: int, owner_fd: int | None) -> list[str]:
    """The command that starts `host`'s PID 1 in its own network, PID, mount and UTS namespaces."""
    spec = {
        "hostname": host.name,
        "hosts_root": str(Path(layout.workdir) / "hosts"),
        "tmp_src": str(Path(host.hostdir) / "tmp"),
        "job_src": str(Path(host.hostdir) / "job"),
        "job_dir": layout.job_dir,
        "shared_src": layout.shared_path if host.role == TRAIN else None,
        "shared_path": layout.shared_path,
        "hosts_file": layout.hosts_file,
        "keep": software_under_tmp(),
        "ready_fd": ready_fd,
        "owner_fd": owner_fd,
    }
    return [
        "ip",
        "netns",
        "exec",
        host.netns,
        "unshare",
        "--fork",
        "--pid",
        "--mount",
        "--uts",
        "--mount-proc",
        "--propagation=private",
        "--",
        sys.executable,
        "-I",
        "-S",
        str(INIT_SCRIPT),
        layout.prefix,
        host.name,
        json.dumps(spec),
    ]


def read_replies(names_by_fd: dict[int, str]) -> dict[int, str]:
    """Each PID 1's one-line reply on its ready pipe (`ok` or why not), all within BOOT_TIMEOUT_S."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    replies: dict[int, bytes] = {fd: b"" for fd in names_by_fd}
    open_fds = set(names_by_fd)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(names_by_fd[fd] for fd in open_fds)
            raise UnavailableError(f"host(s) {names} did not boot within {BOOT_TIMEOUT_S:g} s")
        readable, _, _ = select.select(list(open_fds), [], [], left)
        for fd in readable:
            chunk = os.read(fd, 4096)
            replies[fd] += chunk
            if not chunk or b"\n" in replies[fd]:
                open_fds.discard(fd)
    return {fd: reply.decode(errors="replace").strip() for fd, reply in replies.items()}


def booted_init(host: Host, launcher_pid: int, reply: str) -> dict[str, Any]:
    """The host's state once its PID 1 said `ok`: that PID 1 (the one child of unshare), its start
    time and PID namespace; a GpuguardError with its log's tail otherwise."""
    if reply != "ok":
        log_tail = (Path(host.hostdir) / "init.log").read_text(errors="replace")[-800:]
        raise GpuguardError(f"host {host.name} failed to boot: {reply or 'no reply'} {log_tail.strip()}")
    kids = _linux.children(launcher_pid)
    if len(kids) != 1:
        raise GpuguardError(f"host {host.name}: expected one PID 1 under unshare, found {kids}")
    init = kids[0]
    return {
        "powered": True,
        "init_pid": init,
        "init_start": _linux.start_time(init),
        "pid_ns": _linux.ns_id(init, "pid"),
        "frozen": False,
    }


def etcd_argv(ctl: Host, job_dir: str) -> list[str]:
    """A one-member etcd on the control host's address (and its loopback), data in the job dir."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise _linux.HostsUnavailableError(
            "etcd is not installed (Debian package etcd-server): up(etcd=False) to do without"
        )
    url = f"http://{ctl.address}:{ETCD_CLIENT_PORT}"
    peer = f"http://{ctl.address}:{ETCD_PEER_PORT}"
    return [
        etcd,
        "--name",
        ctl.name,
        "--data-dir",
        f"{job_dir}/etcd",
        "--listen-client-urls",
        f"{url},http://127.0.0.1:{ETCD_CLIENT_PORT}",
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"{ctl.name}={peer}",
        "--initial-cluster-state",
        "new",
    ]


def wait_etcd_healthy(cluster: Cluster, ctl: Host, proc: HostPopen) -> None:
    """Until etcd's /health says true (UnavailableError when it exits or ETCD_TIMEOUT_S runs out)."""
    deadline = time.monotonic() + ETCD_TIMEOUT_S
    for _ in range(10_000):
        if proc.poll() is not None:
            raise UnavailableError(f"etcd on {ctl.name} exited ({proc.returncode}): see {ctl.hostdir}/etcd.log")
        if _etcd_healthy(cluster, ctl, ctl.address):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise UnavailableError(f"etcd on {ctl.name} not healthy within {ETCD_TIMEOUT_S:g} s: see {ctl.hostdir}/etcd.log")


def _etcd_healthy(cluster: Cluster, host: Host, address: str) -> bool:
    try:
        with cluster.connect(host, address, ETCD_CLIENT_PORT, timeout=1.0) as sock:
            sock.settimeout(2.0)
            sock.sendall(f"GET /health HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
            reply = b""
            for _ in range(64):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return b'"health":"true"' in reply


def software_under_tmp() -> list[str]:
    """Folders every host must still see after its private /tmp hides the machine's: the Python that
    runs the harness and its venv, and the checkout gpuguard is imported from (a CI clone or a venv
    under /tmp would otherwise vanish inside the hosts: "nsenter: failed to execute ...")."""
    candidates = {
        os.path.realpath(sys.prefix),
        os.path.realpath(sys.base_prefix),
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.dirname(os.path.realpath(__file__))),  # the gpuguard package (the checkout)
        os.path.realpath(os.getcwd()),
    }
    keep = sorted(p for p in candidates if p == "/tmp" or p.startswith("/tmp/"))
    # the outermost folders only: a bind of /tmp/ci/.venv inside a bind of /tmp/ci adds nothing
    return [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep) and p != "/tmp"]
