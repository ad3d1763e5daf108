"""YAML runbooks: diagnose → abort → rendezvous → restore → verify, with conditions, resumable.

A runbook is data (`yaml.safe_load`), validated against a small schema with errors that name the
step and the field. Steps call the actions in-process, or run gpuguard's own console scripts with
an argument list (never a shell). Every step's result goes to the job's audit log under the run's
id, so a run interrupted half-way resumes where it stopped: completed steps are skipped and their
recorded results feed the later conditions.

Safety: a dry run runs only `command` steps proven read-only (`read_only_reason`: an allow-list of
gpu-doctor subcommands, each with an allow-list of options, so no output path such as `--dump-nvml`
can slip in); every other step only says what it would do. A `command` step runs in its own
session and process group with stdin from /dev/null; at its `timeout_s` (or when the runner is
interrupted) the whole group gets SIGTERM, then SIGKILL after `COMMAND_GRACE_S`, so no child it
forked outlives it. Runbooks cannot recurse: a step running `gpu-recover runbook run` is refused at
validation, and a runbook run started inside a step (`$GPUGUARD_RUNBOOK_DEPTH` >= 1) is refused at
run time (both exit 4). A runbook file is at most `MAX_RUNBOOK_BYTES` (1 MiB) and a mapping may not
repeat a key (both 65, naming the line): read by the one YAML reader, foundation.yamlfile.

Format::

    name: rank-failure                      # required, [a-z0-9-]
    description: ...                        # optional
    steps:                                  # required, 1..32 steps, names unique
      - name: diagnose                      # required, [a-z0-9_-]
        action: diagnose                    # diagnose | abort | rendezvous | restore | verify | command
        when: diagnose.verdict == dead      # optional condition over EARLIER steps (recovery.operator.conditions)
        args: {grace_s: 10}                 # optional, per-action keys only
        argv: [gpu-doctor, diagnose, job, --job-dir, "{job_dir}", --json]   # action: command only
        newer_than: diagnose                # verify only: wait for a generation newer than that step's
        on_failure: stop                    # stop (default) | continue

Lazy imports (start-up time): yaml, only when a runbook is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gpuguard.foundation.env import RUNBOOK_DEPTH_ENV
from gpuguard.foundation.errors import (
    EXIT_OK,
    EXIT_REFUSED,
    DataError,
    GpuguardError,
    NoInputError,
    RefusedError,
)
from gpuguard.foundation.jobdir import require_job_dir
from gpuguard.foundation.yamlfile import parse_yaml, read_capped
from gpuguard.recovery.operator import actions, audit, conditions

BUILTIN_DIR = "runbooks"
CONSOLE_SCRIPTS = ("gpu-doctor", "gpu-generation", "gpu-recover")
# The only commands a dry run runs: gpu-doctor subcommands that write nothing, each with the options
# it may carry (an option not listed, e.g. --dump-nvml, --textfile, --state-dir, may write: not run).
READ_ONLY_DOCTOR: dict[tuple[str, ...], frozenset[str]] = {
    ("diagnose", "node"): frozenset(
        {
            "--kernel-log",
            "--nvml-snapshot",
            "--since",
            "--config",
            "--json",
            "--format",
            "--demo",
            "--processes",
            "--no-processes",
            "--nvml-timeout",
            "--timeout",
            "--log",
            "--mode",
        }
    ),
    ("diagnose", "job"): frozenset(
        {
            "--job-dir",
            "--json",
            "--config",
            "--window",
            "--log",
            "--log-spec",
            "--log-regex",
            "--node-report",
            "--torchrun-log",
            "--interval",
        }
    ),
    ("diagnose", "torchrun"): frozenset({"--job-dir", "--init-timeout", "--json"}),
    ("logs",): frozenset({"--json", "--min-severity"}),
    ("contract",): frozenset({"--json", "--pg", "--world-size", "--jobs"}),
}
MAX_RUNBOOK_BYTES = 1 << 20
COMMAND_GRACE_S = 2.0  # between SIGTERM and SIGKILL to a timed-out step's process group
ACTION_ARGS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "diagnose": {"init_timeout_s": (int, float)},
    "abort": {"grace_s": (int, float), "generation": int, "ranks": list, "include_active": bool},
    "rendezvous": {"deadline_s": (int, float), "endpoint": str, "run_id": str},
    "restore": {"step": int, "max_tries": int},
    "verify": {"timeout_s": (int, float), "poll_s": (int, float)},
    "command": {"timeout_s": (int, float)},
}
DONE_OUTCOMES = frozenset({"done", "noop", "coalesced", "already-advanced", "skipped"})
FAILED_OUTCOMES = frozenset({"failed", "error", "refused", "timeout"})
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
MAX_STEPS = 32


class RunbookError(DataError):
    """A runbook that does not match the schema (the message names the step and field)."""


@dataclass(frozen=True)
class Step:
    name: str
    action: str
    when: str | None = None
    condition: tuple | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    newer_than: str | None = None
    on_failure: str = "stop"


@dataclass(frozen=True)
class Runbook:
    name: str
    description: str
    steps: tuple[Step, ...]
    source: str


# --- loading -----------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    folder = resources.files("gpuguard.recovery.operator").joinpath(BUILTIN_DIR)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def locate(name_or_file: str) -> tuple[str, str]:
    """(text, source) of a built-in runbook name or a YAML file path."""
    if _NAME.match(name_or_file) and name_or_file in builtin_names():
        res = resources.files("gpuguard.recovery.operator").joinpath(BUILTIN_DIR).joinpath(f"{name_or_file}.yaml")
        return res.read_text(), f"builtin:{name_or_file}"
    path = Path(name_or_file)
    if not path.exists():
        raise NoInputError(f"no runbook {name_or_file!r} (built-in: {', '.join(builtin_names())}; or a YAML file)")
    raw = read_capped(path, max_bytes=MAX_RUNBOOK_BYTES, what="a runbook", error=RunbookError)
    try:
        return raw.decode("utf-8"), str(path)
    except UnicodeDecodeError:
        raise RunbookError(f"{path}: not a text file") from None


def load(name_or_file: str) -> Runbook:
    text, source = locate(name_or_file)
    return parse(text, source)


def parse(text: str, source: str = "<runbook>") -> Runbook:
    """YAML text → validated Runbook, or one RunbookError naming what is wrong where."""
    doc = parse_yaml(
        text, source=source, max_bytes=MAX_RUNBOOK_BYTES, what="a runbook", error=RunbookError, finite=False
    )  # finite=False: validate() names the step and field of a NaN or infinite number
    return validate(doc, source)


def validate(doc: Any, source: str = "<runbook>") -> Runbook:
    def err(msg: str) -> RunbookError:
        return RunbookError(f"{source}: {msg}".replace("\n", "\\n"))

    if not isinstance(doc, dict):
        raise err("a runbook is a mapping with 'name' and 'steps'")
    unknown = set(map(str, doc)) - {"name", "description", "steps"}
    if unknown:
        raise err(f"unknown top-level field(s): {', '.join(repr(k)[:40] for k in sorted(unknown))}")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise err("field 'name': required, lowercase letters, digits, '-' or '_'")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise err("field 'description': must be a string")
    raw_steps = doc.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise err("field 'steps': required, a non-empty list")
    if len(raw_steps) > MAX_STEPS:
        raise err(f"field 'steps': at most {MAX_STEPS} steps")
    steps: list[Step] = []
    for index, raw in enumerate(raw_steps, 1):
        steps.append(_validate_step(raw, index, [s.name for s in steps], err))
    return Runbook(name, description, tuple(steps), source)


def _validate_step(raw: Any, index: int, earlier: list[str], err: Callable[[str], RunbookError]) -> Step:
    if not isinstance(raw, dict):
        raise err(f"step {index}: must be a mapping with 'name' and 'action'")
    sname = raw.get("name")
    if not isinstance(sname, str) or not _NAME.match(sname):
        raise err(f"step {index}: field 'name': required, lowercase letters, digits, '-' or '_'")
    where = f"step {index} ({sname})"
    if sname in earlier:
        raise err(f"{where}: field 'name': duplicate step name")
    unknown = set(map(str, raw)) - {"name", "action", "when", "args", "argv", "newer_than", "on_failure"}
    if unknown:
        raise err(f"{where}: unknown field(s): {', '.join(repr(k)[:40] for k in sorted(unknown))}")
    action = raw.get("action")
    if action not in ACTION_ARGS:
        raise err(f"{where}: field 'action': must be one of {', '.join(ACTION_ARGS)}")
    when, condition = raw.get("when"), None
    if when is not None:
        if not isinstance(when, str):
            raise err(f"{where}: field 'when': must be a string condition")
        try:
            condition = conditions.parse(when)
        except conditions.ConditionError as exc:
            raise err(f"{where}: field 'when': {exc}") from None
        for ref in sorted(conditions.references(condition)):
            if ref not in earlier:
                raise err(f"{where}: field 'when': refers to {ref!r}, which is not an earlier step")
    args = raw.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise err(f"{where}: field 'args': must be a mapping")
    allowed = ACTION_ARGS[action]
    for key, value in args.items():
        if key not in allowed:
            shown = key if isinstance(key, str) and key.isidentifier() else repr(str(key)[:40])
            raise err(
                f"{where}: field 'args.{shown}': not an argument of {action} (allowed: {', '.join(allowed) or 'none'})"
            )
        if (isinstance(value, bool) and allowed[key] is not bool) or not isinstance(value, allowed[key]):
            raise err(f"{where}: field 'args.{key}': wrong type {type(value).__name__}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not (0 <= value < 1e9):
            raise err(f"{where}: field 'args.{key}': must be a finite number >= 0")  # NaN, inf, -1 s
        if (
            key == "ranks"
            and isinstance(value, list)
            and not all(isinstance(r, int) and not isinstance(r, bool) for r in value)
        ):
            raise err(f"{where}: field 'args.ranks': must be a list of integers")
    argv = raw.get("argv")
    if action == "command":
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise err(f"{where}: field 'argv': required for action command, a list of strings")
        if argv[0] not in CONSOLE_SCRIPTS:
            raise err(f"{where}: field 'argv': must start with one of {', '.join(CONSOLE_SCRIPTS)}")
        if _runs_a_runbook(argv):
            refusal = err(
                f"{where}: field 'argv': a step may not run `gpu-recover runbook run`: runbooks cannot recurse"
            )
            refusal.exit_code = EXIT_REFUSED
            raise refusal
    elif argv is not None:
        raise err(f"{where}: field 'argv': only for action command")
    newer_than = raw.get("newer_than")
    if newer_than is not None:
        if action != "verify":
            raise err(f"{where}: field 'newer_than': only for action verify")
        if newer_than not in earlier:
            raise err(f"{where}: field 'newer_than': {newer_than!r} is not an earlier step")
    on_failure = raw.get("on_failure", "stop")
    if on_failure not in ("stop", "continue"):
        raise err(f"{where}: field 'on_failure': must be stop or continue")
    return Step(sname, action, when, condition, dict(args), tuple(argv or ()), newer_than, on_failure)


def _runs_a_runbook(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether `argv` is `gpu-recover [opts] runbook [opts] <anything but list/show>`."""
    if not argv or argv[0] != "gpu-recover":
        return False
    words = [a for a in argv[1:] if not a.startswith("-")]
    return bool(words) and words[0] == "runbook" and (len(words) < 2 or words[1] not in ("list", "show"))


