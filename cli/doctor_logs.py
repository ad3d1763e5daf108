"""`gpu-doctor logs FILE...|-`: structured events and a diagnosis for every line that matters.

Why: the first thing on-call has is a log (dmesg, journal, a rank's stderr, a torchrun summary). This
command runs the one streaming parser over it and says, per event, what it means and what to do,
then sums up per GPU with the Xid catalog (Xid 154 actions authoritative, sympathetic codes attached).

Exit codes: 0 nothing at warning level, 1 warning events, 2 critical events (GPU lost, reset/drain Xid,
uncorrectable ECC...), 64 usage error, 66 input missing or a directory, 74 read error, 77 permission
denied, 65 a corrupt .gz. Never imports torch; reads files in bounded chunks (a 1 GiB log is never
loaded whole); gzip-compressed (rotated) logs are decompressed on the fly (`logscan.open_log`, the
same reader as `diagnose node` and `sweep`). Inputs up to 8 MiB (pastes) are read whole and lines a
terminal or a ticket wrapped are re-joined (`collectors.logwrap`).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from gpuguard.cli._app import safe_text  # every log-derived string is escaped in human output
from gpuguard.cli._text import NARROW, columns, wrap
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    EXIT_WARNING,
    DataError,
    NoInputError,
    UsageError,
    from_os_error,
)

if TYPE_CHECKING:
    import typer

_PROGRESS_MIN_BYTES = 64 << 20
_TABLE_ROWS = 1000
_JSON_BATCH = 256
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}
_ALL_CLEAR = "no evidence of a fault in these lines; that is what was found, not proof of health"
_BRIEF_SKIP = {"message", "name", "catalog_severity", "binary", "error", "location", "uptime_s", "summary"}


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add `gpu-doctor logs` to the app (typer only here: `cli._fast` calls `logs_command` without it)."""
    import typer

    @app.command("logs")
    def logs(
        files: list[str] = typer.Argument(..., metavar="FILE|-", help="Log files to explain; '-' reads stdin."),
        as_json: bool = typer.Option(False, "--json", help="Print a gpuguard.events/1 JSON document."),
        min_severity: str = typer.Option(
            "info",
            "--min-severity",
            metavar="info|warning|critical",
            help="Hide events below: info, warning, critical.",
        ),
    ) -> int:
        """Explain logs: kernel Xid/SXid, NCCL, watchdog, gloo, torchrun and CUDA errors, with a diagnosis each.

        Exit 0: nothing at warning level; 1: warnings; 2: critical events; 64 usage; 66 missing input;
        77 permission denied.
        """
        return logs_command(files, as_json=as_json, min_severity=min_severity)


def logs_command(files: list[str], *, as_json: bool = False, min_severity: str = "info") -> int:
    """`gpu-doctor logs` once its arguments are parsed (by typer, or by `cli._fast`)."""
    if min_severity not in _SEVERITY_STYLE:
        raise UsageError(f"--min-severity must be one of info, warning, critical (got {min_severity!r})")
    return run_logs(files, as_json=as_json, min_severity=min_severity)


_LEVEL = {"info": 0, "warning": 1, "critical": 2}


def _open_inputs(paths: list[str]) -> list[tuple[str, BinaryIO, int | None]]:
    """Open every input before reading any, so a bad path fails fast with one line."""
    if paths.count("-") > 1:
        raise UsageError("'-' (stdin) may be given only once")
    opened: list[tuple[str, BinaryIO, int | None]] = []
    try:
        for path in paths:
            if path == "-":
                opened.append(("-", sys.stdin.buffer, None))
                continue
            try:
                st = os.stat(path)
            except OSError as exc:
                raise from_os_error(exc, path) from None
            if stat.S_ISDIR(st.st_mode):
                raise NoInputError(f"{path}: is a directory, not a log file")
            from gpuguard.collectors.logscan import open_log

            try:
                fh, compressed = open_log(path)  # a rotated kern.log.2.gz is decompressed as it is read
            except OSError as exc:
                raise from_os_error(exc, path) from None
            opened.append((path, fh, None if compressed or not stat.S_ISREG(st.st_mode) else st.st_size))
    except BaseException:
        _close_all(opened)
        raise
    return opened


def _close_all(opened: list[tuple[str, BinaryIO, int | None]]) -> None:
    from gpuguard.collectors.logscan import close_log

    for path, fh, _ in opened:
        if path != "-":
            close_log(fh)


