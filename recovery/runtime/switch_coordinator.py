"""The in-place switch's coordinator: the I/O around the pure decisions of `recovery.runtime.switch`.

The lowest old rank that reported and is alive coordinates (`switch.choose_coordinator`); if it
dies, the next one takes over. One pass (`decide`): probe this host's members of the old
generation, kill the ones `decide_eviction` names (stopped, or silent past the grace period: each
by `kill_confirmed`, never a reused pid), read the commit record and the snapshots, check that the
kept survivors hold the frontier state with one digest (the rank state's `agree`), and issue and
activate what `plan_switch` says. Two coordinators racing give one generation: the ledger's
compare-and-swap lets one win, and the other follows it. A switch that cannot happen in place is
recorded as a refusal and every survivor stops (status 4): the restart path takes over.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from gpuguard.foundation.errors import RefusedError
from gpuguard.foundation.gcpause import gc_paused
from gpuguard.foundation.identity import kill_confirmed, process_status
from gpuguard.foundation.inplace_files import HOST_BLOCK
from gpuguard.generation.certificate import issue
from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.job import issuer
from gpuguard.generation.records import Incarnation
from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.housekeeping import after_activation
from gpuguard.recovery.runtime.rank_state import RankState
from gpuguard.recovery.runtime.switch import (
    EvictionFacts,
    Layout,
    Liveness,
    Report,
    SwitchFacts,
    admit_survivors,
    certified_manifest,
    choose_coordinator,
    committed_by_all_from_reports,
    coordinator_probes,
    decide_eviction,
    follow_racer,
    liveness,
    operator_requested,
    plan_switch,
)

BLOCKS_READ_ALONE = 8  # lowest blocks a survivor reads one by one before one full read instead


class SwitchCoordinator:
    """One survivor's turn at coordinating the switch out of a failed generation."""

    def __init__(self, ctx: Context, state: RankState, *, grace_s: float, pg_timeout_s: float) -> None:
        self.ctx, self.state = ctx, state
        self.grace_s, self.pg_timeout_s = grace_s, pg_timeout_s
        self.killed: dict[str, str] = {}  # incarnation id -> eviction evidence (this process killed it)

    def decide(
        self,
        parent: Any,
        reports: dict[int, Report],
        layout: Layout,
        since: float,
        operator: bool,
        phases: dict[str, float],
    ) -> bool:
        """One pass of the decision; True once a certificate is active (mine or a racer's)."""
        ctx = self.ctx
        host = socket.gethostname()
        status = {
            m.incarnation.id: process_status(m.incarnation.pid, m.incarnation.start_time)
            for m in parent.members
            if m.incarnation.host == host
        }
        with gc_paused():  # one evidence line per member (foundation/gcpause.py)
            eviction = decide_eviction(
                EvictionFacts(
                    generation=parent.generation,
                    members=parent.members,
                    reports=reports,
                    host=host,
                    status=status,
                    killed_before=dict(self.killed),
                    waited_s=time.time() - since,
                    # sharded: a survivor can be blocked in a collective of a subgroup that a departed peer
                    # has not freed yet (its snapshot save, FSDP's all-gather) until the group's timeout
                    grace_s=self.grace_s + (self.pg_timeout_s if self.state.sharded else 0.0),
                    lease_expired=ctx.coord.expired(
                        m.incarnation.id for m in parent.members if m.incarnation.host != host
                    ),
                    # a remote member's lease is gone at most TTL (+ etcd's expiry sweep) after its last beat
                    remote_wait_s=max(5.0, 2 * ctx.lease_timing.ttl_s + 1.0) if ctx.lease else 5.0,
                    fenced_sinks=ctx.coord.kind == "etcd",  # ledger, reports, store and frontier compare the generation
                )
            )
        for kill in eviction.kill:
            if not kill_confirmed(kill.pid, kill.start_time):
                ctx.log(f"could not kill rank {kill.rank} pid {kill.pid}: waiting")
                return False
            self.killed[kill.incarnation_id] = kill.evidence
        if eviction.waiting:
            if eviction.give_up:
                self.refuse(parent.generation, eviction.give_up)
            return False
        phases["evicted"] = time.time()
        admission = admit_survivors(layout, eviction, self.state.replica_ranks())
        if admission.layout is None:
            self.refuse(parent.generation, admission.refused)
        ledger = ctx.ledger()
        committed = self._committed_by_all(ledger, parent, reports)
        frontier = frontier_limit(parent, committed)
        agreement = self.state.agree([reports[r] for r in admission.kept], frontier)
        if agreement.digest is None:
            lost = f"ranks {sorted(eviction.lost)} lost; " if self.state.sharded else ""
            self.refuse(parent.generation, lost + "; ".join(agreement.problems))
        manifest = certified_manifest(self.state.select(ctx.snapshot_root, frontier), frontier)
        phases["frontier"] = time.time()
        with gc_paused():  # the plan and the signed certificate: compute only (foundation/gcpause.py)
            plan = plan_switch(
                SwitchFacts(
                    parent=parent,
                    previous_layout=layout,
                    layout=admission.layout,
                    kept=admission.kept,
                    eviction=eviction,
                    reports=reports,
                    committed_by_all=committed,
                    frontier=frontier,
                    manifest=manifest,
                    state_digest=agreement.digest,
                    sharded=self.state.sharded,
                    admission=admission,
                    operator=operator_requested(operator, reports.values()),
                    phases=dict(phases),
                    since=since,
                    coordinator_rank=ctx.rank,
                    coordinator_incarnation=ctx.incarnation.id,
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
                    "rendezvous_round": ctx.attempt.round if ctx.attempt else None,
                    **self.state.switch_extra(agreement, eviction),
                },
                ownership_map_version=parent.ownership_map_version + self.state.layout_step,
            )
        ctx.require_lease(f"certificate of generation {cert.generation}")
        try:
            ledger.activate(cert, manifest_ok=True if manifest else None)
        except RefusedError as exc:
            active = ledger.active()
            if follow_racer(active.generation if active is not None else None, parent.generation):
                return True  # another coordinator won the compare-and-swap: follow it
            self.refuse(parent.generation, str(exc))
        phases["certified"] = time.time()
        after_activation(ctx, ledger, parent.generation)
        ctx.log(
            f"in-place: generation {cert.generation} certified (world {len(plan.members)}, frontier {frontier}, "
            f"evicted dead={list(eviction.dead)} killed={list(eviction.killed)}"
            + (f"; HSDP layout kept, dropped {list(admission.dropped)}" if admission.replica is not None else "")
            + ")"
        )
        return True

    def _committed_by_all(self, ledger: Any, parent: Any, reports: dict[int, Report]) -> int | None:
        """The ledger's frontier record, raised to what the reports prove (`committed_by_all_from_reports`)
        first: the activation's rule checks the certificate's frontier against the ledger's record."""
        committed = ledger.last_committed_by_all(parent.generation)
        proved = committed_by_all_from_reports(parent.ranks, reports, start=parent.frontier.step)
        if proved is not None and (committed is None or proved > committed):
            self.ctx.require_lease(f"frontier of generation {parent.generation}")
            if ledger.record_frontier(parent.generation, proved, self.ctx.incarnation.id, "reports"):
                committed = proved
        return committed

    def refuse(self, generation: int, reason: str) -> NoReturn:
        """Record why the switch cannot happen in place, then stop (every survivor reads it and stops too)."""
        ctx = self.ctx
        ctx.require_lease(f"refusal of generation {generation}")
        ctx.coord.record_refusal(
            generation, {"generation": generation, "reason": reason, "by": ctx.incarnation.id, "time": time.time()}
        )
        ctx.refuse("stops", f"in-place switch refused: {reason}")


