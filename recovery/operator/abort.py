"""`gpu-recover abort`: terminate the old generations' workers and prove every one of them is gone.

Three parts, as the runtime's decisions are built (`activation.py`, `switch.py`):

- `gather_abort_facts` (I/O) reads the incarnation records with their file owners, the ledger's
  active generation and job.json's id, and probes every record of this host
  (`foundation.identity.check_job_process`: the proof comes from the live process, never from
  what the record says alone);
- `plan_abort` (pure) decides from those facts which processes to signal and what to report about
  every other record: left alone (the active generation), gone, not the job's, unverified,
  unreadable. `--dry-run` prints this plan and nothing else happens;
- `execute_abort` (I/O) sends SIGTERM, waits the grace, SIGKILLs what is left (each signal to
  exactly the recorded process: `identity.send_signal_checked`), writes the quiescence evidence
  and says what became of each target.

An unreadable record is an unverified worker, so it can never turn into a quiescence proof.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    DataError,
    GpuguardError,
    NoInputError,
    PermissionDeniedError,
)
from gpuguard.foundation.identity import (
    ALIVE_STATES,
    JobProcessCheck,
    JobProcessClaim,
    check_job_process,
    process_status,
    send_signal_checked,
)
from gpuguard.foundation.jobdir import IncarnationRecord
from gpuguard.recovery.operator.ledger_facts import read_active_generation
from gpuguard.recovery.operator.result import ActionResult

KILL_CONFIRM_S = 5.0  # after SIGKILL, how long a target may take to be gone before it is reported alive


# --- the facts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AbortRequest:
    """What the operator asked for."""

    generation: int | None = None  # only incarnations of this generation or older (None: any)
    ranks: tuple[int, ...] = ()  # only these ranks (empty: all)
    grace_s: float = 10.0
    include_active: bool = False


@dataclass(frozen=True)
class RecordFacts:
    """One incarnation record as found: the record (None: unreadable, with `problem`), whether it ran
    on this host, and the probe of its live process (None: not probed, on another host)."""

    record: IncarnationRecord | None
    problem: str | None = None
    here: bool = True
    check: JobProcessCheck | None = None


@dataclass(frozen=True)
class AbortFacts:
    request: AbortRequest
    records: tuple[RecordFacts, ...]
    active: int | None  # the ledger's active generation (None: no ledger or unreadable)
    ledger_problem: str | None = None  # why the active generation could not be read
    host: str = ""


# --- the plan (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessRow:
    """One record in `details.processes` (`gpuguard.action/1`): what abort did or would do with it."""

    rank: int | None
    incarnation: str | None
    pid: int | None
    host: str | None
    generation: int | None
    active: bool
    outcome: (
        str  # would-terminate | terminated | still-alive | gone | not-the-job | unverified | left-alone | unreadable
    )
    signal: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "pid": self.pid,
            "host": self.host,
            "generation": self.generation,
            "active": self.active,
            "outcome": self.outcome,
            "signal": self.signal,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class AbortPlan:
    """What `plan_abort` decided: the processes to signal and every other record's line."""

    targets: tuple[IncarnationRecord, ...]
    considered: tuple[IncarnationRecord, ...]  # every selected record (targets, gone, unverified): the evidence file
    rows: tuple[ProcessRow, ...]  # every record but the targets
    gone: tuple[str, ...] = ()  # evidence lines: selected records already gone
    unverified: tuple[str, ...] = ()
    left_alone: tuple[str, ...] = ()
    unverified_ids: frozenset[str] = field(default_factory=frozenset)
    active: int | None = None
    grace_s: float = 10.0
    host: str = ""

    def target_row(self, rec: IncarnationRecord, outcome: str, reason: str, sig: str | None = None) -> ProcessRow:
        return _row(rec, outcome, reason, self.active, sig)

    def to_dry_run(self) -> ActionResult:
        """The plan as `--dry-run` prints it (and the confirmation describes it): nothing is done."""
        how = f"SIGTERM, then SIGKILL after {self.grace_s:g} s"
        rows = [*self.rows, *(self.target_row(r, "would-terminate", f"proven the job's: {how}") for r in self.targets)]
        return ActionResult(
            "abort",
            "dry-run",
            EXIT_OK,
            f"would terminate {len(self.targets)} process(es)",
            {
                "would_terminate": [f"rank {r.rank} pid {r.pid}: would {how}" for r in self.targets],
                "targets": [
                    {
                        "host": r.host or self.host,
                        "pid": r.pid,
                        "rank": r.rank,
                        "generation": r.generation,
                        "active": is_active(r.generation, self.active),
                    }
                    for r in self.targets
                ],
                "active_generation": self.active,
                "grace_s": self.grace_s,
                "evidence": list(self.gone),
                "unverified": list(self.unverified),
                "left_alone": list(self.left_alone),
                "processes": [row.to_json() for row in rows],
            },
            dry_run=True,
        )


