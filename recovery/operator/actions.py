"""The operator actions of `gpu-recover`, and the driver they share.

Each action is usable alone and idempotent (running it twice does no more harm than once), takes
plain arguments, returns an `ActionResult` (`gpuguard.action/1`), and never goes through a shell or
imports torch. One module per action where it is more than a few lines: `abort.py` (a pure plan and
its execution), `restore.py`, `verify.py`; `diagnose` and `rendezvous` are here. The Slurm drain of
`gpu-doctor sweep --run-drain` is the doctor's (`doctor/drain.py`), imported here for the operator. Confirmation and the audit log live in
`run_action`, shared by the CLI and runbooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuguard.collectors.torchrun import gather
from gpuguard.diagnostics.torchrun_hazards import assess_facts
from gpuguard.doctor.drain import (  # the sweep's drain is the doctor's: the operator uses the same one
    DRAIN_PREFIX,
    drain_command,
    drain_command_line,
    drain_node,
    foreign_reason,
)
from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import EXIT_OK, EXIT_REFUSED, GpuguardError, RefusedError
from gpuguard.foundation.etcd import redact
from gpuguard.recovery.operator import audit
from gpuguard.recovery.operator.abort import abort, describe_abort
from gpuguard.recovery.operator.ledger_facts import read_active_generation
from gpuguard.recovery.operator.restore import restore
from gpuguard.recovery.operator.result import SCHEMA, ActionResult
from gpuguard.recovery.operator.verify import verify
from gpuguard.recovery.rendezvous import state as rdzv
from gpuguard.recovery.snapshots.store import list_snapshots

__all__ = [
    "ACTIONS",
    "DRAIN_PREFIX",
    "MUTATING",
    "SCHEMA",
    "ActionResult",
    "describe_abort",
    "diagnose",
    "drain_command",
    "drain_command_line",
    "drain_node",
    "foreign_reason",
    "read_rendezvous",
    "rendezvous",
    "run_action",
]

MUTATING = frozenset({"abort", "rendezvous", "restore"})


# --- diagnose ----------------------------------------------------------------------------------


def diagnose(job_dir: Path | None, *, init_timeout_s: float = 60.0) -> ActionResult:
    """Hazards + verdict of the job (orphaned | hung | dead | healthy | unknown) and its active generation."""
    assessment = assess_facts(gather(job_dir), now=time.time(), init_timeout_s=init_timeout_s)
    generation = read_active_generation(job_dir)[0] if job_dir is not None else None
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


# --- shared driver: confirmation + audit -------------------------------------------------------


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
    (exit 4) and nothing is changed. What is recorded: every mutating action that is not a dry run,
    and every step of a runbook run (`run_id`: its results are the run's record, for resumption).
    A read-only action on its own (`verify`, `diagnose`) writes nothing, the audit log included. The
    audit log is checked writable before anything is done: an action never acts, then fails to say so.
    """

    # the audit log never holds a password: an etcd URL's credentials are redacted (`user:***@`)
    args = {k: (str(v) if isinstance(v, Path) else redact(v) if isinstance(v, str) else v) for k, v in kwargs.items()}
    audited = job_dir is not None and not dry_run and (name in MUTATING or run_id is not None) and job_dir.is_dir()

    def record(outcome: str, code: int, detail: Mapping[str, Any]) -> None:
        if audited and job_dir is not None:
            audit.append(
                job_dir, audit.new_record(name, outcome, code, args=args, run_id=run_id, step=step, detail=detail)
            )

    if audited and job_dir is not None:
        audit.check_writable(job_dir)
    if name in MUTATING and not dry_run and not yes:
        if confirm is None or not confirm(_describe(name, fn, kwargs)):
            why = "not confirmed" if confirm is not None else "no terminal to confirm on: pass --yes (or --dry-run)"
            record("refused", EXIT_REFUSED, {"why": why})
            raise RefusedError(f"{name} refused: {why}")
    try:
        result = fn(**kwargs, dry_run=dry_run) if name in MUTATING else fn(**kwargs)
    except GpuguardError as exc:
        record("error", exc.exit_code, {"error": str(exc)})
        raise
    record(result.outcome, result.exit_code, {"summary": result.summary, **result.details})
    return result


ACTIONS: dict[str, Callable[..., ActionResult]] = {
    "diagnose": diagnose,
    "abort": abort,
    "rendezvous": rendezvous,
    "restore": restore,
    "verify": verify,
}