def coordinator_of(
    coord: Any, reports: Mapping[int, Report], members: Mapping[int, Incarnation], host: str
) -> int | None:
    """`choose_coordinator` over every report: gone are the reporters on this host whose process
    (pid + the parent's start time) is gone, and those on other hosts whose lease expired since."""
    probes = coordinator_probes(reports, members, host)
    gone = [r for r, (pid, start) in probes.items() if member_liveness(pid, start) == "gone"]
    remote = {r: rep.incarnation_id for r, rep in reports.items() if rep.host != host}
    expired = coord.expired(remote.values()) if remote else frozenset()
    gone += [r for r, inc in remote.items() if inc in expired]  # a reporter that has fenced since
    return choose_coordinator(reports, gone)


def lowest_live_reporter(
    coord: Any,
    generation: int,
    members: Mapping[int, Incarnation],
    host: str,
    upto: int,
    *,
    blocks_alone: int = BLOCKS_READ_ALONE,
) -> int | None:
    """`coordinator_of` all of G's reports whenever that is at most `upto` (else a rank above
    `upto`, or None), read block by block from rank 0 (`block_reports`, etcd; the block's remote
    reporters' lease keys in one read) and stopped at the first reporter that is not gone by the
    same rule: one block when the lowest reporter lives, instead of every host's reports and every
    lease key. Past `blocks_alone` blocks of gone reporters: `coordinator_of` the full read."""
    for block in range(upto // HOST_BLOCK + 1):
        if block >= blocks_alone:
            return coordinator_of(coord, coord.read_reports(generation), members, host)
        reports = coord.block_reports(generation, block)
        remote = [rep.incarnation_id for rep in reports.values() if rep.host != host]
        expired = coord.expired(remote) if remote else frozenset()
        for r in sorted(reports):
            rep = reports[r]
            if rep.host == host:
                gone = member_liveness(rep.pid, members[r].start_time if r in members else 0.0) == "gone"
            else:
                gone = rep.incarnation_id in expired
            if not gone:
                return r
    return None


def member_liveness(pid: int, start_time: float) -> Liveness:
    """'gone', 'stopped' (SIGSTOP / traced) or 'running' for this exact process (pid + start time)."""
    return liveness(process_status(pid, start_time))
