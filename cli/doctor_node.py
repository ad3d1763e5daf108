"""`gpu-doctor diagnose node`, `gpu-doctor sweep` and `gpu-doctor plugins`.

Thin shell: collectors read (NVML, kernel log, processes), `diagnostics.node_verdict` judges, the
output plugins deliver; the sweep's state, retention and lock are `doctor.sweep`'s, the Slurm drain
is `recovery.operator.actions.drain_node`. Heavy modules (rich, prometheus_client, requests, psutil) are imported
only by the paths that need them, so `diagnose node --json` stays a fraction of a second and never
imports torch.

Exit codes (human/json): 0 healthy, 1 degraded, 2 reset or drain, 3 unknown; 64 usage or config error,
65 malformed input, 66 missing input, 73 output cannot be created, 75 another sweep holds the state
directory, 77 permission denied.
`--format npd`: 0 OK, 1 problem, 2 unknown (node-problem-detector), also for a usage, input or lock error
found once the options are parsed (NPD reads anything else as a problem). `--format nagios`: 0/1/2/3.
`sweep --quiet`: nothing on stdout when the node is healthy (cron mails any output).
"""

from __future__ import annotations

import functools
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.cli._app import emit_json
from gpuguard.foundation.env import STATE_DIR_ENV
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    EXIT_UNKNOWN,
    EXIT_WARNING,
    GpuguardError,
    UsageError,
    from_os_error,
)

if TYPE_CHECKING:
    import typer

DATA = Path(__file__).resolve().parents[1] / "collectors" / "data"
SAMPLE_KERNEL_LOG = DATA / "sample-kern.log"
SAMPLE_NVML = DATA / "sample-nvml.json"
FORMATS = ("human", "json", "npd", "nagios")
EXIT_BY_VERDICT = {
    "healthy": EXIT_OK,
    "degraded": EXIT_WARNING,
    "reset": EXIT_CRITICAL,
    "drain": EXIT_CRITICAL,
    "unknown": EXIT_UNKNOWN,
}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.I)
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """`90s`, `30m`, `2h`, `7d`, `1w` ago, or an ISO-8601 time -> Unix time; UsageError otherwise."""
    if text is None:
        return None
    now = time.time() if now is None else now
    match = _DURATION_RE.match(text)
    if match:
        return now - float(match.group(1)) * _UNIT_S[(match.group(2) or "s").lower() if match.group(2) else None]
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"--since {text!r}: expected a duration (30m, 2h, 7d) or an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


def _format(json_flag: bool, fmt: str | None) -> str:
    if fmt is None:
        return "json" if json_flag else "human"
    fmt = fmt.lower()
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if json_flag and fmt != "json":
        raise UsageError("--json and --format are exclusive")
    return fmt


def _warn(message: str) -> None:
    print(f"gpu-doctor: warning: {message}", file=sys.stderr)


def _npd_exit_codes(command: Callable[..., int]) -> Callable[..., int]:
    """With `--format npd`, an error is `unknown` (exit 2, its one NPD line on stdout, the error on
    stderr): node-problem-detector knows 0, 1 and 2 only, and reads any other code as a problem."""

    @functools.wraps(command)
    def run(**kw: Any) -> int:
        if str(kw.get("fmt") or "").lower() != "npd":
            return command(**kw)
        try:
            return command(**kw)
        except BrokenPipeError:
            raise
        except (GpuguardError, OSError) as exc:
            err = exc if isinstance(exc, GpuguardError) else from_os_error(exc, exc.filename or "I/O")
            from gpuguard.plugins.outputs import npd_line

            code, line = npd_line({"verdict": "unknown", "summary": f"unknown: {err}"})
            print(f"gpu-doctor: error: {err} (exit {err.exit_code}; {code} for node-problem-detector)", file=sys.stderr)
            print(line)
            return code

    return run


# ---------------------------------------------------------------------------------------------------
# Collect + judge (shared by diagnose node and sweep)


def _nvml_snapshot(path: str | None, timeout: float) -> tuple[dict[str, Any], str]:
    from gpuguard.collectors import nvml

    if path is not None:
        return nvml.load_snapshot(path), f"file {path}"
    snap = nvml.collect(timeout)
    if snap.get("timed_out"):
        _warn(snap["reason"])
    return snap, "live"


