"""Restart-free hot recovery: survivors switch from generation G to G+1 in place, certified.

    rt = InPlaceRuntime.from_env(job_dir, layout=Layout(dp=world, global_batch=B))
    state = rt.activate(model, optimizer)                 # the restart path's certified activation
    last = rt.run(state, step_fn, until=N)                # step_fn(step, rank, world): fwd, bwd, all_reduce, update

On a collective failure (peer closed, timeout, or, opt-in, a peer's UDP heartbeat gone silent:
`recovery.runtime.heartbeat`, docs/formats/peer-heartbeat.md) or an operator's abort (`request_abort`), every
survivor, in this order (measured on torch 2.13 + gloo: docs/torchrun-hazards.md; files: docs/formats/inplace.md):
1. leaves the `except` scope, then destroys G's gloo group: that closes its sockets, which wakes a
   survivor still blocked on a *live* neighbour (inside `except` the traceback keeps the group
   alive: a 30 s stall);
2. writes a report (rank, incarnation, committed step, digests of its local state snapshots)
   through the coordination transport (`recovery.runtime.coordination`): etcd next to an etcd ledger, so no
   host's filesystem coordinates anything; `<job-dir>/coord/inplace/g<G>/` with a directory
   ledger (one host, or a job dir that really is shared);
3. waits for the ledger to show a newer generation. The coordinator is the lowest old rank that
   reported and is alive (`switch.choose_coordinator`); if it dies, the next one takes over. It
   evicts members that are gone (pid + start time) at once, kills stopped (SIGSTOP) members and
   members that did not report within the grace period, evicts members on other hosts whose etcd
   lease expired (each fenced itself before: `recovery.runtime.lease`, docs/formats/leases.md), computes the frontier (never past the
   last step *all* G members committed), checks that every survivor holds that state with one
   digest, issues the certificate (`extra.switch = "in-place"`, phases, layout) and activates it
   with the ledger's compare-and-swap: two coordinators racing -> one generation;
4. verifies the certificate, rolls back to the frontier from its in-memory snapshot if it had
   already committed a step past it (the mid-update case), and joins G+1's gloo group through a
   fresh per-generation store (a FileStore in the job dir, or a TCPStore served by the new
   rank 0 and published in etcd). A member of G+1 that is gone or frozen makes
   that group fail: the survivors repeat the protocol as G+1's survivors (a clean G+2).
If the switch cannot happen in place (a TP/PP group lost a member, the survivors disagree on the
state, a member on another host cannot be proved gone) the coordinator records why and every
survivor exits with status 4: the restart path takes over.

Sharded state (`sharded=True`, `activate(build=...)`; FSDP2 / HSDP): each survivor remembers its own
chunks at every commit and reports their sums; the certificate binds the digest the survivors'
chunks make together (`recovery.runtime.reshard`: only when replicas of every lost shard survive,
as with HSDP; plain FSDP is refused, to the restart path). After the new group forms, `build()`
makes the model over the new world and the reshard plan is executed from memory, peer to peer;
the filled state must have the certified digest before the first step (`rt.model`, `rt.optimizer`
are then the new objects: a `step_fn` must use them).

Lazy imports (start-up time): torch.distributed, only in the methods that run inside a training process (optional `gpuguard[runtime]`).
"""

from __future__ import annotations

import gc
import ipaddress
import os
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from gpuguard.foundation import jobdir
from gpuguard.foundation.env import PEER_HEARTBEAT_ENV
from gpuguard.foundation.errors import (
    EXIT_REFUSED,
    EXIT_USAGE,
    DataError,
    GpuguardError,
    RefusedError,
    UnavailableError,
)
from gpuguard.foundation.identity import process_status
from gpuguard.foundation.inplace_files import inplace_dir, read_reports, request_abort
from gpuguard.foundation.steplog import StepLog
from gpuguard.generation.certificate import check_stored, issue
from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.job import issuer
from gpuguard.generation.ownership import (
    describe_reshard,
    layout_from_keys,
    plan_digest,
    plan_reshard,
    reshard_problems,
)
from gpuguard.recovery.runtime import heartbeat as peer_hb
from gpuguard.recovery.runtime import reshard as ir
from gpuguard.recovery.runtime.runtime import FencedError, Runtime, TrainState, _Snapshotter
from gpuguard.recovery.runtime.switch import (
    OPERATOR_ABORT,
    EvictionFacts,
    Layout,
    Liveness,
    Report,
    SwitchFacts,
    admit_survivors,
    agree_on_state,
    certified_manifest,
    choose_coordinator,
    coordinator_probes,
    decide_eviction,
    follow_racer,
    liveness,
    operator_requested,
    plan_switch,
)
from gpuguard.recovery.snapshots import digests, parts
from gpuguard.recovery.snapshots import sharded as ss
from gpuguard.recovery.snapshots.store import clone_state, select_restorable, state_digest

