"""The in-job runtime: what a training script adds to be recoverable and to prove what it resumed from.

    rt = Runtime.from_env(job_dir)            # torchrun's env -> an incarnation of this process
    state = rt.activate(model, optimizer)     # agree on the frontier, verify the certificate, restore
    for step in rt.steps(state, until=N):
        ...                                   # forward, backward, all-reduce on rt.pg / the default group
        rt.commit(step)                       # step record + commit record (+ async snapshot every k)

Why each piece (measured on torch 2.13 + gloo: docs/torchrun-hazards.md; protocol: docs/formats/activation.md):
- the gloo group of every generation rendezvouses under its own store namespace
  `gpuguard/<job>/g<N>/a<attempt>/pg`, where the attempt is the torchrun rendezvous round: the dead
  attempt's gloo keys in torchrun's shared store can never be read again (1/9 resumes otherwise);
- the generation number comes from the ledger, never from TORCHELASTIC_RESTART_COUNT;
- activation: every member publishes its incarnation; rank 0 computes the frontier (newest verified
  snapshot at or below the last step *all* parent members committed), issues the certificate and
  activates it with the ledger's compare-and-swap; every member verifies the certificate (admitted,
  signed, chained) and the loaded state's digest before the first collective, or refuses to start;
- snapshots every k steps in a background thread (DCP); a SIGTERM from the agent lets an in-flight
  snapshot finish first (bounded), so a survivor's last snapshot is not lost: RPO one step;
- fencing: commits and snapshot writes stamped with an older generation are dropped and counted;
- across hosts (an etcd ledger): each incarnation holds an etcd lease and fences itself (exit 4)
  before it can expire (`recovery.runtime.lease`), so the next coordinator proves an incarnation on a lost
  host quiet by its expired lease; snapshots live under `GPUGUARD_SNAPSHOT_ROOT` (the cluster's
  shared checkpoint storage) so that a new rank 0 on another host finds them;
- sharded state (`sharded=True`, `GPUGUARD_SHARDED=1`; FSDP2 / HSDP / DDP through DCP): every
  rank writes its own shards of each snapshot (`recovery.snapshots.sharded`, collective, on a gloo
  group of its own), the group forms before the (collective, resharding) restore, a model that
  needs the group comes from `activate(build=...)`, and the certificate carries the frontier
  snapshot's ownership map and the reshard plan (docs/formats/sharded-snapshots.md).

Lazy imports (start-up time): torch, only in the methods that run inside a training process (torch is the optional `gpuguard[runtime]`; `gpu-recover` imports this package without it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.env import (
    BACKEND_ENV,
    CHECKPOINT_EVERY_ENV,
    JOB_DIR_ENV,
    JOB_ID_ENV,
    LEASE_TTL_ENV,
    LEDGER_ENV,
    PG_TIMEOUT_ENV,
    SHARDED_ENV,
    SNAPSHOT_EVERY_ENV,
    SNAPSHOT_ROOT_ENV,
)
from gpuguard.foundation.errors import (
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    GpuguardError,
    RefusedError,
    UnavailableError,
)
from gpuguard.foundation.identity import same_process
from gpuguard.foundation.steplog import StepLog
from gpuguard.generation.certificate import check_stored, issue
from gpuguard.generation.job import init_job, issuer
from gpuguard.generation.keys import key_path
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.ownership import (
    describe_reshard,
    ownership_record,
    plan_digest,
    plan_reshard,
    predict_layout,
    reshard_record,
    same_holding,
)
from gpuguard.generation.records import Incarnation
from gpuguard.recovery.runtime import group_sockets
from gpuguard.recovery.runtime.activation import (
    MAX_UNRESTORABLE_SKIPS,
    ActivationFacts,
    Hello,
    branch_problem,
    check_hellos,
    plan_activation,
    restore_bound,
    skip_unrestorable,
    unvouched,
)
from gpuguard.recovery.runtime.attempt import Attempt, current_attempt, record_round
from gpuguard.recovery.runtime.coordination import open_coordination
from gpuguard.recovery.runtime.lease import DEFAULT_TTL_S, Heartbeat, LeaseTiming
from gpuguard.recovery.snapshots import digests, parts, sharded_writer
from gpuguard.recovery.snapshots import sharded as ss
from gpuguard.recovery.snapshots.store import (
    Selection,
    SnapshotInfo,
    clone_state,
    copy_to_checkpoint,
    load_snapshot,
    prune,
    save_snapshot,
    select_restorable,
    state_digest,
)

RESTORE_PIN = "restore.json"  # written by `gpu-recover restore` (recovery/operator/actions.py)
# how long a SIGTERMed worker lets its in-flight snapshot finish: below torchrun's grace period
# between SIGTERM and SIGKILL (30 s in torch.distributed.elastic's PContext.close)
SIGTERM_FLUSH_S = 10.0


class FencedError(RefusedError):
    """This incarnation's generation is no longer the active one: its writes are dropped."""


class ActivationRefused(RefusedError):
    """A member could not verify the certificate (or activation failed): it must not start."""


@dataclass
class TrainState:
    """What `activate` hands the training loop: where to start and what was certified."""

    start_step: int  # first step to run (frontier + 1)
    generation: int
    frontier_step: int
    state_digest: str | None  # digest of the restored state (None: initial state)
    certificate_digest: str
    restored_from: str | None  # snapshot path, or None for the initial state
    phases: dict[str, float] = field(default_factory=dict)
    model: Any = None  # sharded mode with `activate(build=...)`: what build() made, restored
    optimizer: Any = None
    scheduler: Any = None  # sharded mode: the lr scheduler build() made (the third item), restored


@dataclass
class Counters:
    commits: int = 0
    fenced_commits: int = 0
    snapshots: int = 0
    fenced_snapshots: int = 0
    snapshot_errors: int = 0
    skipped_snapshots: int = 0
    commit_s: float = 0.0  # wall time spent in commit() (main thread)
    snapshot_cpu_s: float = 0.0  # CPU time of the snapshot writer thread