def _kernel_log(spec: str | None, *, cursor: Any = None, timeout: float) -> Any:
    from gpuguard.collectors import kernel_log

    if spec == "-":
        return kernel_log.read_stream(sys.stdin.buffer, "-", timeout=timeout)
    if spec is not None:
        if not sys.stderr.isatty():
            return kernel_log.read_file(spec, cursor=cursor, timeout=timeout)
        with _ProgressBar(f"reading {spec}") as bar:
            return kernel_log.read_file(spec, cursor=cursor, timeout=timeout, progress=bar.start)
    return kernel_log.read_live(cursor=cursor, timeout=timeout)


class _ProgressBar:
    """A rich progress bar on stderr, shown only for big reads on a terminal (never when piped)."""

    MIN_BYTES = 64 * 1024 * 1024

    def __init__(self, label: str) -> None:
        self.label = label
        self.progress: Any = None

    def start(self, total: int, _done: int) -> Any:
        if total < self.MIN_BYTES:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        from gpuguard.cli._app import console

        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console(stderr=True),
            transient=True,
        )
        self.progress.start()
        task = self.progress.add_task(self.label, total=total)
        return lambda n: self.progress.advance(task, n)

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def _training_logs(paths: list[str]) -> tuple[list[Any], list[dict[str, Any]]]:
    """Events and per-file stats of `--log` files (gzip-compressed ones decompressed, pastes re-joined)."""
    from gpuguard.collectors import logscan
    from gpuguard.foundation.errors import DataError, NoInputError, from_os_error

    events: list[Any] = []
    stats: list[dict[str, Any]] = []
    for path in paths:
        if Path(path).is_dir():
            raise NoInputError(f"--log {path}: is a directory, not a log file")
        try:
            found, info = logscan.read_log(path)
        except OSError as exc:
            if logscan.is_corrupt_archive(exc):
                raise DataError(f"--log {path}: compressed log is truncated or corrupt ({exc})") from None
            raise from_os_error(exc, f"--log {path}") from None
        except (EOFError, ValueError) as exc:
            if logscan.is_corrupt_archive(exc) or "zlib" in type(exc).__module__:
                raise DataError(f"--log {path}: compressed log is truncated or corrupt ({exc})") from None
            raise
        except Exception as exc:
            if logscan.is_corrupt_archive(exc):
                raise DataError(f"--log {path}: compressed log is truncated or corrupt ({exc})") from None
            raise
        events.extend(found)
        stats.append({"path": path, **info, "events": len(found)})
    return events, stats


def _processes() -> dict[str, Any]:
    try:
        from gpuguard.collectors import processes

        return processes.collect()
    except Exception as exc:  # noqa: BLE001 - a process listing problem must not stop the diagnosis
        return {"schema": "gpuguard.processes/1", "status": "unknown", "reason": f"{type(exc).__name__}: {exc}"}