def _scan(opened: list[tuple[str, BinaryIO, int | None]], stats: list[dict[str, Any]]) -> Iterator[Any]:
    from gpuguard.cli._progress import ProgressBar
    from gpuguard.collectors import logwrap
    from gpuguard.collectors.logscan import LogScan, _Chained, is_corrupt_archive

    bar = ProgressBar(in_bytes=True, enabled=any((size or 0) >= _PROGRESS_MIN_BYTES for *_, size in opened))
    try:
        for path, fh, size in opened:
            on_progress = bar.ticker(path, size)
            count = 0
            try:
                small = size is not None and size <= logwrap.MAX_BYTES
                head = fh.read(logwrap.MAX_BYTES + 1) if small or size is None else b""
                if len(head) <= logwrap.MAX_BYTES and (small or size is None):
                    # a paste or a small log: read whole, wrapped lines re-joined (logwrap)
                    lines, unreadable = logwrap.split_paste(head)
                    for event in logwrap.iter_rejoined(lines, source=path):
                        count += 1
                        yield event
                    stats.append(
                        {
                            "path": path,
                            "bytes": len(head),
                            "lines": len(lines),
                            "events": count,
                            "unreadable_lines": unreadable,
                        }
                    )
                    continue
                scan = LogScan(cast(BinaryIO, _Chained(head, fh)) if head else fh, source=path, on_progress=on_progress)
                for event in scan:
                    count += 1
                    yield event
            except (OSError, EOFError, zlib.error) as exc:  # EOFError / zlib.error / BadGzipFile: a bad .gz
                if is_corrupt_archive(exc):
                    raise DataError(f"{path}: compressed log is truncated or corrupt ({exc})") from None
                assert isinstance(exc, OSError)  # is_corrupt_archive took EOFError and zlib.error
                raise from_os_error(exc, path) from None
            stats.append(
                {
                    "path": path,
                    "bytes": scan.bytes_read,
                    "lines": scan.next_line - 1,
                    "events": count,
                    "unreadable_lines": scan.unreadable_lines,
                }
            )
    finally:
        bar.stop()
        _close_all(opened)


class _Summary:
    """Counts, the worst severity, and the Xid events per GPU for the catalog's resolution."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.by_severity: Counter[str] = Counter()
        self.gpu_events: dict[str, list[dict[str, Any]]] = {}
        self.identity: dict[str, dict[str, str]] = {}  # PCI address -> uuid / serial (for an RMA ticket)

    def add(self, event: Any) -> None:
        self.by_kind[event.kind] += 1
        self.by_severity[event.severity] += 1
        if event.kind == "gpu_identity" and event.fields.get("pci_bus_id"):
            ident = self.identity.setdefault(event.fields["pci_bus_id"], {})
            ident.update({k: event.fields[k] for k in ("uuid", "serial") if event.fields.get(k)})
        if event.kind in ("xid", "gpu_lost"):
            key = event.fields.get("pci_bus_id") or event.fields.get("gpu_uuid") or "unknown"
            self.gpu_events.setdefault(key, []).append({"kind": event.kind, **event.fields})

    @property
    def worst(self) -> str:
        return max(self.by_severity, key=lambda s: _LEVEL.get(s, 0), default="info")

    def exit_code(self) -> int:
        return {"critical": EXIT_CRITICAL, "warning": EXIT_WARNING}.get(self.worst, EXIT_OK)

    def gpus(self) -> dict[str, dict[str, Any]]:
        from gpuguard.foundation.xid_catalog import resolution_for

        return {
            gpu: {**resolution_for(evs).to_json(), **self.identity.get(gpu, {})}
            for gpu, evs in sorted(self.gpu_events.items())
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "events": sum(self.by_kind.values()),
            "worst": self.worst if self.by_kind else None,
            "by_kind": dict(self.by_kind),
            "by_severity": dict(self.by_severity),
            "gpus": self.gpus(),
        }


def run_logs(paths: list[str], *, as_json: bool, min_severity: str = "info") -> int:
    opened = _open_inputs(paths)
    stats: list[dict[str, Any]] = []
    summary = _Summary()
    floor = _LEVEL[min_severity]
    events = (e for e in _scan(opened, stats) if _LEVEL.get(e.severity, 0) >= floor)
    if as_json:
        _write_json(events, summary, stats)
    elif sys.stdout.isatty() and (columns() or NARROW) >= NARROW:  # below, a table folds its cells mid-token
        _write_rich(events, summary, stats)
    else:
        _write_plain(events, summary, stats)
    return summary.exit_code()


def _write_json(events: Iterator[Any], summary: _Summary, stats: list[dict[str, Any]]) -> None:
    """Stream the document: events are written as they are found (in groups), never all held in memory."""
    from gpuguard.foundation.events import EVENTS_SCHEMA

    out = sys.stdout
    out.write(f'{{"schema": {json.dumps(EVENTS_SCHEMA)},\n "events": [')
    encode = json.JSONEncoder(default=str).encode  # what json.dumps(..., default=str) makes per call, once
    pending: list[str] = []  # written in groups of _JSON_BATCH events: fewer writes, memory still bounded
    sep = "\n  "
    try:
        for event in events:
            summary.add(event)
            pending.append(sep + encode(event.to_json()))
            sep = ",\n  "
            if len(pending) >= _JSON_BATCH:
                out.write("".join(pending))
                pending.clear()
    finally:  # what was found before an error (a corrupt .gz further on) is out, as when written one by one
        out.write("".join(pending))
    out.write("\n ],\n")
    out.write(f' "files": {json.dumps(stats)},\n')
    out.write(f' "summary": {json.dumps(summary.to_json())},\n')
    out.write(f' "exit_code": {summary.exit_code():d}\n}}\n')
    out.flush()


def brief(event: Any) -> str:
    """The event's key facts on one line (`xid=79 pci_bus_id=0000:2b:00.0 ...`)."""
    parts = []
    for key, value in event.fields.items():
        if key in _BRIEF_SKIP or value is None or value == "":
            continue
        parts.append(f"{key}={value}")
    if "error" in event.fields and event.fields["error"]:
        parts.append(f"error={str(event.fields['error'])[:80]!r}")
    return " ".join(parts)


