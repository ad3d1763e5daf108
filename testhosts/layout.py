"""A test cluster's names, addresses and paths (`Layout`, fixed at `up`), its hosts (`Host`) and
what faults change (`HostState`); picking an unused cluster id, and making the bridge, namespaces,
veth links and directories a layout names. Apart from `cluster` so that cleanup and the CLI can
name things without running them."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from gpuguard.foundation.errors import GpuguardError, UsageError
from gpuguard.testhosts import _linux

PREFIX = "gpth"  # every bridge, veth, netns, work dir and init of this harness starts with it
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range: never routed
RUN_ROOT = Path("/run/gpuguard-testhosts")
TRAIN, CONTROL = "train", "control"
CONTROL_NAME = "ctl"


@dataclass(frozen=True)
class Host:
    """One simulated host: what never changes while the cluster lives."""

    name: str  # also its hostname (UTS namespace)
    role: str  # TRAIN or CONTROL
    index: int
    address: str  # in ADDRESS_RANGE
    ifname: str  # its link, inside its netns: GLOO_SOCKET_IFNAME
    peer: str  # the other end of its veth, on the bridge: what partition takes down
    netns: str  # `ip netns exec NETNS ...` for a developer
    hostdir: str  # backing store of its private /tmp and job directory (outside view)


@dataclass(frozen=True)
class HostState:
    """What a fault changes: replaced, never mutated, so a saved state is one consistent record."""

    powered: bool = False
    init_pid: int | None = None  # outside-view pid of the host's PID 1
    init_start: int | None = None  # its start time: a reused pid is not mistaken for it
    pid_ns: str | None = None  # `pid:[inode]`
    partitioned: bool = False
    frozen: bool = False
    delay_ms: float = 0.0
    rate_kbit: int | None = None


@dataclass(frozen=True)
class Layout:
    """The cluster's names, addresses and paths: fixed at `up`, the same in every CLI invocation."""

    prefix: str
    subnet: str
    bridge: str
    workdir: str
    job_dir: str  # the same path on every host, private contents
    shared_path: str  # the shared checkpoint storage: the same path on every training host
    shared_owned: bool  # created by the harness (removed at down) or given by the caller (kept)
    hosts_file: str
    rendezvous_host: str
    etcd: bool
    hosts: tuple[Host, ...]
    capabilities: dict[str, bool] = field(default_factory=dict, hash=False, compare=False)

    @property
    def control(self) -> Host:
        return next(h for h in self.hosts if h.role == CONTROL)

    @property
    def training(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.role == TRAIN)


def new_prefix(existing_links: set[str], existing_netns: set[str]) -> str:
    for _ in range(32):
        prefix = PREFIX + secrets.token_hex(3)
        if not any(n.startswith(prefix) for n in existing_links | existing_netns) and not (RUN_ROOT / prefix).exists():
            return prefix
    raise GpuguardError("could not pick an unused cluster id in 32 tries")


def make_layout(
    prefix: str, n: int, shared: str | None, rendezvous_host: str | None, etcd: bool, subnet: str | None
) -> Layout:
    net = ipaddress.ip_network(subnet) if subnet else None
    if net is None:
        k = int(prefix[len(PREFIX) :], 16) % 512  # one /24 of the /15, picked by the cluster id
        net = ipaddress.ip_network(f"198.{18 + k // 256}.{k % 256}.0/24")
    if not net.subnet_of(ADDRESS_RANGE):  # type: ignore[arg-type]
        raise UsageError(f"subnet {net} is outside {ADDRESS_RANGE} (the benchmarking range test hosts use)")
    addrs = list(net.hosts())
    if len(addrs) < n + 11:
        raise UsageError(f"subnet {net} is too small for {n} hosts")
    workdir = RUN_ROOT / prefix
    hosts = [
        Host(
            name=CONTROL_NAME,
            role=CONTROL,
            index=0,
            address=str(addrs[0]),
            ifname=f"{prefix}e0",
            peer=f"{prefix}v0",
            netns=f"{prefix}-{CONTROL_NAME}",
            hostdir=str(workdir / "hosts" / CONTROL_NAME),
        )
    ]
    for i in range(1, n + 1):
        hosts.append(
            Host(
                name=f"h{i}",
                role=TRAIN,
                index=i,
                address=str(addrs[9 + i]),
                ifname=f"{prefix}e{i}",
                peer=f"{prefix}v{i}",
                netns=f"{prefix}-h{i}",
                hostdir=str(workdir / "hosts" / f"h{i}"),
            )
        )
    rdzv = rendezvous_host or "h1"
    if rdzv not in {h.name for h in hosts if h.role == TRAIN}:
        raise UsageError(f"rendezvous host {rdzv!r} is not a training host (h1..h{n})")
    for h in hosts:
        assert len(h.ifname) <= 15 and len(h.peer) <= 15, h  # IFNAMSIZ - 1
    shared_path = str(Path(shared).resolve()) if shared else str(workdir / "shared")
    return Layout(
        prefix=prefix,
        subnet=str(net),
        bridge=f"{prefix}br",
        workdir=str(workdir),
        job_dir=str(workdir / "job"),
        shared_path=shared_path,
        shared_owned=shared is None,
        hosts_file=str(workdir / "etc-hosts"),
        rendezvous_host=rdzv,
        etcd=etcd,
        hosts=tuple(hosts),
    )


def plumb(layout: Layout) -> None:
    """The bridge, then per host: a netns, a veth pair (one end on the bridge), an address, links up."""
    br = layout.bridge
    _linux.run(["ip", "link", "add", "name", br, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
    _linux.disable_ipv6([br])
    _linux.run(["ip", "link", "set", "dev", br, "up"])
    prefixlen = ipaddress.ip_network(layout.subnet).prefixlen
    for h in layout.hosts:
        _linux.run(["ip", "netns", "add", h.netns])
        _linux.disable_ipv6(["all", "default", "lo"], h.netns)  # before its link exists: it inherits "default"
        _linux.run(["ip", "link", "add", "name", h.peer, "type", "veth", "peer", "name", h.ifname, "netns", h.netns])
        _linux.disable_ipv6([h.peer])
        _linux.run(["ip", "link", "set", "dev", h.peer, "master", br, "up"])
        _linux.run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/{prefixlen}", "dev", h.ifname])
        _linux.run(["ip", "-n", h.netns, "link", "set", "dev", h.ifname, "up"])
        _linux.run(["ip", "-n", h.netns, "link", "set", "dev", "lo", "up"])


def make_dirs(layout: Layout) -> None:
    RUN_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    workdir = Path(layout.workdir)
    workdir.mkdir(mode=0o700)
    Path(layout.job_dir).mkdir()
    Path(layout.shared_path).mkdir(parents=True, exist_ok=True)
    for h in layout.hosts:
        for sub in ("tmp", "job"):
            d = Path(h.hostdir) / sub
            d.mkdir(parents=True)
        os.chmod(Path(h.hostdir) / "tmp", 0o1777)
    lines = ["127.0.0.1\tlocalhost"] + [f"{h.address}\t{h.name}" for h in layout.hosts]
    Path(layout.hosts_file).write_text("\n".join(lines) + "\n")


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600 (the state names pids that faults signal)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