StepFn = Callable[[int, int, int], None]


def _etcd_ports(url: str | None) -> list[int]:
    """The ports of an etcd:// ledger's endpoints: the peer heartbeat never breaks those connections."""
    if not url or not url.startswith("etcd://"):
        return []
    hosts = url[len("etcd://") :].split("/", 1)[0]
    return [int(p) for h in hosts.split(",") if (p := h.rpartition(":")[2]).isdigit()]


def _process_state(pid: int, start_time: float) -> Liveness:
    """'gone', 'stopped' (SIGSTOP / traced) or 'running' for this exact process (pid + start time)."""
    return liveness(process_status(pid, start_time))


def _kill_and_confirm(pid: int, start_time: float, timeout: float = 5.0) -> bool:
    """SIGKILL this exact process and wait until it is gone (a stopped process dies on SIGKILL too)."""
    if _process_state(pid, start_time) == "gone":
        return True
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _process_state(pid, start_time) == "gone":
            return True
        time.sleep(0.005)
    return False


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
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, lease_ttl_s=lease_ttl_s, **kwargs)
        # opt-in silent-peer detector (recovery.runtime.heartbeat); off: a lost host is noticed at the collective timeout
        setting = peer_heartbeat if peer_heartbeat is not None else os.environ.get(PEER_HEARTBEAT_ENV)
        self.peer_heartbeat_config = peer_hb.parse_setting(setting)
        self._peer_hb: peer_hb.PeerHeartbeat | None = None
        self._suspicion: str | None = None  # set by the detector thread: why this generation is over
        self.layout = layout or Layout(dp=self.world_size)
        self.grace_s, self.switch_timeout_s = grace_s, switch_timeout_s
        self.keep_local = max(2, keep_local)
        self.committed: int | None = None
        self._local: OrderedDict[int, tuple[dict[str, Any], str]] = OrderedDict()
        self.switches: list[dict[str, Any]] = []
        self.remember_times: list[float] = []  # cost of the in-memory rollback snapshot, per commit
        self._pending_first_commit: dict[str, Any] | None = None
        self._killed: dict[str, str] = {}  # incarnation id -> eviction evidence (this process killed it)
        self._shards: OrderedDict[int, ir.Remembered] = OrderedDict()  # sharded mode: step -> my chunks
        self._train_state: TrainState | None = None  # what `run` was given (its objects are dropped at a switch)

    # ------------------------------------------------------------------ local state
    def replicated_digest(self, state: dict[str, Any] | None = None) -> str:
        """Digest of what every data-parallel replica holds identically (model + optimizer)."""
        state = state if state is not None else self.state_dict()
        return state_digest({k: state[k] for k in ("model", "optim") if k in state})

    def _remember(self, step: int) -> None:
        if self.sharded:  # my chunks only, copied; their sums are computed when a report needs them
            opt = self._objects.get("optimizer")
            if opt is not None and not opt.state:
                # an optimizer before its first step has no state, and reading it (`get_state_dict`)
                # would create it by a zero step (AdamW's step count 1: the training would change).
                # Nothing to remember: a failure before the first commit goes to the restart path.
                return
            self._shards[step] = ir.remember(self.sharded_state())
            while len(self._shards) > 2:  # the frontier is the newest commit or the one before: two suffice
                self._shards.popitem(last=False)
            return
        snap = clone_state(self.state_dict())
        self._local[step] = (snap, self.replicated_digest(snap))
        while len(self._local) > self.keep_local:
            self._local.popitem(last=False)

    def _load_local(self, step: int) -> str:
        # a fresh copy: the optimizer may alias what it loads
        self._apply_state(clone_state(self._local[step][0]))
        return self.replicated_digest()

    # ------------------------------------------------------------------ activation and commits
    def activate(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        extra: Any = None,
        *,
        build: Callable[[], tuple[Any, ...]] | None = None,
    ) -> TrainState:
        if self.sharded and build is None:  # the switch rebuilds the model over the new world
            raise GpuguardError(
                "the in-place switch with sharded state needs activate(build=...)", exit_code=EXIT_USAGE
            )
        state = super().activate(model, optimizer, scheduler, extra, build=build)
        self.committed = state.frontier_step
        self._remember(state.frontier_step)
        why = self._start_peer_heartbeat()
        if why is not None:  # detection falls back to the collective timeout for this generation
            self._log(f"peer heartbeat off in generation {self.generation}: {why}")
        return state

    def commit(self, step: int) -> None:
        self._require_lease(f"commit of step {step}")
        super().commit(step)
        self.committed = step
        t0 = time.perf_counter()
        self._remember(step)
        self.remember_times.append(time.perf_counter() - t0)
        if self._pending_first_commit is not None:
            rec, self._pending_first_commit = self._pending_first_commit, None
            rec["phases"]["first_commit"] = time.time()
            rec["first_step"] = step
            rec["rank"] = self.rank
            jobdir.atomic_write_json(inplace_dir(self.job_dir) / f"switch-g{self.generation}-r{self.rank}.json", rec)

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
                state.scheduler = self._objects.get("scheduler")
        finally:
            self._stop_peer_heartbeat()
        return self.committed if self.committed is not None else state.frontier_step

    def close(self, timeout: float = 30.0) -> None:
        self._stop_peer_heartbeat()
        super().close(timeout)

    def _abort_requested(self) -> bool:
        return self.generation is not None and self.coord.abort_requested(self.generation)

    def _try_step(self, step: int, step_fn: StepFn) -> str | None:
        """One step and its commit; the failure text (no exception object survives this frame)."""
        if self._abort_requested():
            return OPERATOR_ABORT
        if self._suspicion is not None:
            return self._suspicion
        self._step_t0 = time.perf_counter()
        if self._steplog is not None:
            self._steplog.begin_step(step)
        try:
            step_fn(step, self.rank, self.world_size)
            self.commit(step)
        except FencedError:
            raise
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out waiting ..."
            if self._suspicion is not None:  # the detector broke the connections: its evidence is the cause
                return self._suspicion
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return None

    # ------------------------------------------------------------------ the peer heartbeat (opt-in)
    def _start_peer_heartbeat(self) -> str | None:
        """Publish my heartbeat address in the new group's store, read the others', start watching.

        Runs right after a group formed, on every member whose GPUGUARD_PEER_HEARTBEAT is set. The
        exchange goes through the group's store, not a collective, so a member started without the
        setting cannot be paired with a collective it never makes; a member that publishes no
        address ("-"), or none within the collective timeout, turns the detector off for the
        generation, on every member that sees it (None, or why not).
        """
        self._stop_peer_heartbeat()
        self._suspicion = None
        cfg = self.peer_heartbeat_config
        if cfg is None or self.world_size < 2 or self.generation is None:
            return None
        import torch.distributed as dist

        ledger = self.ledger()
        cert = ledger.get(self.generation)
        sock, why = None, None
        if ledger.key is None:
            why = "no signing key to authenticate heartbeats"
        else:
            try:
                sock = peer_hb.open_socket(peer_hb.worker_address(self.master_addr))
            except OSError as exc:
                why = f"no heartbeat socket: {exc}"
        store = dist.PrefixStore(
            f"gpuguard-peer-heartbeat/g{self.generation}", dist.distributed_c10d._get_default_store()
        )
        try:
            store.set(f"r{self.rank}", "-" if sock is None else "{} {}".format(*sock.getsockname()[:2]))
            keys = [f"r{r}" for r in range(self.world_size)]
            store.wait(keys, timedelta(seconds=self.pg_timeout_s))
            published = {r: bytes(store.get(k))[:128].decode(errors="replace") for r, k in enumerate(keys)}
        except RuntimeError as exc:  # DistStoreError: a member never published, or the store is gone
            why = why or f"address exchange failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            published = {}
        peers, hosts = {}, {m.rank: m.incarnation.host for m in cert.members}
        incarnations = {m.rank: m.incarnation.id for m in cert.members}
        for rank, text in published.items():
            addr, _, port = text.partition(" ")
            try:
                ip = ipaddress.ip_address(addr)
                peers[rank] = peer_hb.Peer(rank, incarnations.get(rank, ""), (str(ip), int(port)))
            except ValueError:
                why = why or f"rank {rank} publishes no heartbeat address ({text[:40]!r})"
                continue
            if ip.is_loopback and len(set(hosts.values())) > 1:
                why = why or f"rank {rank} on a multi-host job publishes loopback {ip}: set MASTER_ADDR routable"
        if why is not None or sock is None:
            if sock is not None:
                sock.close()
            return why
        self._peer_hb = peer_hb.PeerHeartbeat(
            sock,
            key=peer_hb.derive_key(ledger.key),
            job_id=cert.job_id,
            generation=self.generation,
            rank=self.rank,
            incarnation_id=self.incarnation.id,
            peers=peers,
            config=cfg,
            on_suspect=self._on_suspect,
        )
        self._peer_hb.start()
        return None

    def _stop_peer_heartbeat(self) -> None:
        hb, self._peer_hb = self._peer_hb, None
        if hb is not None:
            hb.stop()

    def _on_suspect(self, rank: int, silent_s: float) -> None:
        """(detector thread) End this generation: record why, wake the blocked collective."""
        hb = self._peer_hb
        self._suspicion = f"no heartbeat from rank {rank} for {silent_s:.2f} s"
        if hb is None or rank not in hb.peers:
            return
        peer_ip, own_ip = hb.peers[rank].address[0], hb.sock.getsockname()[0]
        if peer_ip == own_ip:  # same host: a dead process resets its sockets itself; a frozen one times out
            self._log(f"{self._suspicion}: a peer on this host, left to the collective timeout")
            return
        n = peer_hb.break_connections(peer_ip, keep_ports=_etcd_ports(self.ledger_url))
        self._log(f"{self._suspicion}: shut {n} connection(s) to {peer_ip}")

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
            self._log(f"generation {cert.generation} could not form ({joined}): switching again")
            generation, failure, t_detect, operator = cert.generation, joined, time.time(), False
            self._teardown()

    def _teardown(self) -> None:
        import torch.distributed as dist

        self._stop_peer_heartbeat()
        if self._sharded is not None:
            # a save in flight is a collective of the failed group: it fails at the latest at the group's
            # timeout, and a late publish is fenced (the ledger moved on). Waiting for it here would
            # delay this survivor's report past the coordinator's grace period: leave it to end alone.
            self._sharded.abandon()
            self._sharded = None
        # wake every peer still blocked on one of this generation's groups, however long something keeps
        # the group alive (recovery.runtime.group_sockets); the abandoned snapshot save fails at once too
        self._opened.shut()
        if self.sharded:
            # the model's device mesh holds the failed group's subgroups: while anything references them
            # their sockets stay open and a peer blocked on this rank waits for the group timeout.
            # Drop them (the state is in `_shards`, as plain tensors) so that the destroy below frees them.
            self._objects.update(model=None, optimizer=None, scheduler=None)
            if self._train_state is not None:
                self._train_state.model = self._train_state.optimizer = self._train_state.scheduler = None
            self.snapshot_group = None
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None
        self.snapshot_group = None
        if self.sharded:
            gc.collect()

    def _report(self, generation: int, failure: str) -> Report:
        sums = {s: ir.chunk_sums(mem) for s, mem in self._shards.items()} if self.sharded else {}
        digests = (
            {s: ir.digest_of(c) for s, c in sums.items()}
            if self.sharded
            else {s: d for s, (_, d) in self._local.items()}
        )
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
        )
        self._require_lease(f"report of generation {generation}")
        if not self.coord.write_report(rep):
            self._require_lease(f"report of generation {generation}")
            self._log(f"report of generation {generation} fenced: generation {generation} is no longer active")
        return rep

    def _agree(self, generation: int, failure: str, t_detect: float, operator: bool) -> tuple[Any, dict[str, float]]:
        """Report, then wait for the ledger to move past `generation` (coordinating when it is my turn)."""
        phases: dict[str, float] = {"detect": t_detect}
        me = self._report(generation, failure)
        phases["reported"] = time.time()
        self.fault("reported", generation)
        ledger = self.ledger()
        parent = ledger.get(generation)
        deadline = time.monotonic() + self.switch_timeout_s
        coordinating_since: float | None = None
        while time.monotonic() < deadline:
            active = ledger.require_active()
            if active.generation > generation:
                phases["decided"] = time.time()
                return active, phases
            self._require_lease(f"switch from generation {generation}")
            refused = self.coord.refusal(generation)
            if refused is not None:
                self._refuse(f"in-place switch refused: {refused.get('reason')}")
            reports = self.coord.read_reports(generation)
            probes = coordinator_probes(reports, parent.ranks, me.host)
            gone = [r for r, (pid, start) in probes.items() if _process_state(pid, start) == "gone"]
            remote = {r: rep.incarnation_id for r, rep in reports.items() if rep.host != me.host}
            expired = self.coord.expired(remote.values()) if remote else frozenset()
            gone += [r for r, inc in remote.items() if inc in expired]  # a reporter that has fenced since
            if choose_coordinator(reports, gone) == self.rank:
                if coordinating_since is None:
                    coordinating_since = time.time()
                    self.fault("coordinate", generation)
                done = self._coordinate_switch(parent, reports, coordinating_since, operator, phases)
                if done:
                    continue
            time.sleep(0.005)
        raise UnavailableError(
            f"in-place switch from generation {generation}: no decision within {self.switch_timeout_s:.0f} s"
        )

    def _refuse(self, why: str) -> NoReturn:
        print(
            f"gpuguard: rank {self.rank} (incarnation {self.incarnation.id[:12]}) stops: {why}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_REFUSED)

    # ------------------------------------------------------------------ the coordinator
    def _coordinate_switch(
        self, parent: Any, reports: dict[int, Report], since: float, operator: bool, phases: dict[str, float]
    ) -> bool:
        """One pass of the decision; True once a certificate is active (mine or a racer's).

        The I/O shell of `switch`: probe this host's members, kill the ones `decide_eviction` names,
        read the commit record and the snapshots, issue and activate what `plan_switch` says.
        """

        host = socket.gethostname()
        status = {
            m.incarnation.id: process_status(m.incarnation.pid, m.incarnation.start_time)
            for m in parent.members
            if m.incarnation.host == host
        }
        eviction = decide_eviction(
            EvictionFacts(
                generation=parent.generation,
                members=parent.members,
                reports=reports,
                host=host,
                status=status,
                killed_before=dict(self._killed),
                waited_s=time.time() - since,
                # sharded: a survivor can be blocked in a collective of a subgroup that a departed peer
                # has not freed yet (its snapshot save, FSDP's all-gather) until the group's timeout
                grace_s=self.grace_s + (self.pg_timeout_s if self.sharded else 0.0),
                lease_expired=self.coord.expired(
                    m.incarnation.id for m in parent.members if m.incarnation.host != host
                ),
                # a remote member's lease is gone at most TTL (+ etcd's expiry sweep) after its last beat
                remote_wait_s=max(5.0, 2 * self.lease_timing.ttl_s + 1.0) if self.heartbeat else 5.0,
            )
        )
        for kill in eviction.kill:
            if not _kill_and_confirm(kill.pid, kill.start_time):
                self._log(f"could not kill rank {kill.rank} pid {kill.pid}: waiting")
                return False
            self._killed[kill.incarnation_id] = kill.evidence
        if eviction.waiting:
            if eviction.give_up:
                self._record_refusal(parent.generation, eviction.give_up)
            return False
        phases["evicted"] = time.time()
        admission = admit_survivors(self.layout, eviction)
        if admission.layout is None:
            self._record_refusal(parent.generation, admission.refused)
            return False
        ledger = self.ledger()
        committed = ledger.last_committed_by_all(parent.generation)
        frontier = frontier_limit(parent, committed)
        kept_reports = [reports[r] for r in admission.kept]
        agreement = (
            ir.agree_on_sharded_state(kept_reports, frontier)
            if self.sharded
            else agree_on_state(kept_reports, frontier)
        )
        if agreement.digest is None:
            lost = f"ranks {sorted(eviction.lost)} lost; " if self.sharded else ""
            self._record_refusal(parent.generation, lost + "; ".join(agreement.problems))
            return False
        select = parts.select_sharded if self.sharded else select_restorable
        manifest = certified_manifest(select(self.snapshot_root, frontier), frontier)
        phases["frontier"] = time.time()
        plan = plan_switch(
            SwitchFacts(
                parent=parent,
                previous_layout=self.layout,
                layout=admission.layout,
                kept=admission.kept,
                eviction=eviction,
                reports=reports,
                committed_by_all=committed,
                frontier=frontier,
                manifest=manifest,
                state_digest=agreement.digest,
                sharded=self.sharded,
                operator=operator_requested(operator, reports.values()),
                phases=dict(phases),
                since=since,
                coordinator_rank=self.rank,
                coordinator_incarnation=self.incarnation.id,
            )
        )
        cert = issue(
            parent=parent,
            job_id=parent.job_id,
            members=plan.members,
            reason=plan.reason,
            frontier=plan.frontier,
            quiescence="proved",
            quiescence_evidence=plan.quiescence_evidence,
            issued_by=f"gpuguard-inplace {issuer()}",
            key=ledger.key,
            # no new rendezvous round for an in-place switch: its members still run in the round they
            # were started in, and the certificate names it (`gpu-generation show`/`history`)
            extra={
                **plan.extra,
                "rendezvous_round": self.attempt.round if self.attempt else None,
                **(
                    {
                        "sharded_state": {
                            "chunks": agreement.chunks,
                            "replicated": agreement.replicated,
                            "lost": sorted(eviction.lost),
                        }
                    }
                    if isinstance(agreement, ir.ShardedAgreement)
                    else {}
                ),
            },
            # sharded: the new world holds its chunks in another layout (map version +1)
            ownership_map_version=parent.ownership_map_version + (1 if self.sharded else 0),
        )
        self._require_lease(f"certificate of generation {cert.generation}")
        try:
            ledger.activate(cert, manifest_ok=True if manifest else None)
        except RefusedError as exc:
            active = ledger.active()
            if follow_racer(active.generation if active is not None else None, parent.generation):
                return True  # another coordinator won the compare-and-swap: follow it
            self._record_refusal(parent.generation, str(exc))
            return False
        phases["certified"] = time.time()
        self._log(
            f"in-place: generation {cert.generation} certified (world {len(plan.members)}, frontier {frontier}, "
            f"evicted dead={list(eviction.dead)} killed={list(eviction.killed)})"
        )
        return True

    def _record_refusal(self, generation: int, reason: str) -> None:
        self._require_lease(f"refusal of generation {generation}")
        self.coord.record_refusal(
            generation, {"generation": generation, "reason": reason, "by": self.incarnation.id, "time": time.time()}
        )
        self._refuse(f"in-place switch refused: {reason}")

    # ------------------------------------------------------------------ joining the next generation
    def _join(self, cert: Any, phases: dict[str, float]) -> str | None:
        """Verify, roll back, form the new group. None when joined, else why the group failed."""

        ledger = self.ledger()
        parent = ledger.get(cert.parent_generation)
        violations = check_stored(cert, parent=parent, key=ledger.key)
        if violations:
            self._refuse(
                f"certificate of generation {cert.generation} fails rule {violations[0].rule}: {violations[0].message}"
            )
        mine = [m for m in cert.members if m.incarnation.id == self.incarnation.id]
        if not mine:
            self._refuse(f"evicted: generation {cert.generation} does not admit this incarnation")
        self.fault("joining", cert.generation)
        frontier = cert.frontier.step
        mem = None
        if self.sharded:  # the state is rebuilt from the survivors' chunks once the group is up
            mem = self._shards.get(frontier)
            if mem is None:
                self._refuse(f"no local sharded state of frontier step {frontier} (have {sorted(self._shards)})")
            while self._shards and next(reversed(self._shards)) > frontier:
                self._shards.popitem(last=True)
            self.committed = frontier
        want = cert.extra.get("replicated_state_digest")
        if not self.sharded and (self.committed != frontier or self.replicated_digest() != want):
            if frontier not in self._local:
                self._refuse(f"no local state of frontier step {frontier} (have {sorted(self._local)})")
            got = self._load_local(frontier)
            if want is not None and got != want:
                self._refuse(f"local state of step {frontier} has digest {got[:12]}, certified {str(want)[:12]}")
            self.committed = frontier
            while self._local and next(reversed(self._local)) > frontier:
                self._local.popitem(last=True)
        phases["restored"] = time.time()
        host = socket.gethostname()
        for m in cert.members:
            inc = m.incarnation
            if inc.host == host and _process_state(inc.pid, inc.start_time) != "running":
                return f"member rank {m.rank} (pid {inc.pid}) of generation {cert.generation} is gone or stopped"
        expired = self.coord.expired(m.incarnation.id for m in cert.members if m.incarnation.host != host)
        if expired:
            ranks = sorted(m.rank for m in cert.members if m.incarnation.id in expired)
            return f"members {ranks} of generation {cert.generation} lost their lease"
        if self._snapshotter is not None:
            # a snapshot queued in the old generation is stamped with it (the writer reads the generation
            # when it writes): let it finish, or be fenced, before the generation changes
            self._snapshotter.flush(timeout=10.0)
        self.generation = cert.generation
        # the snapshot the new certificate names is the one pruning must keep (`verify --deep` checks it)
        self._frontier_step = frontier
        self.rank, self.world_size = mine[0].rank, len(cert.members)
        if cert.extra.get("layout"):
            lay = cert.extra["layout"]
            self.layout = Layout(int(lay["dp"]), int(lay["tp"]), int(lay["pp"]), lay.get("global_batch"))
        failure = self._init_group(cert.generation)
        if failure is not None:
            return failure
        if mem is not None:
            failure = self._reshard_in_place(cert, mem, phases)
            if failure is not None:
                self._teardown()
                return failure
        why = self._start_peer_heartbeat()
        if why is not None:  # detection falls back to the collective timeout for this generation
            self._log(f"peer heartbeat off in generation {cert.generation}: {why}")
        phases["group_ready"] = time.time()
        self._after_join(cert, phases)
        return None

    def _reshard_in_place(self, cert: Any, mem: ir.Remembered, phases: dict[str, float]) -> str | None:
        """Collective over the new group: build the model over the new world, fill it from the
        survivors' chunks of the frontier (peer to peer) and check it has the certified digest.
        None when done; the failure text when the group broke (switch again); a refusal otherwise."""
        import torch.distributed as dist

        ledger = self.ledger()
        parent = ledger.get(cert.parent_generation)
        mine = [m.rank for m in parent.members if m.incarnation.id == self.incarnation.id]
        try:
            self.snapshot_group = self._opened.track(lambda: ss.new_snapshot_group(self.pg_timeout_s))
            assert self._build is not None
            built = tuple(self._opened.track(self._build))
            self._objects["model"], self._objects["optimizer"] = built[0], built[1]
            if len(built) > 2:
                self._objects["scheduler"] = built[2]
            live = self.sharded_state()
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, {"old_rank": mine[0], "old": mem.held(), "new": ir.held_by(live)})
        except RuntimeError as exc:  # a peer gone while the new group builds: switch again
            return f"building generation {cert.generation} failed: {type(exc).__name__}: {str(exc)[:200]}"
        survivors = {int(e["old_rank"]): i for i, e in enumerate(every)}
        held_old = {int(e["old_rank"]): e["old"] for e in every}
        # a chunk "written" by its lowest surviving holder: the one that sends it (`describe_reshard`)
        writers: dict[str, int] = {}
        for r in sorted(held_old):
            for k in held_old[r]:
                writers.setdefault(k, r)
        try:  # every rank computes the same layouts and plan from the same gathered facts
            old = layout_from_keys(parent.ownership_map_version, len(parent.members), held_old, writers)
            new = layout_from_keys(
                cert.ownership_map_version, self.world_size, {i: e["new"] for i, e in enumerate(every)}
            )
        except ValueError as exc:  # two survivors disagree on a chunk's geometry
            self._refuse(f"in-place reshard of generation {cert.generation}: {exc}")
        plan = plan_reshard(old, new, survivors=survivors, in_memory=True)
        problems = reshard_problems(new, plan) + [
            f"{t.region.fqn}: no survivor holds it" for t in plan if t.source == "checkpoint"
        ]
        if problems:
            self._refuse(f"in-place reshard of generation {cert.generation}: {problems[0]}")
        try:
            others, stats = ir.transfer(plan, mem, live, rank=self.rank, timeout_s=self.pg_timeout_s)
            self._apply_sharded(ir.put_back(live, others))
            got = digests.state_digest_sharded(self.sharded_state())
        except RuntimeError as exc:  # gloo: a peer gone during the transfer
            return f"shard transfer of generation {cert.generation} failed: {type(exc).__name__}: {str(exc)[:200]}"
        except DataError as exc:  # the rebuilt model has no place for a region (another model): not in place
            self._refuse(f"in-place reshard of generation {cert.generation}: {exc}")
        want = cert.extra.get("sharded_state_digest")
        if got != want:
            self._refuse(
                f"the state rebuilt in place has digest {got[:16]}…, generation {cert.generation} certified {str(want)[:16]}…"
            )
        phases["resharded"] = time.time()
        lost = sorted(set(range(len(parent.members))) - set(survivors))
        self.reshard = {
            "in_place": True,
            "plan_digest": plan_digest(plan),
            "reads": len(plan),
            "elements_moved": sum(t.region.numel for t in plan if t.source != "local"),
            "elements": sum(t.region.numel for t in plan),
            "mine": {"copied": stats.copied, "received": stats.received, "sent": stats.sent},
            "lines": describe_reshard(old, new, plan, step=cert.frontier.step, survivors=survivors, lost=lost),
        }
        self.ownership_map_version = cert.ownership_map_version
        if self.rank == 0:
            for line in self.reshard["lines"]:
                self._log(f"  {line}")
        return None

    def _init_group(self, generation: int) -> str | None:
        import torch.distributed as dist

        failure = None
        try:
            store = self.coord.group_store(generation, self.rank, self.pg_timeout_s)
            self._opened.track(
                lambda: dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore("pg", store),
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=timedelta(seconds=self.pg_timeout_s),
                )
            )
        except (RuntimeError, ValueError, UnavailableError) as exc:  # DistStoreError is a RuntimeError
            failure = f"group of generation {generation} did not form: {type(exc).__name__}: {str(exc)[:200]}"
        if failure is not None:
            self._teardown()
            return failure
        self.pg = dist.group.WORLD
        return None

    def _after_join(self, cert: Any, phases: dict[str, float]) -> None:

        if self._steplog is not None:
            self._steplog.close()
        self._steplog = StepLog(self.job_dir, self.rank, self.incarnation.id, self.generation)
        if self.sharded:
            self._start_sharded_writer()
        elif self.rank == 0 and self._snapshotter is None:
            self._snapshotter = _Snapshotter(self._write_snapshot)
        self._write_incarnation(phases=phases, switch="in-place")
        rec = {
            "schema": "gpuguard.inplace-switch/1",
            "generation": cert.generation,
            "parent_generation": cert.parent_generation,
            "frontier_step": cert.frontier.step,
            "world_size": self.world_size,
            "reason": cert.reason,
            "phases": dict(phases),
            "certificate_phases": dict(cert.extra.get("phases") or {}),
            **({"reshard": self.reshard} if self.sharded else {}),
        }
        self.switches.append(rec)
        self._pending_first_commit = rec
        self._log(
            f"generation {cert.generation} active in place: rank {self.rank} of {self.world_size}, "
            f"resuming at step {cert.frontier.step + 1}"
        )


__all__ = ["InPlaceRuntime", "Layout", "inplace_dir", "read_reports", "request_abort"]
