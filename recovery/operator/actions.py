"""The operator actions of `gpu-recover`: diagnose, abort, rendezvous, restore, verify; and the Slurm
drain of `gpu-doctor sweep --run-drain`.

Each is usable alone and idempotent (running it twice does no more harm than once), takes plain
arguments, returns an `ActionResult` (`gpuguard.action/1`), and never goes through a shell or
imports torch. Confirmation and the audit log live in `run_action`, shared by the CLI and runbooks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.collectors.torchrun import gather
from gpuguard.diagnostics.torchrun_hazards import assess_facts
from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TEMPFAIL,
    DataError,
    GpuguardError,
    NoInputError,
    PermissionDeniedError,
    RefusedError,
    UnavailableError,
    UsageError,
)
from gpuguard.foundation.identity import (
    ALIVE_STATES,
    JobProcessClaim,
    check_job_process,
    process_status,
    send_signal_checked,
)
from gpuguard.foundation.jobdir import iter_incarnations
from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.job import ledger_url, open_job_ledger
from gpuguard.generation.keys import load_key
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.verify import verify_ledger
from gpuguard.recovery.operator import audit
from gpuguard.recovery.rendezvous import state as rdzv
from gpuguard.recovery.snapshots import store as snapshot
from gpuguard.recovery.snapshots.store import list_snapshots

SCHEMA = "gpuguard.action/1"
MUTATING = frozenset({"abort", "rendezvous", "restore"})


@dataclass
class ActionResult:
    action: str
    outcome: str  # done | noop | dry-run | refused | failed | coalesced | already-advanced | timeout
    exit_code: int
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "action": self.action,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "dry_run": self.dry_run,
            "summary": self.summary,
            "details": self.details,
        }


# --- diagnose ----------------------------------------------------------------------------------


def diagnose(job_dir: Path | None, *, init_timeout_s: float = 60.0) -> ActionResult:
    """Hazards + verdict of the job (orphaned | hung | dead | healthy | unknown) and its active generation."""
    assessment = assess_facts(gather(job_dir), now=time.time(), init_timeout_s=init_timeout_s)
    generation = _active_generation(job_dir) if job_dir is not None else None
    snapshots = 0
    if job_dir is not None:
        snapshots = len(list_snapshots(jobdir.snapshot_root(job_dir)))
    verdict = assessment.verdict
    details = {
        "verdict": verdict,
        "generation": generation,
        "live_workers": assessment.live_workers,
        "snapshots": snapshots,
        "hazards": [h.to_json() for h in assessment.hazards],
        "notes": list(assessment.notes),
    }
    summary = f"verdict {verdict}; {len(assessment.hazards)} hazard(s); {assessment.live_workers} live worker(s)"
    return ActionResult("diagnose", "done", assessment.exit_code, summary, details)


def _active_generation(job_dir: Path) -> int | None:
    return _read_active_generation(job_dir)[0]


def _read_active_generation(job_dir: Path, timeout_s: float = 5.0) -> tuple[int | None, str | None]:
    """(active generation, why it could not be read): (None, None) when the job has no ledger at all.

    The ledger is wherever `init` put it (`<job-dir>/ledger/`, `ledger.url`, $GPUGUARD_LEDGER).
    """
    try:
        if ledger_url(job_dir) is None and not jobdir.ledger_dir(job_dir).exists():
            return None, None
        with open_job_ledger(job_dir, timeout=timeout_s) as ledger:
            cert = ledger.active()
    except GpuguardError as exc:
        return None, str(exc)
    if cert is None:
        return None, "the ledger holds no valid certificate"
    return cert.generation, None


# --- abort -------------------------------------------------------------------------------------


def abort(
    job_dir: Path,
    *,
    generation: int | None = None,
    ranks: tuple[int, ...] = (),
    grace_s: float = 10.0,
    include_active: bool = False,
    dry_run: bool = False,
) -> ActionResult:
    """Terminate the recorded workers (SIGTERM, grace, SIGKILL) and prove every one of them is gone.

    A process is signalled only when it is proven to be the recorded worker
    (`foundation.identity.check_job_process`: pid, start time, uid, the job's torchrun run id in its
    own environment, its parent agent); a reused pid is reported as gone, anything else that does not
    match is reported "not the job's" and left alone. An unreadable record is an unverified worker,
    so it can never turn into a quiescence proof. `generation` limits it to incarnations of that
    generation or older (records without a generation count as old); `ranks` to those ranks. The
    active generation's workers (the ledger's active certificate) are left alone unless
    `include_active`: the command is for the old generation's leftovers, not the running job.
    """

    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    active, ledger_problem = _read_active_generation(job_dir)
    try:  # a worker launched with another GPUGUARD_JOB_ID is not ours; an unreadable job.json checks nothing
        job = jobdir.read_job(job_dir)
    except GpuguardError:
        job = None
    job_id = job.job_id if job is not None else None
    records = []
    unknown: list[str] = []
    spared: list[str] = []
    procs: list[dict[str, Any]] = []  # the same evidence as objects, one per record (details.processes)

    def said(rec: Any, outcome: str, reason: str, signal_name: str | None = None) -> None:
        procs.append(
            {
                "rank": getattr(rec, "rank", None),
                "incarnation": getattr(rec, "incarnation_id", None),
                "pid": getattr(rec, "pid", None),
                "host": getattr(rec, "host", None),
                "generation": getattr(rec, "generation", None),
                "active": _is_active(getattr(rec, "generation", None), active),
                "outcome": outcome,
                "signal": signal_name,
                "reason": reason,
            }
        )

    for rec in iter_incarnations(job_dir):
        if isinstance(rec, DataError):
            unknown.append(f"unreadable incarnation record, not verified: {rec}")
            said(None, "unreadable", str(rec))
        elif (generation is None or rec.generation is None or rec.generation <= generation) and (
            not ranks or rec.rank in ranks
        ):
            who = f"rank {rec.rank} incarnation {rec.incarnation_id} pid {rec.pid} on {rec.host or '?'}"
            if not include_active and _is_active(rec.generation, active):
                spared.append(
                    f"{who}: generation {rec.generation} is the ACTIVE generation: left alone "
                    "(--include-active to abort it)"
                )
                said(rec, "left-alone", "the active generation (--include-active to abort it)")
                continue
            if not include_active and ledger_problem is not None and rec.generation is not None:
                # which generation is active is unknown: this one may be the running job's
                spared.append(
                    f"{who}: generation {rec.generation} may be the active one (ledger: {ledger_problem}): "
                    "left alone (--include-active to abort it)"
                )
                said(rec, "left-alone", f"may be the active generation (ledger: {ledger_problem})")
                continue
            records.append(rec)
    host = os.uname().nodename
    targets: list[tuple[Any, Any]] = []
    evidence: list[str] = []
    unverified_ids: set[str] = set()
    for rec in records:
        who = f"rank {rec.rank} incarnation {rec.incarnation_id} pid {rec.pid}"
        if rec.host and rec.host not in (host, _hostname()):
            unknown.append(f"{who} on {rec.host}: not on this host, not verified")
            unverified_ids.add(rec.incarnation_id)
            said(rec, "unverified", "not on this host")
            continue
        claim = JobProcessClaim(
            rec.pid, rec.start_time, uid=rec.uid, run_id=rec.run_id, agent_pid=rec.agent_pid, job_id=job_id
        )
        check = check_job_process(claim)
        if check.verdict == "job":
            targets.append((rec, check.process))
        elif check.verdict == "gone":
            suffix = ": not signalled" if "newer process" in check.reason else ""
            evidence.append(f"{who}: gone ({check.reason}{suffix})")
            said(rec, "gone", check.reason)
        elif check.verdict == "not-the-job":
            unknown.append(f"{who}: alive but not the job's ({check.reason}): not signalled")
            unverified_ids.add(rec.incarnation_id)
            said(rec, "not-the-job", check.reason)
        else:
            unknown.append(f"{who}: cannot be verified ({check.reason}): not signalled")
            unverified_ids.add(rec.incarnation_id)
            said(rec, "unverified", check.reason)
    if dry_run:
        plan = [f"rank {r.rank} pid {r.pid}: would SIGTERM, then SIGKILL after {grace_s:g} s" for r, _ in targets]
        for r, _ in targets:
            said(r, "would-terminate", f"proven the job's: SIGTERM, then SIGKILL after {grace_s:g} s")
        return ActionResult(
            "abort",
            "dry-run",
            EXIT_OK,
            f"would terminate {len(targets)} process(es)",
            {
                "would_terminate": plan,
                "targets": [
                    {
                        "host": r.host or _hostname(),
                        "pid": r.pid,
                        "rank": r.rank,
                        "generation": r.generation,
                        "active": _is_active(r.generation, active),
                    }
                    for r, _ in targets
                ],
                "active_generation": active,
                "grace_s": grace_s,
                "evidence": evidence,
                "unverified": unknown,
                "left_alone": spared,
                "processes": procs,
            },
            dry_run=True,
        )
    t0 = time.monotonic()
    for rec, _ in targets:
        _signal(rec, signal.SIGTERM)
    alive = _wait_gone(targets, grace_s)
    killed = {rec.pid for rec, _ in alive}
    for rec, _ in alive:
        _signal(rec, signal.SIGKILL)
    still = _wait_gone(alive, 5.0)
    for rec, _ in targets:
        how = "SIGKILL" if rec.pid in killed else "SIGTERM"
        state = process_status(rec.pid, rec.start_time)
        if state in ALIVE_STATES:
            evidence.append(f"rank {rec.rank} incarnation {rec.incarnation_id} pid {rec.pid}: STILL ALIVE after {how}")
            said(rec, "still-alive", f"still {state} after {how}", how)
        else:
            evidence.append(
                f"rank {rec.rank} incarnation {rec.incarnation_id} pid {rec.pid}: terminated by {how} ({state})"
            )
            said(rec, "terminated", str(state), how)
    quiescent = not still and not unknown
    evidence_file = _write_quiescence(
        job_dir,
        records,
        unknown_ids=unverified_ids,
        alive_ids={rec.incarnation_id for rec, _ in still},
    )
    details = {
        "terminated": [r.pid for r, _ in targets],
        "killed_after_grace": sorted(killed),
        "evidence": evidence,
        "unverified": unknown,
        # "proved" covers every recorded incarnation; with the active generation left running it cannot
        "quiescence": ("proved" if not spared else "active-running") if quiescent else "unknown",
        "left_alone": spared,
        "processes": procs,
        "evidence_file": str(evidence_file),
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    if still:
        return ActionResult(
            "abort",
            "failed",
            EXIT_CRITICAL,
            f"{len(still)} process(es) survived SIGKILL: {sorted(r.pid for r, _ in still)}",
            details,
        )
    outcome = "done" if targets else "noop"
    summary = (
        f"terminated {len(targets)} process(es); every recorded incarnation is gone"
        if quiescent
        else f"terminated {len(targets)} process(es); {len(unknown)} incarnation(s) could not be verified"
    )
    if spared:
        summary += f"; {len(spared)} incarnation(s) of the active generation left alone (--include-active)"
        if quiescent:
            summary = summary.replace("every recorded incarnation is gone", "every old incarnation is gone")
    return ActionResult("abort", outcome, EXIT_OK, summary, details)


def _is_active(record_generation: int | None, active: int | None) -> bool:
    """A record of the active generation (or one newer than the ledger knows: being activated)."""
    return active is not None and record_generation is not None and record_generation >= active


def describe_abort(plan: ActionResult) -> str:
    """The abort confirmation in words: each process (host, pid, rank, generation) and the signals."""
    targets = plan.details.get("targets") or []
    grace = plan.details.get("grace_s", 10.0)
    lines = [
        f"abort will send SIGTERM to {len(targets)} process(es), then SIGKILL to any still alive after {grace:g} s:"
        if targets
        else "abort finds no process of the job to signal:"
    ]
    for t in targets:
        gen = "-" if t["generation"] is None else str(t["generation"])
        mark = "  (ACTIVE generation)" if t["active"] else ""
        lines.append(f"  host {t['host']}  pid {t['pid']}  rank {t['rank']}  generation {gen}{mark}")
    for line in (*(plan.details.get("left_alone") or ()), *(plan.details.get("unverified") or ())):
        lines.append(f"  not signalled: {line}")
    lines.append("Proceed?")
    return "\n".join(lines)


def _describe(name: str, fn: Callable[..., ActionResult], kwargs: Mapping[str, Any]) -> str:
    """What a mutating action is about to do, as a person reads it (never a Python dict)."""
    if name == "abort":
        return describe_abort(fn(**kwargs, dry_run=True))
    shown = ", ".join(
        f"{k.replace('_', ' ')} {v if not isinstance(v, (tuple, list)) else ' '.join(map(str, v)) or '-'}"
        for k, v in kwargs.items()
        if v is not None and v != ()
    )
    return f"{name}: {shown}. Proceed?"


def _write_quiescence(job_dir: Path, records: list[Any], *, unknown_ids: set[str], alive_ids: set[str]) -> Path:
    """`coord/quiescence-abort-<ns>.json`: which incarnations this host saw gone (pid + create time), for
    whoever certifies the next generation (e.g. a drained node's workers no new member can check)."""

    gone = [r.incarnation_id for r in records if r.incarnation_id not in unknown_ids | alive_ids]
    path = jobdir.coord_dir(job_dir) / f"quiescence-abort-{time.time_ns()}.json"
    jobdir.atomic_write_json(
        path,
        {
            "schema": "gpuguard.quiescence/1",
            "host": _hostname(),
            "time": time.time(),
            "gone": gone,
            "alive": sorted(alive_ids),
            "unverified": sorted(unknown_ids),
        },
    )
    return path


def _wait_gone(targets: list[tuple[Any, Any]], timeout: float) -> list[tuple[Any, Any]]:
    """Poll until every target is gone or a zombie (its parent may reap it later); return the rest."""
    end = time.monotonic() + timeout
    while True:
        rest = [(rec, proc) for rec, proc in targets if process_status(rec.pid, rec.start_time) in ALIVE_STATES]
        if not rest or time.monotonic() >= end:
            return rest
        time.sleep(0.05)


def _hostname() -> str:
    return socket.gethostname()


def _signal(rec: Any, sig: int) -> None:
    """`sig` to exactly the recorded process (`identity.send_signal_checked`: never a reused pid)."""
    if send_signal_checked(rec.pid, rec.start_time, sig) == "denied":
        raise PermissionDeniedError(f"pid {rec.pid}: not allowed to send signal {sig}")


# --- rendezvous --------------------------------------------------------------------------------


def rendezvous(
    job_dir: Path | None,
    *,
    endpoint: str | None = None,
    run_id: str | None = None,
    deadline_s: float = 30.0,
    expect_round: int | None = None,
    dry_run: bool = False,
    backend: str | None = None,
    conf: str | None = None,
) -> ActionResult:
    """Force exactly one new rendezvous round (concurrent callers coalesce on one), c10d or etcd."""

    ep = rdzv.find_endpoint(endpoint=endpoint, run_id=run_id, job_dir=job_dir, backend=backend, conf=conf)
    result = rdzv.trigger_once(ep, deadline_s=deadline_s, expect_round=expect_round, dry_run=dry_run)
    details = {"endpoint": ep.to_json(), **result.to_json()}
    outcome = {"triggered": "done"}.get(result.outcome, result.outcome)
    summary = {
        "triggered": f"round {result.round_before} -> {result.round_after} (one new rendezvous round)",
        "coalesced": f"joined a concurrent trigger: round {result.round_before} -> {result.round_after}",
        "already-advanced": f"round already advanced to {result.round_after}: nothing to do",
        "dry-run": f"would force round {result.round_before} -> {result.round_before + 1}",
    }[result.outcome]
    if result.outcome == "triggered" and result.round_after != result.round_before + 1:
        summary += f" (WARNING: {result.round_after - result.round_before} rounds seen)"
    return ActionResult("rendezvous", outcome, EXIT_OK, summary, details, dry_run=dry_run)


def read_rendezvous(
    job_dir: Path | None,
    *,
    endpoint: str | None = None,
    run_id: str | None = None,
    backend: str | None = None,
    conf: str | None = None,
    rounds: int = 16,
) -> ActionResult:
    """The decoded state, and the last `rounds` rounds with the generation bound to each."""

    ep = rdzv.find_endpoint(endpoint=endpoint, run_id=run_id, job_dir=job_dir, backend=backend, conf=conf)
    state, bound = rdzv.read_with_rounds(ep, rounds=rounds)
    return ActionResult(
        "rendezvous-state",
        "done",
        EXIT_OK,
        f"run {ep.run_id!r} round {state.round} ({'complete' if state.complete else 'in progress'}) at {ep.where()}",
        {"endpoint": ep.to_json(), "state": state.to_json(), "rounds": bound},
    )


# --- restore -----------------------------------------------------------------------------------


def restore(
    job_dir: Path,
    *,
    step: int | None = None,
    max_tries: int = 3,
    snapshot_root: Path | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Pin the newest complete, verified state at or before the committed frontier (and `step`).

    Corrupt or incomplete candidates are rejected with the reason and the next older one is tried,
    at most `max_tries` times. The choice is written to `<job-dir>/restore.json` for the runtime.
    `snapshot_root`: where the job keeps snapshots/ and checkpoints/ (`jobdir.snapshot_root`: this,
    else $GPUGUARD_SNAPSHOT_ROOT, else the job dir).
    """

    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    if max_tries < 1:
        raise UsageError("--max-tries must be at least 1")
    frontier, source = _frontier(job_dir)
    bound = step if frontier is None else (frontier if step is None else min(step, frontier))
    root = jobdir.snapshot_root(job_dir, snapshot_root)
    if not root.is_dir():
        raise NoInputError(f"{root}: no such snapshot root")
    selection = snapshot.select_restorable(root, bound, max_tries=max_tries)
    details: dict[str, Any] = {
        "frontier": frontier,
        "frontier_source": source,
        "limit": bound,
        "snapshot_root": str(root),
        **selection.to_dict(),
    }
    if selection.chosen is None:
        if not selection.rejected:
            raise NoInputError(f"{root}: no snapshot or checkpoint to restore")
        return ActionResult(
            "restore",
            "failed",
            EXIT_CRITICAL,
            f"no complete, verified state at or before step {bound}: {len(selection.rejected)} candidate(s) rejected",
            details,
            dry_run=dry_run,
        )
    chosen = selection.chosen
    pin = jobdir.RestorePin(
        chosen.step,
        str(chosen.path),
        chosen.kind,
        chosen.generation,
        chosen.manifest_digest,
        chosen.state_digest,
        pinned_at=time.time(),
    )
    try:
        current = jobdir.read_restore_pin(job_dir)
    except GpuguardError:
        current = None
    summary = f"step {chosen.step} ({chosen.kind}, manifest {str(chosen.manifest_digest)[:12]})"
    # what the pin changes, in words: the next activation's bound (`activation.restore_bound`)
    change = f"the next generation starts from step {chosen.step}"
    if frontier is None:
        change += f" (no frontier limit to compare with: {source})"
    elif chosen.step < frontier:
        change += f" instead of the frontier limit, step {frontier}"
    else:
        change += " (the frontier limit itself: the pin fixes which copy)"
    details["effect"] = change + " (used by the next activation only; a pin never moves the frontier forward)"
    summary = f"{summary}: {details['effect']}"
    if current is not None and current.choice() == pin.choice():
        return ActionResult("restore", "noop", EXIT_OK, f"already pinned: {summary}", details, dry_run=dry_run)
    if dry_run:
        return ActionResult("restore", "dry-run", EXIT_OK, f"would pin {summary}", details, dry_run=True)
    jobdir.write_restore_pin(job_dir, pin)
    return ActionResult("restore", "done", EXIT_OK, f"pinned {summary}", details)


def _frontier(job_dir: Path) -> tuple[int | None, str]:
    """The newest step the next generation may start from (the runtime's own rule: `frontier_limit`)."""
    if not jobdir.ledger_dir(job_dir).exists():
        return None, "none (no ledger: bounded by --step only)"

    with open_ledger(job_dir) as ledger:
        cert = ledger.active()
        if cert is None:
            return None, "none (no active certificate)"
        committed = ledger.last_committed_by_all(cert.generation) if cert.members else None
    return frontier_limit(cert, committed), f"generation {cert.generation} (committed by all: {committed})"


# --- verify ------------------------------------------------------------------------------------


def verify(
    job_dir: Path,
    *,
    newer_than: int | None = None,
    timeout_s: float = 60.0,
    poll_s: float = 0.5,
    ledger_url: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ActionResult:
    """Wait (bounded) for an active certificate newer than `newer_than`, then verify its chain."""

    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    end = time.monotonic() + timeout_s
    while True:
        with open_ledger(job_dir, ledger_url) as ledger:
            cert = ledger.active()
            if cert is not None and (newer_than is None or cert.generation > newer_than):
                report = verify_ledger(ledger, load_key(job_dir), generation=cert.generation)
                break
        if time.monotonic() >= end:
            want = "active certificate" if newer_than is None else f"a generation newer than {newer_than}"
            raise UnavailableError(f"no {want} within {timeout_s:g} s")
        sleep(poll_s)
    details = {
        "generation": cert.generation,
        "certificate_digest": cert.digest(),
        "reason": cert.reason,
        "members": len(cert.members),
        "frontier_step": cert.frontier.step,
        "quiescence": cert.quiescence,
        "findings": [str(f) for f in report.findings],
    }
    if report.findings:
        return ActionResult(
            "verify",
            "failed",
            EXIT_CRITICAL,
            f"generation {cert.generation}: {len(report.findings)} finding(s): {report.findings[0]}",
            details,
        )
    return ActionResult(
        "verify",
        "done",
        EXIT_OK,
        f"generation {cert.generation} verified ({len(cert.members)} members, frontier step {cert.frontier.step})",
        details,
    )


# --- drain (Slurm) -----------------------------------------------------------------------------

DRAIN_PREFIX = "gpu-doctor:"  # every Reason= gpu-doctor sets starts with this: a drain it may own
_REASON_RE = re.compile(r"\bReason=(.*?)(?: \w+=|$)")


def drain_command(node: str, summary: str) -> list[str]:
    """`scontrol update NodeName=<node> State=DRAIN Reason=gpu-doctor: <summary>` as an argv."""
    reason = f"{DRAIN_PREFIX} {summary}"[:200].replace("\n", " ")
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def drain_command_line(node: str, summary: str) -> str:
    """`drain_command` as a line to print and paste: quoted with `shlex.join` (the reason has spaces,
    and a summary from a log may hold `;`, `$(...)` or quotes)."""
    return shlex.join(drain_command(node, summary))


def foreign_reason(show_output: str) -> str | None:
    """The Reason= in `scontrol show node <node> -o` output when someone other than gpu-doctor set it.

    None when there is no reason (`(null)` or empty) or it is gpu-doctor's own: then a drain may be set.
    """
    match = _REASON_RE.search(show_output or "")
    if match and match.group(1) not in ("(null)", "") and not match.group(1).startswith(DRAIN_PREFIX):
        return match.group(1)
    return None


def drain_node(node: str, summary: str, *, timeout_s: float = 10.0) -> ActionResult:
    """Drain `node` in Slurm with `drain_command`, never through a shell.

    A node that already carries a reason someone else set (an admin's drain, a maintenance) is left
    alone: outcome `refused`. The summary is the one line the sweep reports: `drained`, `not run: ...`
    or `failed: ...`.
    """
    command = drain_command(node, summary)
    details: dict[str, Any] = {"node": node, "command": command}

    def result(outcome: str, code: int, text: str) -> ActionResult:
        return ActionResult("drain", outcome, code, text, details)

    exe = shutil.which(command[0])
    if exe is None:
        return result("failed", EXIT_CRITICAL, "not run: scontrol is not installed")
    try:
        show = subprocess.run(
            [exe, "show", "node", node, "-o"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        theirs = foreign_reason(show.stdout or "")
        if theirs is not None:
            return result(
                "refused", EXIT_REFUSED, f"not run: node already has a reason set by someone else ({theirs[:60]})"
            )
        proc = subprocess.run(
            [exe, *command[1:]],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return result("timeout", EXIT_TEMPFAIL, f"failed: scontrol timed out after {timeout_s:g} s")
    except OSError as exc:
        return result("failed", EXIT_CRITICAL, f"failed: {exc}")
    if proc.returncode == 0:
        return result("done", EXIT_OK, "drained")
    err = (proc.stderr or "").strip().splitlines()
    return result("failed", EXIT_CRITICAL, f"failed: exit {proc.returncode} {err[0] if err else ''}".strip())


# --- shared driver: confirmation + audit -------------------------------------------------------


def run_action(
    name: str,
    fn: Callable[..., ActionResult],
    kwargs: Mapping[str, Any],
    *,
    job_dir: Path | None,
    dry_run: bool,
    yes: bool,
    confirm: Callable[[str], bool] | None,
    run_id: str | None = None,
    step: str | None = None,
) -> ActionResult:
    """Ask (or require --yes) for a mutating action, run it, append the audit record.

    `confirm` is None when no terminal is attached: then a mutating action without --yes is refused
    (exit 4) and nothing is changed. Dry runs change nothing, the audit log included.
    """

    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in kwargs.items()}
    if name in MUTATING and not dry_run and not yes:
        if confirm is None or not confirm(_describe(name, fn, kwargs)):
            why = "not confirmed" if confirm is not None else "no terminal to confirm on: pass --yes (or --dry-run)"
            if job_dir is not None and job_dir.is_dir():
                audit.append(
                    job_dir,
                    audit.new_record(
                        name, "refused", EXIT_REFUSED, args=args, run_id=run_id, step=step, detail={"why": why}
                    ),
                )
            raise RefusedError(f"{name} refused: {why}")
    try:
        result = fn(**kwargs, dry_run=dry_run) if name in MUTATING else fn(**kwargs)
    except GpuguardError as exc:
        if job_dir is not None and job_dir.is_dir() and not dry_run:
            audit.append(
                job_dir,
                audit.new_record(
                    name, "error", exc.exit_code, args=args, run_id=run_id, step=step, detail={"error": str(exc)}
                ),
            )
        raise
    if job_dir is not None and job_dir.is_dir() and not dry_run:
        audit.append(
            job_dir,
            audit.new_record(
                name,
                result.outcome,
                result.exit_code,
                args=args,
                run_id=run_id,
                step=step,
                detail={"summary": result.summary, **result.details},
            ),
        )
    return result


ACTIONS: dict[str, Callable[..., ActionResult]] = {
    "diagnose": diagnose,
    "abort": abort,
    "rendezvous": rendezvous,
    "restore": restore,
    "verify": verify,
}
