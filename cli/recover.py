"""`gpu-recover`: drive recovery against a running torchrun job.

Each command is a thin wrapper over `gpuguard.recovery.operator.actions` (confirmation, audit log and the
`gpuguard.action/1` document are shared with the runbooks); `status` (registered by
`recover_status`) renders `gpuguard.recovery.operator.status`. Every command checks first that the job dir is
a gpuguard job (66 otherwise). No torch import here: only `demo` (registered by `recover_demo`) and
the in-job runtime import torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli import recover_demo, recover_status
from gpuguard.cli._app import console, emit_json, entry, job_dir_option, make_app, require_job, safe_line, safe_text
from gpuguard.cli._params import RUNBOOK_METAVAR
from gpuguard.cli._text import say as say_wrapped
from gpuguard.cli._text import short
from gpuguard.foundation.env import SNAPSHOT_ROOT_ENV
from gpuguard.foundation.errors import EXIT_OK

app = make_app(
    "gpu-recover",
    "Recover a torchrun job: abort, re-rendezvous, restore, verify; alone or as YAML runbooks.",
)
runbook_app = typer.Typer(help="YAML runbooks: list, show, run.", no_args_is_help=True)
app.add_typer(runbook_app, name="runbook")

_DRY = typer.Option(False, "--dry-run", help="Show what would be done; change nothing (not even the audit log).")
_YES = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (required without a terminal).")
_JSON = typer.Option(False, "--json", help="Print a gpuguard.action/1 JSON document.")


def _confirm() -> Callable[[str], bool] | None:
    """A terminal prompt, or None when stdin is not a terminal (then --yes is required)."""
    if not sys.stdin.isatty():
        return None
    return lambda question: typer.confirm(safe_text(f"gpu-recover: {question}"), default=False)


def _emit(result: Any, as_json: bool) -> int:
    if as_json:
        emit_json(result.to_json())
        return result.exit_code
    out = console()

    def say(text: str) -> None:
        say_wrapped(out, safe_line(text))

    say(f"{result.action}: {result.outcome}: {result.summary}")
    for key in ("evidence", "would_terminate", "left_alone", "unverified", "findings", "notes"):
        for line in result.details.get(key) or ():
            say(f"  {line}")
    for hazard in result.details.get("hazards") or ():
        say(f"  [{hazard['severity']}] {hazard['kind']}: {hazard['message']}")
    for rej in result.details.get("rejected") or ():
        say(f"  rejected step {rej['step']}: {rej['reason']}")
    return result.exit_code


def _act(name: str, kwargs: dict[str, Any], job_dir: Path | None, dry_run: bool, yes: bool, as_json: bool) -> int:
    from gpuguard.recovery.operator import actions

    if job_dir is not None:
        require_job(job_dir)  # a typo'd dir: 66 at once, no wait, nothing written there

    result = actions.run_action(
        name, actions.ACTIONS[name], kwargs, job_dir=job_dir, dry_run=dry_run, yes=yes, confirm=_confirm()
    )
    return _emit(result, as_json)


@app.command("abort")
def abort_cmd(
    job_dir: Path = job_dir_option(),
    generation: int | None = typer.Option(None, "--generation", help="Only incarnations of this generation or older."),
    rank: list[int] = typer.Option([], "--rank", help="Only these ranks (repeatable)."),
    grace: float = typer.Option(10.0, "--grace", min=0.0, help="Seconds between SIGTERM and SIGKILL."),
    include_active: bool = typer.Option(
        False,
        "--include-active",
        help="Also the ACTIVE generation's workers (the running job); default: old ones only.",
    ),
    dry_run: bool = _DRY,
    yes: bool = _YES,
    as_json: bool = _JSON,
) -> int:
    """Terminate the old generations' workers by PID (SIGTERM, grace, SIGKILL) and prove they are gone.

    Only processes proven to be the job's recorded workers are signalled. The active generation's
    workers are left alone unless --include-active.
    """
    return _act(
        "abort",
        {
            "job_dir": job_dir,
            "generation": generation,
            "ranks": tuple(rank),
            "grace_s": grace,
            "include_active": include_active,
        },
        job_dir,
        dry_run,
        yes,
        as_json,
    )


@app.command("rendezvous")
def rendezvous_cmd(
    job_dir: Path | None = job_dir_option(required=False),
    endpoint: str | None = typer.Option(
        None,
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="torchrun's --rdzv-endpoint: HOST[:PORT] (c10d) or HOST:PORT[,HOST:PORT...] (etcd, gpuguard backend).",
    ),
    run_id: str | None = typer.Option(None, "--run-id", help="torchrun's --rdzv-id (default: from the agent)."),
    backend: str | None = typer.Option(
        None,
        "--rdzv-backend",
        metavar="c10d|gpuguard",
        help="c10d or gpuguard (default: the live agent's; else gpuguard for several endpoints, c10d for one).",
    ),
    rdzv_conf: str | None = typer.Option(
        None,
        "--rdzv-conf",
        metavar="KEY=VALUE,...",
        help="gpuguard backend: torchrun's --rdzv-conf (key_prefix, protocol, ca_cert, ...; default: the live agent's).",
    ),
    expect_round: int | None = typer.Option(
        None, "--expect-round", help="Only trigger if the round is still N (idempotent retries)."
    ),
    deadline: float = typer.Option(30.0, "--deadline", min=1.0, help="Seconds to wait for the new round."),
    state: bool = typer.Option(False, "--state", help="Only read and print the rendezvous state (no change)."),
    dry_run: bool = _DRY,
    yes: bool = _YES,
    as_json: bool = _JSON,
) -> int:
    """Force exactly one new rendezvous round of the live job (concurrent calls coalesce).

    Works on torch's c10d backend (the agent's TCPStore) and on gpuguard's (etcd v3). --state reads
    only: the decoded state and the generation bound to each recent round.
    """
    if state:
        from gpuguard.recovery.operator import actions

        if job_dir is not None:
            require_job(job_dir)
        result = actions.read_rendezvous(job_dir, endpoint=endpoint, run_id=run_id, backend=backend, conf=rdzv_conf)
        if not as_json:
            st = result.details["state"]
            lines = [
                result.summary,
                f"  participants: {st['participants']}",
                f"  wait_list: {st['wait_list']}",
                "  rounds (newest first):",
            ]
            for b in result.details["rounds"]:
                bound = (
                    f"generation {b['generation']}, certificate {short(b['digest'])}"
                    if b["status"] == "certified"
                    else b["status"]
                )
                lines.append(f"    round {b['round']}: {bound}")
            out = console()
            for line in lines:
                say_wrapped(out, safe_line(line))
            return EXIT_OK
        return _emit(result, True)
    return _act(
        "rendezvous",
        {
            "job_dir": job_dir,
            "endpoint": endpoint,
            "run_id": run_id,
            "deadline_s": deadline,
            "expect_round": expect_round,
            "backend": backend,
            "conf": rdzv_conf,
        },
        job_dir,
        dry_run,
        yes,
        as_json,
    )


@app.command("restore")
def restore_cmd(
    job_dir: Path = job_dir_option(),
    step: int | None = typer.Option(None, "--step", min=0, help="Newest step acceptable (default: the frontier)."),
    max_tries: int = typer.Option(3, "--max-tries", min=1, max=100, help="Candidates verified before giving up."),
    snapshot_root: Path | None = typer.Option(
        None,
        "--snapshot-root",
        help=f"Where snapshots/ and checkpoints/ live when not in the job dir (shared storage; default: ${SNAPSHOT_ROOT_ENV}, else the job dir).",
    ),
    dry_run: bool = _DRY,
    yes: bool = _YES,
    as_json: bool = _JSON,
) -> int:
    """Pin the newest complete, verified state at or before the committed frontier."""
    kwargs = {"job_dir": job_dir, "step": step, "max_tries": max_tries, "snapshot_root": snapshot_root}
    return _act("restore", kwargs, job_dir, dry_run, yes, as_json)


@app.command("verify")
def verify_cmd(
    job_dir: Path = job_dir_option(),
    newer_than: int | None = typer.Option(None, "--newer-than", help="Wait for a generation newer than N."),
    timeout: float = typer.Option(60.0, "--timeout", min=0.0, help="Seconds to wait for the certificate."),
    ledger: str | None = typer.Option(None, "--ledger", metavar="URL", help="Ledger URL (default: the job dir)."),
    as_json: bool = _JSON,
) -> int:
    """Wait for the new generation's certificate (bounded) and verify it."""
    return _act(
        "verify",
        {"job_dir": job_dir, "newer_than": newer_than, "timeout_s": timeout, "ledger_url": ledger},
        job_dir,
        False,
        True,
        as_json,
    )


