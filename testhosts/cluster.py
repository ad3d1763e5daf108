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

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import (
    DataError,
    GpuguardError,
    NoInputError,
    PermissionDeniedError,
    UnavailableError,
    UsageError,
)
from gpuguard.testhosts import _linux, boot
from gpuguard.testhosts._linux import HostsUnavailableError
from gpuguard.testhosts.boot import ETCD_CLIENT_PORT
from gpuguard.testhosts.layout import (
    CONTROL,
    RUN_ROOT,
    Host,
    HostState,
    Layout,
    make_dirs,
    make_layout,
    new_prefix,
    plumb,
    write_private,
)
from gpuguard.testhosts.owners import register, signals_deferred, unregister

SCHEMA = "gpuguard.testhosts/1"
DEFAULT_STATE = RUN_ROOT / "cluster.json"
MASTER_PORT, RDZV_PORT = 29500, 29400
MAX_HOSTS = 64
KILL_TIMEOUT_S = 10.0
FREEZE_TIMEOUT_S = 5.0
ROLES = ("rendezvous", "control")


class HostPopen(subprocess.Popen):
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
            register(self)

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
        _linux.set_link(h.peer, up=False)
        members = _linux.members(st.pid_ns) if st.pid_ns else []
        parents = {_linux.ppid(p) for p in members} - set(members) - {None, 0}
        if st.init_pid and _linux.is_alive(st.init_pid, st.init_start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(st.init_pid, signal.SIGKILL)
        _linux.continue_stopped(parents)  # a frozen host's nsenters stopped themselves: let them reap
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
            _linux.set_link(h.peer, up=True)
        if h.role == CONTROL and self.layout.etcd:
            self._start_etcd()
        self.save()

    def partition(self, host: str | Host) -> None:
        """The host's link goes down (the bridge end of its veth): packets vanish, its processes live on."""
        h = self.host(host)
        _linux.set_link(h.peer, up=False)
        self._set(h, partitioned=True)

    def heal(self, host: str | Host) -> None:
        """Bring a partitioned host's link back (a powered-off host stays dark until power-on)."""
        h = self.host(host)
        if self.states[h.name].powered:
            _linux.set_link(h.peer, up=True)
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
            parents = {pp for p in members if (pp := _linux.ppid(p))} - set(members)  # not None, not 0
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

    def start(self, *, owner_pipe: bool) -> None:
        """Make what the layout names and boot it: folders, the owner pipe (the hosts die with this
        process), the bridge and links, each host's PID 1, and etcd when the layout has it."""
        make_dirs(self.layout)
        if owner_pipe:
            self._owner_r, self._owner_w = os.pipe()
        plumb(self.layout)
        caps = {kind: _linux.qdisc_supported(kind, self.layout.bridge) for kind in ("netem", "tbf")}
        self.layout = dataclasses.replace(self.layout, capabilities=caps)
        self._boot(self.layout.hosts)
        if self.layout.etcd:
            self._start_etcd()
        self.save()

    def _boot(self, hosts: Sequence[Host]) -> None:
        """Start each host's PID 1 (all at once) and wait, bounded, for each to report its mounts done."""
        pending: dict[int, tuple[Host, subprocess.Popen[bytes]]] = {}
        try:
            for h in hosts:
                ready_r, ready_w = os.pipe()
                argv = boot.init_argv(self.layout, h, ready_w, self._owner_r)
                fds = (ready_w,) if self._owner_r is None else (ready_w, self._owner_r)
                with open(Path(h.hostdir) / "init.log", "ab") as log:
                    proc = subprocess.Popen(
                        argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                    )
                os.close(ready_w)
                pending[ready_r] = (h, proc)
                self._launchers[h.name] = proc
            replies = boot.read_replies({fd: h.name for fd, (h, _) in pending.items()})
            for fd, (h, proc) in pending.items():
                self.states[h.name] = dataclasses.replace(
                    self.states[h.name], **boot.booted_init(h, proc.pid, replies[fd])
                )
        finally:
            for fd in pending:
                os.close(fd)
        self.save()

    def _start_etcd(self) -> None:
        """A real etcd on the control host, on its address (and its loopback); wait until /health says true."""
        ctl = self.control_host
        argv = boot.etcd_argv(ctl, self.layout.job_dir)
        with open(Path(ctl.hostdir) / "etcd.log", "ab") as log:
            self._etcd = self.exec(
                ctl, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, inherit_env=False
            )
        boot.wait_etcd_healthy(self, ctl, self._etcd)

    def detach(self) -> None:
        """Stop owing teardown (the CLI's `up`): the hosts outlive this process until `down`."""
        self.owned = False
        unregister(self)

    def down(self) -> None:
        """Remove everything of this cluster: processes, namespaces, links, work dir, state file.

        Idempotent and tolerant (a host already gone is fine); interrupts wait until it is done.
        """
        if self._closed:
            return
        with signals_deferred():
            self._teardown()
            self._closed = True
            unregister(self)

    def _teardown(self) -> None:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        inits = []
        netns_ids = {ns for h in self.hosts if (ns := _linux.netns_inode(h.netns)) is not None}
        for h in self.hosts:
            st = self.states[h.name]
            if st.init_pid and _linux.is_alive(st.init_pid, st.init_start):
                members = _linux.members(st.pid_ns) if st.pid_ns else []
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.init_pid, signal.SIGKILL)
                _linux.continue_stopped({_linux.ppid(p) for p in members} - set(members))  # frozen hosts' nsenters
                inits.append(st)
        for st in inits:
            _linux.wait_gone(st.init_pid or 0, st.init_start, deadline)
        # A developer's `ip netns exec NS cmd` lives outside the PID namespace but on the host's network.
        # (After the inits are gone: killing an nsenter before it reaps its command slows the PID
        # namespace's exit down by about a second.)
        _linux.kill_in_netns(netns_ids)
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
        _linux.remove_workdir(Path(self.layout.workdir))
        if self.state_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()


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
    prefix = new_prefix(set(_linux.link_names()), set(_linux.netns_names()))
    layout = make_layout(prefix, hosts, shared, rendezvous_host, etcd, subnet)
    cluster = Cluster(
        layout,
        {h.name: HostState() for h in layout.hosts},
        state_path=Path(state_path) if state_path else None,
        owned=True,  # until up returns: a failure or an interrupt half-way still tears down
    )
    try:
        cluster.start(owner_pipe=not detached)
    except BaseException:
        cluster.down()
        raise
    if detached:
        cluster.detach()
    return cluster
