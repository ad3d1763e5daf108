"""`gpu-recover status --job-dir DIR [--json] [--follow [--interval S]]`: the page on-call reads first.

`recovery.operator.status` gathers (every probe with a deadline) and decides ("safe to resume" is its pure
`decide`); this module only renders. Exit code by state: 0 healthy, 1 warning, 2 critical, 3 unknown.
With --follow the page is refreshed every --interval seconds until Ctrl-C, and the exit code is the
last page's.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli._app import console, emit_json, job_dir_option, require_job, safe_line, stdout_is_terminal
from gpuguard.cli._text import echo_lines, lines_for, short


def _when(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def page_lines(doc: dict[str, Any]) -> list[str]:
    """The status page as plain lines (a `gpuguard.status/1` document in, text out)."""
    led = doc["ledger"]
    lines = [f"{doc['job_dir']} at {_when(doc['time'])}"]
    if led["active_generation"] is None:
        lines.append(f"generation     unknown: {led['problem'] or 'no certificate'}")
    else:
        lines.append(
            f"generation     {led['active_generation']} (certificate {short(led['certificate_digest'])}, "
            f"frontier step {led['frontier_step']}) in {led['url']}"
        )
    if led["unverified_after_active"]:
        lines.append(
            f"               CORRUPT OR UNVERIFIABLE: generation(s) {led['unverified_after_active']} "
            "are stored but do not verify"
        )
    job = doc["job"]
    lines.append(f"job            {job['state']}")
    lines += [f"  {line}" for line in job["evidence"]]
    lines.append(
        f"health         {doc['state'].upper()}" + (f": {'; '.join(doc['reasons'])}" if doc["reasons"] else "")
    )
    resume = doc["resume"]
    if resume["step"] is None:
        lines.append(f"resume step    unknown: {resume['problem']}")
    else:
        lines.append(f"resume step    {resume['step']}: {resume['source']}")
    members = doc["members"]
    lines.append(f"members        {len(members)}" + (f" ({doc['members_problem']})" if doc["members_problem"] else ""))
    for m in members:
        state = m["state"] if m["state"] == "unknown" and not m["detail"] else f"{m['state']}: {m['detail']}"
        if m["state"] == "alive":
            state = f"alive ({m['detail']})"
        lines.append(f"  rank {m['rank']:<4} {m['host']:<16} pid {m['pid']:<8} {state}")
    vote = doc["vote"]
    if vote is not None:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(vote.get("counts", {}).items()) if v)
        lines.append(f"vote           {vote['verdict']} ({counts or 'no ranks'}): {vote['reason']}")
    else:
        lines.append(f"vote           unknown: {doc['vote_problem']}")
    tr = doc["torchrun"]
    if tr["problem"]:
        lines.append(f"torchrun       unknown: {tr['problem']}")
    elif not tr["hazards"]:
        lines.append(f"torchrun       no hazard; {tr['live_workers']} live worker(s) of the job on this host")
    else:
        lines.append(f"torchrun       {len(tr['hazards'])} hazard(s); {tr['live_workers']} live worker(s) on this host")
        for h in tr["hazards"]:
            lines.append(f"  [{h['severity']}] {h['kind']}: {h['message']}")
    if led["fenced_commits"] is not None:
        lines.append(
            f"ledger         {led['fenced_commits']} fenced commit(s), {led['refusals']} refused activation(s)"
        )
    for e in doc["evicted"]:
        lines.append(f"evicted        generation {e['generation']}: dead {e['dead']}, killed {e['killed']}")
    for f in doc.get("fenced_incarnations") or ():
        state = {"may-be-running": "may still be running", "ended": "ended"}.get(f["state"], f["state"])
        lines.append(
            f"fenced         rank {f['rank']} of generation {f['fenced_by_generation'] - 1} on {f['host']} "
            f"(incarnation {f['incarnation'][:12]}): {state}, every sink refuses it; {f['until']}"
        )
    inc = doc.get("incarnations") or {}
    if inc.get("unreadable") or inc.get("problem"):
        lines.append(
            f"incarnations   {len(inc.get('unreadable') or [])} record(s) unreadable"
            + (f" ({inc['problem']})" if inc.get("problem") else "")
        )
        lines += [f"  {why}" for why in (inc.get("unreadable") or [])[:8]]
    tail = doc["audit_tail"]
    lines.append(
        f"audit          last {len(tail)} entr{'y' if len(tail) == 1 else 'ies'}"
        + (f" ({doc['audit_problem']})" if doc["audit_problem"] else "")
    )
    for a in tail:
        dry = " (dry run)" if a["dry_run"] else ""
        summary = f": {a['summary']}" if a["summary"] else ""
        lines.append(
            f"  {_when(a['time'])} {a['user']}@{a['host']} {a['action']} {a['outcome']}{dry} "
            f"(exit {a['exit_code']}){summary}"
        )
    lines.append(f"safe to resume: {'yes' if doc['safe_to_resume'] else 'no'}, because {doc['because']}")
    return [safe_line(line) for line in lines]


def _page(job_dir: Path, ledger: str | None, probe_timeout: float) -> dict[str, Any]:
    from gpuguard.recovery.operator import status

    facts = status.gather(job_dir, ledger_url=ledger, probe_timeout_s=probe_timeout)
    return status.to_json(facts, status.decide(facts))


def _await_job(job_dir: Path, wait_s: float, interval_s: float) -> None:
    """With --follow, a job dir that is not there yet is waited for (bounded, said once on stderr), so
    `status --follow` can be started before the job; after `wait_s` the usual one line and 66."""
    from gpuguard.foundation.errors import NoInputError
    from gpuguard.foundation.jobdir import require_job_dir

    try:
        require_job_dir(job_dir)
        return
    except NoInputError as exc:
        if wait_s <= 0:
            raise
        first = exc
    print(
        safe_line(f"gpu-recover status: {first}; waiting up to {wait_s:g} s for it to appear (Ctrl-C to stop)"),
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
        try:
            require_job_dir(job_dir)
            return
        except NoInputError:
            continue
    raise NoInputError(f"{first} after waiting {wait_s:g} s")


def register(*, app: typer.Typer) -> None:
    """Add `gpu-recover status` to the app."""

    @app.command("status")
    def status_cmd(
        job_dir: Path = job_dir_option(),
        as_json: bool = typer.Option(
            False, "--json", help="Print a gpuguard.status/1 document (JSON lines with --follow)."
        ),
        follow: bool = typer.Option(False, "--follow", help="Refresh until Ctrl-C."),
        interval: float = typer.Option(2.0, "--interval", min=0.1, metavar="S", help="Seconds between refreshes."),
        count: int = typer.Option(0, "--count", min=0, metavar="N", help="With --follow: stop after N pages."),
        wait: float = typer.Option(
            600.0,
            "--wait",
            min=0.0,
            metavar="S",
            help="With --follow: wait up to S seconds for the job directory to appear (a job not started yet).",
        ),
        ledger: str | None = typer.Option(None, "--ledger", metavar="URL", help="Ledger URL (default: the job dir's)."),
        probe_timeout: float = typer.Option(
            5.0, "--probe-timeout", min=0.1, metavar="S", help="Deadline of each probe (ledger, processes, records)."
        ),
    ) -> int:
        """What the job is doing (running, restarting, switching in place, finished, down) and the
        evidence; members, the vote, torchrun hazards, audit; the resume step; safe to resume?

        Exit 0 healthy, 1 warning, 2 critical, 3 unknown.
        """
        import json

        if follow:
            _await_job(job_dir, wait, interval)
        require_job(job_dir)
        if not follow:
            doc = _page(job_dir, ledger, probe_timeout)
            if as_json:
                emit_json(doc)
            else:
                echo_lines(page_lines(doc))
            return int(doc["exit_code"])
        code, n, live = 3, 0, None
        try:
            if stdout_is_terminal() and not as_json:
                from rich.live import Live
                from rich.text import Text

                live = Live(console=console(), refresh_per_second=4, transient=False)
                live.start()
            while True:
                doc = _page(job_dir, ledger, probe_timeout)
                code, n = int(doc["exit_code"]), n + 1
                if as_json:
                    print(json.dumps(doc, default=str), flush=True)
                elif live is not None:
                    live.update(Text("\n".join(lines_for(page_lines(doc))), no_wrap=True))
                else:
                    echo_lines([*page_lines(doc), ""])
                    sys.stdout.flush()
                if count and n >= count:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how --follow ends: the exit code is the last page's
        finally:
            if live is not None:
                live.stop()
        return code