def read_only_reason(argv: tuple[str, ...] | list[str]) -> str | None:
    """None if `argv` (a command step's, before `{job_dir}` is filled in) is proven to write nothing,
    else why not: only allow-listed gpu-doctor subcommands with allow-listed options qualify."""
    if not argv or argv[0] != "gpu-doctor":
        return f"{argv[0] if argv else 'it'} is not a read-only gpu-doctor command"
    rest = list(argv[1:])
    for path, options in READ_ONLY_DOCTOR.items():
        if tuple(rest[: len(path)]) == path:
            for token in rest[len(path) :]:
                if token.startswith("-") and token != "-":
                    name = token.split("=", 1)[0]
                    if name not in options:
                        return f"option {name} is not known to be read-only (it may write a file)"
            return None
    words = [a for a in rest if not a.startswith("-")][:2]
    return f"gpu-doctor {' '.join(words)} is not on the read-only list"


# --- running -----------------------------------------------------------------------------------


@dataclass
class StepReport:
    name: str
    action: str
    outcome: str
    exit_code: int
    summary: str
    resumed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "action": self.action,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "summary": self.summary,
            "resumed": self.resumed,
        }


@dataclass
class RunReport:
    runbook: str
    run_id: str
    dry_run: bool
    steps: list[StepReport] = field(default_factory=list)
    outcome: str = "done"
    exit_code: int = EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "gpuguard.runbook-run/1",  # not an action/1 document: steps, no details
            "action": "runbook",
            "runbook": self.runbook,
            "run_id": self.run_id,
            "dry_run": self.dry_run,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "steps": [s.to_json() for s in self.steps],
        }