class _Snapshotter:
    """One background writer; the newest request replaces a pending one (training never waits)."""

    def __init__(self, write: Callable[[int, dict[str, Any]], None]) -> None:
        self._write = write
        self._cv = threading.Condition()
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._busy = False
        self._stop = False
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, name="gpuguard-snapshot", daemon=True)
        self._thread.start()

    def submit(self, step: int, state: dict[str, Any], max_wait: float = 30.0) -> None:
        """Queue `state`; if one is still pending, wait for the writer first (back-pressure keeps
        every committed step's snapshot: the RPO). After `max_wait` the pending one is replaced."""
        end = time.monotonic() + max_wait
        with self._cv:
            while self._pending is not None and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
            if self._pending is not None:
                self.skipped += 1
            self._pending = (step, state)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._stop:
                    self._cv.wait()
                if self._pending is None and self._stop:
                    return
                step, state = self._pending  # type: ignore[misc]
                self._pending = None
                self._busy = True
                self._cv.notify_all()
            try:
                self._write(step, state)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        ok = self.flush(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        return ok


class Runtime:
    """One incarnation of one training process (see the module docstring)."""

    def __init__(
        self,
        job_dir: str | Path,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        master_addr: str,
        master_port: int,
        run_id: str,
        restart_count: int,
        use_agent_store: bool,
        snapshot_every: int = 1,
        checkpoint_every: int = 0,
        keep_snapshots: int = 3,
        pg_timeout_s: float = 60.0,
        activation_timeout_s: float = 300.0,
        quiesce_wait_s: float = 10.0,
        ledger_url: str | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
        log: Callable[[str], None] | None = None,
        lease_ttl_s: float | None = None,
        snapshot_root: str | Path | None = None,
        sharded: bool = False,
        snapshot_budget: float = sharded_writer.DEFAULT_BUDGET,
        backend: str = "gloo",
    ):

        self.job_dir = Path(os.path.realpath(job_dir))  # followed once; nothing inside it is
        # where snapshots and checkpoints live: the job dir on one host, shared storage across hosts
        root = snapshot_root or os.environ.get(SNAPSHOT_ROOT_ENV) or job_dir
        self.snapshot_root = Path(os.path.realpath(root))
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.run_id, self.restart_count = run_id, restart_count
        self.use_agent_store = use_agent_store
        self.snapshot_every, self.checkpoint_every = max(0, snapshot_every), max(0, checkpoint_every)
        self.keep_snapshots = max(1, keep_snapshots)
        self.pg_timeout_s, self.activation_timeout_s = pg_timeout_s, activation_timeout_s
        self.quiesce_wait_s = quiesce_wait_s
        self.ledger_url = ledger_url
        self.fault_hook = fault_hook
        self._log = log or (lambda msg: print(f"[gpuguard rank {self.rank}] {msg}", file=sys.stderr, flush=True))
        self.incarnation = Incarnation.current()
        self.t_created = time.time()
        # The training script's model (FSDP2's, through its device mesh) keeps the process group alive
        # past close(); freed during interpreter finalization, gloo can abort a finished worker
        # (SIGABRT). At exit, after the script's frames are gone, free it while the interpreter is whole.
        atexit.register(gc.collect)
        self.job = jobdir.ensure_job(self.job_dir, job_id=os.environ.get(JOB_ID_ENV) or None)
        self.generation: int | None = None
        self.counters = Counters()
        self.attempt: Attempt | None = None
        self.pg: Any = None
        self._store: Any = None
        self._ledger: Any = None
        self._objects: dict[str, Any] = {}
        self._snapshotter: _Snapshotter | None = None
        self._steplog: Any = None
        self._collective_seq = 0
        self._step_t0: float | None = None
        self.step_times: deque[float] = deque(maxlen=4096)  # recent step durations (bounded)
        self._write_incarnation()
        ttl = lease_ttl_s if lease_ttl_s is not None else float(os.environ.get(LEASE_TTL_ENV, DEFAULT_TTL_S))
        self.lease_timing = LeaseTiming(ttl)
        self.coord = open_coordination(self.job_dir, self.ledger_url)
        self.heartbeat: Heartbeat | None = None
        if self.coord.kind == "etcd":  # other hosts cannot see this process: its lease speaks for it
            self.heartbeat = self.coord.hold_lease(
                self.incarnation.id,
                {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()},
                self.lease_timing,
                self._fenced,
            )
        self._snapshot_ledger: Any = None
        self._frontier_step = -1
        # sharded state (FSDP2 / HSDP / DDP through DCP): every rank writes its shards, collectively
        self.sharded = bool(sharded)
        self.backend = parse_backend(backend)  # the world group's; snapshots keep their own gloo group
        _require_backends(self.backend)
        self.snapshot_group: Any = None
        self._opened = group_sockets.Opened()  # the sockets this generation's groups opened (in-place teardown)
        self._sharded: Any = None  # the ShardedSnapshotter (every rank), sharded mode only
        # sharded mode: snapshot_every is the shortest interval; the budget (a fraction of step time
        # for the snapshot's CPU, 0: off) stretches it (ShardedSnapshotter.due)
        self.snapshot_budget = max(0.0, snapshot_budget)
        self._commit_gaps: deque[float] = deque(maxlen=16)  # recent commit-to-commit times (the step time)
        self._last_commit_t: float | None = None
        self.ownership_map_version = 0
        self.reshard: dict[str, Any] | None = None  # the certified reshard plan and whether it held
        self.rng_restore: str | None = None  # sharded restore: what happened to the RNG states, in words
        if self.rank == 0 or self.sharded:  # the snapshot writers; other ranks keep SIGTERM's default (instant) action
            self._install_sigterm_flush()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, job_dir: str | Path | None = None, **options: Any) -> Runtime:
        """Build from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
        env = os.environ
        job_dir = job_dir or env.get(JOB_DIR_ENV)
        if not job_dir:
            raise GpuguardError("no job directory: pass one or set GPUGUARD_JOB_DIR", exit_code=EXIT_USAGE)
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            master_addr, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        except (KeyError, ValueError) as exc:
            raise GpuguardError(f"not started by torchrun (missing or bad {exc})", exit_code=EXIT_USAGE) from None
        options.setdefault("snapshot_every", int(env.get(SNAPSHOT_EVERY_ENV, "1")))
        options.setdefault("checkpoint_every", int(env.get(CHECKPOINT_EVERY_ENV, "50")))
        options.setdefault("pg_timeout_s", float(env.get(PG_TIMEOUT_ENV, "60")))
        options.setdefault("ledger_url", env.get(LEDGER_ENV) or None)
        options.setdefault("sharded", env.get(SHARDED_ENV, "0") == "1")
        options.setdefault("backend", env.get(BACKEND_ENV) or "gloo")
        return cls(
            job_dir,
            rank=rank,
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            master_addr=master_addr,
            master_port=master_port,
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True",
            **options,
        )

    def _write_incarnation(self, **extra: Any) -> None:
        rec = jobdir.IncarnationRecord(
            incarnation=self.incarnation.to_dict(),
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            generation=self.generation,
            agent_pid=os.getppid(),
            run_id=self.run_id,
            master_addr=self.master_addr,
            master_port=self.master_port,
            restart_count=self.restart_count,
            attempt=self.attempt.token if self.attempt else "",
            extra=extra,
            uid=os.getuid(),
        )
        jobdir.write_incarnation(self.job_dir, rec)

    def _install_sigterm_flush(self) -> None:
        """On SIGTERM (torchrun stopping the survivors) let an in-flight snapshot finish, then exit.

        The main thread may be blocked in a gloo collective, where no Python handler can run: the
        C-level wakeup fd wakes a helper thread instead. Only the snapshot writers do this (rank 0;
        every rank with sharded state, whose save is collective): a Python-level handler delays
        death until the interpreter runs (measured: a survivor blocked in all_reduce then lingers
        for seconds), so the other ranks keep SIGTERM's default. The flush is bounded by
        SIGTERM_FLUSH_S, below the agent's grace period before its SIGKILL.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return

        def watch() -> None:
            while True:
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if signal.SIGTERM in data:
                    snap = self._sharded if self._sharded is not None else self._snapshotter
                    if snap is not None:
                        snap.flush(timeout=SIGTERM_FLUSH_S)
                    os._exit(128 + signal.SIGTERM)

        threading.Thread(target=watch, name="gpuguard-sigterm", daemon=True).start()

    # ------------------------------------------------------------------ the lease
    def _fenced(self, why: str) -> None:
        """The self-fence: this incarnation may no longer be alive in etcd's eyes, so it writes
        nothing more and leaves at once (the process's group sockets die with it). Exit status 4."""
        print(
            f"gpuguard: rank {self.rank} (incarnation {self.incarnation.id[:12]}) fenced itself: {why}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_REFUSED)

    def _require_lease(self, what: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.require(what)

    def ledger(self) -> Any:

        if self._ledger is None:
            self._ledger = open_ledger(self.job_dir, self.ledger_url)
        return self._ledger

    # ------------------------------------------------------------------ activation
    def activate(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        extra: Mapping[str, Any] | None = None,
        *,
        build: Callable[[], tuple[Any, ...]] | None = None,
    ) -> TrainState:
        """Agree on the frontier, verify the certificate, restore, form this generation's group.

        Sharded mode: the group forms before the restore (DCP's load is collective), and a model that
        needs the group to be built (`fully_shard`, a device mesh) comes from `build()` -> (model,
        optimizer[, lr scheduler]), called once the group is up; the restored pair is
        `TrainState.model/.optimizer` (the scheduler is restored in place).
        A member that cannot verify prints one line and exits with status 4 (refused).
        """
        if build is not None and not self.sharded:
            raise GpuguardError("activate(build=...) needs sharded=True", exit_code=EXIT_USAGE)
        if build is None and model is None:
            raise GpuguardError("activate() needs a model (or, sharded, build=...)", exit_code=EXIT_USAGE)
        self._objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": dict(extra or {})}
        self._build = build
        try:
            return self._activate()
        except (ActivationRefused, FencedError, UnavailableError) as exc:
            print(
                f"gpuguard: rank {self.rank} (incarnation {self.incarnation.id[:12]}) refuses to start: {exc}",
                file=sys.stderr,
                flush=True,
            )
            sys.stderr.flush()
            os._exit(EXIT_REFUSED)

    def _activate(self) -> TrainState:
        import torch.distributed as dist

        phases: dict[str, float] = {
            "process_start": self.incarnation.start_time,
            "runtime_created": self.t_created,
            "activate_called": time.time(),
        }
        self.attempt = current_attempt()
        phases["attempt_known"] = time.time()
        if self.attempt.round is None:
            self._log(f"warning: attempt token from {self.attempt.source}")
        store = self._connect_store()
        ns = dist.PrefixStore(f"gpuguard/{self.job.job_id}/a{self.attempt.token}/act", store)
        phases["store_connected"] = time.time()

        ns.set(f"hello/{self.rank}", json.dumps(self._hello().to_dict()))
        if self.rank == 0:
            self._coordinate(ns, phases)
        decision = self._wait_json(ns, "cert")
        phases["certificate"] = time.time()
        if "error" in decision:
            raise ActivationRefused(f"coordinator could not activate a generation: {decision['error']}")
        if self.sharded:
            return self._activate_sharded(ns, store, decision, phases)
        try:
            state = self._verify_and_restore(int(decision["generation"]), str(decision["digest"]))
            verdict = "ok"
        except (ActivationRefused, GpuguardError) as exc:
            state, verdict = None, str(exc)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            state, verdict = None, f"restore failed: {type(exc).__name__}: {_first_line(exc)}"
        ns.set(f"verdict/{self.rank}", verdict)
        phases["restored"] = time.time()
        for r in range(self.world_size):
            other = self._wait_raw(ns, f"verdict/{r}")
            if other != "ok":
                raise ActivationRefused(
                    f"rank {r} refused generation {decision['generation']}: {other}" if r != self.rank else other
                )
        assert state is not None
        self.generation = state.generation
        self._frontier_step = state.frontier_step
        self._init_pg(store)
        phases["pg_ready"] = time.time()
        return self._started(state, phases)

    def _init_pg(self, store: Any) -> None:
        import torch.distributed as dist

        assert self.attempt is not None
        pg_store = dist.PrefixStore(f"gpuguard/{self.job.job_id}/g{self.generation}/a{self.attempt.token}/pg", store)
        self._opened.track(
            lambda: dist.init_process_group(
                self.backend,
                store=pg_store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.pg_timeout_s),
            )
        )
        self.pg = dist.group.WORLD

    def _started(self, state: TrainState, phases: dict[str, float]) -> TrainState:
        """The group is up and the state restored: records, the snapshot writer(s), the log line."""
        assert self.attempt is not None and self.generation is not None
        state.phases = phases
        self._write_incarnation(phases=phases)

        self._steplog = StepLog(self.job_dir, self.rank, self.incarnation.id, self.generation)
        if self.rank == 0:
            jobdir.atomic_write_json(
                jobdir.activation_path(self.job_dir, self.generation),
                {
                    "schema": "gpuguard.activation/1",
                    "generation": self.generation,
                    "attempt": self.attempt.token,
                    "attempt_source": self.attempt.source,
                    "frontier_step": state.frontier_step,
                    "restored_from": state.restored_from,
                    "phases": phases,
                    "world_size": self.world_size,
                    "restart_count": self.restart_count,
                    **({"sharded": True, "reshard": self.reshard, "rng": self.rng_restore} if self.sharded else {}),
                },
            )
        if self.sharded:
            self._start_sharded_writer()
        elif self.rank == 0:
            self._snapshotter = _Snapshotter(self._write_snapshot)
            # a worker that dies of a collective error (peer gone) still finishes its last snapshot
            atexit.register(self._snapshotter.flush, SIGTERM_FLUSH_S)
        self._log(
            f"generation {self.generation} active: world {self.world_size}, "
            f"resuming at step {state.start_step} (frontier {state.frontier_step}, attempt {self.attempt.token})"
        )
        return state

    def _connect_store(self) -> Any:
        import torch.distributed as dist

        # Shared mode: torchrun's agent hosts the store at MASTER_PORT. Otherwise nobody does until
        # rank 0 hosts it (env:// init would have; we do not use env://).
        host_it = self.rank == 0 and not self.use_agent_store
        return dist.TCPStore(
            self.master_addr,
            self.master_port,
            is_master=host_it,
            timeout=timedelta(seconds=self.activation_timeout_s),
            wait_for_workers=False,
            multi_tenant=host_it,
        )

    def _hello(self) -> Hello:

        gone: list[str] = []
        alive: list[str] = []
        host = socket.gethostname()
        try:
            parent = self.ledger().active()
        except GpuguardError:
            parent = None
        if parent is not None:
            deadline = time.monotonic() + self.quiesce_wait_s
            for m in parent.members:
                inc = m.incarnation
                if inc.host != host:
                    continue
                while same_process(inc.pid, inc.start_time) and time.monotonic() < deadline:
                    time.sleep(0.05)
                (alive if same_process(inc.pid, inc.start_time) else gone).append(inc.id)
        return Hello(self.rank, self.incarnation.to_dict(), host, tuple(gone), tuple(alive))

    def _coordinate(self, ns: Any, phases: dict[str, float]) -> None:
        """Rank 0: gather hellos and the ledger's facts, plan the certificate (`activation`), issue
        and activate it, publish the outcome. The decisions are in `plan_activation`; this is the I/O."""

        try:
            hellos = tuple(Hello.from_dict(self._wait_json(ns, f"hello/{r}")) for r in range(self.world_size))
            phases["hellos"] = time.time()
            problems = check_hellos(hellos, self.world_size)
            if problems:
                raise ActivationRefused("; ".join(problems))
            if not key_path(self.job_dir).exists():
                try:
                    init_job(self.job_dir, url=self.ledger_url, job_id=self.job.job_id)
                    self._log("initialised the ledger (genesis, generation 0)")
                except GpuguardError as exc:
                    if exc.exit_code != 73:  # 73: someone initialised it first
                        raise
                self._ledger = None
            ledger = self.ledger()
            parent = ledger.active()
            if parent is None:
                raise ActivationRefused(
                    f"the ledger holds {len(ledger.generations())} certificate(s) but no valid "
                    "genesis: wrong signing key or tampered ledger"
                )
            expired = self._await_leases(parent, hellos)
            phases["leases"] = time.time()
            committed = ledger.last_committed_by_all(parent.generation) if parent.members else None
            pin = _read_restore_pin(self.job_dir)  # `gpu-recover restore` chose a state: never past it
            frontiers = {c.generation: c.frontier.step for c in ledger.history()}

            def check(info: SnapshotInfo) -> str | None:
                problem = branch_problem(info.generation, info.step, frontiers, parent.generation)
                if problem is None and self.sharded:  # every member's part present and unaltered
                    problem = parts.parts_problem(info)
                return problem

            selection = self._restorable(restore_bound(parent, committed, pin), check)
            plan = plan_activation(
                ActivationFacts(
                    parent=parent,
                    hellos=hellos,
                    committed_by_all=committed,
                    selection=selection,
                    restore_pin=pin,
                    world_size=self.world_size,
                    attempt_token=self.attempt.token if self.attempt else "",
                    attempt_source=self.attempt.source if self.attempt else "",
                    restart_count=self.restart_count,
                    rendezvous_round=self.attempt.round if self.attempt else None,
                    lease_expired=expired,
                    rendezvous_participants=self.attempt.participants if self.attempt else (),
                )
            )
            extra, version = dict(plan.extra), 0
            if self.sharded:
                version, more = self._ownership_facts(parent, selection, plan.choice.frontier)
                extra.update(more)
            cert = issue(
                parent=parent,
                job_id=parent.job_id,
                members=plan.members,
                reason=plan.reason,
                frontier=plan.choice.frontier,
                quiescence=plan.quiescence,
                quiescence_evidence=plan.quiescence_evidence,
                ownership_map_version=version,
                issued_by=f"gpuguard-runtime {issuer()}",
                key=ledger.key,
                extra=extra,
            )
            ledger.activate(cert, manifest_ok=True if plan.choice.frontier.state_manifest_digest else None)
            if plan.consume_pin:  # used once: the next generation is bounded by its commits again
                jobdir.coord_dir(self.job_dir).mkdir(parents=True, exist_ok=True)
                os.replace(
                    self.job_dir / RESTORE_PIN, jobdir.coord_dir(self.job_dir) / f"restore-used-g{cert.generation}.json"
                )
            for line in plan.log_rejected:
                self._log(f"rejected {line}")
            ns.set("cert", json.dumps({"generation": cert.generation, "digest": cert.digest()}))
            # the round's binding (gpu-recover rendezvous --state): after publishing, no member waits for it
            record_round(self.attempt, cert.generation, cert.digest(), parent.job_id, self._log)
        except GpuguardError as exc:
            ns.set("cert", json.dumps({"error": str(exc)}))

    def _await_leases(self, parent: Any, hellos: tuple[Hello, ...]) -> frozenset[str]:
        """Old incarnations on hosts no member is on (a lost host): wait, bounded, for their etcd
        leases to expire; each fenced itself before it could (docs/formats/leases.md)."""
        remote = unvouched(parent, hellos)
        if not remote or self.heartbeat is None:
            return frozenset()
        # gone at most TTL (+ etcd's expiry sweep, ~0.5 s) after its holder's last keepalive
        deadline = time.monotonic() + 2 * self.lease_timing.ttl_s + 1.0
        expired = self.coord.expired(remote)
        while len(expired) < len(remote) and time.monotonic() < deadline:
            time.sleep(0.1)
            expired = self.coord.expired(remote)
        if len(expired) < len(remote):
            self._log(
                f"lease still held after {2 * self.lease_timing.ttl_s + 1.0:.0f} s: {sorted(set(remote) - expired)}"
            )
        return expired

    def _restorable(self, bound: int, check: Callable[[SnapshotInfo], str | None] | None = None) -> Selection:
        """The newest verified state at or below `bound` that passes `check` (on the chain), skipping (a
        bounded number of) states a member already failed to load: the marks are on disk, the merge is pure."""
        selection = select_restorable(self.snapshot_root, bound, check=check)
        for _ in range(MAX_UNRESTORABLE_SKIPS):
            chosen = selection.chosen
            if chosen is None or not _unrestorable(self.snapshot_root, chosen.manifest_digest):
                break
            self._log(f"skipping step {chosen.step}: a member failed to load it before")
            selection = skip_unrestorable(
                selection, select_restorable(self.snapshot_root, chosen.step - 1, check=check)
            )
        return selection

    def _verify_and_restore(self, generation: int, digest: str) -> TrainState:
        """Every member: the certificate admits me, is signed and chained; restore and check the digest."""
        cert = self._verify_certificate(generation, digest)
        frontier = cert.frontier
        restored_from, loaded_digest = None, None
        if frontier.state_manifest_digest:
            restored_from, loaded_digest = self._restore_replicated(frontier)
        return TrainState(frontier.step + 1, generation, frontier.step, loaded_digest, cert.digest(), restored_from)

    def _verify_certificate(self, generation: int, digest: str) -> Any:
        """The certificate the coordinator published: in the ledger, signed, chained, admitting me."""
        if self._ledger is not None and self._ledger.key is None:
            self._ledger = None  # opened before the coordinator created the key: reopen with it
        ledger = self.ledger()
        cert = ledger.get(generation)
        if cert.digest() != digest:
            raise ActivationRefused(
                f"generation {generation} in the ledger is not the certificate the coordinator issued"
            )
        parent = ledger.get(cert.parent_generation) if cert.parent_generation is not None else None
        if ledger.key is None:
            raise ActivationRefused("no signing key in the job directory: cannot verify the certificate")
        violations = check_stored(cert, parent=parent, key=ledger.key)
        if violations:
            raise ActivationRefused(
                f"certificate of generation {generation} fails rule {violations[0].rule}: {violations[0].message}"
            )
        mine = cert.ranks.get(self.rank)
        if mine is None or mine.id != self.incarnation.id:
            raise ActivationRefused(
                f"certificate of generation {generation} does not admit this incarnation on rank {self.rank}"
            )
        return cert

    def _restore_replicated(self, frontier: Any) -> tuple[str, str]:
        """Load the certified replicated state into the live objects: (path, loaded digest)."""
        selection = select_restorable(
            self.snapshot_root, frontier.step, expected_manifest_digest=frontier.state_manifest_digest
        )
        info = self._certified(selection, frontier.step)
        try:
            loaded_digest = self._restore(info)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                _mark_unrestorable(self.snapshot_root, info, f"{type(exc).__name__}: {_first_line(exc)}")
            raise
        if loaded_digest != info.state_digest:
            _mark_unrestorable(self.snapshot_root, info, "loaded state digest differs from the snapshot's")
            raise ActivationRefused(
                f"loaded state digest {loaded_digest[:16]} differs from the snapshot's "
                f"{str(info.state_digest)[:16]} (step {frontier.step})"
            )
        return str(info.path), loaded_digest

    @staticmethod
    def _certified(selection: Selection, step: int) -> SnapshotInfo:
        info = selection.chosen
        if info is None or info.step != step:
            why = "; ".join(f"step {r.step}: {r.reason}" for r in selection.rejected if r.step == step)
            raise ActivationRefused(f"certified state of step {step} not found or does not verify ({why or 'missing'})")
        return info

    # ------------------------------------------------------------------ sharded state (FSDP2 / HSDP / DDP)
    def _activate_sharded(
        self, ns: Any, store: Any, decision: Mapping[str, Any], phases: dict[str, float]
    ) -> TrainState:
        """Sharded activation: verify the certificate (every member, before the group forms), form the
        group and the snapshot group, build the model, restore collectively (DCP reshards to this
        world), check the loaded state's digest against the stored chunks, agree, start."""
        generation = int(decision["generation"])
        try:
            cert, verdict = self._verify_certificate(generation, str(decision["digest"])), "ok"
        except (ActivationRefused, GpuguardError) as exc:
            cert, verdict = None, str(exc)
        self._agree_verdicts(ns, "verdict", verdict, generation)
        phases["verified"] = time.time()
        assert cert is not None
        self.generation, self._frontier_step = cert.generation, cert.frontier.step
        self.ownership_map_version = cert.ownership_map_version
        self._init_pg(store)
        self.snapshot_group = self._opened.track(lambda: ss.new_snapshot_group(self.pg_timeout_s))
        phases["pg_ready"] = time.time()
        restored_from, digest = None, None
        try:
            if self._build is not None:  # (model, optimizer) or (model, optimizer, lr scheduler)
                built = tuple(self._opened.track(self._build))  # FSDP2 / a device mesh: its groups' sockets
                self._objects["model"], self._objects["optimizer"] = built[0], built[1]
                if len(built) > 2:  # the scheduler needs the optimizer build() made: snapshotted with it
                    self._objects["scheduler"] = built[2]
            if cert.frontier.state_manifest_digest:
                restored_from, digest = self._restore_sharded(cert)
            verdict = "ok"
        except (ActivationRefused, GpuguardError) as exc:
            verdict = str(exc)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            verdict = f"restore failed: {type(exc).__name__}: {_first_line(exc)}"
        self._agree_verdicts(ns, "restored", verdict, generation)
        phases["restored"] = time.time()
        state = TrainState(cert.frontier.step + 1, generation, cert.frontier.step, digest, cert.digest(), restored_from)
        state.model, state.optimizer = self._objects["model"], self._objects["optimizer"]
        state.scheduler = self._objects["scheduler"]
        return self._started(state, phases)

    def _agree_verdicts(self, ns: Any, key: str, verdict: str, generation: int) -> None:
        ns.set(f"{key}/{self.rank}", verdict)
        for r in range(self.world_size):
            other = self._wait_raw(ns, f"{key}/{r}")
            if other != "ok":
                raise ActivationRefused(
                    f"rank {r} refused generation {generation}: {other}" if r != self.rank else other
                )

    def _restore_sharded(self, cert: Any) -> tuple[str, str | None]:
        """Collective: load the certified sharded state into this world's model (resharded by DCP),
        checked against the stored chunks; with a reshard plan in the certificate, check that the
        plan it certified (predicted) is the one this world's real layout needs."""
        frontier = cert.frontier
        selection = parts.select_sharded(
            self.snapshot_root, frontier.step, expected_manifest_digest=frontier.state_manifest_digest
        )
        info = self._certified(selection, frontier.step)
        live = self.sharded_state()
        try:
            loaded, digest = ss.load_sharded_checked(info, live, group=self.snapshot_group)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                _mark_unrestorable(self.snapshot_root, info, f"{type(exc).__name__}: {_first_line(exc)}")
            raise
        self._apply_sharded(loaded)
        _, self.rng_restore = parts.restore_rng(info.path, self.rank, self.world_size)  # after build()'s seeding
        if self.rank == 0:
            self._log(self.rng_restore)
        certified = cert.extra.get("reshard")
        if isinstance(certified, Mapping):
            actual = ss.current_layout(live, cert.ownership_map_version, self.snapshot_group)
            plan = plan_reshard(parts.snapshot_layout(info.path), actual)
            held = plan_digest(plan) == certified.get("plan_digest")
            self.reshard = {"certified_plan_held": held, "plan_digest": plan_digest(plan)}
            if not held and self.rank == 0:
                self._log("the certified reshard plan was a prediction that did not hold; what was read:")
                for line in describe_reshard(parts.snapshot_layout(info.path), actual, plan, step=frontier.step):
                    self._log(f"  {line}")
                self.reshard["lines"] = describe_reshard(
                    parts.snapshot_layout(info.path), actual, plan, step=frontier.step
                )
        return str(info.path), digest

    @property
    def model(self) -> Any:
        """The model this generation trains (sharded in-place switch: rebuilt by `build()` over the new world)."""
        return getattr(self, "_objects", {}).get("model")

    @property
    def optimizer(self) -> Any:
        """The optimizer of `model` (rebuilt with it)."""
        return getattr(self, "_objects", {}).get("optimizer")

    def sharded_state(self) -> dict[str, Any]:
        """Sharded mode: model / optim (`get_state_dict`: DTensors stay sharded) / sched / extra.

        No RNG state here: a per-rank RNG tensor cannot live in a resharded checkpoint (DCP stores
        a plain tensor once, as a replica); each rank's RNG goes into its part (`commit`)."""
        model, opt, sched = self._objects["model"], self._objects["optimizer"], self._objects["scheduler"]
        state = ss.model_state(model, opt, extra=self._objects["extra"] or None)
        if sched is not None:
            state["sched"] = sched.state_dict()
        return state

    def _apply_sharded(self, loaded: Mapping[str, Any]) -> None:
        ss.apply_model_state(self._objects["model"], self._objects["optimizer"], loaded)
        sched = self._objects["scheduler"]
        if sched is not None and "sched" in loaded:
            sched.load_state_dict(loaded["sched"])
        extra = self._objects["extra"]
        for k, v in (loaded.get("extra") or {}).items():
            if k in extra and hasattr(extra[k], "copy_") and extra[k] is not v:
                extra[k].copy_(v)

    def _start_sharded_writer(self) -> None:
        hook = self.fault_hook
        self._sharded = sharded_writer.ShardedSnapshotter(
            self.snapshot_root,
            generation=int(self.generation or 0),
            incarnation=self.incarnation.id,
            group=self.snapshot_group,
            still_current=self._still_current,  # only the coordinator (rank 0) calls it
            before_publish=(lambda step, _dir: hook("snapshot", step)) if hook else None,
            ownership_map_version=lambda: self.ownership_map_version,
            on_done=self._sharded_done,
            every=max(1, self.snapshot_every),
            cpu_budget=self.snapshot_budget,
            max_wait=max(30.0, 2 * self.pg_timeout_s),
        )
        # a worker that dies of a collective error (peer gone) still lets its last save end
        atexit.register(self._sharded.flush, SIGTERM_FLUSH_S)

    def _sharded_done(self, step: int, info: Any, error: BaseException | None) -> None:
        """The writer thread, after each collective save (every rank): counters; rank 0 prunes."""
        if self._sharded is not None:
            self.counters.snapshot_cpu_s = self._sharded.cpu_s
            if self._sharded.broken is not None and isinstance(error, RuntimeError):
                self._log(f"sharded snapshots off for generation {self.generation}: their group failed")
        why = None if error is None else f"{type(error).__name__}: {_first_line(error)}"
        shown = info.snapshot(self.generation) if info is not None else None
        self._snapshot_outcome(step, shown, why, publisher=self.rank == 0)

    def _snapshot_outcome(
        self, step: int, info: SnapshotInfo | None, error: str | None, publisher: bool = True
    ) -> None:
        """Counters for one snapshot (error, fenced: no info, or written); the publisher (the
        replicated writer; rank 0 of a sharded save) copies a due checkpoint and prunes."""
        if error is not None:
            self.counters.snapshot_errors += 1
            self._log(f"snapshot of step {step} failed: {error}")
            return
        if info is None:
            self.counters.fenced_snapshots += 1
            self._log(f"snapshot of step {step} dropped: generation {self.generation} is no longer active")
            return
        self.counters.snapshots += 1
        if publisher:
            if self.checkpoint_every and step % self.checkpoint_every == 0:
                copy_to_checkpoint(self.snapshot_root, info)
            prune(self.snapshot_root, self.keep_snapshots, protect=frozenset({self._frontier_step}))

    def _ownership_facts(self, parent: Any, selection: Selection, frontier: Any) -> tuple[int, dict[str, Any]]:
        """The coordinator, sharded mode: the frontier snapshot's ownership map for the certificate
        and the reshard plan of this restart (this world's layout predicted: the group does not exist
        yet; `_restore_sharded` checks the prediction). (ownership map version, extra keys)."""
        chosen = selection.chosen
        if (
            not frontier.state_manifest_digest
            or chosen is None
            or chosen.manifest_digest != frontier.state_manifest_digest
        ):
            return parent.ownership_map_version, {}
        old = parts.snapshot_layout(chosen.path)
        extra: dict[str, Any] = {"ownership_map": ownership_record(old.ownership())}
        extra["rng"] = parts.rng_restore_plan(chosen.path, self.world_size)[1]
        new = predict_layout(old, self.world_size, old.version)
        if new is None:
            extra["reshard"] = None
            extra["reshard_note"] = "the new layout is not predictable (not FSDP2 Shard(0)): DCP reshards on load"
            return max(parent.ownership_map_version, old.version) + 1, extra
        if not same_holding(old, new) or parent.ownership_map_version != old.version:
            new = predict_layout(old, self.world_size, max(parent.ownership_map_version, old.version) + 1)
            assert new is not None
        lost = range(self.world_size, old.world_size)
        extra["reshard"] = reshard_record(old, new, plan_reshard(old, new), step=chosen.step, lost=lost)
        return new.version, extra

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """model / optim / sched / rng / extra, as DCP saves and loads it."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt, sched = self._objects["model"], self._objects["optimizer"], self._objects["scheduler"]
        if opt is not None:
            msd, osd = get_state_dict(model, opt)
        else:
            msd, osd = model.state_dict(), {}
        state: dict[str, Any] = {"model": msd, "rng": {"torch": torch.get_rng_state()}}
        if opt is not None:
            state["optim"] = osd
        if sched is not None:
            state["sched"] = sched.state_dict()
        if self._objects["extra"]:
            state["extra"] = self._objects["extra"]
        return state

    def _restore(self, info: SnapshotInfo) -> str:
        self._apply_state(load_snapshot(info, self.state_dict()))
        return state_digest(self.state_dict())

    def _apply_state(self, loaded: Mapping[str, Any]) -> None:
        """Put a loaded state (model, optimizer, scheduler, RNG, extra) into the live objects."""
        import torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model, opt, sched = self._objects["model"], self._objects["optimizer"], self._objects["scheduler"]
        if opt is not None:
            set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        else:
            model.load_state_dict(loaded["model"])
        if sched is not None and "sched" in loaded:
            sched.load_state_dict(loaded["sched"])
        torch.set_rng_state(loaded["rng"]["torch"])
        extra = self._objects["extra"]
        for k, v in (loaded.get("extra") or {}).items():
            if k in extra and hasattr(extra[k], "copy_"):
                extra[k].copy_(v)

    def state_hash(self) -> str:
        """The digest of this rank's current state (what snapshots and the certificate bind).

        Sharded mode: a collective over the default group, the layout-independent digest of the
        whole (sharded) state, equal at any world size."""
        if self.sharded:
            return digests.state_digest_sharded(self.sharded_state())
        return state_digest(self.state_dict())

    # ------------------------------------------------------------------ the loop
    def steps(self, state: TrainState, until: int | None = None) -> Iterator[int]:
        """Step numbers from the certified start (inclusive) to `until` (inclusive; None: forever)."""
        step = state.start_step
        while until is None or step <= until:
            self._step_t0 = time.perf_counter()
            if self._steplog is not None:
                self._steplog.begin_step(step)
            yield step
            step += 1

    def collective(self, op: str = "all_reduce", nbytes: int = 0) -> Any:
        """`with rt.collective("all_reduce", t.nbytes): dist.all_reduce(t)`.

        Marks this rank as *waiting in collective N* in its step records, separately from its own
        compute time, so `gpu-doctor diagnose job` can name the rank that never arrived instead of
        calling every waiting rank hung. Sequence numbers restart with each generation's processes.
        """
        self._collective_seq += 1
        if self._steplog is None:
            return contextlib.nullcontext()
        return self._steplog.collective(self._collective_seq, op, nbytes)

    def commit(self, step: int) -> None:
        """After the optimizer update of `step`: step record, commit record, snapshot every k."""
        if self.generation is None:
            raise RefusedError("commit() before activate()")
        t0 = time.perf_counter()
        try:
            self._commit(step)
        finally:
            self.counters.commit_s += time.perf_counter() - t0

    def _commit(self, step: int) -> None:
        self._require_lease(f"commit of step {step}")
        if self._steplog is not None:
            self._steplog.end_step(step)
        if not self.ledger().record_commit(self.generation, step, self.rank, self.incarnation.id):
            self.counters.fenced_commits += 1
            raise FencedError(
                f"commit of step {step} in generation {self.generation} fenced: "
                f"generation {self.ledger().active().generation} is active"
            )
        self.counters.commits += 1
        if self._step_t0 is not None:
            self.step_times.append(time.perf_counter() - self._step_t0)
        due = self.snapshot_every and step % self.snapshot_every == 0
        if self._sharded is not None:  # every rank, the same steps (`due` agrees): the save is collective
            now = time.perf_counter()
            if self._last_commit_t is not None:  # commit to commit: the whole step, with or without rt.steps()
                self._commit_gaps.append(now - self._last_commit_t)
            self._last_commit_t = now
            self._sharded.every = max(1, self.snapshot_every)
            if self.snapshot_every and self._sharded.due(step):
                step_s = statistics.median(self._commit_gaps) if self._commit_gaps else 0.0
                self._sharded.submit(step, self.sharded_state, rng=parts.rng_state(), step_s=step_s)
        elif self._snapshotter is not None and due:
            self._snapshotter.submit(step, clone_state(self.state_dict()))

    def _still_current(self) -> bool:
        # the snapshot writer's check: published only while the lease is provably alive and the
        # generation still active
        if self.heartbeat is not None and not self.heartbeat.valid():
            return False
        if self._snapshot_ledger is None:  # the writer thread's own instance (it caches the chain)
            self._snapshot_ledger = open_ledger(self.job_dir, self.ledger_url)
        active = self._snapshot_ledger.active()
        return active is not None and active.generation == self.generation

    def _write_snapshot(self, step: int, state: dict[str, Any]) -> None:
        t0 = time.thread_time()
        try:
            self._write_snapshot_timed(step, state)
        finally:
            self.counters.snapshot_cpu_s += time.thread_time() - t0

    def _write_snapshot_timed(self, step: int, state: dict[str, Any]) -> None:
        hook = self.fault_hook
        try:
            info = save_snapshot(
                self.snapshot_root,
                step,
                state,
                generation=int(self.generation or 0),
                owner=f"rank{self.rank}/{self.incarnation.id}",
                still_current=self._still_current,
                before_publish=(lambda _p: hook("snapshot", step)) if hook else None,
            )
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not kill training
            self._snapshot_outcome(step, None, f"{type(exc).__name__}: {exc}")
            return
        self._snapshot_outcome(step, info, None)

    def flush_snapshots(self, timeout: float) -> bool:
        """Wait (bounded) until no snapshot is pending or being written; False on timeout. Sharded
        mode: a collective wait in effect (every rank's writer is in the same save)."""
        snap = self._sharded if self._sharded is not None else self._snapshotter
        return True if snap is None else bool(snap.flush(timeout))

    def fault(self, point: str, step: int) -> None:
        """Call the test/demo fault hook at a named point of a step (no-op without one)."""
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    def close(self, timeout: float = 30.0) -> None:
        """Flush the last snapshot, tear the group down (outside any `except`: docs/torchrun-hazards.md)."""
        import torch.distributed as dist

        if self._snapshotter is not None:
            self._snapshotter.close(timeout)
            self.counters.skipped_snapshots = self._snapshotter.skipped
        if self._sharded is not None:
            self._sharded.close(timeout)
            self.counters.snapshot_cpu_s = self._sharded.cpu_s
        if self._steplog is not None:
            self._steplog.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Drop the last references while the interpreter is whole: a gloo group destroyed during
        # interpreter finalization can abort the process (std::terminate) after a clean run.
        self.pg = None
        self.snapshot_group = None
        if self._sharded is not None:
            self._sharded.group = None
        self.coord.close()  # gives the lease back: a clean exit frees it at once

    # ------------------------------------------------------------------ store helpers
    def _wait_raw(self, ns: Any, key: str) -> str:
        try:
            ns.wait([key], timedelta(seconds=self.activation_timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
            raise UnavailableError(f"activation: no {key!r} within {self.activation_timeout_s:.0f} s ({exc})") from None
        return ns.get(key).decode()

    def _wait_json(self, ns: Any, key: str) -> dict[str, Any]:
        return json.loads(self._wait_raw(ns, key))


BACKENDS = ("gloo", "nccl", "ucc", "mpi", "xccl")
DEVICES = ("cpu", "cuda", "xpu")


def parse_backend(text: str) -> str:
    """The world group's backend as torch takes it: one name (`gloo`, `nccl`, ...) or device:name
    pairs (`cpu:gloo,cuda:nccl`: CPU tensors over gloo, CUDA ones over NCCL); a usage error otherwise."""
    value = text.strip()
    if value in BACKENDS:
        return value
    pairs = [p.strip() for p in value.split(",")] if value else []
    devices = []
    for pair in pairs:
        device, _, name = pair.partition(":")
        if device not in DEVICES or name not in BACKENDS:
            break
        devices.append(device)
    else:
        if pairs and len(set(devices)) == len(devices):
            return ",".join(pairs)
    raise GpuguardError(
        f"backend {text!r}: want one of {', '.join(BACKENDS)}, or device:backend pairs such as cpu:gloo,cuda:nccl",
        exit_code=EXIT_USAGE,
    )


def _require_backends(backend: str) -> None:
    """Every backend `backend` names is in this torch build (a CPU wheel has no NCCL): one clear
    error (exit 69) before any group forms, not a traceback from init_process_group."""
    import torch.distributed as dist

    names = [p.partition(":")[2] or p for p in backend.split(",")]
    missing = [n for n in names if not dist.is_backend_available(n)]
    if missing:
        raise GpuguardError(
            f"backend {backend!r}: {', '.join(missing)} is not built into this torch", exit_code=EXIT_UNAVAILABLE
        )


def _first_line(exc: BaseException) -> str:
    """DCP exceptions carry whole tracebacks: the last non-empty line says what went wrong."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _unrestorable_path(job_dir: Path, manifest_digest: str | None) -> Path:
    return jobdir.coord_dir(job_dir) / f"unrestorable-{str(manifest_digest)[:32]}.json"


def _mark_unrestorable(job_dir: Path, info: SnapshotInfo, why: str) -> None:
    """Remember that this exact state (manifest digest) could not be loaded, so the next
    activation falls back to an older one instead of failing the same way forever."""
    try:
        jobdir.atomic_write_json(
            _unrestorable_path(job_dir, info.manifest_digest),
            {
                "step": info.step,
                "path": str(info.path),
                "manifest_digest": info.manifest_digest,
                "reason": why[:500],
                "time": time.time(),
            },
        )
    except OSError:
        pass


def _unrestorable(job_dir: Path, manifest_digest: str | None) -> bool:
    return _unrestorable_path(job_dir, manifest_digest).exists()


def _read_restore_pin(job_dir: Path) -> int | None:
    """The step `gpu-recover restore` pinned in `<job-dir>/restore.json`, if any (malformed: ignored, said)."""
    path = job_dir / RESTORE_PIN
    if not path.exists():
        return None
    try:
        step = jobdir.read_json(path).get("step")
    except GpuguardError as exc:
        print(f"gpuguard: ignoring {path}: {exc}", file=sys.stderr)
        return None
    return step if isinstance(step, int) and step >= 0 else None
