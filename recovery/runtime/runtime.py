"""The in-job runtime: what a training script adds to be recoverable and to prove what it resumed from.

    rt = Runtime.from_env(job_dir)            # torchrun's env -> an incarnation of this process
    state = rt.activate(model, optimizer)     # agree on the frontier, verify the certificate, restore
    for step in rt.steps(state, until=N):
        ...                                   # forward, backward, all-reduce on rt.pg / the default group
        rt.commit(step)                       # step record + commit record (+ async snapshot every k)

or `rt.run(state, step_fn, until=N)`, the same loop around `step_fn(step, rank, world)`.

Why each piece (measured on torch 2.13 + gloo: docs/torchrun-hazards.md; protocol: docs/formats/activation.md):
- the gloo group of every generation rendezvouses under its own store namespace
  `gpuguard/<job>/g<N>/a<attempt>/pg`, where the attempt is the torchrun rendezvous round: the dead
  attempt's gloo keys in torchrun's shared store can never be read again (1/9 resumes otherwise);
- the generation number comes from the ledger, never from TORCHELASTIC_RESTART_COUNT;
- activation: every member publishes its incarnation; rank 0 computes the frontier (newest verified
  snapshot at or below the last step *all* parent members committed), issues the certificate and
  activates it with the ledger's compare-and-swap (`recovery.runtime.restart`); every member
  verifies the certificate (`recovery.runtime.admission`) and the loaded state's digest before the
  first collective, or refuses to start;
- snapshots every k steps in a background thread (DCP); a SIGTERM from the agent lets an in-flight
  snapshot finish first (bounded), so a survivor's last snapshot is not lost: RPO one step;
- a worker that dies of an uncaught exception (a survivor's collective error) leaves once its exit
  handlers ran (the snapshot flush among them), without Python's seconds of finalization, so the
  agent restarts sooner (`foundation.fastexit`; `GPUGUARD_FAST_EXIT=0` keeps Python's exit);
- fencing: commits and snapshot writes stamped with an older generation are dropped and counted;
- across hosts (an etcd ledger): each incarnation's key rides on its host's etcd lease (one per host,
  `recovery.runtime.host_lease`) and it fences itself (exit 4)
  before it can expire (`recovery.runtime.lease`), so the next coordinator proves an incarnation on
  a lost host quiet by its expired lease; snapshots live under `GPUGUARD_SNAPSHOT_ROOT` (the
  cluster's shared checkpoint storage) so that a new rank 0 on another host finds them;
- sharded state (`sharded=True`, `GPUGUARD_SHARDED=1`; FSDP2 / HSDP / DDP through DCP): every
  rank writes its own shards of each snapshot, the group forms before the (collective, resharding)
  restore, a model that needs the group comes from `activate(build=...)`, and the certificate
  carries the frontier snapshot's ownership map and the reshard plan
  (`recovery.runtime.sharded_state`, docs/formats/sharded-snapshots.md).

The runtime is composed: a `Context` (identity, files, ledger, lease, counters), a `RankState`
chosen once (replicated or sharded), the restart coordinator and one admission check. The
in-place runtime (`recovery.runtime.inplace`) adds the switch on the same parts.

Lazy imports (start-up time): torch, only in the methods that run inside a training process (torch is the optional `gpuguard[runtime]`; `gpu-recover` imports this package without it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from gpuguard.foundation import fastexit, jobdir
from gpuguard.foundation.env import (
    BACKEND_ENV,
    CHECKPOINT_EVERY_ENV,
    JOB_DIR_ENV,
    LEDGER_ENV,
    PG_TIMEOUT_ENV,
    SHARDED_ENV,
    SNAPSHOT_EVERY_ENV,
    WATCH_INTERVAL_ENV,
)
from gpuguard.foundation.errors import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    GpuguardError,
    RefusedError,
    UnavailableError,
    one_line,
)
from gpuguard.foundation.steplog import StepLog
from gpuguard.recovery.runtime import group_sockets
from gpuguard.recovery.runtime.admission import admitted_certificate
from gpuguard.recovery.runtime.attempt import current_attempt
from gpuguard.recovery.runtime.context import Context, Counters, Launch
from gpuguard.recovery.runtime.frontier import DEFAULT_WATCH_INTERVAL_S, FrontierAgreement, GenerationWatch
from gpuguard.recovery.runtime.rank_state import SIGTERM_FLUSH_S, RankState, ReplicatedState, TrainObjects
from gpuguard.recovery.runtime.refusals import ActivationRefused, FencedError
from gpuguard.recovery.runtime.restart import RestartCoordinator, hello
from gpuguard.recovery.runtime.sharded_state import ShardedState
from gpuguard.recovery.runtime.warmup import import_heavy_modules
from gpuguard.recovery.runtime.writers import SnapshotOutcomes
from gpuguard.recovery.snapshots.sharded_writer import DEFAULT_BUDGET
from gpuguard.recovery.snapshots.soundness import Policy

StepFn = Callable[[int, int, int], None]

__all__ = ["ActivationRefused", "Counters", "FencedError", "Options", "Runtime", "StepFn", "TrainState"]


@dataclass(frozen=True)
class Options:
    """The runtime's settings (constructor keywords; `from_env` reads the GPUGUARD_* variables)."""

    snapshot_every: int = 1
    checkpoint_every: int = 0
    keep_snapshots: int = 3
    pg_timeout_s: float = 60.0
    activation_timeout_s: float = 300.0
    quiesce_wait_s: float = 10.0
    # sharded mode: snapshot_every is the shortest interval; the budget (a fraction of step time
    # for the snapshot's CPU, 0: off) stretches it (ShardedSnapshotter.due)
    snapshot_budget: float = DEFAULT_BUDGET


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
    model: Any = None  # what the runtime trains: passed in, or what build() made, restored
    optimizer: Any = None
    scheduler: Any = None  # the lr scheduler (build()'s third item), restored


