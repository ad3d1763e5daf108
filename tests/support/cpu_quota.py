"""Cap one process's CPU with a cgroup quota: the compute straggler of the real-job tests and the bench.

A rank under a CPU quota behaves like a throttled GPU or a contended host: its fixed work per step
(`demo_train --burn-work`) takes longer, it keeps making progress, its peers wait for it. One place for
the rule (tests/doctor/test_stragglers_real.py and bench/stragglers.py both use it):

* v1 (`/sys/fs/cgroup/cpu/<name>/cpu.cfs_quota_us`) or v2 (`/sys/fs/cgroup/<name>/cpu.max`), whichever
  the machine has writable; period 100 ms, quota `pct` % of it (at least the kernel's 1 ms);
* the child cgroup is named `gpuguard-straggler-<creator pid>-<target pid>-<n>`; on exit the process is moved
  back to the parent and the cgroup removed. `remove_stale()` removes those whose creator is gone (a run
  that was SIGKILLed), and every live one is removed at interpreter exit too;
* without a writable controller: `probe()` says why, and `Throttle(..., fallback=True)` duty-cycles the
  process with SIGSTOP/SIGCONT instead (coarse: the bench labels those rows).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import threading
import time
from pathlib import Path

CG_V1 = Path("/sys/fs/cgroup/cpu")
CG_V2 = Path("/sys/fs/cgroup")
PREFIX = "gpuguard-straggler-"
PERIOD_US = 100_000
MIN_QUOTA_US = 1000  # the kernel refuses less than 1 ms

_live: set[Throttle] = set()
_seq = itertools.count()
_lock = threading.Lock()


def _roots() -> list[tuple[str, Path]]:
    out = []
    if (CG_V1 / "cpu.cfs_quota_us").exists():
        out.append(("cgroup-v1", CG_V1))
    ctl = CG_V2 / "cgroup.controllers"
    try:
        if ctl.exists() and "cpu" in ctl.read_text().split():
            out.append(("cgroup-v2", CG_V2))
    except OSError:
        pass
    return out


def probe() -> tuple[str, str]:
    """('cgroup-v1' | 'cgroup-v2', '') when a child cgroup with a CPU quota can really be made here,
    else ('', why not). Tries it: a read-only mount or a container without the privilege refuses mkdir."""
    roots = _roots()
    if not roots:
        return (
            "",
            "no cgroup cpu controller (neither /sys/fs/cgroup/cpu/cpu.cfs_quota_us nor cpu in cgroup.controllers)",
        )
    why = []
    for kind, root in roots:
        path = root / f"{PREFIX}{os.getpid()}-probe"
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            why.append(f"{kind}: cannot create a cgroup under {root} ({exc.strerror})")
            continue
        try:
            _set_quota(kind, path, MIN_QUOTA_US)
            return kind, ""
        except OSError as exc:
            why.append(f"{kind}: cannot set a CPU quota under {root} ({exc.strerror})")
        finally:
            _rmdir(path)
    return "", "; ".join(why)


def _set_quota(kind: str, path: Path, quota_us: int) -> None:
    if kind == "cgroup-v1":
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota_us))
    else:
        (path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")


def _set_weight(kind: str, path: Path, boost: float) -> None:
    """`boost` x the default CPU weight (v1 cpu.shares 1024, v2 cpu.weight 100)."""
    if kind == "cgroup-v1":
        (path / "cpu.shares").write_text(str(max(2, min(262_144, int(1024 * boost)))))
    else:
        (path / "cpu.weight").write_text(str(max(1, min(10_000, int(100 * boost)))))


def _rmdir(path: Path, tries: int = 50) -> bool:
    """rmdir a cgroup; the kernel refuses while a task is still leaving it, so retry briefly."""
    for _ in range(tries):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.05)
    return False


def _cgroup_of(pid: int, kind: str, root: Path) -> Path | None:
    """The cgroup (a directory under `root`) process `pid` is in now, from /proc/PID/cgroup."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if (kind == "cgroup-v2" and controllers == "") or (kind == "cgroup-v1" and "cpu" in controllers.split(",")):
            path = root / rel.lstrip("/")
            return path if path.is_dir() else None
    return None


def _move_out(path: Path, to: dict[str, Path] | None = None) -> None:
    """Every task still in `path` back where it came from (`to`: pid -> cgroup), else to the parent."""
    try:
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        for dest in ((to or {}).get(pid), path.parent):
            if dest is None or dest == path:
                continue
            try:
                (dest / "cgroup.procs").write_text(pid)
                break
            except OSError:
                continue  # gone meanwhile, or its origin was removed


