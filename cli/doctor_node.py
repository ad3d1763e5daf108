"""`gpu-doctor diagnose node`, `gpu-doctor sweep` and `gpu-doctor plugins`.

Thin shell: options in, a doctor service call, rendering out. The joins are the doctor's:
`doctor.node_diagnosis` reads (NVML, kernel log, training logs, processes) and judges, `doctor.sweeper`
runs one sweep (state, retention, lock, outputs, the Slurm drain of `doctor.drain`). Each command
imports its service when it runs, and heavy modules (rich, prometheus_client, requests, psutil) only on
the paths that need them, so `diagnose node --json` stays a fraction of a second and never imports torch.

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
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from gpuguard.cli._app import emit_json
from gpuguard.cli._text import echo
from gpuguard.foundation.env import STATE_DIR_ENV
from gpuguard.foundation.errors import EXIT_OK, GpuguardError, UsageError, from_os_error

if TYPE_CHECKING:
    import typer

DATA = Path(__file__).resolve().parents[1] / "collectors" / "data"
SAMPLE_KERNEL_LOG = DATA / "sample-kern.log"
SAMPLE_NVML = DATA / "sample-nvml.json"
_PROGRESS_MIN_BYTES = 64 << 20  # a kernel log worth drawing a bar for
FORMATS = ("human", "json", "npd", "nagios")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.I)
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


@overload
def parse_since(text: str, now: float | None = None) -> float: ...
@overload
def parse_since(text: None, now: float | None = None) -> None: ...
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
# Rendering


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
        pci = g["pci_bus_id"] if g["pci_bus_id"] and not str(g["pci_bus_id"]).startswith("index:") else "?"
        out.print(f"\n[bold]{label}[/bold] {pci}{escape(name)}  [{_STYLE[g['verdict']]}]{g['verdict']}[/]")
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

        for command in drain.get("commands") or [drain["command"]]:
            out.print(f"drain: {escape(shlex.join(command))}")
        if drain.get("result"):
            out.print(f"drain: {escape(str(drain['result']))}")


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
    job = (doc.get("counts") or {}).get("job_events") or 0
    if job:
        import shlex

        files = [kl["source"]] if kl.get("source") and kl.get("status") == "ok" else []
        files += [f["path"] for f in (secs.get("logs") or {}).get("files") or []]
        where = " ".join(shlex.quote(str(f)) for f in files) if files else "FILE"
        text += f"\nalso: {job} job-level event(s) (collectives, CUDA, NIC), not node evidence: gpu-doctor logs {where}"
    return text


# ---------------------------------------------------------------------------------------------------
# Commands


def _parse_options(pairs: Sequence[str]) -> dict[str, dict[str, str]]:
    """`--output-option webhook.url=http://...` -> {"webhook": {"url": ...}}."""
    out: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot or not name or not option:
            raise UsageError(f"--output-option {pair!r}: expected NAME.KEY=VALUE")
        out.setdefault(name, {})[option] = value
    return out


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
    from gpuguard.doctor.node_diagnosis import NodeRequest, diagnose

    request = NodeRequest(
        mode=mode,
        kernel_log=kernel_log,
        nvml_snapshot=nvml_snapshot,
        since=cutoff,
        logs=tuple(log),
        processes=processes if processes is not None else mode == "live",
        nvml_timeout=nvml_timeout,
        timeout=timeout,
    )
    thresholds = node_thresholds.load(config)
    from gpuguard.cli._progress import ProgressBar

    with ProgressBar(in_bytes=True, enabled=kernel_log not in (None, "-")) as bar:

        def progress(total: int, _done: int) -> Callable[[int], None] | None:
            return bar.ticker(f"reading {kernel_log}", total) if total >= _PROGRESS_MIN_BYTES else None

        result = diagnose(request, thresholds, started=started, warn=_warn, progress=progress)
    if dump_nvml:
        if result.snapshot is None:
            raise UsageError("--dump-nvml: NVML is not examined in replay mode; add --mode live (or --nvml-snapshot)")
        import json

        from gpuguard.foundation.outfile import write_output_file

        text = json.dumps(result.snapshot, indent=2) + "\n"
        write_output_file(dump_nvml, text.encode(), force=force, what="--dump-nvml")
    return _render(result.document, out_fmt)


def sweep_options(
    *,
    kernel_log: str | None = None,
    nvml_snapshot: str | None = None,
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
    drain_via: str = "slurm",
    node: str | None = None,
    nvml_timeout: float = 10.0,
    timeout: float = 10.0,
) -> Any:
    """The sweep's options (shared by `sweep` and `watch node`), checked: a `doctor.sweeper.SweepOptions`."""
    retain_s = time.time() - parse_since(retain, now=time.time())
    if webhook_retries < 0 or webhook_retries > 10:
        raise UsageError("--webhook-retries must be between 0 and 10")
    output_options = _parse_options(output_option)
    if drain_via not in ("slurm", "kubernetes"):
        raise UsageError(f"--drain-via {drain_via!r}: expected slurm or kubernetes")
    from gpuguard.doctor.publish import PublishOptions
    from gpuguard.doctor.sweep import default_state_dir
    from gpuguard.doctor.sweeper import SweepOptions

    return SweepOptions(
        state_dir=Path(state_dir) if state_dir else default_state_dir(),
        kernel_log=kernel_log,
        nvml_snapshot=nvml_snapshot,
        retain_s=retain_s,
        publish=PublishOptions(
            textfile=textfile,
            webhook=webhook,
            webhook_timeout=webhook_timeout,
            webhook_retries=webhook_retries,
            budget=budget,
            outputs=tuple(dict.fromkeys(output)),
            output_options=output_options,
        ),
        drain=drain,
        run_drain=run_drain,
        drain_via=drain_via,
        node=node,
        nvml_timeout=nvml_timeout,
        timeout=timeout,
        create_parents=state_dir is None,
    )