def is_active(record_generation: int | None, active: int | None) -> bool:
    """A record of the active generation (or one newer than the ledger knows: being activated)."""
    return active is not None and record_generation is not None and record_generation >= active


def _row(
    rec: IncarnationRecord | None, outcome: str, reason: str, active: int | None, sig: str | None = None
) -> ProcessRow:
    if rec is None:
        return ProcessRow(None, None, None, None, None, False, outcome, sig, reason)
    return ProcessRow(
        rec.rank,
        rec.incarnation_id,
        rec.pid,
        rec.host,
        rec.generation,
        is_active(rec.generation, active),
        outcome,
        sig,
        reason,
    )


def _who(rec: IncarnationRecord) -> str:
    return f"rank {rec.rank} incarnation {escape_newlines(rec.incarnation_id)} pid {rec.pid}"


def escape_newlines(text: object) -> str:
    """A record's string inside a line of the plan (and of the confirmation prompt, which is several
    lines): its newlines escaped, so a host or file name can never start a line of its own. The CLI
    escapes every other control character (`cli._app.safe_text`)."""
    return str(text).replace("\n", "\\x0a")


def plan_abort(facts: AbortFacts) -> AbortPlan:
    """Which recorded processes to signal, from the facts alone (no I/O, no clock).

    A record is a target only when its probe proved the live process the job's. Selection first
    (`request.generation`, `request.ranks`), then the active generation is left alone unless
    `include_active` (and so is any generation-stamped record while the active generation cannot be
    read: it may be the running job's), then a record on another host is unverified, then the probe
    decides: gone, not the job's, unverified, or a target.
    """
    req, active = facts.request, facts.active
    targets: list[IncarnationRecord] = []
    considered: list[IncarnationRecord] = []
    rows: list[ProcessRow] = []
    gone: list[str] = []
    unverified: list[str] = []
    left_alone: list[str] = []
    unverified_ids: set[str] = set()

    def unsure(rec: IncarnationRecord, line: str, outcome: str, reason: str) -> None:
        unverified.append(line)
        unverified_ids.add(rec.incarnation_id)
        rows.append(_row(rec, outcome, reason, active))

    for found in facts.records:
        rec = found.record
        if rec is None:
            unverified.append(f"unreadable incarnation record, not verified: {escape_newlines(found.problem)}")
            rows.append(_row(None, "unreadable", str(found.problem), active))
            continue
        if req.generation is not None and rec.generation is not None and rec.generation > req.generation:
            continue
        if req.ranks and rec.rank not in req.ranks:
            continue
        who = f"{_who(rec)} on {escape_newlines(rec.host or '?')}"
        if not req.include_active and is_active(rec.generation, active):
            left_alone.append(
                f"{who}: generation {rec.generation} is the ACTIVE generation: left alone (--include-active to abort it)"
            )
            rows.append(_row(rec, "left-alone", "the active generation (--include-active to abort it)", active))
            continue
        if not req.include_active and facts.ledger_problem is not None and rec.generation is not None:
            left_alone.append(
                f"{who}: generation {rec.generation} may be the active one (ledger: {facts.ledger_problem}): "
                "left alone (--include-active to abort it)"
            )
            rows.append(
                _row(rec, "left-alone", f"may be the active generation (ledger: {facts.ledger_problem})", active)
            )
            continue
        considered.append(rec)
        check = found.check
        if not found.here or check is None:
            unsure(
                rec,
                f"{_who(rec)} on {escape_newlines(rec.host)}: not on this host, not verified",
                "unverified",
                "not on this host",
            )
        elif check.verdict == "job":
            targets.append(rec)
        elif check.verdict == "gone":
            suffix = ": not signalled" if "newer process" in check.reason else ""
            gone.append(f"{_who(rec)}: gone ({check.reason}{suffix})")
            rows.append(_row(rec, "gone", check.reason, active))
        elif check.verdict == "not-the-job":
            unsure(
                rec,
                f"{_who(rec)}: alive but not the job's ({check.reason}): not signalled",
                "not-the-job",
                check.reason,
            )
        else:
            unsure(rec, f"{_who(rec)}: cannot be verified ({check.reason}): not signalled", "unverified", check.reason)
    return AbortPlan(
        tuple(targets),
        tuple(considered),
        tuple(rows),
        tuple(gone),
        tuple(unverified),
        tuple(left_alone),
        frozenset(unverified_ids),
        active,
        req.grace_s,
        facts.host,
    )