@runbook_app.command("list")
def runbook_list(as_json: bool = _JSON) -> int:
    """The built-in runbooks, with what each is for."""
    from gpuguard.recovery.operator import runbooks

    books = [runbooks.load(n) for n in runbooks.builtin_names()]
    if as_json:
        emit_json(
            {
                "schema": "gpuguard.runbooks/1",
                "runbooks": [
                    {"name": b.name, "description": b.description.strip(), "steps": [s.name for s in b.steps]}
                    for b in books
                ],
            }
        )
        return EXIT_OK
    out = console()
    for b in books:
        say_wrapped(out, safe_line(f"{b.name}: {' -> '.join(s.name for s in b.steps)}"))
        say_wrapped(out, safe_line(f"  {' '.join(b.description.split())}"))
    return EXIT_OK


def _step_json(s: Any) -> dict[str, Any]:
    return {
        "name": s.name,
        "action": s.action,
        "when": s.when,
        "args": dict(s.args),
        "argv": list(s.argv),
        "newer_than": s.newer_than,
        "on_failure": s.on_failure,
    }


def _step_lines(i: int, s: Any) -> list[str]:
    """One step as a person reads it: what it does, when, with which arguments, and on failure."""
    lines = [f"{i}. {s.name}" if s.name == s.action else f"{i}. {s.name}: {s.action}"]
    lines.append(f"     when:       {s.when}" if s.when else "     when:       always")
    if s.argv:
        import shlex

        lines.append(f"     runs:       {shlex.join(s.argv)}")
    for key, value in s.args.items():
        shown = (
            " ".join(map(str, value))
            if isinstance(value, list)
            else str(value).lower()
            if isinstance(value, bool)
            else value
        )
        label = f"{key[:-2].replace('_', ' ')} (s)" if key.endswith("_s") else key.replace("_", " ")
        lines.append(f"     {label + ':':<11} {shown}")
    if s.newer_than:
        lines.append(f"     waits for:  a generation newer than the one active at step {s.newer_than}")
    lines.append(f"     on failure: {'stop the run' if s.on_failure == 'stop' else 'continue with the next step'}")
    return lines


