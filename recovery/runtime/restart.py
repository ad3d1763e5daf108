"""The restart path's activation protocol, the I/O around the pure plan (`recovery.runtime.activation`).

Every member publishes a hello in the attempt's store (its incarnation, and what it proved about
the old incarnations on its host); rank 0, the coordinator, gathers the hellos and the ledger's
facts (the parent certificate, the commit record, the operator's pin, the verified snapshots, the
leases of old incarnations on hosts no member is on), asks `plan_activation` for the certificate,
issues it, activates it with the ledger's compare-and-swap and publishes its digest (or why not).
Protocol: docs/formats/activation.md.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.gcpause import gc_paused
from gpuguard.foundation.identity import same_process
from gpuguard.generation.certificate import issue
from gpuguard.generation.job import init_job, issuer
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
from gpuguard.recovery.runtime.attempt import record_round
from gpuguard.recovery.runtime.context import Context
from gpuguard.recovery.runtime.housekeeping import after_activation
from gpuguard.recovery.runtime.rank_state import RankState
from gpuguard.recovery.runtime.refusals import ActivationRefused
from gpuguard.recovery.snapshots.store import Selection, SnapshotInfo

Wait = Callable[[Any, str], dict[str, Any]]


def hello(ctx: Context, quiesce_wait_s: float) -> Hello:
    """What this member publishes: its incarnation, and which old incarnations on its host are gone
    (waiting, bounded, for each to exit) or still running."""
    gone: list[str] = []
    alive: list[str] = []
    host = socket.gethostname()
    try:
        parent = ctx.ledger().active()
    except GpuguardError:
        parent = None
    if parent is not None:
        deadline = time.monotonic() + quiesce_wait_s
        for m in parent.members:
            inc = m.incarnation
            if inc.host != host:
                continue
            while same_process(inc.pid, inc.start_time) and time.monotonic() < deadline:
                time.sleep(0.05)
            (alive if same_process(inc.pid, inc.start_time) else gone).append(inc.id)
    return Hello(ctx.rank, ctx.incarnation.to_dict(), host, tuple(gone), tuple(alive))


class RestartCoordinator:
    """Rank 0 of a restart (see the module docstring)."""

    def __init__(self, ctx: Context, state: RankState, wait_json: Wait) -> None:
        self.ctx, self.state, self.wait_json = ctx, state, wait_json

    def coordinate(self, ns: Any, phases: dict[str, float]) -> None:
        """Publish `cert` = {generation, digest}, or {error} when no certificate could be activated."""
        try:
            cert = self._certify(ns, phases)
            ns.set("cert", json.dumps({"generation": cert.generation, "digest": cert.digest()}))
            # the round's binding (gpu-recover rendezvous --state): after publishing, no member waits for it
            record_round(self.ctx.attempt, cert.generation, cert.digest(), cert.job_id, self.ctx.log)
        except GpuguardError as exc:
            ns.set("cert", json.dumps({"error": str(exc)}))

    def _certify(self, ns: Any, phases: dict[str, float]) -> Any:
        ctx = self.ctx
        hellos = tuple(Hello.from_dict(self.wait_json(ns, f"hello/{r}")) for r in range(ctx.world_size))
        phases["hellos"] = time.time()
        problems = check_hellos(hellos, ctx.world_size)
        if problems:
            raise ActivationRefused("; ".join(problems))
        ledger = self._ledger()
        parent = ledger.active()
        if parent is None:
            raise ActivationRefused(
                f"the ledger holds {len(ledger.generations())} certificate(s) but no valid "
                "genesis: wrong signing key or tampered ledger"
            )
        expired, fenced = self._quiet_remote(parent, hellos)
        phases["leases"] = time.time()
        committed = ledger.last_committed_by_all(parent.generation) if parent.members else None
        pin = _restore_pin(ctx)  # `gpu-recover restore` chose a state: never past it
        frontiers = {c.generation: c.frontier.step for c in ledger.history()}

        def check(info: SnapshotInfo) -> str | None:
            return branch_problem(info.generation, info.step, frontiers, parent.generation)

        selection = self._restorable(restore_bound(parent, committed, pin), check)
        attempt = ctx.attempt
        with gc_paused():  # the plan and the signed certificate: compute only (foundation/gcpause.py)
            plan = plan_activation(
                ActivationFacts(
                    parent=parent,
                    hellos=hellos,
                    committed_by_all=committed,
                    selection=selection,
                    restore_pin=pin,
                    world_size=ctx.world_size,
                    attempt_token=attempt.token if attempt else "",
                    attempt_source=attempt.source if attempt else "",
                    restart_count=ctx.launch.restart_count,
                    rendezvous_round=attempt.round if attempt else None,
                    lease_expired=expired,
                    fenced=fenced,
                    rendezvous_participants=attempt.participants if attempt else (),
                )
            )
            version, more = self.state.certificate_facts(parent, selection, plan.choice.frontier, ctx.world_size)
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
                extra={**plan.extra, **more},
            )
        ledger.activate(cert, manifest_ok=True if plan.choice.frontier.state_manifest_digest else None)
        after_activation(ctx, ledger, parent.generation)
        if plan.consume_pin:  # used once: the next generation is bounded by its commits again
            jobdir.consume_restore_pin(ctx.job_dir, cert.generation)
        for line in plan.log_rejected:
            ctx.log(f"rejected {line}")
        return cert

    def _ledger(self) -> Any:
        """The ledger, initialised (genesis, generation 0) by the first coordinator of a new job."""
        ctx = self.ctx
        if not ctx.has_key():
            try:
                init_job(ctx.job_dir, url=ctx.ledger_url, job_id=ctx.job.job_id)
                ctx.log("initialised the ledger (genesis, generation 0)")
            except GpuguardError as exc:
                if exc.exit_code != 73:  # 73: someone initialised it first
                    raise
            ctx.forget_ledger()
        return ctx.ledger()

    def _quiet_remote(self, parent: Any, hellos: tuple[Hello, ...]) -> tuple[frozenset[str], frozenset[str]]:
        """Old incarnations on hosts no member is on (a lost host): (those whose lease already
        expired, those proved quiet by fencing). Next to an etcd ledger every sink such an
        incarnation could write to refuses its generation (docs/fencing.md), so nothing waits for its
        lease: it may still run until it fences itself, and nothing it does is seen."""
        ctx = self.ctx
        remote = unvouched(parent, hellos)
        if not remote or ctx.lease is None:  # one host (a directory ledger): the hellos vouch for all
            return frozenset(), frozenset()
        expired = ctx.coord.expired(remote)
        return expired, frozenset(remote) - expired

    def _restorable(self, bound: int, check: Callable[[SnapshotInfo], str | None]) -> Selection:
        """The newest verified state at or below `bound` that passes `check` (on the chain), skipping (a
        bounded number of) states a member already failed to load: the marks are on disk, the merge is pure."""
        root = self.ctx.snapshot_root
        selection = self.state.select(root, bound, check=check)
        for _ in range(MAX_UNRESTORABLE_SKIPS):
            chosen = selection.chosen
            if chosen is None or not jobdir.is_unrestorable(root, chosen.manifest_digest):
                break
            self.ctx.log(f"skipping step {chosen.step}: a member failed to load it before")
            selection = skip_unrestorable(selection, self.state.select(root, chosen.step - 1, check=check))
        return selection


def _restore_pin(ctx: Context) -> int | None:
    """The step `gpu-recover restore` pinned, if any; a malformed pin is ignored, and said."""
    try:
        pin = jobdir.read_restore_pin(ctx.job_dir)
    except GpuguardError as exc:
        ctx.log(f"ignoring {jobdir.restore_pin_path(ctx.job_dir)}: {exc}")
        return None
    return None if pin is None else pin.step