# --- gathering (I/O) ---------------------------------------------------------------------------


def this_host() -> frozenset[str]:
    return frozenset({os.uname().nodename, socket.gethostname()})


def gather_abort_facts(job_dir: Path, request: AbortRequest) -> AbortFacts:
    """Read the records (with their files' owners), the active generation, job.json's id; probe the
    live process of every record on this host."""
    active, ledger_problem = read_active_generation(job_dir)
    try:  # a worker launched with another GPUGUARD_JOB_ID is not ours; an unreadable job.json checks nothing
        job = jobdir.read_job(job_dir)
    except GpuguardError:
        job = None
    here = this_host()
    found: list[RecordFacts] = []
    for item in jobdir.iter_incarnation_files(job_dir):
        if isinstance(item, DataError):
            found.append(RecordFacts(None, str(item)))
            continue
        rec, owner = item
        on_host = not rec.host or rec.host in here
        check = None
        if on_host:
            claim = JobProcessClaim(
                rec.pid,
                rec.start_time,
                owner_uid=owner,
                uid=rec.uid,
                run_id=rec.run_id,
                agent_pid=rec.agent_pid,
                job_id=job.job_id if job is not None else None,
                job_dir=str(job_dir),
                incarnation_id=rec.incarnation_id,
            )
            check = check_job_process(claim)
        found.append(RecordFacts(rec, None, on_host, check))
    return AbortFacts(request, tuple(found), active, ledger_problem, socket.gethostname())


