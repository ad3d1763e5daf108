"""One etcd lease per host, shared by the host's ranks: keepalive load per host, the self-fence per rank.

One lease per rank costs etcd's leader ranks / (TTL/3) keepalives a second (100,000 ranks, TTL 6 s:
50,000/s). Ranks on one host share one clock (CLOCK_BOOTTIME, `lease.now`) and one process
table, so they can share one lease: one of them (the *renewer*, elected by a `flock` on a host-local
file) renews it and writes when each keepalive that succeeded was sent; every rank attaches its own
key (`P/lease/<incarnation>`) to that lease and fences itself by the same rule as before, against
the host's last successful keepalive instead of its own. Comparing a time the renewer took with the
rank's own `now()` is valid: same host, same clock.

What changes, and why the fence still holds (docs/formats/leases.md, "The host lease"):
- a frozen, powered-off or partitioned *host* stops renewing: the lease expires for all its ranks
  at once, each of them having fenced first (or fencing on its first instruction after waking);
- a renewer that dies releases its flock: another rank of the host takes over within
  `WATCH_PERIOD_S`; a renewer that is frozen keeps its flock, so a rank that sees the renewal
  overdue renews once itself (one at a time, under a second flock);
- a *single* dead or frozen rank on a live host no longer loses its lease (its host-mates renew
  it): the renewer deletes the key of every rank of the host whose process is gone (pid + start
  time, its own process table) or whose watchdog has not run for the margin (its `tick`), and a
  rank fences itself when it has not run for the margin, so a missing key still proves it quiet.

Files in the host directory (0700, the job's and this host's own; every file 0600, no link followed):
  renewer.lock             flock held by the renewer for as long as it renews
  backup.lock              flock held by a rank renewing because the renewer is overdue (one keepalive)
  lease.json               HostState, replaced atomically (write a temp file, rename)
  members/<incarnation>    {"key", "pid", "start_time", "tick"}: the ranks whose keys ride on the lease
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuguard.foundation.env import HOST_LEASE_DIR_ENV
from gpuguard.foundation.errors import DataError, UnavailableError
from gpuguard.foundation.identity import same_process
from gpuguard.recovery.runtime.lease import WATCH_PERIOD_S, Heartbeat, LeaseTiming, now

STATE_VERSION = 1
MAX_STATE_BYTES = 4096
TICK_S = 4 * WATCH_PERIOD_S  # how often a rank records that it runs (its member file's `tick`)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def boot_id() -> str:
    """This boot's id: a state file from an earlier boot (a clock that restarted) is never fresh."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text()[:64].strip()
    except OSError:
        return ""


