"""N simulated hosts on one machine: namespaces, a bridge, etcd on a control host, and faults.

Each host is a long-lived PID 1 (testhosts/_hostinit.py) started by `ip netns exec NS unshare --fork
--pid --mount --uts --mount-proc`: its own network namespace (a veth on the cluster's bridge, one
address in 198.18.0.0/15), PID namespace, mount namespace (private /tmp, /dev/shm and job directory,
the shared checkpoint storage bound on training hosts) and hostname. A command runs "on a host" by
`nsenter --target INIT` into all four namespaces. Power-off is SIGKILL on that PID 1.

Teardown is owed whatever happens: `with up(...) as cluster`, an atexit hook, SIGTERM/SIGHUP
handlers, and an owner pipe whose EOF makes every host's PID 1 exit when the harness dies by
SIGKILL. Links and namespaces left by a killed harness go with `cleanup_all()` (their names start
with PREFIX).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import (
    EXIT_UNAVAILABLE,
    DataError,
    GpuguardError,
    NoInputError,
    PermissionDeniedError,
    UnavailableError,
    UsageError,
)
from gpuguard.testhosts import _linux

SCHEMA = "gpuguard.testhosts/1"
PREFIX = "gpth"  # every bridge, veth, netns, work dir and init of this harness starts with it
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range: never routed
RUN_ROOT = Path("/run/gpuguard-testhosts")
DEFAULT_STATE = RUN_ROOT / "cluster.json"
INIT_SCRIPT = Path(__file__).resolve().with_name("_hostinit.py")
TRAIN, CONTROL = "train", "control"
CONTROL_NAME = "ctl"
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
MASTER_PORT, RDZV_PORT = 29500, 29400
MAX_HOSTS = 64
BOOT_TIMEOUT_S = 20.0
ETCD_TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 10.0
FREEZE_TIMEOUT_S = 5.0
ROLES = ("rendezvous", "control")


class HostsUnavailableError(GpuguardError):
    """This machine cannot make test hosts (not root, no `ip`/`unshare`/`nsenter`, no netns)."""

    exit_code = EXIT_UNAVAILABLE


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


class HostPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A process on a host. `pid` is nsenter's; signals go to the command itself (`inner_pid`).

    nsenter does not forward signals, so Popen.terminate()/kill() would stop only nsenter and
    leave the command running inside the host; this subclass signals the command instead.
    """

    host: str = ""

    def inner_pid(self) -> int | None:
        """Outside-view pid of the command (nsenter's one child), None before the fork or after exit."""
        kids = _linux.children(self.pid)
        return kids[0] if kids else None

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.inner_pid() or self.pid, sig)
            if sig == signal.SIGKILL and _linux.proc_state(self.pid) == "T":
                os.kill(self.pid, signal.SIGCONT)  # on a frozen host nsenter stopped itself: let it reap


def preflight() -> str | None:
    """Why test hosts cannot be made here, or None. Tests skip with exactly this reason."""
    if os.geteuid() != 0:
        return "test hosts need root (network, PID and mount namespaces, veth links)"
    missing = _linux.missing_tools()
    if missing:
        return f"test hosts need {', '.join(missing)} (iproute2, util-linux)"
    if not os.path.exists("/proc/self/ns/net"):
        return "test hosts need Linux namespaces (/proc/self/ns)"
    refused = _linux.namespaces_refused()
    if refused:
        return f"test hosts need to create namespaces, and this root may not: {refused}"
    return None


# -- the registry that owes teardown ------------------------------------------------------------

_LIVE: dict[int, Cluster] = {}
_LIVE_LOCK = threading.Lock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _register(cluster: Cluster) -> None:
    with _LIVE_LOCK:
        _LIVE[id(cluster)] = cluster
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _TEARDOWN_SIGNALS:
            if sig not in _PREVIOUS_HANDLERS and signal.getsignal(sig) in (signal.SIG_DFL, None):
                _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)


def _unregister(cluster: Cluster) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(cluster), None)
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_PREVIOUS_HANDLERS.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
            del _PREVIOUS_HANDLERS[sig]