# --- execution (I/O) ---------------------------------------------------------------------------


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

    A process is signalled only when it is proven to be the job's (see the module docstring); the
    active generation's workers are left alone unless `include_active`: the command is for the old
    generation's leftovers, not the running job. `--dry-run` returns the plan and does nothing.
    """
    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    plan = plan_abort(gather_abort_facts(job_dir, AbortRequest(generation, tuple(ranks), grace_s, include_active)))
    return plan.to_dry_run() if dry_run else execute_abort(job_dir, plan)


def execute_abort(job_dir: Path, plan: AbortPlan) -> ActionResult:
    """Signal the plan's targets, wait, and report what became of each one (and of every other record)."""
    t0 = time.monotonic()
    for rec in plan.targets:
        _signal(rec, signal.SIGTERM)
    alive = _wait_gone(plan.targets, plan.grace_s)
    killed = {rec.pid for rec in alive}
    for rec in alive:
        _signal(rec, signal.SIGKILL)
    still = _wait_gone(alive, KILL_CONFIRM_S)
    evidence = list(plan.gone)
    rows = list(plan.rows)
    for rec in plan.targets:
        how = "SIGKILL" if rec.pid in killed else "SIGTERM"
        state = process_status(rec.pid, rec.start_time)
        if state in ALIVE_STATES:
            evidence.append(f"{_who(rec)}: STILL ALIVE after {how}")
            rows.append(plan.target_row(rec, "still-alive", f"still {state} after {how}", how))
        else:
            evidence.append(f"{_who(rec)}: terminated by {how} ({state})")
            rows.append(plan.target_row(rec, "terminated", str(state), how))
    quiescent = not still and not plan.unverified
    evidence_file = write_quiescence(
        job_dir,
        plan.considered,
        unknown_ids=plan.unverified_ids,
        alive_ids={rec.incarnation_id for rec in still},
    )
    details = {
        "terminated": [r.pid for r in plan.targets],
        "killed_after_grace": sorted(killed),
        "evidence": evidence,
        "unverified": list(plan.unverified),
        # "proved" covers every recorded incarnation; with the active generation left running it cannot
        "quiescence": ("proved" if not plan.left_alone else "active-running") if quiescent else "unknown",
        "left_alone": list(plan.left_alone),
        "processes": [row.to_json() for row in rows],
        "evidence_file": str(evidence_file),
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    if still:
        return ActionResult(
            "abort",
            "failed",
            EXIT_CRITICAL,
            f"{len(still)} process(es) survived SIGKILL: {sorted(r.pid for r in still)}",
            details,
        )
    return ActionResult("abort", "done" if plan.targets else "noop", EXIT_OK, _summary(plan, quiescent), details)


def _summary(plan: AbortPlan, quiescent: bool) -> str:
    n = len(plan.targets)
    if not quiescent:
        summary = f"terminated {n} process(es); {len(plan.unverified)} incarnation(s) could not be verified"
    elif plan.left_alone:
        summary = f"terminated {n} process(es); every old incarnation is gone"
    else:
        summary = f"terminated {n} process(es); every recorded incarnation is gone"
    if plan.left_alone:
        summary += f"; {len(plan.left_alone)} incarnation(s) of the active generation left alone (--include-active)"
    return summary


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
        lines.append(f"  host {escape_newlines(t['host'])}  pid {t['pid']}  rank {t['rank']}  generation {gen}{mark}")
    for line in (*(plan.details.get("left_alone") or ()), *(plan.details.get("unverified") or ())):
        lines.append(f"  not signalled: {line}")
    lines.append("Proceed?")
    return "\n".join(lines)


def write_quiescence(
    job_dir: Path, records: Iterable[IncarnationRecord], *, unknown_ids: Iterable[str], alive_ids: Iterable[str]
) -> Path:
    """`coord/quiescence-abort-<ns>.json`: which incarnations this host saw gone (pid + create time), for
    whoever certifies the next generation (e.g. a drained node's workers no new member can check)."""
    unknown, alive = set(unknown_ids), set(alive_ids)
    gone = [r.incarnation_id for r in records if r.incarnation_id not in unknown | alive]
    path = jobdir.quiescence_path(job_dir, time.time_ns())
    jobdir.atomic_write_json(
        path,
        {
            "schema": "gpuguard.quiescence/1",
            "host": socket.gethostname(),
            "time": time.time(),
            "gone": gone,
            "alive": sorted(alive),
            "unverified": sorted(unknown),
        },
    )
    return path


def _wait_gone(targets: Iterable[IncarnationRecord], timeout: float) -> list[IncarnationRecord]:
    """Poll until every target is gone or a zombie (its parent may reap it later); return the rest."""
    rest = list(targets)
    end = time.monotonic() + timeout
    while True:
        rest = [rec for rec in rest if process_status(rec.pid, rec.start_time) in ALIVE_STATES]
        if not rest or time.monotonic() >= end:
            return rest
        time.sleep(0.05)


def _signal(rec: IncarnationRecord, sig: int) -> None:
    """`sig` to exactly the recorded process (`identity.send_signal_checked`: never a reused pid)."""
    if send_signal_checked(rec.pid, rec.start_time, sig) == "denied":
        raise PermissionDeniedError(f"pid {rec.pid}: not allowed to send signal {sig}")