@runbook_app.command("show")
def runbook_show(
    name: str = typer.Argument(..., metavar=RUNBOOK_METAVAR, help="Built-in runbook name or YAML file."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw runbook (gpuguard.runbooks/1)."),
) -> int:
    """Validate and print a runbook: its steps, their conditions and arguments (--json: the raw form)."""
    from gpuguard.recovery.operator import runbooks

    book = runbooks.load(name)
    if as_json:
        emit_json(
            {
                "schema": "gpuguard.runbooks/1",
                "runbooks": [
                    {
                        "name": book.name,
                        "description": book.description.strip(),
                        "source": book.source,
                        "steps": [_step_json(s) for s in book.steps],
                    }
                ],
            }
        )
        return EXIT_OK
    lines = [f"runbook {book.name} ({book.source})"]
    if book.description.strip():
        lines.append(f"  {' '.join(book.description.split())}")
    lines.append(f"steps ({len(book.steps)}, in order; a step whose condition is false is skipped):")
    for i, s in enumerate(book.steps, 1):
        lines += [f"  {line}" for line in _step_lines(i, s)]
    out = console()
    for line in lines:
        say_wrapped(out, safe_line(line))
    return EXIT_OK


@runbook_app.command("run")
def runbook_run(
    name: str = typer.Argument(..., metavar=RUNBOOK_METAVAR, help="Built-in runbook name or YAML file."),
    job_dir: Path = job_dir_option(),
    run_id: str | None = typer.Option(None, "--run-id", help="Resume this run (default: the newest unfinished one)."),
    new: bool = typer.Option(False, "--new", help="Start a new run even if one is unfinished."),
    dry_run: bool = _DRY,
    yes: bool = _YES,
    as_json: bool = _JSON,
) -> int:
    """Run a runbook step by step; resumes an interrupted run from the audit log."""
    from gpuguard.recovery.operator import runbooks

    book = runbooks.load(name)
    require_job(job_dir)  # an empty or typo'd dir is not a job that was recovered
    if new and run_id is None:
        import uuid

        run_id = f"{book.name}-{uuid.uuid4().hex[:12]}"
    out = console(stderr=as_json)

    def progress(rep: Any) -> None:
        mark = " (resumed)" if rep.resumed else ""
        what = rep.name if rep.name == rep.action else f"{rep.name} ({rep.action})"  # not "abort: abort: ..."
        say_wrapped(out, safe_line(f"  {what}: {rep.outcome}{mark}: {rep.summary}"))

    report = runbooks.run(book, job_dir, dry_run=dry_run, yes=yes, confirm=_confirm(), run_id=run_id, progress=progress)
    if as_json:
        emit_json(report.to_json())
    else:
        say_wrapped(out, safe_line(f"runbook {book.name} run {report.run_id}: {report.outcome}"))
    return report.exit_code


recover_status.register(app=app)
recover_demo.register(app=app)

main = entry(app, "gpu-recover")

if __name__ == "__main__":
    main()