def _close_all() -> None:
    for cluster in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            cluster.down()


def _on_signal(signum: int, _frame: object) -> None:
    """Tear every owned cluster down, then die of the same signal (exit status as without us)."""
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_close_all)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while tearing down: an interrupt must not leave half a cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = {signal.SIGINT, *_TEARDOWN_SIGNALS}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# -- the cluster ----------------------------------------------------------------------------------


class Cluster:
    """A running set of test hosts. Use `up()` (or `Cluster.load(state_file)` from another process)."""

    def __init__(
        self,
        layout: Layout,
        states: dict[str, HostState],
        *,
        state_path: Path | None,
        owned: bool,
    ) -> None:
        self.layout = layout
        self.states = dict(states)
        self.state_path = state_path
        self.owned = owned  # this process tears it down (context manager, atexit, signals)
        self._launchers: dict[str, subprocess.Popen[bytes]] = {}
        self._etcd: HostPopen | None = None
        self._owner_r: int | None = None
        self._owner_w: int | None = None
        self._closed = False
        if owned:
            _register(self)

    # -- lookups ---------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def prefix(self) -> str:
        return self.layout.prefix

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.layout.hosts

    @property
    def training_hosts(self) -> tuple[Host, ...]:
        return self.layout.training

    @property
    def control_host(self) -> Host:
        return self.layout.control

    @property
    def shared_path(self) -> str:
        return self.layout.shared_path

    @property
    def job_dir(self) -> str:
        return self.layout.job_dir

    @property
    def etcd_url(self) -> str | None:
        return f"http://{self.control_host.address}:{ETCD_CLIENT_PORT}" if self.layout.etcd else None

    @property
    def rendezvous_endpoint(self) -> str:
        """`host:port` for torchrun --rdzv-endpoint (c10d): on the rendezvous host."""
        return f"{self.host_for_role('rendezvous').address}:{RDZV_PORT}"

    def host(self, host: str | Host) -> Host:
        name = host.name if isinstance(host, Host) else host
        for h in self.layout.hosts:
            if h.name == name:
                return h
        raise UsageError(f"no host {name!r} in cluster {self.prefix} (hosts: {', '.join(h.name for h in self.hosts)})")

    def host_for_role(self, role: str) -> Host:
        """`rendezvous`: the host serving torchrun's rendezvous and MASTER_ADDR; `control`: etcd's host."""
        if role == "rendezvous":
            return self.host(self.layout.rendezvous_host)
        if role == "control":
            return self.control_host
        raise UsageError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")

    def state(self, host: str | Host) -> HostState:
        return self.states[self.host(host).name]

    def env(self, host: str | Host) -> dict[str, str]:
        """Environment hints for a process on `host`: gloo's link, MASTER_ADDR in the range, no proxy, and
        our PYTHONPATH (a checkout run without an install imports the same gpuguard on every host)."""
        h = self.host(host)
        no_proxy = ",".join(["127.0.0.1", "localhost", *(x.address for x in self.hosts), *(x.name for x in self.hosts)])
        return {
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
            "GLOO_SOCKET_IFNAME": h.ifname,
            "TP_SOCKET_IFNAME": h.ifname,
            "MASTER_ADDR": self.host_for_role("rendezvous").address,
            "MASTER_PORT": str(MASTER_PORT),
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
            "HOSTNAME": h.name,
        }

    # -- processes -------------------------------------------------------------------------------

    def _require_powered(self, h: Host) -> HostState:
        st = self.states[h.name]
        if not st.powered or not _linux.is_alive(st.init_pid or 0, st.init_start):
            raise UnavailableError(f"host {h.name} is powered off")
        return st

    def exec(
        self,
        host: str | Host,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        inherit_env: bool = True,
        cwd: str | None = None,
        **popen_kwargs: Any,
    ) -> HostPopen:
        """Start `argv` (an argument list, never a shell string) on `host`; return its Popen.

        The environment is ours (unless inherit_env=False) plus `env(host)` plus `env`; the working
        directory is the host's job directory unless `cwd` is given (a path as the host sees it).
        """
        if isinstance(argv, str) or not argv:
            raise UsageError("exec takes an argument list (no shell string), with at least the program")
        h = self.host(host)
        st = self._require_powered(h)
        full_env = {**(os.environ if inherit_env else {}), **self.env(h), **(env or {})}
        wrapper = [
            "nsenter",
            f"--target={st.init_pid}",
            "--net",
            "--pid",
            "--mount",
            "--uts",
            f"--wd={cwd or self.layout.job_dir}",
            "--",
        ]
        proc = HostPopen([*wrapper, *argv], env=full_env, **popen_kwargs)
        proc.host = h.name
        return proc

    def run(
        self,
        host: str | Host,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on `host` to completion within `timeout` (then it is killed); capture text output."""
        with self.exec(
            host,
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=KILL_TIMEOUT_S)
                raise UnavailableError(
                    f"{argv[0]} on {self.host(host).name}: still running after {timeout:g} s"
                ) from None
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise GpuguardError(f"{' '.join(argv)} on {self.host(host).name}: exit {proc.returncode}: {err.strip()}")
        return result

    def pids(self, host: str | Host) -> list[int]:
        """Outside-view pids of every process on `host` (its PID namespace, PID 1 included)."""
        st = self.states[self.host(host).name]
        if not st.powered or st.pid_ns is None:
            return []
        return _linux.members(st.pid_ns)

    def connect(self, host: str | Host, address: str, port: int, timeout: float = 2.0) -> socket.socket:
        """A TCP connection from `host`'s network stack, made by this process (no process on the host)."""
        return _linux.connect(self.host(host).netns, address, port, timeout)

    def wait_tcp(self, host: str | Host, address: str, port: int, timeout: float) -> bool:
        """Whether `address:port` accepts a connection from `host` before `timeout` runs out."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.connect(host, address, port, timeout=min(1.0, left)).close()
                return True
            except OSError:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    # -- faults ----------------------------------------------------------------------------------

    def power_off(self, host: str | Host) -> None:
        """Every process on the host dies at once, and the host answers nothing (its link goes down first,
        so peers see silence, not resets). SIGKILL on its PID 1: the kernel kills the whole PID namespace."""
        h = self.host(host)
        st = self.states[h.name]
        if not st.powered:
            return
        _link(h.peer, up=False)
        members = _linux.members(st.pid_ns) if st.pid_ns else []
        parents = {_linux.ppid(p) for p in members} - set(members) - {None, 0}
        if st.init_pid and _linux.is_alive(st.init_pid, st.init_start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(st.init_pid, signal.SIGKILL)
        _continue_stopped(parents)  # a frozen host's nsenters stopped themselves: let them reap
        deadline = time.monotonic() + KILL_TIMEOUT_S
        _linux.wait_gone(st.init_pid or 0, st.init_start, deadline)
        for _ in range(10_000):
            if not (st.pid_ns and _linux.members(st.pid_ns)) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        launcher = self._launchers.pop(h.name, None)
        if launcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=max(0.1, deadline - time.monotonic()))
        if h.role == CONTROL and self._etcd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._etcd.wait(timeout=max(0.1, deadline - time.monotonic()))
            self._etcd = None
        left = [p for p in members if _linux.proc_state(p) not in (None, "Z", "X")]
        self._set(h, powered=False, init_pid=None, init_start=None, pid_ns=None, frozen=False)
        if left and st.pid_ns and _linux.members(st.pid_ns):
            raise UnavailableError(f"power-off {h.name}: processes still alive after {KILL_TIMEOUT_S:g} s: {left}")

    def power_on(self, host: str | Host) -> None:
        """Boot a powered-off host again: a new PID 1, empty process table, its disks (private /tmp,
        job dir) as they were; etcd restarts on the control host."""
        h = self.host(host)
        if self.states[h.name].powered:
            return
        self._boot([h])
        if not self.states[h.name].partitioned:
            _link(h.peer, up=True)
        if h.role == CONTROL and self.layout.etcd:
            self._start_etcd()
        self.save()

    def partition(self, host: str | Host) -> None:
        """The host's link goes down (the bridge end of its veth): packets vanish, its processes live on."""
        h = self.host(host)
        _link(h.peer, up=False)
        self._set(h, partitioned=True)

    def heal(self, host: str | Host) -> None:
        """Bring a partitioned host's link back (a powered-off host stays dark until power-on)."""
        h = self.host(host)
        if self.states[h.name].powered:
            _link(h.peer, up=True)
        self._set(h, partitioned=False)

    def freeze(self, host: str | Host) -> None:
        """SIGSTOP every process on the host (state T), repeated until a full pass finds none running,
        so a process forked during the pass is stopped too."""
        h = self.host(host)
        st = self._require_powered(h)
        assert st.pid_ns is not None
        deadline = time.monotonic() + FREEZE_TIMEOUT_S
        for _ in range(10_000):
            running = [p for p in _linux.members(st.pid_ns) if _linux.proc_state(p) not in ("T", "t", "Z", "X", None)]
            if not running:
                break
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            if time.monotonic() > deadline:
                raise UnavailableError(f"freeze {h.name}: processes still running after {FREEZE_TIMEOUT_S:g} s")
            time.sleep(0.002)
        self._set(h, frozen=True)

    def thaw(self, host: str | Host) -> None:
        """SIGCONT every process on the host."""
        h = self.host(host)
        st = self._require_powered(h)
        assert st.pid_ns is not None
        for _ in range(2):  # a stopped process forks nothing, so two passes reach everyone
            members = _linux.members(st.pid_ns)
            # nsenter (outside the PID namespace) stops itself when its command stops, and waits
            # for a SIGCONT before it resumes its command: continue those parents too.
            parents = {_linux.ppid(p) for p in members} - set(members) - {None, 0}
            for pid in [*members, *(p for p in parents if _linux.proc_state(p) == "T")]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        self._set(h, frozen=False)

    def slow(self, host: str | Host, *, delay_ms: float = 0.0, rate_kbit: int | None = None) -> None:
        """Delay each direction of the host's link by `delay_ms` (netem) and/or cap it at `rate_kbit`
        (netem rate, or tbf without a delay). Raises NetemUnavailableError when the kernel has no netem."""
        h = self.host(host)
        if delay_ms < 0 or (rate_kbit is not None and rate_kbit <= 0):
            raise UsageError("slow: delay_ms must be >= 0 and rate_kbit > 0")
        _linux.shape(h.peer, None, delay_ms=delay_ms, rate_kbit=rate_kbit)  # toward the host
        try:
            _linux.shape(h.ifname, h.netns, delay_ms=delay_ms, rate_kbit=rate_kbit)  # from the host
        except GpuguardError:
            _linux.unshape(h.peer, None)
            raise
        self._set(h, delay_ms=float(delay_ms), rate_kbit=rate_kbit)

    def unslow(self, host: str | Host) -> None:
        h = self.host(host)
        _linux.unshape(h.peer, None)
        _linux.unshape(h.ifname, h.netns)
        self._set(h, delay_ms=0.0, rate_kbit=None)

    def _set(self, h: Host, **changes: Any) -> None:
        self.states[h.name] = dataclasses.replace(self.states[h.name], **changes)
        self.save()

    # -- status, state file ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The cluster as the `status --json` document (schema gpuguard.testhosts/1)."""
        hosts = []
        for h in self.hosts:
            st = self.states[h.name]
            alive = st.powered and _linux.is_alive(st.init_pid or 0, st.init_start)
            hosts.append(
                {
                    "name": h.name,
                    "role": h.role,
                    "address": h.address,
                    "ifname": h.ifname,
                    "netns": h.netns,
                    "power": "on" if alive else "off",
                    "partitioned": st.partitioned,
                    "frozen": st.frozen,
                    "delay_ms": st.delay_ms,
                    "rate_kbit": st.rate_kbit,
                    "processes": len(self.pids(h)) if alive else 0,
                    "init_pid": st.init_pid if alive else None,
                }
            )
        return {
            "schema": SCHEMA,
            "prefix": self.prefix,
            "subnet": self.layout.subnet,
            "bridge": self.layout.bridge,
            "workdir": self.layout.workdir,
            "job_dir": self.layout.job_dir,
            "shared_path": self.layout.shared_path,
            "etcd_url": self.etcd_url,
            "rendezvous_host": self.layout.rendezvous_host,
            "rendezvous_endpoint": self.rendezvous_endpoint,
            "state_file": str(self.state_path) if self.state_path else None,
            "capabilities": dict(self.layout.capabilities),
            "hosts": hosts,
        }

    def to_json(self) -> dict[str, Any]:
        layout = dataclasses.asdict(self.layout)
        return {
            "schema": SCHEMA,
            "layout": layout,
            "states": {name: dataclasses.asdict(st) for name, st in self.states.items()},
        }

    def save(self) -> None:
        """Write the state file (JSON, mode 0600, atomically) when the cluster has one."""
        if self.state_path is None or self._closed:
            return
        write_private(self.state_path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, state_path: str | Path) -> Cluster:
        """The cluster a state file describes (another process's: it is not torn down at our exit)."""
        path = Path(state_path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise NoInputError(f"{path}: no cluster state (run `up` first, or pass --state)") from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: unreadable cluster state: {exc}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise DataError(f"{path}: not a {SCHEMA} state file")
        try:
            lay = dict(doc["layout"])
            lay["hosts"] = tuple(Host(**h) for h in lay["hosts"])
            layout = Layout(**lay)
            states = {name: HostState(**st) for name, st in doc["states"].items()}
        except (KeyError, TypeError) as exc:
            raise DataError(f"{path}: malformed cluster state: {exc}") from None
        return cls(layout, states, state_path=path, owned=False)

    # -- boot and teardown -----------------------------------------------------------------------

    def _boot(self, hosts: Sequence[Host]) -> None:
        """Start each host's PID 1 (all at once) and wait, bounded, for each to report its mounts done."""
        pending: dict[int, tuple[Host, subprocess.Popen[bytes]]] = {}
        try:
            for h in hosts:
                ready_r, ready_w = os.pipe()
                spec = {
                    "hostname": h.name,
                    "hosts_root": str(Path(self.layout.workdir) / "hosts"),
                    "tmp_src": str(Path(h.hostdir) / "tmp"),
                    "job_src": str(Path(h.hostdir) / "job"),
                    "job_dir": self.layout.job_dir,
                    "shared_src": self.layout.shared_path if h.role == TRAIN else None,
                    "shared_path": self.layout.shared_path,
                    "hosts_file": self.layout.hosts_file,
                    "keep": _software_under_tmp(),
                    "ready_fd": ready_w,
                    "owner_fd": self._owner_r,
                }
                argv = [
                    "ip",
                    "netns",
                    "exec",
                    h.netns,
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
                    self.prefix,
                    h.name,
                    json.dumps(spec),
                ]
                fds = (ready_w,) if self._owner_r is None else (ready_w, self._owner_r)
                with open(Path(h.hostdir) / "init.log", "ab") as log:
                    proc = subprocess.Popen(
                        argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                    )
                os.close(ready_w)
                pending[ready_r] = (h, proc)
                self._launchers[h.name] = proc
            deadline = time.monotonic() + BOOT_TIMEOUT_S
            replies: dict[int, bytes] = {fd: b"" for fd in pending}
            open_fds = set(pending)
            while open_fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(pending[fd][0].name for fd in open_fds)
                    raise UnavailableError(f"host(s) {names} did not boot within {BOOT_TIMEOUT_S:g} s")
                readable, _, _ = select.select(list(open_fds), [], [], left)
                for fd in readable:
                    chunk = os.read(fd, 4096)
                    replies[fd] += chunk
                    if not chunk or b"\n" in replies[fd]:
                        open_fds.discard(fd)
            for fd, (h, proc) in pending.items():
                reply = replies[fd].decode(errors="replace").strip()
                if reply != "ok":
                    log_tail = (Path(h.hostdir) / "init.log").read_text(errors="replace")[-800:]
                    raise GpuguardError(f"host {h.name} failed to boot: {reply or 'no reply'} {log_tail.strip()}")
                kids = _linux.children(proc.pid)
                if len(kids) != 1:
                    raise GpuguardError(f"host {h.name}: expected one PID 1 under unshare, found {kids}")
                init = kids[0]
                self.states[h.name] = dataclasses.replace(
                    self.states[h.name],
                    powered=True,
                    init_pid=init,
                    init_start=_linux.start_time(init),
                    pid_ns=_linux.ns_id(init, "pid"),
                    frozen=False,
                )
        finally:
            for fd in pending:
                os.close(fd)
        self.save()

    def _start_etcd(self) -> None:
        """A real etcd on the control host, on its address (and its loopback); wait until /health says true."""
        ctl = self.control_host
        etcd = shutil.which("etcd")
        if etcd is None:
            raise HostsUnavailableError(
                "etcd is not installed (Debian package etcd-server): up(etcd=False) to do without"
            )
        url = f"http://{ctl.address}:{ETCD_CLIENT_PORT}"
        peer = f"http://{ctl.address}:{ETCD_PEER_PORT}"
        argv = [
            etcd,
            "--name",
            ctl.name,
            "--data-dir",
            f"{self.layout.job_dir}/etcd",
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
        with open(Path(ctl.hostdir) / "etcd.log", "ab") as log:
            self._etcd = self.exec(
                ctl, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, inherit_env=False
            )
        deadline = time.monotonic() + ETCD_TIMEOUT_S
        for _ in range(10_000):
            if self._etcd.poll() is not None:
                raise UnavailableError(
                    f"etcd on {ctl.name} exited ({self._etcd.returncode}): see {ctl.hostdir}/etcd.log"
                )
            if _etcd_healthy(self, ctl, ctl.address):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise UnavailableError(
            f"etcd on {ctl.name} not healthy within {ETCD_TIMEOUT_S:g} s: see {ctl.hostdir}/etcd.log"
        )

    def detach(self) -> None:
        """Stop owing teardown (the CLI's `up`): the hosts outlive this process until `down`."""
        self.owned = False
        _unregister(self)

    def down(self) -> None:
        """Remove everything of this cluster: processes, namespaces, links, work dir, state file.

        Idempotent and tolerant (a host already gone is fine); interrupts wait until it is done.
        """
        if self._closed:
            return
        with _signals_deferred():
            self._teardown()
            self._closed = True
            _unregister(self)

    def _teardown(self) -> None:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        inits = []
        netns_ids = {_netns_inode(h.netns) for h in self.hosts} - {None}
        for h in self.hosts:
            st = self.states[h.name]
            if st.init_pid and _linux.is_alive(st.init_pid, st.init_start):
                members = _linux.members(st.pid_ns) if st.pid_ns else []
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.init_pid, signal.SIGKILL)
                _continue_stopped({_linux.ppid(p) for p in members} - set(members))  # frozen hosts' nsenters
                inits.append(st)
        for st in inits:
            _linux.wait_gone(st.init_pid or 0, st.init_start, deadline)
        # A developer's `ip netns exec NS cmd` lives outside the PID namespace but on the host's network.
        # (After the inits are gone: killing an nsenter before it reaps its command slows the PID
        # namespace's exit down by about a second.)
        _kill_in_netns(netns_ids)
        for proc in [*self._launchers.values(), *([self._etcd] if self._etcd else [])]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._launchers.clear()
        self._etcd = None
        for h in self.hosts:
            if h.netns in _linux.netns_names():
                _linux.run(["ip", "netns", "del", h.netns], check=False)
        present = set(_linux.link_names())
        for h in self.hosts:
            if h.peer in present:
                _linux.run(["ip", "link", "del", h.peer], check=False)
        if self.layout.bridge in present:
            _linux.run(["ip", "link", "del", self.layout.bridge], check=False)
        for fd in (self._owner_r, self._owner_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._owner_r = self._owner_w = None
        _remove_workdir(Path(self.layout.workdir))
        if self.state_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()


# -- helpers ----------------------------------------------------------------------------------------


def _link(name: str, *, up: bool) -> None:
    _linux.run(["ip", "link", "set", "dev", name, "up" if up else "down"])


def _continue_stopped(pids: set[int | None]) -> None:
    for pid in pids:
        if pid and _linux.proc_state(pid) == "T":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


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


def _netns_inode(netns: str) -> str | None:
    try:
        return f"net:[{os.stat(Path(_linux.NETNS_DIR) / netns).st_ino}]"
    except OSError:
        return None


def _kill_in_netns(netns_ids: set[str]) -> list[int]:
    """SIGKILL every process whose network namespace is one of `netns_ids` (`net:[inode]`)."""
    killed = []
    if not netns_ids:
        return killed
    me = os.getpid()
    for pid in _linux.pids():
        if pid != me and _linux.ns_id(pid, "net") in netns_ids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def _remove_workdir(workdir: Path) -> None:
    """Remove a cluster's work dir, never crossing a mount point (a bind left in our namespace)."""
    if not workdir.exists():
        return
    mounts = _mount_points()
    inside = [m for m in mounts if m == str(workdir) or m.startswith(str(workdir) + "/")]
    if inside:
        return  # something is still mounted there: leave it rather than delete through the mount
    shutil.rmtree(workdir, ignore_errors=True)


def _mount_points() -> list[str]:
    try:
        with open("/proc/self/mountinfo") as f:
            return [line.split()[4].replace("\\040", " ") for line in f if len(line.split()) > 4]
    except OSError:
        return []


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


def _new_prefix(existing_links: set[str], existing_netns: set[str]) -> str:
    for _ in range(32):
        prefix = PREFIX + secrets.token_hex(3)
        if not any(n.startswith(prefix) for n in existing_links | existing_netns) and not (RUN_ROOT / prefix).exists():
            return prefix
    raise GpuguardError("could not pick an unused cluster id in 32 tries")


def _layout(
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


def _plumb(layout: Layout) -> None:
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


def _make_dirs(layout: Layout) -> None:
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


def up(
    hosts: int = 3,
    *,
    shared: str | None = None,
    state_path: str | Path | None = None,
    etcd: bool = True,
    rendezvous_host: str | None = None,
    subnet: str | None = None,
    detached: bool = False,
) -> Cluster:
    """Start `hosts` training hosts and a control host (running etcd unless etcd=False).

    Owned by this process (torn down by `with`, `down()`, atexit or SIGTERM, and its hosts die with
    it) unless `detached` (the CLI): then it lives until `down` and only `state_path` finds it again.
    """
    reason = preflight()
    if reason:
        raise HostsUnavailableError(reason) if os.geteuid() == 0 else PermissionDeniedError(reason)
    if not 1 <= hosts <= MAX_HOSTS:
        raise UsageError(f"hosts must be 1..{MAX_HOSTS}, not {hosts}")
    if shared is not None and Path(shared).exists() and not Path(shared).is_dir():
        raise UsageError(f"shared storage {shared} is not a directory")
    prefix = _new_prefix(set(_linux.link_names()), set(_linux.netns_names()))
    layout = _layout(prefix, hosts, shared, rendezvous_host, etcd, subnet)
    cluster = Cluster(
        layout,
        {h.name: HostState() for h in layout.hosts},
        state_path=Path(state_path) if state_path else None,
        owned=True,  # until up returns: a failure or an interrupt half-way still tears down
    )
    try:
        _make_dirs(layout)
        if not detached:
            cluster._owner_r, cluster._owner_w = os.pipe()
        _plumb(layout)
        caps = {kind: _linux.qdisc_supported(kind, layout.bridge) for kind in ("netem", "tbf")}
        cluster.layout = dataclasses.replace(layout, capabilities=caps)
        cluster._boot(layout.hosts)
        if etcd:
            cluster._start_etcd()
        cluster.save()
    except BaseException:
        cluster.down()
        raise
    if detached:
        cluster.detach()
    return cluster


def _software_under_tmp() -> list[str]:
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