def build_document(
    snapshot: dict[str, Any] | None,
    nvml_source: str,
    log: Any,
    events: list[Any],
    thresholds: Any,
    since: float | None,
    started: float,
    processes: dict[str, Any] | None = None,
    extra_sections: dict[str, Any] | None = None,
    *,
    mode: str = "live",
    log_events: list[Any] | None = None,
    log_stats: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Judge and assemble the `gpuguard.node/1` document.

    snapshot None: NVML not examined (replay without --nvml-snapshot). log None: no kernel log read.
    log_events / log_stats: the `--log` training logs.
    """
    from gpuguard.diagnostics import node_verdict

    kernel_events = list(events)
    verdict = node_verdict.judge(
        snapshot,
        kernel_events + list(log_events or []),
        thresholds,
        since=since,
        kernel_log_status="ok" if log is None or log.status == "ok" else (log.reason or log.status),
        mode=mode,
        unread_lines=tuple(log.unread_lines) if log is not None else (),
    )
    now = time.time()
    doc: dict[str, Any] = {
        "schema": node_verdict.SCHEMA,
        "node": socket.gethostname(),
        "generated_at": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "generated_at_unix": round(now, 3),
    }
    doc.update(verdict.to_json())
    doc["exit_code"] = EXIT_BY_VERDICT[verdict.verdict]
    nvml_section: dict[str, Any] = (
        {
            "status": snapshot.get("status"),
            "reason": snapshot.get("reason"),
            "source": nvml_source,
            "driver_version": snapshot.get("driver_version"),
            "gpu_count": len(snapshot.get("gpus") or []),
        }
        if snapshot is not None
        else {"status": "not_examined", "reason": "replay: the node's NVML was not recorded", "source": None}
    )
    sections: dict[str, Any] = {
        "nvml": nvml_section,
        "kernel_log": log.section()
        if log is not None
        else {"status": "not_examined", "reason": "replay without --kernel-log", "source": None},
        "config": {"status": "ok", "source": thresholds.source},
    }
    if log_stats is not None:
        sections["logs"] = {"status": "ok", "files": log_stats}
    dropped = verdict.counts.get("events", 0) - verdict.counts.get("events_in_window", 0)
    if since is not None:
        sections["kernel_log"]["since"] = datetime.fromtimestamp(since, timezone.utc).isoformat(timespec="seconds")
        sections["kernel_log"]["dropped_by_since"] = dropped
    if processes is not None:
        sections["processes"] = {
            "status": processes.get("status"),
            "reason": processes.get("reason"),
            "count": len(processes.get("processes") or []),
        }
    sections.update(extra_sections or {})
    doc["sections"] = sections
    kernel_kinds = ("xid", "sxid", "gpu_lost", "gpu_fault")
    in_window = [e for e in kernel_events if since is None or e.timestamp is None or e.timestamp >= since]
    doc["events"] = [e.to_json() for e in in_window if e.kind in kernel_kinds][-200:]
    if log_events:
        doc["log_events"] = [e.to_json() for e in log_events if e.fields.get("fault") or e.kind in kernel_kinds][-200:]
    totals: dict[str, int] = {}
    for e in events:
        if e.kind == "xid" and isinstance(e.fields.get("xid"), int):
            key = f"{e.fields.get('pci_bus_id') or ''}|{e.fields['xid']}"
            totals[key] = totals.get(key, 0) + 1
    doc["xid_totals"] = totals
    lost: dict[str, int] = {}
    for e in events:
        if e.kind == "gpu_lost" or (e.kind == "xid" and e.fields.get("xid") == 79):
            key = str(e.fields.get("pci_bus_id") or "")
            lost[key] = lost.get(key, 0) + 1
    doc["gpu_lost_totals"] = lost
    faults: dict[str, int] = {}
    for e in events:
        if e.kind == "gpu_fault":
            key = f"{e.fields.get('pci_bus_id') or ''}|{e.fields.get('fault')}"
            faults[key] = faults.get(key, 0) + 1
    doc["fault_totals"] = faults
    doc["nvml"] = snapshot
    if processes is not None:
        doc["processes"] = processes.get("processes") or []
    doc["duration_s"] = round(time.monotonic() - started, 4)
    return doc, verdict


def _render(doc: dict[str, Any], fmt: str) -> int:
    if fmt == "json":
        emit_json(doc)
        return doc["exit_code"]
    from gpuguard.plugins.outputs import nagios_text, npd_line  # not for JSON: start-up time

    if fmt == "npd":
        code, line = npd_line(doc)
        print(line)
        return code
    if fmt == "nagios":
        code, text = nagios_text(doc)
        print(text)
        return code
    _render_human(doc)
    return doc["exit_code"]


_STYLE = {"healthy": "green", "degraded": "yellow", "reset": "red", "drain": "bold red", "unknown": "magenta"}


def _render_human(doc: dict[str, Any]) -> None:
    from rich.markup import escape

    from gpuguard.cli._app import console

    out = console()
    verdict = doc["verdict"]
    out.print(f"[bold]{escape(doc['node'])}[/bold]: [{_STYLE[verdict]}]{verdict.upper()}[/] - {escape(doc['summary'])}")
    for g in doc["gpus"]:
        label = f"GPU{g['index']}" if g["index"] is not None else "GPU?"
        name = f"  {g['name']}" if g.get("name") else ""
        out.print(
            f"\n[bold]{label}[/bold] {g['pci_bus_id'] or '?'}{escape(name)}  [{_STYLE[g['verdict']]}]{g['verdict']}[/]"
        )
        ev = g["evidence"]
        shown = [e for e in ev if e["verdict"] != "healthy"] + [e for e in ev if e["verdict"] == "healthy"]
        for e in shown[:6]:
            where = f" (line {e['line']})" if e.get("line") else ""
            out.print(f"  - [{_STYLE.get(e['verdict'], 'white')}]{e['verdict']}[/] {escape(e['message'])}{where}")
        if len(shown) > 6:
            out.print(f"  - ... {len(shown) - 6} more (--json for all)")
        if g["verdict"] != "healthy":
            out.print(f"  action: {escape(g['action'])}")
    if doc["evidence"]:
        out.print("\n[bold]node[/bold]")
    for e in doc["evidence"]:
        where = f" (line {e['line']})" if e.get("line") else ""
        out.print(f"  - [{_STYLE.get(e['verdict'], 'white')}]{e['verdict']}[/] {escape(e['message'])}{where}")
    for name, sec in doc["sections"].items():
        if isinstance(sec, dict) and sec.get("status") not in ("ok", None, "not_examined"):
            out.print(f"  {name}: {sec.get('status')} - {escape(str(sec.get('reason')))}")
    out.print(f"\n[bold]action[/bold]: {escape(doc['action'])}")
    out.print(escape(_read_summary(doc)))
    drain = doc.get("drain")
    if drain:
        import shlex

        out.print(
            f"drain: {escape(shlex.join(drain['command']))}" + (f" ({drain['result']})" if drain.get("result") else "")
        )


def _read_summary(doc: dict[str, Any]) -> str:
    """What was read, in words: the honest basis of the verdict (an all clear is not proof of health)."""
    secs = doc.get("sections") or {}
    parts: list[str] = []
    kl = secs.get("kernel_log") or {}
    if kl.get("status") == "not_examined":
        parts.append("kernel log: not examined")
    elif kl.get("source"):
        text = f"kernel log {kl['source']}: {kl.get('lines_read', 0)} lines, {kl.get('events', 0)} events"
        if kl.get("compressed"):
            text += " (gzip)"
        if kl.get("dropped_by_since"):
            text += f", {kl['dropped_by_since']} older than --since dropped"
        if kl.get("unread_lines"):
            text += f", {kl['unread_lines']} Xid-looking lines not readable"
        parts.append(text)
    for f in (secs.get("logs") or {}).get("files") or []:
        parts.append(f"log {f['path']}: {f.get('lines', 0)} lines, {f.get('events', 0)} events")
    nv = secs.get("nvml") or {}
    if nv.get("status") == "not_examined":
        parts.append("NVML: not examined (replay)")
    else:
        parts.append(f"NVML: {nv.get('status')} ({nv.get('source')})")
    text = f"read ({doc.get('mode', 'live')}): " + "; ".join(parts)
    if doc.get("verdict") == "healthy":
        text += "\nfound: no evidence of a fault in what was read; that is not proof of health"
    return text


# ---------------------------------------------------------------------------------------------------
# Commands


def _parse_options(pairs: list[str]) -> dict[str, dict[str, str]]:
    """`--output-option webhook.url=http://...` -> {"webhook": {"url": ...}}."""
    out: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot or not name or not option:
            raise UsageError(f"--output-option {pair!r}: expected NAME.KEY=VALUE")
        out.setdefault(name, {})[option] = value
    return out


# ---------------------------------------------------------------------------------------------------
# Output files (--dump-nvml): a new file, atomically, never through a link, never a missing directory


def write_textfile(path: str, doc: dict[str, Any]) -> str:
    """The Prometheus textfile, replaced atomically through `write_output_file` (a temp file in the
    same directory, renamed over the old one): never through a link, never into a missing directory
    (66, not created) and, as root, never into a directory another user controls (77)."""
    from prometheus_client import generate_latest

    from gpuguard.foundation.outfile import write_output_file
    from gpuguard.plugins.outputs import prometheus_registry

    if not str(path).endswith(".prom"):
        raise UsageError(f"textfile {path}: the node_exporter textfile collector only reads *.prom files")
    write_output_file(path, generate_latest(prometheus_registry(doc)), force=True, what="--textfile")
    return path


@_npd_exit_codes
def diagnose_node(
    *,
    kernel_log: str | None = None,
    nvml_snapshot: str | None = None,
    since: str | None = None,
    config: str | None = None,
    json_: bool = False,
    fmt: str | None = None,
    demo: bool = False,
    dump_nvml: str | None = None,
    force: bool = False,
    processes: bool | None = None,
    nvml_timeout: float = 10.0,
    timeout: float = 10.0,
    log: Sequence[str] = (),
    mode: str | None = None,
) -> int:
    """`gpu-doctor diagnose node` once its options are parsed (by typer, or by `cli._fast`)."""
    started = time.monotonic()
    out_fmt = _format(json_, fmt)
    if demo:
        kernel_log = kernel_log or str(SAMPLE_KERNEL_LOG)
        nvml_snapshot = nvml_snapshot or str(SAMPLE_NVML)
    if mode is None:
        mode = "replay" if (kernel_log is not None or log or nvml_snapshot is not None) else "live"
    if mode not in ("live", "replay"):
        raise UsageError(f"--mode {mode!r}: expected live or replay")
    cutoff = parse_since(since)
    if dump_nvml and (nvml_snapshot is not None or mode == "live"):
        from gpuguard.foundation.outfile import check_output_path

        check_output_path(dump_nvml, force=force, what="--dump-nvml")  # refuse before the probe, not after
    from gpuguard.diagnostics import node_thresholds

    thresholds = node_thresholds.load(config)
    klog = _kernel_log(kernel_log, timeout=timeout) if (kernel_log is not None or mode == "live") else None
    if klog is not None and klog.status != "ok":
        _warn(f"kernel log not read: {klog.reason}")
    log_events, log_stats = _training_logs(log) if log else ([], None)
    snapshot: dict[str, Any] | None
    if nvml_snapshot is not None or mode == "live":
        snapshot, nvml_source = _nvml_snapshot(nvml_snapshot, nvml_timeout)
    else:
        snapshot, nvml_source = None, "not examined"
    if dump_nvml:
        if snapshot is None:
            raise UsageError("--dump-nvml: NVML is not examined in replay mode; add --mode live (or --nvml-snapshot)")
        import json

        from gpuguard.foundation.outfile import write_output_file

        write_output_file(dump_nvml, (json.dumps(snapshot, indent=2) + "\n").encode(), force=force, what="--dump-nvml")
    procs = _processes() if (processes if processes is not None else mode == "live") else None
    doc, _ = build_document(
        snapshot,
        nvml_source,
        klog,
        list(klog.events) if klog is not None else [],
        thresholds,
        cutoff,
        started,
        procs,
        mode=mode,
        log_events=log_events,
        log_stats=log_stats,
    )
    return _render(doc, out_fmt)


@dataclass(frozen=True)
class SweepOptions:
    """`gpu-doctor sweep`'s options, checked and parsed: what one sweep reads, keeps and delivers."""

    state_dir: Path
    kernel_log: str | None = None
    nvml_snapshot: str | None = None
    retain_s: float = 86400.0
    textfile: str | None = None
    webhook: str | None = None
    webhook_timeout: float = 5.0
    webhook_retries: int = 2
    budget: float = 30.0
    outputs: tuple[str, ...] = ()  # extra gpuguard.outputs plugins, in order, without repeats
    output_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    drain: bool = False  # print the drain command on a drain verdict
    run_drain: bool = False  # run it
    node: str | None = None  # the Slurm node name; None: this host's short name
    out_fmt: str = "human"
    nvml_timeout: float = 10.0
    timeout: float = 10.0
    quiet: bool = False  # nothing on stdout when healthy


@_npd_exit_codes
def sweep_cmd(
    *,
    kernel_log: str | None = None,
    nvml_snapshot: str | None = None,
    config: str | None = None,
    state_dir: str | None = None,
    retain: str = "24h",
    textfile: str | None = None,
    webhook: str | None = None,
    webhook_timeout: float = 5.0,
    webhook_retries: int = 2,
    budget: float = 30.0,
    output: Sequence[str] = (),
    output_option: Sequence[str] = (),
    drain: bool = False,
    run_drain: bool = False,
    node: str | None = None,
    json_: bool = False,
    fmt: str | None = None,
    nvml_timeout: float = 10.0,
    timeout: float = 10.0,
    quiet: bool = False,
) -> int:
    """`gpu-doctor sweep` once its options are parsed (by typer, or by `cli._fast`)."""
    started = time.monotonic()
    out_fmt = _format(json_, fmt)
    retain_s = time.time() - parse_since(retain, now=time.time())
    if webhook_retries < 0 or webhook_retries > 10:
        raise UsageError("--webhook-retries must be between 0 and 10")
    output_options = _parse_options(output_option)
    from gpuguard.diagnostics import node_thresholds
    from gpuguard.doctor.sweep import SweepLock, default_state_dir

    thresholds = node_thresholds.load(config)
    options = SweepOptions(
        state_dir=Path(state_dir) if state_dir else default_state_dir(),
        kernel_log=kernel_log,
        nvml_snapshot=nvml_snapshot,
        retain_s=retain_s,
        textfile=textfile,
        webhook=webhook,
        webhook_timeout=webhook_timeout,
        webhook_retries=webhook_retries,
        budget=budget,
        outputs=tuple(dict.fromkeys(output)),
        output_options=output_options,
        drain=drain,
        run_drain=run_drain,
        node=node,
        out_fmt=out_fmt,
        nvml_timeout=nvml_timeout,
        timeout=timeout,
        quiet=quiet,
    )
    with SweepLock(options.state_dir, wait=min(10.0, budget), create_parents=state_dir is None):
        return run_sweep(options, thresholds, started=started)


def run_sweep(options: SweepOptions, thresholds: Any, *, started: float) -> int:
    """One sweep, under the state directory's lock: read, retain, judge, save, deliver, drain, render."""
    from gpuguard.doctor import sweep

    state_file = options.state_dir / sweep.STATE_FILE
    state, notes = sweep.load_state(state_file)
    for note in notes:
        _warn(note)
    log = _kernel_log(options.kernel_log, cursor=state["cursor"], timeout=options.timeout)
    if log.status != "ok":
        _warn(f"kernel log not read: {log.reason}")
    kept = sweep.retain(state, log.events, cursor=log.cursor, now=time.time(), retain_s=options.retain_s)
    snapshot, nvml_source = _nvml_snapshot(options.nvml_snapshot, options.nvml_timeout)
    extra = {
        "state": {
            "status": "ok",
            "path": str(state_file),
            "retained_events": len(kept.events),
            "new_events": kept.new_events,
        }
    }
    doc, verdict = build_document(
        snapshot,
        nvml_source,
        log,
        list(kept.events),
        thresholds,
        None,
        started,
        extra_sections=extra,
        mode="replay" if options.nvml_snapshot is not None else "live",
    )
    doc["xid_totals"] = dict(kept.state["xid_totals"])
    previous = kept.state["last_verdict"]
    # saved before the outputs: a crashing notifier never loses the cursor
    sweep.save_state(state_file, {**kept.state, "last_verdict": verdict.verdict})

    results = _deliver(doc, verdict, previous, options)
    doc["outputs"] = [r.to_json() for r in results]
    for r in results:
        if r.status != "ok":
            _warn(f"output {r.name} failed: {r.message}")
    if (options.drain or options.run_drain) and verdict.verdict == "drain":
        from gpuguard.recovery.operator.actions import drain_command, drain_command_line, drain_node

        node = options.node or socket.gethostname().split(".")[0]
        cmd = drain_command(node, verdict.summary)
        doc["drain"] = {
            "command": cmd,
            "ran": options.run_drain,
            "result": drain_node(node, verdict.summary, timeout_s=10.0).summary if options.run_drain else None,
        }
        if options.out_fmt in ("npd", "nagios"):
            print(f"gpu-doctor: drain: {drain_command_line(node, verdict.summary)}", file=sys.stderr)
    doc["duration_s"] = round(time.monotonic() - started, 4)
    if options.quiet and doc["exit_code"] == EXIT_OK:
        return EXIT_OK  # healthy: the textfile, the webhook and the state are written; stdout stays empty
    return _render(doc, options.out_fmt)


def _deliver(doc: dict[str, Any], verdict: Any, previous: str | None, options: SweepOptions) -> list[Any]:
    """The textfile, the webhook (when unhealthy or just recovered), then the plugins, within the budget."""
    from gpuguard.plugins import outputs as builtin
    from gpuguard.plugins.registry import load, run_safely

    deadline = time.monotonic() + options.budget
    results = []
    textfile, webhook = options.textfile, options.webhook
    if textfile:
        results.append(
            run_safely(
                "gpuguard.outputs",
                "prometheus",
                lambda: write_textfile(textfile, doc),
            )
        )
    if webhook and (verdict.verdict != "healthy" or (previous not in (None, "healthy"))):
        left = max(0.1, deadline - time.monotonic())
        results.append(
            run_safely(
                "gpuguard.outputs",
                "webhook",
                lambda: builtin.post_webhook(
                    webhook,
                    builtin.webhook_payload(doc, resolved=verdict.verdict == "healthy"),
                    timeout=options.webhook_timeout,
                    retries=options.webhook_retries,
                    budget=left,
                ),
            )
        )
    if options.outputs:
        plugins, failures = load("gpuguard.outputs", list(options.outputs))
        for f in failures:
            results.append(_failed(f))
        for name, cls in plugins.items():
            if time.monotonic() > deadline:
                results.append(run_safely("gpuguard.outputs", name, _budget_spent))
                continue
            opts = dict(options.output_options.get(name, {}))
            results.append(run_safely("gpuguard.outputs", name, lambda cls=cls, opts=opts: cls(opts).emit(doc)))
    return results


def plugins_cmd(
    *,
    json_: bool = False,
) -> int:
    """`gpu-doctor plugins` once its options are parsed (by typer, or by `cli._fast`)."""
    from gpuguard.plugins.registry import discover

    found = discover()
    if json_:
        emit_json({"schema": "gpuguard.plugins/1", "plugins": [p.to_json() for p in found]})
        return EXIT_OK
    if not found:
        print("no plugins installed")
    for p in found:
        origin = f"{p.distribution} {p.version}" if p.distribution else "?"
        line = f"{p.group:<20} {p.name:<14} {p.status:<7} {p.target}  ({origin})"
        if p.error:
            line += f"  error: {p.error}"
        print(line)
    return EXIT_OK


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add `diagnose node`, `sweep` and `plugins` to the gpu-doctor app: the typer signatures (help,
    completion) wrap the plain functions above (`cli._fast` calls `diagnose_node` without typer)."""
    import typer

    def _diagnose_node(
        kernel_log: str | None = typer.Option(
            None,
            "--kernel-log",
            metavar="FILE|-",
            help="Kernel log to read (a file, or - for stdin). Default: dmesg, else journalctl -k, else /var/log/kern.log.",
        ),
        nvml_snapshot: str | None = typer.Option(
            None, "--nvml-snapshot", metavar="FILE", help="A recorded gpuguard.nvml/1 snapshot instead of live NVML."
        ),
        since: str | None = typer.Option(
            None,
            "--since",
            metavar="D",
            help="Only kernel-log events newer than D (30m, 2h, 7d, ISO time). A log file is judged whole otherwise.",
        ),
        config: str | None = typer.Option(None, "--config", metavar="FILE", help="Thresholds YAML override."),
        json_: bool = typer.Option(False, "--json", help="Print the gpuguard.node/1 JSON document."),
        fmt: str | None = typer.Option(None, "--format", metavar="human|json|npd|nagios", help="Output format."),
        demo: bool = typer.Option(False, "--demo", help="Use the bundled sample kernel log and NVML snapshot."),
        dump_nvml: str | None = typer.Option(
            None,
            "--dump-nvml",
            metavar="FILE",
            help="Also save the NVML snapshot (replay it with --nvml-snapshot). A new file in an existing directory: "
            "73 if FILE exists (see --force), 66 if its directory is missing, 65 if FILE or its directory is a link.",
        ),
        force: bool = typer.Option(
            False, "--force", help="Let --dump-nvml replace an existing regular file (never a link or a directory)."
        ),
        processes: bool | None = typer.Option(
            None, "--processes/--no-processes", help="List torchrun agents/workers (default: on for live runs)."
        ),
        nvml_timeout: float = typer.Option(10.0, "--nvml-timeout", metavar="S", help="Deadline of the NVML probe."),
        timeout: float = typer.Option(10.0, "--timeout", metavar="S", help="Deadline of each kernel-log source."),
        log: list[str] = typer.Option(
            [],
            "--log",
            metavar="FILE",
            help="A training / job log (repeatable, .gz ok): CUDA / NCCL hardware errors in it (uncorrectable ECC, "
            "NVLink, GPU lost, fabric not initialised) count as node evidence, with rank and host.",
        ),
        mode: str | None = typer.Option(
            None,
            "--mode",
            metavar="live|replay",
            help="live: judge this node (NVML absent = a finding). replay: judge the files given (NVML of this "
            "machine is not evidence; not examined unless --nvml-snapshot). Default: replay when --kernel-log, "
            "--log or --nvml-snapshot is given, else live.",
        ),
    ) -> int:
        """Per-GPU and node verdict: healthy, degraded, reset, drain or unknown, with evidence and action.

        Two modes: live (on the node: dmesg/journal + NVML; a driver that does not answer is a finding) and
        replay (files from a node, read anywhere: the verdict comes from the evidence given, and NVML is "not
        examined" unless --nvml-snapshot). "healthy" means no evidence of a fault in what was read.
        """
        return diagnose_node(**locals())

    def _sweep_cmd(
        kernel_log: str | None = typer.Option(
            None, "--kernel-log", metavar="FILE", help="Kernel log file (read incrementally). Default: live sources."
        ),
        nvml_snapshot: str | None = typer.Option(
            None, "--nvml-snapshot", metavar="FILE", help="A recorded NVML snapshot instead of live NVML."
        ),
        config: str | None = typer.Option(None, "--config", metavar="FILE", help="Thresholds YAML override."),
        state_dir: str | None = typer.Option(
            None,
            "--state-dir",
            metavar="DIR",
            envvar=STATE_DIR_ENV,
            help="Where the kernel-log cursor and recent events are kept "
            "(default /var/lib/gpuguard as root, else ~/.local/state/gpuguard).",
        ),
        retain: str = typer.Option(
            "24h",
            "--retain",
            metavar="D",
            help="How long a kernel-log event keeps counting after the sweep that saw it.",
        ),
        textfile: str | None = typer.Option(
            None, "--textfile", metavar="FILE.prom", help="Write Prometheus metrics here (atomic rename)."
        ),
        webhook: str | None = typer.Option(
            None, "--webhook", metavar="URL", help="POST an Alertmanager-style payload when unhealthy or recovered."
        ),
        webhook_timeout: float = typer.Option(5.0, "--webhook-timeout", metavar="S"),
        webhook_retries: int = typer.Option(2, "--webhook-retries", metavar="N"),
        budget: float = typer.Option(
            30.0, "--budget", metavar="S", help="Total time the outputs (webhook, plugins) may take."
        ),
        output: list[str] = typer.Option(
            [], "--output", metavar="NAME", help="Also run this gpuguard.outputs plugin (repeatable)."
        ),
        output_option: list[str] = typer.Option(
            [], "--output-option", metavar="NAME.KEY=VALUE", help="An option for an output plugin (repeatable)."
        ),
        drain: bool = typer.Option(False, "--drain", help="On a drain verdict, print the Slurm drain command."),
        run_drain: bool = typer.Option(False, "--run-drain", help="On a drain verdict, run it (implies --drain)."),
        node: str | None = typer.Option(None, "--node", metavar="NAME", help="Slurm node name (default: host)."),
        json_: bool = typer.Option(False, "--json", help="Print the gpuguard.node/1 JSON document."),
        fmt: str | None = typer.Option(None, "--format", metavar="human|json|npd|nagios", help="Output format."),
        nvml_timeout: float = typer.Option(10.0, "--nvml-timeout", metavar="S"),
        timeout: float = typer.Option(10.0, "--timeout", metavar="S", help="Deadline of the kernel-log read."),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="Print nothing on stdout when the node is healthy (cron mails any output)."
        ),
    ) -> int:
        """The cron entry: diagnose, keep state, write the textfile, notify, optionally drain."""
        return sweep_cmd(**locals())

    def _plugins_cmd(json_: bool = typer.Option(False, "--json", help="Print gpuguard.plugins/1 JSON.")) -> int:
        """List installed plugins (collectors, outputs, actions) and whether each loads."""
        return plugins_cmd(**locals())

    diagnose.command("node")(_diagnose_node)
    app.command("sweep")(_sweep_cmd)
    app.command("plugins")(_plugins_cmd)


def _failed(info: Any) -> Any:
    from gpuguard.plugins.registry import PluginResult

    return PluginResult(info.group, info.name, "failed", info.error or "failed to load", 0.0)


def _budget_spent() -> str:
    from gpuguard.foundation.errors import UnavailableError

    raise UnavailableError("output budget spent before this plugin ran")