@_npd_exit_codes
def sweep_cmd(
    *, config: str | None = None, json_: bool = False, fmt: str | None = None, quiet: bool = False, **sweep_kw: Any
) -> int:
    """`gpu-doctor sweep` once its options are parsed (by typer): `sweep_kw` are `sweep_options`'s keywords."""
    started = time.monotonic()
    out_fmt = _format(json_, fmt)
    from gpuguard.diagnostics import node_thresholds
    from gpuguard.doctor.sweeper import sweep

    options = sweep_options(**sweep_kw)
    thresholds = node_thresholds.load(config)
    doc = sweep(options, thresholds, started=started, warn=_warn)
    if doc.get("drain") and out_fmt in ("npd", "nagios"):
        import shlex

        for command in doc["drain"].get("commands") or [doc["drain"]["command"]]:
            print(f"gpu-doctor: drain: {shlex.join(command)}", file=sys.stderr)
    if quiet and doc["exit_code"] == EXIT_OK:
        return EXIT_OK  # healthy: the textfile, the webhook and the state are written; stdout stays empty
    return _render(doc, out_fmt)


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
        echo("no plugins installed")
    for p in found:
        origin = f"{p.distribution} {p.version}" if p.distribution else "?"
        line = f"{p.group:<20} {p.name:<14} {p.status:<7} {p.target}  ({origin})"
        if p.error:
            line += f"  error: {p.error}"
        echo(line, hang=4)
    return EXIT_OK


def _diagnose_node_command() -> Callable[..., int]:
    """`diagnose node`'s typer signature (help, completion) over `diagnose_node`."""
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

    return _diagnose_node


