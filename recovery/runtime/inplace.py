"""Restart-free hot recovery: survivors switch from generation G to G+1 in place, certified.

    rt = InPlaceRuntime.from_env(job_dir, layout=Layout(dp=world, global_batch=B))
    state = rt.activate(model, optimizer)                 # the restart path's certified activation
    last = rt.run(state, step_fn, until=N)                # step_fn(step, rank, world): fwd, bwd, all_reduce, update

On a collective failure (peer closed, timeout, or, opt-in, a peer's UDP heartbeat gone silent:
`recovery.runtime.peer_watch`, docs/formats/peer-heartbeat.md) or an operator's abort
(`request_abort`), every survivor, in this order (measured on torch 2.13 + gloo:
docs/torchrun-hazards.md; files: docs/formats/inplace.md):
1. leaves the `except` scope, then destroys G's gloo group: that closes its sockets, which wakes a
   survivor still blocked on a *live* neighbour (inside `except` the traceback keeps the group
   alive: a 30 s stall);
2. writes a report (rank, incarnation, committed step, digests of its local state snapshots)
   through the coordination transport (`recovery.runtime.coordination`): etcd next to an etcd
   ledger, so no host's filesystem coordinates anything; `<job-dir>/coord/inplace/g<G>/` with a
   directory ledger (one host, or a job dir that really is shared);
3. waits for the ledger to show a newer generation, coordinating when it is its turn
   (`recovery.runtime.switch_coordinator`): evict the gone, kill the stopped and the silent, check
   that every survivor holds the frontier state with one digest, issue and activate the certificate
   (`extra.switch = "in-place"`, phases, layout) with the ledger's compare-and-swap;
4. verifies the certificate (`recovery.runtime.admission`, the same check as a restart), rolls back
   to the frontier from its in-memory copy if it had already committed a step past it (the
   mid-update case), and joins G+1's gloo group through a fresh per-generation store (a FileStore in
   the job dir, or a TCPStore served by the new rank 0 and published in etcd). A member of G+1 that
   is gone or frozen makes that group fail: the survivors repeat the protocol as G+1's survivors.
If the switch cannot happen in place (a TP/PP group lost a member, the survivors disagree on the
state, a member on another host cannot be proved gone) the coordinator records why and every
survivor exits with status 4: the restart path takes over.

Sharded state (`sharded=True`, `activate(build=...)`; FSDP2 / HSDP): each survivor remembers its own
chunks at every commit and reports their sums; the certificate binds the digest the survivors'
chunks make together (only when replicas of every lost shard survive, as with HSDP; plain FSDP is
refused, to the restart path). After the new group forms, `build()` makes the model over the new
world and the state is filled from memory, peer to peer (`ShardedState.rebuild_in_place`): `rt.model`
and `rt.optimizer` are then the new objects, and a `step_fn` must use them. With
`shrink="keep-layout"` ("keep the HSDP layout if possible") a switch that loses ranks of some HSDP
replicas while a whole one survives drops the damaged replicas whole (their other survivors leave with
status 0): the kept survivors hold the same shards as before, keep their model and optimizer, moved to
the new world's mesh (`recovery.runtime.rehome`), and nothing moves between ranks.

The in-place runtime is the runtime plus the switch: it uses the runtime's public parts (its
context, rank state and groups), never another class's private members.

Lazy imports (start-up time): torch.distributed, only in the methods that run inside a training process (optional `gpuguard[runtime]`).
"""

from __future__ import annotations

import gc
import os
import socket
import time
from datetime import timedelta
from typing import Any, NoReturn