def host_scope() -> str:
    """What makes two processes one host for this lease: the hostname (the project's "same host"),
    the user and the PID namespace (the renewer probes its host-mates' pids)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}|{os.getuid()}|{pidns}"


def default_base() -> Path:
    """A host-local, memory-backed directory: never shared storage (a flock there would span hosts)."""
    env = os.environ.get(HOST_LEASE_DIR_ENV)
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class HostState:
    """The shared lease and when its last successful keepalive was sent (the host's `now()`)."""

    lease: int
    last_ok: float
    ttl_s: float
    boot_id: str
    by: int  # pid of the rank that wrote it (for people)

    def to_json(self) -> bytes:
        doc = {"version": STATE_VERSION, **self.__dict__}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> HostState | None:
        """None for anything but a well-formed state of this version (never fresh, never trusted)."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                return None
            lease, last_ok, ttl, boot, by = doc["lease"], doc["last_ok"], doc["ttl_s"], doc["boot_id"], doc["by"]
        except (ValueError, KeyError, TypeError):
            return None
        if not (isinstance(lease, int) and isinstance(by, int) and isinstance(boot, str)):
            return None
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (last_ok, ttl)):
            return None
        return cls(lease, float(last_ok), float(ttl), boot, by)


@dataclass(frozen=True)
class Member:
    """A rank whose key rides on the host lease: its key, its process, and when its watchdog last
    ran (`tick`, the host's `now()`, written before the rank relies on it: see `HostHeartbeat`)."""

    key: str
    pid: int
    start_time: float
    tick: float


class HostDir:
    """The host directory: made 0700 once, opened without following links, read with a size cap."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_private_dir(path)
        members = path / "members"
        self.members_fd = open_private_dir(members)

    @classmethod
    def for_lease(cls, scope: str, base: Path | None = None) -> HostDir:
        """The directory of one job's lease on this host (`scope`: endpoints, prefix, TTL)."""
        digest = hashlib.sha256(f"{host_scope()}|{scope}".encode()).hexdigest()[:20]
        return cls((base or default_base()) / f"gpuguard-lease-{digest}")

    def close(self) -> None:
        os.close(self.members_fd)
        os.close(self.fd)

    # -- the state ----------------------------------------------------------------------------
    def read_state(self) -> HostState | None:
        raw = read_at(self.fd, "lease.json")
        return None if raw is None else HostState.from_json(raw)

    def write_state(self, state: HostState) -> None:
        replace_at(self.fd, "lease.json", state.to_json())

    # -- the locks ------------------------------------------------------------------------------
    def try_lock(self, name: str) -> int | None:
        """The fd holding `name`'s exclusive flock, or None when another process holds it."""
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    # -- the members ----------------------------------------------------------------------------
    def register(self, incarnation_id: str, member: Member) -> None:
        """Write (or refresh: the `tick`) this rank's member file."""
        replace_at(self.members_fd, _member_name(incarnation_id), json.dumps(member.__dict__).encode())

    def unregister(self, incarnation_id: str) -> None:
        try:
            os.unlink(_member_name(incarnation_id), dir_fd=self.members_fd)
        except FileNotFoundError:
            pass

    def members(self) -> Iterator[tuple[str, Member]]:
        """(file name, member) of each registered rank; unreadable files are skipped."""
        for name in os.listdir(self.members_fd):
            if name.startswith(".") or not _SAFE_NAME.match(name):
                continue
            raw = read_at(self.members_fd, name)
            try:
                doc = json.loads(raw or b"")
                yield name, Member(str(doc["key"]), int(doc["pid"]), float(doc["start_time"]), float(doc["tick"]))
            except (ValueError, KeyError, TypeError):
                continue


def _member_name(incarnation_id: str) -> str:
    if _SAFE_NAME.match(incarnation_id) and not incarnation_id.startswith("."):
        return incarnation_id
    return "h-" + hashlib.sha256(incarnation_id.encode()).hexdigest()[:32]


def open_private_dir(path: Path) -> int:
    """Make `path` (0700) or open it if it is a directory of ours that nobody else may write."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnavailableError(f"host lease directory {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        raise DataError(f"host lease directory {path}: not a directory of its own ({exc.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise DataError(f"host lease directory {path}: owned by uid {st.st_uid} or open to others: refusing it")
    return fd


def read_at(dir_fd: int, name: str, cap: int = MAX_STATE_BYTES) -> bytes | None:
    """The first `cap` bytes of the regular file `name` (None: absent, a link or a FIFO)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, cap + 1)[:cap]
    finally:
        os.close(fd)


def replace_at(dir_fd: int, name: str, data: bytes) -> None:
    """A temp file of our own (O_EXCL, 0600), renamed over `name`: readers see the old or the new."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # left by a process of this pid that died mid-write
    except FileNotFoundError:
        pass
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


# ---------------------------------------------------------------------- joining
def join(
    hostdir: HostDir, grant: Callable[[], int], timing: LeaseTiming, *, clock: Callable[[], float] = now
) -> tuple[int, int | None]:
    """(the host's lease id, the renewer flock's fd when this rank is the renewer).

    A fresh state (this boot, this TTL, last keepalive within the margin) is joined as it is; with
    none, the rank that holds the renewer lock grants a new lease (the time is read before the grant
    is sent: etcd's countdown starts after it). Others wait for it, at most one TTL."""
    boot = boot_id()
    end = clock() + timing.ttl_s
    while True:
        fd = hostdir.try_lock("renewer.lock")
        st = hostdir.read_state()
        if st is not None and fresh(st, boot, timing, clock()):
            return st.lease, fd
        if fd is not None:
            sent = clock()
            lease = grant()
            hostdir.write_state(HostState(lease, sent, timing.ttl_s, boot, os.getpid()))
            return lease, fd
        if clock() > end:
            raise UnavailableError(
                f"host lease {hostdir.path}: another process holds renewer.lock but no lease was "
                f"renewed within {timing.ttl_s:g} s"
            )
        time.sleep(WATCH_PERIOD_S)


def fresh(st: HostState, boot: str, timing: LeaseTiming, t: float) -> bool:
    return st.boot_id == boot and st.ttl_s == timing.ttl_s and 0.0 <= t - st.last_ok <= timing.margin_s


# ---------------------------------------------------------------------- the heartbeat
class HostHeartbeat(Heartbeat):
    """A rank's heartbeat on the host lease: `age()` is the age of the host's last successful
    keepalive; the beat thread renews only while this rank is the renewer (or the renewer is
    overdue), and the renewer deletes the keys of host-mates whose process is gone (`forget`)."""

    def __init__(
        self,
        hostdir: HostDir,
        lease: int,
        keepalive: Callable[[], bool],
        timing: LeaseTiming,
        on_fence: Callable[[str], None],
        *,
        renewer_fd: int | None,
        forget: Callable[[str], Any],
        member: tuple[str, Member],
        clock: Callable[[], float] = now,
    ) -> None:
        super().__init__(keepalive, timing, on_fence, clock=clock)
        self.hostdir, self.lease, self.forget = hostdir, lease, forget
        self.renewer_fd = renewer_fd
        self.incarnation_id, self.member = member
        self.last_tick = self.member.tick  # never newer than the tick in the member file
        self.boot = boot_id()
        self.backups = 0  # keepalives this rank sent because the renewer was overdue
        self._retry_at = -1e18
        self._forgotten: set[str] = set()  # keys this rank deleted (a frozen rank's: once)
        self.seen_ok = float("-inf")  # the newest `last_ok` of this lease this rank has read (`age`)

    def host_state(self) -> HostState | None:
        """The host's state, if it is still about this rank's lease (else: never valid again)."""
        st = self.hostdir.read_state()
        if st is None or st.lease != self.lease or st.boot_id != self.boot:
            return None
        self.seen_ok = max(self.seen_ok, st.last_ok)
        return st

    def age(self) -> float:
        """The age of the newest successful keepalive of this lease this rank knows of. No file read
        while the one it last read still proves the lease alive (a keepalive sent at `seen_ok`
        succeeded: the lease lives past `seen_ok + TTL`, beyond the margin), so the commit path and
        the watchdog cost no I/O; the file's `last_ok` is never older, so this fences no later."""
        age = self.clock() - self.seen_ok
        if age <= self.timing.margin_s:
            return age
        st = self.host_state()
        return float("inf") if st is None else self.clock() - st.last_ok

    def stalled(self) -> float:
        """How long this process has not run its watchdog (frozen, or starved)."""
        return self.clock() - self.last_tick

    def problem(self) -> str | None:
        """Why this rank may not write, or None: the host's keepalive, or its own run, is too old."""
        margin = self.timing.margin_s
        if self.fenced is not None:
            return self.fenced
        if self.stalled() > margin:
            return f"this process did not run for {self.stalled():.2f} s (margin {margin:g} s)"
        if self.age() > margin:
            return f"no host lease keepalive for {self.age():.2f} s (margin {margin:g} s)"
        return None

    def valid(self) -> bool:
        return self.problem() is None

    def require(self, what: str) -> None:
        why = self.problem()
        if why is not None:
            self.fence(f"{what}: {why}")

    def _watch(self) -> None:
        """Every 50 ms: fence on `problem()`, else record this run (file first, then memory, so the
        renewer reading a tick older than the margin knows this rank fences before its next write)."""
        while not self._stop.wait(WATCH_PERIOD_S):
            t = self.clock()
            why = self.problem()
            if why is not None:
                self._fence_quietly(why)
                return
            if t - self.last_tick < TICK_S:
                continue
            try:
                self.hostdir.register(self.incarnation_id, replace(self.member, tick=t))
            except OSError:
                continue  # not recorded: the renewer may take this rank for frozen, and it fences
            self.last_tick = t

    @property
    def renewer(self) -> bool:
        return self.renewer_fd is not None

    def stop(self) -> None:
        """Stop and wait for both threads (a keepalive in flight ends within its timeout), so the
        flock is handed over and no file is touched after `HostDir.close`."""
        super().stop()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self.timing.call_timeout_s + 1.0)

    @property
    def stopped(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def _beat(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self.renewer_fd is None:
                        self.renewer_fd = self.hostdir.try_lock("renewer.lock")
                    st = self.host_state() if self._may_be_due() else None
                    if st is not None:
                        self._turn(st)
                except OSError:  # a full or broken host directory: no renewal recorded, the watchdogs fence
                    self.failures += 1
                self._stop.wait(WATCH_PERIOD_S)
        finally:
            self._release()

    def _may_be_due(self) -> bool:
        """Whether a renewal (this rank's, or a backup of an overdue renewer) may be due, judged by
        the newest `last_ok` already read: the file's is never older, so a renewal this says is not
        due is not; only then is the state read (not every `WATCH_PERIOD_S`)."""
        t = self.clock()
        due_after = self.timing.interval_s + (0.0 if self.renewer_fd is not None else self.timing.retry_s)
        return t >= self._retry_at and t - self.seen_ok >= due_after

    def _turn(self, st: HostState) -> None:
        t = self.clock()
        if t < self._retry_at:
            return
        if self.renewer_fd is not None:
            if t - st.last_ok >= self.timing.interval_s:
                if self._renew(st):
                    self._prune()
            return
        if t - st.last_ok > self.timing.interval_s + self.timing.retry_s:  # the renewer is overdue
            fd = self.hostdir.try_lock("backup.lock")
            if fd is None:
                return
            try:
                st2 = self.host_state()
                if st2 is not None and self.clock() - st2.last_ok > self.timing.interval_s + self.timing.retry_s:
                    self.backups += 1
                    if self._renew(st2):
                        self._prune()  # the overdue renewer's own key among them, if it is frozen
            finally:
                os.close(fd)

    def _renew(self, st: HostState) -> bool:
        """One keepalive; the host's last_ok moves to when it was sent, under the same rule as a
        rank's own lease: sent within the margin of the last success, or this rank fences."""
        sent = self.clock()
        try:
            ok = bool(self.keepalive())
        except Exception:  # noqa: BLE001 - any failure to renew is a missed beat
            ok = False
        if self._stop.is_set():
            return False
        if ok and sent - st.last_ok <= self.timing.margin_s:
            cur = self.host_state() or st
            self.hostdir.write_state(HostState(self.lease, max(cur.last_ok, sent), st.ttl_s, self.boot, os.getpid()))
            self.seen_ok = max(self.seen_ok, sent)  # written: what this rank knows without reading it back
            self.beats += 1
            return True
        if ok:
            self._fence_quietly("host lease renewed only after the fence margin")
            return False
        self.failures += 1
        self._retry_at = self.clock() + self.timing.retry_s
        return False

    def _prune(self) -> None:
        """Delete the key of every host-mate whose process is gone, or whose watchdog has not run
        for longer than the margin (it fences itself before its next write, `problem()`): its lease
        no longer expires by itself (this host renews it), so its key goes on a proof its own host
        gives. A frozen rank's file stays (its key goes): it is pruned again once it is gone."""
        for name, m in list(self.hostdir.members()):
            gone = not same_process(m.pid, m.start_time)
            if not gone and (m.key in self._forgotten or self.clock() - m.tick <= self.timing.margin_s):
                continue
            try:
                self.forget(m.key)
            except Exception:  # noqa: BLE001 - etcd unreachable now: the next beat tries again
                continue
            self._forgotten.add(m.key)
            if gone:
                self.hostdir.unregister(name)

    def _release(self) -> None:
        fd, self.renewer_fd = self.renewer_fd, None
        if fd is not None:
            os.close(fd)  # another rank of the host takes over