def _write_plain(events: Iterator[Any], summary: _Summary, stats: list[dict[str, Any]]) -> None:
    """One line per event and its diagnosis under it, each broken between words to the width."""
    out = sys.stdout
    width = columns()
    for event in events:
        summary.add(event)
        where = safe_text(event.source or "-")
        head = f"{where}:{event.line}: {safe_text(event.severity)} {safe_text(event.kind)} {safe_text(brief(event))}"
        for line in (*wrap(head, width, 4), *wrap(f"    {safe_text(event.diagnosis)}", width, 4)):
            out.write(line + "\n")
    _plain_summary(summary, stats)


def _unreadable_note(stats: list[dict[str, Any]]) -> str | None:
    n = sum(s.get("unreadable_lines", 0) for s in stats)
    if not n:
        return None
    return (
        f"warning: {n} unreadable line{'s' if n != 1 else ''} skipped or cut (GPU/NCCL/launcher lines that are not "
        "valid UTF-8, or longer than 2 M characters): their events may be missing or incomplete"
    )


def _plain_summary(summary: _Summary, stats: list[dict[str, Any]]) -> None:
    out = _Wrapped(sys.stdout, columns())
    note = _unreadable_note(stats)
    if note:
        sys.stderr.write(note + "\n")
    total = sum(summary.by_kind.values())
    lines = sum(s["lines"] for s in stats)
    out.write(
        f"summary: {total} events in {lines} lines of {len(stats)} file(s); worst: {summary.worst if total else 'none'}\n"
    )
    if summary.worst == "info" or not total:
        out.write(f"  {_ALL_CLEAR}\n")
    if summary.by_kind:
        out.write("  by kind: " + ", ".join(f"{safe_text(k)}={n}" for k, n in summary.by_kind.most_common()) + "\n")
    for gpu, res in summary.gpus().items():
        ident = f" [{res['uuid']}]" if res.get("uuid") else ""
        out.write(safe_text(f"  GPU {gpu}{ident}: {res['severity']} - {res['action']} ({res['reason']})") + "\n")


class _Wrapped:
    """`write` of whole lines, each broken between words to `width` (`cli._text.wrap`)."""

    def __init__(self, out: Any, width: int | None) -> None:
        self.out, self.width = out, width

    def write(self, text: str) -> None:
        for line in text.splitlines():
            for part in wrap(line, self.width):
                self.out.write(part + "\n")


def _write_rich(events: Iterator[Any], summary: _Summary, stats: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.text import Text

    from gpuguard.cli._app import console

    con = console()
    table = Table(title="events", show_lines=False, expand=False)
    for col in ("where", "severity", "kind", "facts", "diagnosis"):
        table.add_column(col, overflow="fold")
    shown = 0
    for event in events:
        summary.add(event)
        if shown < _TABLE_ROWS:
            style = _SEVERITY_STYLE.get(event.severity, "")
            table.add_row(  # Text, never markup: a log line saying "[bold]" or "[link=...]" is text
                Text(safe_text(f"{os.path.basename(event.source or '-')}:{event.line}")),
                Text(safe_text(event.severity), style=style),
                Text(safe_text(event.kind)),
                Text(safe_text(brief(event))),
                Text(safe_text(event.diagnosis)),
            )
            shown += 1
    total = sum(summary.by_kind.values())
    if total:
        con.print(table)
    if total > shown:
        con.print(f"[dim]... {total - shown} more events (use --json for all)[/dim]")
    lines = sum(s["lines"] for s in stats)
    note = _unreadable_note(stats)
    if note:
        console(stderr=True).print(Text(note, style="yellow"))
    worst = summary.worst if total else "none"
    con.print(
        f"[bold]summary[/bold]: {total} events in {lines} lines of {len(stats)} file(s); worst: "
        f"[{_SEVERITY_STYLE.get(worst, '')}]{worst}[/]"
    )
    if summary.worst == "info" or not total:
        con.print(f"  {_ALL_CLEAR}")
    if summary.by_kind:
        con.print(Text("  by kind: " + ", ".join(f"{safe_text(k)}={n}" for k, n in summary.by_kind.most_common())))
    gpus = summary.gpus()
    if gpus:
        gt = Table(title="per GPU (Xid catalog)")
        for col in ("GPU", "severity", "action", "reason"):
            gt.add_column(col, overflow="fold")
        for gpu, res in gpus.items():
            name = (
                gpu
                + (f"\n{res['uuid']}" if res.get("uuid") else "")
                + (f"\nserial {res['serial']}" if res.get("serial") else "")
            )
            gt.add_row(*(Text(safe_text(v)) for v in (name, res["severity"], res["action"], res["reason"])))
        con.print(gt)