def completed_steps(job_dir: Path, run_id: str) -> dict[str, dict[str, Any]]:
    """Step results of `run_id` already in the audit log (the last record of each step wins)."""

    done: dict[str, dict[str, Any]] = {}
    for rec in audit.read(job_dir).records:
        if rec.run_id == run_id and rec.step and not rec.dry_run:
            if rec.outcome in DONE_OUTCOMES:
                done[rec.step] = {"outcome": rec.outcome, "exit_code": rec.exit_code, **dict(rec.detail)}
            else:
                done.pop(rec.step, None)
    return done


def unfinished_run(job_dir: Path, runbook: str) -> str | None:
    """The newest run of `runbook` that started and never finished (to resume by default)."""

    open_runs: dict[str, float] = {}
    for rec in audit.read(job_dir).records:
        if rec.action != "runbook" or rec.run_id is None or rec.args.get("runbook") != runbook or rec.dry_run:
            continue
        if rec.outcome == "started":
            open_runs[rec.run_id] = rec.time
        else:
            open_runs.pop(rec.run_id, None)
    return max(open_runs, key=lambda run_id: open_runs[run_id]) if open_runs else None


def run(
    book: Runbook,
    job_dir: Path,
    *,
    dry_run: bool,
    yes: bool,
    confirm: Callable[[str], bool] | None,
    run_id: str | None = None,
    progress: Callable[[StepReport], None] | None = None,
) -> RunReport:

    depth = _runbook_depth()
    if depth >= 1:
        raise RefusedError(
            f"runbook {book.name} refused: started inside a runbook step (${RUNBOOK_DEPTH_ENV}={depth}): "
            "runbooks cannot recurse"
        )
    require_job_dir(job_dir)  # an empty or typo'd dir is not a job that was recovered ("done")
    resumed_from = run_id or (None if dry_run else unfinished_run(job_dir, book.name))
    run_id = resumed_from or f"{book.name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    report = RunReport(book.name, run_id, dry_run)
    done = {} if dry_run else completed_steps(job_dir, run_id)
    if not dry_run:
        audit.append(
            job_dir,
            audit.new_record(
                "runbook",
                "started",
                EXIT_OK,
                run_id=run_id,
                args={"runbook": book.name, "source": book.source, "resumed": bool(done)},
            ),
        )
    results: dict[str, dict[str, Any]] = {}
    for step in book.steps:
        if step.name in done:
            results[step.name] = done[step.name]
            rep = StepReport(
                step.name,
                step.action,
                done[step.name]["outcome"],
                int(done[step.name]["exit_code"]),
                "already completed in this run (from the audit log)",
                resumed=True,
            )
        else:
            rep = _run_step(step, book, job_dir, results, dry_run=dry_run, yes=yes, confirm=confirm, run_id=run_id)
        report.steps.append(rep)
        if progress is not None:
            progress(rep)
        if rep.outcome in FAILED_OUTCOMES and step.on_failure == "stop":
            report.outcome, report.exit_code = "failed", rep.exit_code or 1
            break
    if not dry_run:
        audit.append(
            job_dir,
            audit.new_record(
                "runbook",
                report.outcome,
                report.exit_code,
                run_id=run_id,
                args={"runbook": book.name, "source": book.source},
            ),
        )
    return report