_R = TypeVar("_R", bound="Runtime")  # from_env builds the class it is called on (InPlaceRuntime too)


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
        snapshot_budget: float = DEFAULT_BUDGET,
        backend: str = "gloo",
        soundness: Policy | None = None,
    ):
        self.options = Options(
            snapshot_every=max(0, snapshot_every),
            checkpoint_every=max(0, checkpoint_every),
            keep_snapshots=max(1, keep_snapshots),
            pg_timeout_s=pg_timeout_s,
            activation_timeout_s=activation_timeout_s,
            quiesce_wait_s=quiesce_wait_s,
            snapshot_budget=max(0.0, snapshot_budget),
        )
        self.backend = parse_backend(backend)  # the world group's; snapshots keep their own gloo group
        _require_backends(self.backend)
        nccl_fails_fast(self.backend)
        launch = Launch(rank, world_size, local_rank, master_addr, master_port, run_id, restart_count, use_agent_store)
        import_heavy_modules()  # before the lease's threads need the GIL (recovery.runtime.warmup)
        fastexit.install()  # a worker whose collective failed is gone in ms, not seconds (foundation/fastexit.py)
        self.context = Context(
            job_dir,
            launch,
            ledger_url=ledger_url,
            snapshot_root=snapshot_root,
            lease_ttl_s=lease_ttl_s,
            log=log,
            fault_hook=fault_hook,
        )
        self.t_created = time.time()
        # The training script's model (FSDP2's, through its device mesh) keeps the process group alive
        # past close(); freed during interpreter finalization, gloo can abort a finished worker
        # (SIGABRT). At exit, after the script's frames are gone, free it while the interpreter is whole.
        atexit.register(_collect_unless_leaving)
        self.objects = TrainObjects()
        # soundness: what a state must be to be certified (recovery.snapshots.soundness; default: Policy())
        self.state: RankState = (
            ShardedState(self.objects, None, soundness) if sharded else ReplicatedState(self.objects, policy=soundness)
        )
        self.outcomes = SnapshotOutcomes(
            self.context, checkpoint_every=self.options.checkpoint_every, keep_snapshots=self.options.keep_snapshots
        )
        # the commit frontier without a ledger write per rank-step, and the watch that tells a stale
        # incarnation without a round trip per step (recovery.runtime.frontier)
        self.frontier = FrontierAgreement(self.context, self.options.pg_timeout_s)
        self.watch = GenerationWatch(
            self.context, float(os.environ.get(WATCH_INTERVAL_ENV) or DEFAULT_WATCH_INTERVAL_S)
        )
        self.pg: Any = None
        self.opened = group_sockets.Opened()  # the sockets this generation's groups opened (in-place teardown)
        self.step_times: deque[float] = deque(maxlen=4096)  # recent step durations (bounded)
        self._steplog: StepLog | None = None
        self._collective_seq = 0
        self._step_t0: float | None = None
        self._commit_gaps: deque[float] = deque(maxlen=16)  # recent commit-to-commit times (the step time)
        self._last_commit_t: float | None = None
        if rank == 0 or sharded:  # the snapshot writers; other ranks keep SIGTERM's default (instant) action
            self._install_sigterm_flush()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls: type[_R], job_dir: str | Path | None = None, **options: Any) -> _R:
        """Build from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
        env = os.environ
        job_dir = job_dir or env.get(JOB_DIR_ENV)
        if not job_dir:
            raise GpuguardError("no job directory: pass one or set GPUGUARD_JOB_DIR", exit_code=EXIT_USAGE)
        launch = Launch.from_env(env)
        options.setdefault("snapshot_every", int(env.get(SNAPSHOT_EVERY_ENV, "1")))
        options.setdefault("checkpoint_every", int(env.get(CHECKPOINT_EVERY_ENV, "50")))
        options.setdefault("pg_timeout_s", float(env.get(PG_TIMEOUT_ENV, "60")))
        options.setdefault("ledger_url", env.get(LEDGER_ENV) or None)
        options.setdefault("sharded", env.get(SHARDED_ENV, "0") == "1")
        options.setdefault("backend", env.get(BACKEND_ENV) or "gloo")
        return cls(
            job_dir,
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            run_id=launch.run_id,
            restart_count=launch.restart_count,
            use_agent_store=launch.use_agent_store,
            **options,
        )

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
                    self.state.flush(timeout=SIGTERM_FLUSH_S)
                    os._exit(128 + signal.SIGTERM)

        threading.Thread(target=watch, name="gpuguard-sigterm", daemon=True).start()

    # ------------------------------------------------------------------ what callers read
    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def generation(self) -> int | None:
        return self.context.generation

    @property
    def incarnation(self) -> Any:
        return self.context.incarnation

    @property
    def counters(self) -> Counters:
        return self.context.counters

    @property
    def job_dir(self) -> Path:
        return self.context.job_dir

    @property
    def snapshot_root(self) -> Path:
        return self.context.snapshot_root

    @property
    def snapshot_every(self) -> int:
        return self.options.snapshot_every

    @property
    def sharded(self) -> bool:
        return self.state.sharded

    @property
    def model(self) -> Any:
        """The model this generation trains (sharded in-place switch: rebuilt by `build()` over the new world)."""
        return self.objects.model

    @property
    def optimizer(self) -> Any:
        """The optimizer of `model` (rebuilt with it)."""
        return self.objects.optimizer

    @property
    def reshard(self) -> dict[str, Any] | None:
        """Sharded: the certified reshard plan and whether it held (in place: what moved)."""
        return self.state.reshard

    @property
    def rng_restore(self) -> str | None:
        """Sharded restore: what happened to the RNG states, in words."""
        return self.state.rng_restore

    def ledger(self) -> Any:
        return self.context.ledger()

    # ------------------------------------------------------------------ activation
    def activate(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        extra: Mapping[str, Any] | None = None,
        *,
        build: Callable[[], tuple[Any, ...]] | None = None,
        data: Any = None,
    ) -> TrainState:
        """Agree on the frontier, verify the certificate, restore, form this generation's group.

        Sharded mode: the group forms before the restore (DCP's load is collective), and a model that
        needs the group to be built (`fully_shard`, a device mesh) comes from `build()` -> (model,
        optimizer[, lr scheduler]), called once the group is up; the restored objects are
        `TrainState.model/.optimizer/.scheduler`. `data`: the data position (`state_dict` /
        `load_state_dict`), snapshotted and restored with the state (docs/formats/sharded-snapshots.md,
        "Data position"). A member that cannot verify prints one line and exits with status 4 (refused).
        """
        if build is not None and not self.sharded:
            raise GpuguardError("activate(build=...) needs sharded=True", exit_code=EXIT_USAGE)
        if build is None and model is None:
            raise GpuguardError("activate() needs a model (or, sharded, build=...)", exit_code=EXIT_USAGE)
        self.objects.model, self.objects.optimizer, self.objects.scheduler = model, optimizer, scheduler
        self.objects.extra = dict(extra or {})
        self.objects.data = data
        if isinstance(self.state, ShardedState):
            self.state.build = build
        try:
            return self._activate()
        except (ActivationRefused, FencedError, UnavailableError) as exc:
            self.context.refuse("refuses to start", exc)

    def _activate(self) -> TrainState:
        import torch.distributed as dist

        ctx = self.context
        phases: dict[str, float] = {
            "process_start": ctx.incarnation.start_time,
            "runtime_created": self.t_created,
            "activate_called": time.time(),
        }
        ctx.attempt = current_attempt()
        phases["attempt_known"] = time.time()
        if ctx.attempt.round is None:
            ctx.log(f"warning: attempt token from {ctx.attempt.source}")
        store = self._connect_store()
        ns = dist.PrefixStore(f"gpuguard/{ctx.job.job_id}/a{ctx.attempt.token}/act", store)
        phases["store_connected"] = time.time()

        ns.set(f"hello/{ctx.rank}", json.dumps(hello(ctx, self.options.quiesce_wait_s).to_dict()))
        if ctx.rank == 0:
            RestartCoordinator(ctx, self.state, self._wait_json).coordinate(ns, phases)
        decision = self._wait_json(ns, "cert")
        phases["certificate"] = time.time()
        if "error" in decision:
            raise ActivationRefused(f"coordinator could not activate a generation: {decision['error']}")
        generation = int(decision["generation"])
        try:
            cert, verdict = self._admit(generation, str(decision["digest"])), "ok"
        except (ActivationRefused, GpuguardError) as exc:
            cert, verdict = None, str(exc)
        restored: tuple[str | None, str | None] = (None, None)
        if self.state.restores_before_group:  # replicated: load, then agree, then the group forms
            if cert is not None:
                restored, verdict = self._try_restore(cert)
            self._agree_verdicts(ns, "verdict", verdict, generation)
            phases["restored"] = time.time()
            assert cert is not None
            self._enter_generation(cert)
            self._init_pg(store)
            self.frontier.form(self.opened)
            phases["pg_ready"] = time.time()
        else:  # sharded: agree, form the group, build, load collectively, agree again
            self._agree_verdicts(ns, "verdict", verdict, generation)
            phases["verified"] = time.time()
            assert cert is not None
            self._enter_generation(cert)
            self._init_pg(store)
            self.frontier.form(self.opened)
            phases["pg_ready"] = time.time()
            restored, verdict = self._try_restore(cert, prepare=True)
            self._agree_verdicts(ns, "restored", verdict, generation)
            phases["restored"] = time.time()
        restored_from, digest = restored
        state = TrainState(cert.frontier.step + 1, generation, cert.frontier.step, digest, cert.digest(), restored_from)
        state.model, state.optimizer, state.scheduler = (
            self.objects.model,
            self.objects.optimizer,
            self.objects.scheduler,
        )
        return self._started(state, phases)

    def _admit(self, generation: int, digest: str | None = None) -> Any:
        """The one admission check (`recovery.runtime.admission`) for this incarnation on its rank."""
        ctx = self.context
        return admitted_certificate(
            ctx.ledger(), generation, incarnation_id=ctx.incarnation.id, rank=ctx.rank, digest=digest
        )

    def _try_restore(self, cert: Any, prepare: bool = False) -> tuple[tuple[str | None, str | None], str]:
        """(restored path, loaded digest) and the verdict this member publishes ("ok" or why not)."""
        try:
            if prepare:
                self.state.prepare(self.opened, self.options.pg_timeout_s)
            if cert.frontier.state_manifest_digest:
                return self.state.restore(self.context, cert), "ok"
            return (None, None), "ok"
        except (ActivationRefused, GpuguardError) as exc:
            return (None, None), str(exc)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return (None, None), f"restore failed: {one_line(exc)}"

    def _enter_generation(self, cert: Any) -> None:
        ctx = self.context
        ctx.generation, ctx.frontier_step = cert.generation, cert.frontier.step
        if isinstance(self.state, ShardedState):
            self.state.ownership_map_version = cert.ownership_map_version

    def _init_pg(self, store: Any) -> None:
        import torch.distributed as dist

        ctx = self.context
        assert ctx.attempt is not None
        pg_store = dist.PrefixStore(f"gpuguard/{ctx.job.job_id}/g{ctx.generation}/a{ctx.attempt.token}/pg", store)
        self.opened.track(
            lambda: dist.init_process_group(
                self.backend,
                store=pg_store,
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=timedelta(seconds=self.options.pg_timeout_s),
            )
        )
        self.pg = dist.group.WORLD

    def _started(self, state: TrainState, phases: dict[str, float]) -> TrainState:
        """The group is up and the state restored: records, the snapshot writer, the log line."""
        ctx = self.context
        assert ctx.attempt is not None and ctx.generation is not None
        state.phases = phases
        ctx.write_incarnation(phases=phases)
        self.start_step_log()
        if ctx.rank == 0:
            jobdir.atomic_write_json(
                jobdir.activation_path(ctx.job_dir, ctx.generation),
                {
                    "schema": "gpuguard.activation/1",
                    "generation": ctx.generation,
                    "attempt": ctx.attempt.token,
                    "attempt_source": ctx.attempt.source,
                    "frontier_step": state.frontier_step,
                    "restored_from": state.restored_from,
                    "phases": phases,
                    "world_size": ctx.world_size,
                    "restart_count": ctx.launch.restart_count,
                    **({"sharded": True, "reshard": self.reshard, "rng": self.rng_restore} if self.sharded else {}),
                },
            )
        self.state.start_writer(ctx, self.outcomes, self.options, self.frontier)
        self.watch.start()
        ctx.log(
            f"generation {ctx.generation} active: world {ctx.world_size}, "
            f"resuming at step {state.start_step} (frontier {state.frontier_step}, attempt {ctx.attempt.token})"
        )
        return state

    def start_step_log(self) -> None:
        """This generation's step records (`foundation.steplog`): the previous generation's log is closed."""
        ctx = self.context
        if self._steplog is not None:
            self._steplog.close()
        self._steplog = StepLog(ctx.job_dir, ctx.rank, ctx.incarnation.id, int(ctx.generation or 0))

    def _connect_store(self) -> Any:
        import torch.distributed as dist

        launch = self.context.launch
        # Shared mode: torchrun's agent hosts the store at MASTER_PORT. Otherwise nobody does until
        # rank 0 hosts it (env:// init would have; we do not use env://).
        host_it = self.context.rank == 0 and not launch.use_agent_store
        return dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            is_master=host_it,
            timeout=timedelta(seconds=self.options.activation_timeout_s),
            wait_for_workers=False,
            multi_tenant=host_it,
        )

    def _agree_verdicts(self, ns: Any, key: str, verdict: str, generation: int) -> None:
        """Publish my verdict, wait for every member's: one that is not "ok" refuses the generation."""
        ns.set(f"{key}/{self.rank}", verdict)
        for r in range(self.world_size):
            other = self._wait_raw(ns, f"{key}/{r}")
            if other != "ok":
                raise ActivationRefused(
                    f"rank {r} refused generation {generation}: {other}" if r != self.rank else other
                )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state as DCP saves and loads it (sharded: DTensors stay sharded)."""
        return self.state.state_dict()

    def sharded_state(self) -> dict[str, Any]:
        """Sharded mode: model / optim / sched / extra (the name the sharded examples use)."""
        return self.state.state_dict()

    def state_hash(self) -> str:
        """The digest of this rank's current state (what snapshots and the certificate bind).

        Sharded mode: a collective over the default group, the layout-independent digest of the
        whole (sharded) state, equal at any world size."""
        return self.state.digest()

    # ------------------------------------------------------------------ the loop
    def begin_step(self, step: int) -> None:
        """Mark the start of `step` (its step record and its duration): `steps()` and `run()` call it."""
        self._step_t0 = t0 = time.perf_counter()
        if self._steplog is not None:
            self._steplog.begin_step(step)
        self.counters.marks_s += time.perf_counter() - t0

    def steps(self, state: TrainState, until: int | None = None) -> Iterator[int]:
        """Step numbers from the certified start (inclusive) to `until` (inclusive; None: forever)."""
        step = state.start_step
        while until is None or step <= until:
            self.begin_step(step)
            yield step
            step += 1

    def run(self, state: TrainState, step_fn: StepFn, until: int) -> int:
        """`steps()` around `step_fn(step, rank, world)` and `commit(step)`: the last committed step."""
        last = state.frontier_step
        for step in self.steps(state, until):
            step_fn(step, self.rank, self.world_size)
            self.commit(step)
            last = step
        return last

    def collective(self, op: str = "all_reduce", nbytes: int = 0) -> Any:
        """`with rt.collective("all_reduce", t.nbytes): dist.all_reduce(t)`.

        Marks this rank as *waiting in collective N* in its step records, separately from its own
        compute time, so `gpu-doctor diagnose job` can name the rank that never arrived instead of
        calling every waiting rank hung. Sequence numbers restart with each generation's processes.
        """
        self._collective_seq += 1
        if self._steplog is None:
            return contextlib.nullcontext()
        return _Timed(self._steplog.collective(self._collective_seq, op, nbytes), self.counters)

    def commit(self, step: int) -> None:
        """After the optimizer update of `step`: step record, commit record, snapshot every k."""
        if self.generation is None:
            raise RefusedError("commit() before activate()")
        t0 = time.perf_counter()
        try:
            self._commit_locally(step)
            self.on_committed(step)
            self._share_commit(step)
        finally:
            self.counters.commit_s += time.perf_counter() - t0

    def on_committed(self, step: int) -> None:
        """Called once `step` is committed here, before any collective of the commit (the frontier
        meeting, a sharded snapshot): what the commit means to a subclass (in place: a copy in memory)."""
        return None

    def _commit_locally(self, step: int) -> None:
        """The commit is local (the step record); the ledger hears of it once per snapshot, for the
        whole job (`recovery.runtime.frontier`): no ledger round trip here."""
        ctx = self.context
        ctx.require_lease(f"commit of step {step}")
        assert ctx.generation is not None
        newer = self.watch.newer_than(ctx.generation)
        if newer is not None:
            ctx.counters.fenced_commits += 1
            raise FencedError(
                f"commit of step {step} in generation {ctx.generation} fenced: generation {newer} is active"
            )
        if self._steplog is not None:
            self._steplog.end_step(step)
        ctx.counters.commits += 1
        if self._step_t0 is not None:
            self.step_times.append(time.perf_counter() - self._step_t0)
        now = time.perf_counter()
        if self._last_commit_t is not None:  # commit to commit: the whole step, with or without rt.steps()
            self._commit_gaps.append(now - self._last_commit_t)
        self._last_commit_t = now

    def _share_commit(self, step: int) -> None:
        """What the other members learn of the commit: the frontier meeting, a due snapshot."""
        step_s = statistics.median(self._commit_gaps) if self._commit_gaps else 0.0
        if self.state.meets_at(step, self.options.snapshot_every):
            self.frontier.meet(step)  # every member committed `step`: rank 0 records the frontier
        self.state.snapshot(step, self.options.snapshot_every, step_s)

    def flush_snapshots(self, timeout: float) -> bool:
        """Wait (bounded) until no snapshot is pending or being written; False on timeout. Sharded
        mode: a collective wait in effect (every rank's writer is in the same save)."""
        return self.state.flush(timeout)

    def fault(self, point: str, step: int) -> None:
        """Call the test/demo fault hook at a named point of a step (no-op without one)."""
        self.context.fault(point, step)

    def close(self, timeout: float = 30.0) -> None:
        """Flush the last snapshot, tear the group down (outside any `except`: docs/torchrun-hazards.md)."""
        import torch.distributed as dist

        self.state.close_writer(self.context, timeout)
        self.frontier.settle()  # the last meeting (started without waiting): what it proved is queued
        self.frontier.flush(min(timeout, 10.0))
        self.watch.stop()
        if self._steplog is not None:
            self._steplog.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Drop the last references while the interpreter is whole: a gloo group destroyed during
        # interpreter finalization can abort the process (std::terminate) after a clean run.
        self.pg = None
        self.frontier.leave()
        self.state.drop_groups()
        self.context.close()  # gives the lease back: a clean exit frees it at once

    # ------------------------------------------------------------------ store helpers
    def _wait_raw(self, ns: Any, key: str) -> str:
        timeout = self.options.activation_timeout_s
        try:
            ns.wait([key], timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
            raise UnavailableError(f"activation: no {key!r} within {timeout:.0f} s ({exc})") from None
        return str(ns.get(key).decode())

    def _wait_json(self, ns: Any, key: str) -> dict[str, Any]:
        doc = json.loads(self._wait_raw(ns, key))
        if not isinstance(doc, dict):
            raise ActivationRefused(f"activation: {key!r} is not a JSON object")
        return doc


class _Timed:
    """A collective mark whose own enter and exit (not the collective inside) count in `marks_s`:
    the runtime's time on the training thread outside commit(), for the overhead figures."""

    __slots__ = ("mark", "counters")

    def __init__(self, mark: Any, counters: Counters) -> None:
        self.mark, self.counters = mark, counters

    def __enter__(self) -> None:
        t0 = time.perf_counter()
        self.mark.__enter__()
        self.counters.marks_s += time.perf_counter() - t0

    def __exit__(self, *exc: object) -> None:
        t0 = time.perf_counter()
        self.mark.__exit__(*exc)
        self.counters.marks_s += time.perf_counter() - t0


def _collect_unless_leaving() -> None:
    """The exit handler that frees the groups before finalization; moot when finalization is skipped
    (`foundation.fastexit`: a worker dying of an uncaught exception), where it would cost seconds under load."""
    if not fastexit.leaving():
        gc.collect()


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


# Without these, a collective whose peer died never raises on NCCL: the watchdog aborts the
# communicator later, and the runtime's recovery never runs (the device check's finding). Set only
# where the user has not: blocking waits raise on the group's timeout; the watchdog does not tear
# the process down first (the runtime decides what happens next).
NCCL_FAIL_FAST = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def nccl_fails_fast(backend: str) -> None:
    """With NCCL in the world group, make a failed collective raise in the training thread (env, unless set)."""
    if "nccl" in backend:
        for name, value in NCCL_FAIL_FAST.items():
            os.environ.setdefault(name, value)


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