from gpuguard.foundation.env import PEER_HEARTBEAT_ENV
from gpuguard.foundation.errors import EXIT_OK, EXIT_USAGE, GpuguardError, UnavailableError, one_line
from gpuguard.foundation.inplace_files import inplace_dir, read_reports, request_abort, write_switch_record
from gpuguard.recovery.runtime import heartbeat as peer_hb
from gpuguard.recovery.runtime.admission import admitted_certificate
from gpuguard.recovery.runtime.peer_watch import PeerWatch
from gpuguard.recovery.runtime.rank_state import ReplicatedState
from gpuguard.recovery.runtime.refusals import ActivationRefused, FencedError
from gpuguard.recovery.runtime.runtime import Runtime, StepFn, TrainState
from gpuguard.recovery.runtime.sharded_state import ShardedState
from gpuguard.recovery.runtime.switch import OPERATOR_ABORT, Layout, Report
from gpuguard.recovery.runtime.switch_coordinator import (
    SwitchCoordinator,
    coordinator_of,
    lowest_live_reporter,
    member_liveness,
)

# how sharded survivors shrink: re-partition the state over every survivor (the default), or, when
# whole HSDP replicas survive, drop the damaged ones and keep the layout (nothing moves, no rebuild)
REPARTITION = "repartition"
KEEP_LAYOUT = "keep-layout"
SHRINK_POLICIES = (REPARTITION, KEEP_LAYOUT)