def _run_step(
    step: Step,
    book: Runbook,
    job_dir: Path,
    results: dict[str, dict[str, Any]],
    *,
    dry_run: bool,
    yes: bool,
    confirm: Callable[[str], bool] | None,
    run_id: str,
) -> StepReport:

    if step.condition is not None and not conditions.evaluate(step.condition, results):
        results[step.name] = {"outcome": "skipped", "exit_code": EXIT_OK}
        if not dry_run:
            audit.append(
                job_dir,
                audit.new_record(
                    step.action, "skipped", EXIT_OK, run_id=run_id, step=step.name, detail={"when": step.when}
                ),
            )
        return StepReport(step.name, step.action, "skipped", EXIT_OK, f"condition false: {step.when}")
    try:
        if step.action == "command":
            result = _command(step, job_dir, dry_run=dry_run, run_id=run_id)
        elif step.action == "verify" and dry_run:
            result = actions.ActionResult(
                "verify", "dry-run", EXIT_OK, "would wait for and verify the certificate", dry_run=True
            )
        else:
            kwargs = _kwargs(step, job_dir, results)
            result = actions.run_action(
                step.action,
                actions.ACTIONS[step.action],
                kwargs,
                job_dir=job_dir,
                dry_run=dry_run,
                yes=yes,
                confirm=confirm,
                run_id=run_id,
                step=step.name,
            )
    except GpuguardError as exc:
        outcome = "refused" if exc.exit_code == EXIT_REFUSED else "error"
        results[step.name] = {"outcome": outcome, "exit_code": exc.exit_code, "error": str(exc)}
        return StepReport(step.name, step.action, outcome, exc.exit_code, str(exc))
    results[step.name] = {"outcome": result.outcome, "exit_code": result.exit_code, **result.details}
    return StepReport(step.name, step.action, result.outcome, result.exit_code, result.summary)