def sweep_option(name: str) -> Any:
    """The typer option of one of the sweep's options, shared by `sweep` and `watch node` (typer must be
    importable: called in a command signature built after the app is)."""
    import typer

    options: dict[str, Any] = {
        "nvml_snapshot": lambda: typer.Option(
            None, "--nvml-snapshot", metavar="FILE", help="A recorded NVML snapshot instead of live NVML."
        ),
        "config": lambda: typer.Option(None, "--config", metavar="FILE", help="Thresholds YAML override."),
        "state_dir": lambda: typer.Option(
            None,
            "--state-dir",
            metavar="DIR",
            envvar=STATE_DIR_ENV,
            help="Where the kernel-log cursor and recent events are kept "
            "(default /var/lib/gpuguard as root, else ~/.local/state/gpuguard).",
        ),
        "retain": lambda: typer.Option(
            "24h", "--retain", metavar="D", help="How long a kernel-log event keeps counting after it was seen."
        ),
        "textfile": lambda: typer.Option(
            None, "--textfile", metavar="FILE.prom", help="Write Prometheus metrics here (atomic rename)."
        ),
        "webhook": lambda: typer.Option(
            None, "--webhook", metavar="URL", help="POST an Alertmanager-style payload when unhealthy or recovered."
        ),
        "webhook_timeout": lambda: typer.Option(5.0, "--webhook-timeout", metavar="S"),
        "webhook_retries": lambda: typer.Option(2, "--webhook-retries", metavar="N"),
        "budget": lambda: typer.Option(
            30.0, "--budget", metavar="S", help="Total time the outputs (webhook, plugins) may take."
        ),
        "output": lambda: typer.Option(
            [], "--output", metavar="NAME", help="Also run this gpuguard.outputs plugin (repeatable)."
        ),
        "output_option": lambda: typer.Option(
            [], "--output-option", metavar="NAME.KEY=VALUE", help="An option for an output plugin (repeatable)."
        ),
        "drain": lambda: typer.Option(False, "--drain", help="On a drain verdict, print the drain command."),
        "run_drain": lambda: typer.Option(
            False, "--run-drain", help="On a drain verdict, run it (implies --drain; once per drain verdict)."
        ),
        "drain_via": lambda: typer.Option(
            "slurm",
            "--drain-via",
            metavar="slurm|kubernetes",
            help="scontrol drain, or kubectl taint gpuguard.io/gpu-health=drain:NoSchedule + reason annotation.",
        ),
        "node": lambda: typer.Option(
            None, "--node", metavar="NAME", help="Slurm / Kubernetes node name (default: host)."
        ),
        "nvml_timeout": lambda: typer.Option(10.0, "--nvml-timeout", metavar="S"),
        "timeout": lambda: typer.Option(10.0, "--timeout", metavar="S", help="Deadline of one kernel-log read."),
    }
    return options[name]()


def _sweep_command() -> Callable[..., int]:
    """`sweep`'s typer signature over `sweep_cmd`."""
    import typer

    opt = sweep_option

    def _sweep_cmd(
        kernel_log: str | None = typer.Option(
            None, "--kernel-log", metavar="FILE", help="Kernel log file (read incrementally). Default: live sources."
        ),
        nvml_snapshot: str | None = opt("nvml_snapshot"),
        config: str | None = opt("config"),
        state_dir: str | None = opt("state_dir"),
        retain: str = opt("retain"),
        textfile: str | None = opt("textfile"),
        webhook: str | None = opt("webhook"),
        webhook_timeout: float = opt("webhook_timeout"),
        webhook_retries: int = opt("webhook_retries"),
        budget: float = opt("budget"),
        output: list[str] = opt("output"),
        output_option: list[str] = opt("output_option"),
        drain: bool = opt("drain"),
        run_drain: bool = opt("run_drain"),
        drain_via: str = opt("drain_via"),
        node: str | None = opt("node"),
        json_: bool = typer.Option(False, "--json", help="Print the gpuguard.node/1 JSON document."),
        fmt: str | None = typer.Option(None, "--format", metavar="human|json|npd|nagios", help="Output format."),
        nvml_timeout: float = opt("nvml_timeout"),
        timeout: float = opt("timeout"),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="Print nothing on stdout when the node is healthy (cron mails any output)."
        ),
    ) -> int:
        """The cron entry: diagnose, keep state, write the textfile, notify, optionally drain."""
        return sweep_cmd(**locals())

    return _sweep_cmd


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add `diagnose node`, `sweep` and `plugins` to the gpu-doctor app: the typer signatures (help,
    completion) wrap the plain functions above (`cli._fast` calls `diagnose_node` without typer)."""
    import typer

    def _plugins_cmd(json_: bool = typer.Option(False, "--json", help="Print gpuguard.plugins/1 JSON.")) -> int:
        """List installed plugins (collectors, outputs, actions) and whether each loads."""
        return plugins_cmd(**locals())

    diagnose.command("node")(_diagnose_node_command())
    app.command("sweep")(_sweep_command())
    app.command("plugins")(_plugins_cmd)