class InPlaceRuntime(Runtime):
    """The Runtime plus the in-place switch (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        layout: Layout | None = None,
        grace_s: float = 1.0,
        switch_timeout_s: float = 60.0,
        keep_local: int = 3,
        lease_ttl_s: float | None = None,
        peer_heartbeat: str | None = None,
        shrink: str = REPARTITION,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, lease_ttl_s=lease_ttl_s, **kwargs)
        if shrink not in SHRINK_POLICIES:
            raise GpuguardError(
                f"shrink must be one of {', '.join(SHRINK_POLICIES)}, not {shrink!r}", exit_code=EXIT_USAGE
            )
        if isinstance(self.state, ReplicatedState):
            self.state.keep_local = max(2, keep_local)
        if isinstance(self.state, ShardedState):
            self.state.keep_layout = shrink == KEEP_LAYOUT
        # opt-in silent-peer detector; off: a lost host is noticed at the collective timeout
        setting = peer_heartbeat if peer_heartbeat is not None else os.environ.get(PEER_HEARTBEAT_ENV)
        self.peers = PeerWatch(self.context, peer_hb.parse_setting(setting), self.options.pg_timeout_s)
        self.layout = layout or Layout(dp=self.world_size)
        self.switch_timeout_s = switch_timeout_s
        self.coordinator = SwitchCoordinator(
            self.context, self.state, grace_s=grace_s, pg_timeout_s=self.options.pg_timeout_s
        )
        self.committed: int | None = None
        self.switches: list[dict[str, Any]] = []
        self.remember_times: list[float] = []  # cost of the in-memory rollback copy, per commit
        self._pending_first_commit: dict[str, Any] | None = None
        self._train_state: TrainState | None = None  # what `run` was given (its objects are dropped at a switch)

    def replicated_digest(self, state: dict[str, Any] | None = None) -> str:
        """Digest of what every data-parallel replica holds identically (model + optimizer)."""
        if not isinstance(self.state, ReplicatedState):
            raise GpuguardError("replicated_digest() is for replicated state", exit_code=EXIT_USAGE)
        return self.state.memory_digest(state)

    # ------------------------------------------------------------------ activation and commits
    def activate(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        extra: Any = None,
        *,
        build: Any = None,
        data: Any = None,
    ) -> TrainState:
        if self.sharded and build is None:  # the switch rebuilds the model over the new world
            raise GpuguardError(
                "the in-place switch with sharded state needs activate(build=...)", exit_code=EXIT_USAGE
            )
        state = super().activate(model, optimizer, scheduler, extra, build=build, data=data)
        self.committed = state.frontier_step
        self.state.remember(state.frontier_step)
        self._watch_peers()
        return state

    def on_committed(self, step: int) -> None:
        """Committed here: the newest step this survivor would report, and its copy in memory (kept
        before the commit's collectives, so a peer lost in them leaves this step rolled back to, not lost)."""
        self.committed = step
        t0 = time.perf_counter()
        self.state.remember(step)
        self.remember_times.append(time.perf_counter() - t0)
        if self._pending_first_commit is not None:
            rec, self._pending_first_commit = self._pending_first_commit, None
            rec["phases"]["first_commit"] = time.time()
            rec["first_step"] = step
            rec["rank"] = self.rank
            write_switch_record(self.job_dir, rec)

    # ------------------------------------------------------------------ the loop
    def run(self, state: TrainState, step_fn: StepFn, until: int) -> int:
        """Run steps state.start_step..until, switching generation in place on a failure.

        Returns the last committed step. `step_fn(step, rank, world)` must use the default group.
        """
        step = state.start_step
        self._train_state = state
        try:
            while step <= until:
                failure = self._try_step(step, step_fn)
                if failure is None:
                    step += 1
                    continue
                # outside the except scope: the failed group can really be torn down now
                step = self.switch(failure)
                state.model, state.optimizer = self.model, self.optimizer  # sharded: rebuilt over the new world
                state.scheduler = self.objects.scheduler
        finally:
            self.peers.stop()
        return self.committed if self.committed is not None else state.frontier_step

    def close(self, timeout: float = 30.0) -> None:
        self.peers.stop()
        super().close(timeout)

    def _try_step(self, step: int, step_fn: StepFn) -> str | None:
        """One step and its commit; the failure text (no exception object survives this frame)."""
        if self.generation is not None and self.context.coord.abort_requested(self.generation):
            return OPERATOR_ABORT
        if self.peers.suspicion is not None:
            return self.peers.suspicion
        self.begin_step(step)
        try:
            step_fn(step, self.rank, self.world_size)
            self.commit(step)
        except FencedError:
            raise
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out waiting ..."
            if self.peers.suspicion is not None:  # the detector broke the connections: its evidence is the cause
                return self.peers.suspicion
            return one_line(exc)
        return None

    def _watch_peers(self) -> None:
        why = self.peers.start()
        if why is not None:  # detection falls back to the collective timeout for this generation
            self.context.log(f"peer heartbeat off in generation {self.generation}: {why}")

    # ------------------------------------------------------------------ the switch (every survivor)
    def switch(self, failure: str) -> int:
        """Leave the failed generation and join the next one in place; the next step to run."""
        t_detect = time.time()
        generation = int(self.generation or 0)
        operator = failure == OPERATOR_ABORT
        self._teardown()
        while True:
            cert, phases = self._agree(generation, failure, t_detect, operator)
            joined = self._join(cert, phases)
            if joined is None:
                return int(self.committed if self.committed is not None else cert.frontier.step) + 1
            self.context.log(f"generation {cert.generation} could not form ({joined}): switching again")
            generation, failure, t_detect, operator = cert.generation, joined, time.time(), False
            self._teardown()

    def _teardown(self) -> None:
        import torch.distributed as dist

        self.peers.stop()
        self.state.leave_group()
        # wake every peer still blocked on one of this generation's groups, however long something keeps
        # the group alive (recovery.runtime.group_sockets); an abandoned snapshot save fails at once too
        self.opened.shut()
        if self.sharded:  # nothing may keep the failed group's mesh alive: destroying it then frees it
            if self._train_state is not None:
                self._train_state.model = self._train_state.optimizer = self._train_state.scheduler = None
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None
        self.frontier.leave()
        if self.sharded:
            gc.collect()

    def _report(self, generation: int, failure: str) -> Report:
        digests, sums = self.state.report()
        rep = Report(
            generation,
            self.rank,
            self.incarnation.id,
            os.getpid(),
            socket.gethostname(),
            self.committed,
            digests,
            failure,
            time.time(),
            sums,
            (self.peers.suspect,) if self.peers.suspect is not None else (),
        )
        ctx = self.context
        ctx.require_lease(f"report of generation {generation}")
        if not ctx.coord.write_report(rep):
            ctx.require_lease(f"report of generation {generation}")
            ctx.log(f"report of generation {generation} fenced: generation {generation} is no longer active")
        return rep

    def _agree(self, generation: int, failure: str, t_detect: float, operator: bool) -> tuple[Any, dict[str, float]]:
        """Report, then wait for the ledger to move past `generation` (coordinating when it is my turn)."""
        ctx = self.context
        phases: dict[str, float] = {"detect": t_detect}
        me = self._report(generation, failure)
        phases["reported"] = time.time()
        self.fault("reported", generation)
        ledger = ctx.ledger()
        parent = ledger.get(generation)
        deadline = time.monotonic() + self.switch_timeout_s
        coordinating_since: float | None = None
        while time.monotonic() < deadline:
            active = ledger.require_active()
            if active.generation > generation:
                phases["decided"] = time.time()
                return active, phases
            ctx.require_lease(f"switch from generation {generation}")
            refused = ctx.coord.refusal(generation)
            if refused is not None:
                self._refuse(f"in-place switch refused: {refused.get('reason')}")
            ctx.coord.aggregate(generation)  # this host's reports, when it is my turn to publish them
            if not self._may_coordinate(generation, parent, me.host):
                time.sleep(0.005)
                continue
            reports = ctx.coord.read_reports(generation)
            if coordinator_of(ctx.coord, reports, parent.ranks, me.host) == self.rank:
                if coordinating_since is None:
                    coordinating_since = time.time()
                    self.fault("coordinate", generation)
                if self.coordinator.decide(parent, reports, self.layout, coordinating_since, operator, phases):
                    continue
            time.sleep(0.005)
        raise UnavailableError(
            f"in-place switch from generation {generation}: no decision within {self.switch_timeout_s:.0f} s"
        )

    def _refuse(self, why: str) -> NoReturn:
        self.context.refuse("stops", why)

    def _may_coordinate(self, generation: int, parent: Any, host: str) -> bool:
        """Whether `choose_coordinator` over every report names this rank, read cheaply: with etcd,
        block by block from rank 0, each reporter probed (this host) or its lease key read (another),
        up to the first that is not gone: the lowest live reporter, the coordinator. A survivor that is
        not it reads one block and one lease key a pass, not every host's reports and every lease.
        The same answer as the full read (tests/recovery/runtime/test_coord_etcd_incremental.py)."""
        coord = self.context.coord
        if coord.kind != "etcd":
            return True  # the job dir's files: the full read below decides
        return lowest_live_reporter(coord, generation, parent.ranks, host, self.rank) == self.rank

    # ------------------------------------------------------------------ joining the next generation
    def _join(self, cert: Any, phases: dict[str, float]) -> str | None:
        """Verify, roll back, form the new group. None when joined, else why the group failed."""
        ctx = self.context
        memory = None
        kept = cert.extra.get("layout_kept") or {}
        if ctx.incarnation.id in kept.get("dropped_incarnations", ()):
            ctx.refuse(
                "leaves",
                f"generation {cert.generation} keeps the HSDP layout without this rank's damaged replica "
                "(nothing moves); this rank is not needed",
                code=EXIT_OK,
            )
        try:
            self._admit_in_place(cert.generation)
            self.fault("joining", cert.generation)
            frontier = cert.frontier.step
            memory = self.state.roll_back(frontier, self.committed, cert.extra.get("replicated_state_digest"))
        except ActivationRefused as exc:
            self._refuse(str(exc))
        self.committed = frontier
        phases["restored"] = time.time()
        failure = self._members_alive(cert)
        if failure is not None:
            return failure
        self.state.settle_writer()
        mine = next(m for m in cert.members if m.incarnation.id == ctx.incarnation.id)
        ctx.generation = cert.generation
        # the snapshot the new certificate names is the one pruning must keep (`verify --deep` checks it)
        ctx.frontier_step = frontier
        ctx.rank, ctx.world_size = mine.rank, len(cert.members)
        if cert.extra.get("layout"):
            lay = cert.extra["layout"]
            self.layout = Layout(int(lay["dp"]), int(lay["tp"]), int(lay["pp"]), lay.get("global_batch"))
        failure = self._init_group(cert.generation)
        if failure is not None:
            return failure
        if isinstance(self.state, ShardedState):
            parent = ctx.ledger().get(cert.parent_generation)
            try:
                failure = self.state.rebuild_in_place(ctx, cert, parent, memory, self.opened, self.options.pg_timeout_s)
            except ActivationRefused as exc:
                self._refuse(str(exc))
            if failure is not None:
                self._teardown()
                return failure
            phases["resharded"] = time.time()
        self._watch_peers()
        phases["group_ready"] = time.time()
        self._after_join(cert, phases)
        return None

    def _admit_in_place(self, generation: int) -> Any:
        """The one admission check; in place the survivors are renumbered, so on any rank."""
        ctx = self.context
        return admitted_certificate(ctx.ledger(), generation, incarnation_id=ctx.incarnation.id)

    def _members_alive(self, cert: Any) -> str | None:
        """Every member of the new generation is running (this host) and holds its lease (others)."""
        ctx = self.context
        host = socket.gethostname()
        for m in cert.members:
            inc = m.incarnation
            if inc.host == host and member_liveness(inc.pid, inc.start_time) != "running":
                return f"member rank {m.rank} (pid {inc.pid}) of generation {cert.generation} is gone or stopped"
        expired = ctx.coord.expired(m.incarnation.id for m in cert.members if m.incarnation.host != host)
        if expired:
            ranks = sorted(m.rank for m in cert.members if m.incarnation.id in expired)
            return f"members {ranks} of generation {cert.generation} lost their lease"
        return None

    def _init_group(self, generation: int) -> str | None:
        import torch.distributed as dist

        ctx = self.context
        failure = None
        try:
            store = ctx.coord.group_store(generation, ctx.rank, self.options.pg_timeout_s)
            self.opened.track(
                lambda: dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore("pg", store),
                    rank=ctx.rank,
                    world_size=ctx.world_size,
                    timeout=timedelta(seconds=self.options.pg_timeout_s),
                )
            )
            self.frontier.form(self.opened)
        except (RuntimeError, ValueError, UnavailableError) as exc:  # DistStoreError is a RuntimeError
            failure = f"group of generation {generation} did not form: {one_line(exc, 200)}"
        if failure is not None:
            self._teardown()
            return failure
        self.pg = dist.group.WORLD
        return None

    def _after_join(self, cert: Any, phases: dict[str, float]) -> None:
        ctx = self.context
        self.start_step_log()
        self.state.start_writer(ctx, self.outcomes, self.options, self.frontier)
        ctx.write_incarnation(phases=phases, switch="in-place")
        rec = {
            "schema": "gpuguard.inplace-switch/1",
            "generation": cert.generation,
            "parent_generation": cert.parent_generation,
            "frontier_step": cert.frontier.step,
            "world_size": ctx.world_size,
            "reason": cert.reason,
            "phases": dict(phases),
            "certificate_phases": dict(cert.extra.get("phases") or {}),
            **({"reshard": self.reshard} if self.sharded else {}),
        }
        self.switches.append(rec)
        self._pending_first_commit = rec
        ctx.log(
            f"generation {cert.generation} active in place: rank {ctx.rank} of {ctx.world_size}, "
            f"resuming at step {cert.frontier.step + 1}"
        )


__all__ = ["InPlaceRuntime", "Layout", "inplace_dir", "read_reports", "request_abort"]