def _kwargs(step: Step, job_dir: Path, results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"job_dir": job_dir, **step.args}
    if step.action == "abort" and "ranks" in kwargs:
        kwargs["ranks"] = tuple(kwargs["ranks"])
    if step.action == "verify" and step.newer_than:
        generation = results.get(step.newer_than, {}).get("generation")
        if isinstance(generation, int):
            kwargs["newer_than"] = generation
    return kwargs


def _runbook_depth() -> int:
    raw = os.environ.get(RUNBOOK_DEPTH_ENV, "").strip()
    if not raw:
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        return 1  # set but unreadable: assume we are inside a step


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


class _Signalled(BaseException):
    """SIGTERM or SIGHUP reached the runner while a step ran (raised to end the step's group first)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, _frame: Any) -> None:
    raise _Signalled(signum)


_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def run_in_group(
    argv: list[str],
    *,
    timeout: float,
    grace: float = COMMAND_GRACE_S,
    env: Mapping[str, str] | None = None,
) -> Completed:
    """Run `argv` (no shell) in a new session and process group, stdin /dev/null, output captured.

    At `timeout` (subprocess.TimeoutExpired), Ctrl-C, or SIGTERM/SIGHUP to the runner, the whole
    group gets SIGTERM and, after `grace`, SIGKILL: no process the command forked is left behind.
    A runner ended by a signal then dies of that signal, as it would have.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _raise_signalled) for sig in _ENDING_SIGNALS} if main else {}
    proc: subprocess.Popen[str] | None = None
    try:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
                env=dict(env) if env is not None else None,
            )
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            if proc is not None:
                for sig in previous:
                    signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
                _end_group(proc, grace)
            raise
        if _group_alive(proc.pid):
            _end_group(proc, grace)  # the command is done; what it left running in its group is not
        return Completed(proc.returncode, out, err)
    except _Signalled as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.raise_signal(exc.signum)
        raise  # pragma: no cover - only if the restored handler returns
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - a member changed uid: SIGKILL what we may
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True


def _end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the group, wait up to `grace` for it to empty, SIGKILL it, reap the leader."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            break
        time.sleep(0.05)
    _killpg(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=max(grace, 1.0))
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass
    end = time.monotonic() + 1.0
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.02)  # reparented members are reaped by init; zombies cannot run
    for pipe in (proc.stdout, proc.stderr):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:  # pragma: no cover
            pass


def _command(step: Step, job_dir: Path, *, dry_run: bool, run_id: str) -> Any:
    """Run one of gpuguard's own console scripts (argument list, no shell); parse JSON output if any."""

    script = Path(sys.executable).parent / step.argv[0]
    argv = [str(script)] + [a.replace("{job_dir}", str(job_dir)) for a in step.argv[1:]]
    if dry_run:
        why_not = read_only_reason(step.argv)
        if why_not is not None:
            shown = " ".join([step.argv[0], *argv[1:]])
            return actions.ActionResult(
                "command", "dry-run", EXIT_OK, f"would run {shown} (not run: {why_not})", dry_run=True
            )
    timeout = float(step.args.get("timeout_s", 300))
    env = {**os.environ, RUNBOOK_DEPTH_ENV: str(_runbook_depth() + 1)}
    try:
        proc = run_in_group(argv, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        result = actions.ActionResult(
            "command", "timeout", 75, f"{step.argv[0]} did not finish in {timeout:g} s (its process group was ended)"
        )
    except OSError as exc:
        why = exc.strerror or (errno.errorcode.get(exc.errno or 0) if exc.errno else None) or str(exc)
        result = actions.ActionResult("command", "error", 70, f"cannot run {step.argv[0]}: {why}")
    else:
        details: dict[str, Any] = {"returncode": proc.returncode}
        try:
            doc = json.loads(proc.stdout)
            if isinstance(doc, dict):
                details.update({k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool)) or v is None})
        except ValueError:
            pass
        # a command's non-zero health code (warning/critical) is a finding, not a failed step
        outcome = "done" if proc.returncode in (0, 1, 2, 3) else "failed"
        if "verdict" in details:
            summary = f"verdict {details['verdict']}" + (f": {details['reason']}" if details.get("reason") else "")
        else:
            summary = (proc.stderr.strip().splitlines() or [""])[-1]
        summary = summary[:200]
        result = actions.ActionResult(
            "command", outcome, proc.returncode, summary or f"exit {proc.returncode}", details
        )
    if not dry_run:
        audit.append(
            job_dir,
            audit.new_record(
                "command",
                result.outcome,
                result.exit_code,
                run_id=run_id,
                step=step.name,
                args={"argv": list(step.argv)},
                detail=result.details,
            ),
        )
    return result