def remove_stale() -> list[str]:
    """Remove straggler cgroups whose creator process is gone (an interrupted run). Returns their names."""
    removed = []
    for _, root in _roots():
        try:
            found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
        except OSError:
            continue
        for path in found:
            creator = path.name[len(PREFIX) :].split("-")[0]
            if creator.isdigit() and _alive(int(creator)):
                continue  # its creator still runs (this process included): its own to remove
            _move_out(path)
            if _rmdir(path, tries=10):
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Throttle:
    """Cap process `pid` at `pct` % of one CPU while the context is open; removed on exit, whatever happens.

    `kind` says how: 'cgroup-v1', 'cgroup-v2' or, with `fallback=True` and no usable cgroup,
    'sigstop-duty'. Without fallback and without a cgroup, entering raises OSError with the reason.

    `boost`: the cgroup's CPU weight as a multiple of the default. A test job's ranks in boosted groups
    get their share of the CPU even on a machine crowded by other work, so that a 20 % quota is really
    below the rank's share (`Boost` puts the other ranks in one such group, without a quota)."""

    def __init__(self, pid: int, pct: float, *, fallback: bool = False, boost: float | None = None) -> None:
        if not 0 < pct <= 100:
            raise ValueError(f"CPU quota must be in (0, 100] %, got {pct}")
        self.pids = [pid]
        self.pid, self.pct, self.fallback, self.boost = pid, pct, fallback, boost
        self.kind = ""
        self.path: Path | None = None
        self._origin: dict[str, Path] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Throttle:
        quota = max(MIN_QUOTA_US, int(PERIOD_US * self.pct / 100))
        errors = []
        for kind, root in _roots():
            path = root / f"{PREFIX}{os.getpid()}-{self.pid}-{next(_seq)}"
            try:
                path.mkdir()
            except OSError as exc:
                errors.append(f"{kind}: {exc.strerror}")
                continue
            self.path = path
            with _lock:
                _live.add(self)
            try:
                if self.pct < 100:
                    _set_quota(kind, path, quota)
                if self.boost is not None:
                    _set_weight(kind, path, self.boost)
                for pid in self.pids:
                    origin = _cgroup_of(pid, kind, root)
                    if origin is not None:
                        self._origin[str(pid)] = origin
                    (path / "cgroup.procs").write_text(str(pid))
                self.kind = kind
                return self
            except OSError as exc:
                errors.append(f"{kind}: {exc.strerror}")
                self._remove()
        if not self.fallback:
            raise OSError("no writable cgroup CPU controller: " + ("; ".join(errors) or "none mounted"))
        self.kind = "sigstop-duty"
        with _lock:
            _live.add(self)
        self._thread = threading.Thread(target=self._duty, daemon=True)
        self._thread.start()
        return self

    def _duty(self) -> None:
        cycle = 0.1
        on = self.pct / 100 * cycle
        while not self._stop.is_set():
            time.sleep(on)
            try:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(cycle - on)
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                return

    def _remove(self) -> None:
        if self.path is not None:
            _move_out(self.path, self._origin)
            _rmdir(self.path)
            self.path = None

    def release(self) -> None:
        """Undo the throttle (idempotent; also from a signal handler or atexit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._remove()
        with _lock:
            _live.discard(self)

    def __exit__(self, *exc: object) -> None:
        self.release()


class Boost(Throttle):
    """Processes `pids` in one cgroup of `boost` x the default CPU weight, no quota (cgroup only)."""

    def __init__(self, pids: list[int], boost: float) -> None:
        super().__init__(pids[0], 100, boost=boost)
        self.pids = list(pids)


def burn_job(
    job_dir: Path, *, workers: int, burn_work: int, pg_timeout_s: float, run_id: str
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the job to throttle: torchrun of `demo_train --burn-work` (a fixed amount of compute
    per step, step records through the Runtime), no snapshots or checkpoints in the way, and a collective
    timeout long enough for the slowest quota's steps."""
    from gpuguard.examples import demo

    env = demo.worker_env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["GPUGUARD_PG_TIMEOUT"] = str(int(pg_timeout_s))
    argv = demo.torchrun_argv(
        job_dir,
        workers=workers,
        steps=10_000_000,
        kills=[],
        max_restarts=0,
        port=demo.free_port(),
        run_id=run_id,
        extra=["--burn-work", str(burn_work), "--snapshot-every", "1000000", "--checkpoint-every", "1000000"],
    )
    return argv, env


def release_all() -> None:
    """Remove every throttle this process still holds (interpreter exit, a signal handler)."""
    with _lock:
        live = list(_live)
    for t in live:
        t.release()


atexit.register(release_all)
