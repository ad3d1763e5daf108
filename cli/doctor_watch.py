"""`gpu-doctor watch node`: the sweep as a long-running watcher (`doctor.watcher`).

Thin shell: the sweep's options (`doctor_node.sweep_options`), the watcher's own (poll interval, NVML
interval), and one line per judgement on stdout: `--format npd` the node-problem-detector line, `--json`
one `gpuguard.node/1` document per line, else a short human line. Imports its service when it runs.

Exit codes: 0 after SIGTERM / SIGINT (the state saved), or when a followed stream (`--kernel-log -`)
ends; 64 usage, 65 malformed input, 66 missing input, 73 output cannot be created, 75 another sweep or
watcher holds the state directory, 77 permission denied.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from gpuguard.cli.doctor_node import _format, _warn, sweep_option, sweep_options
from gpuguard.foundation.errors import UsageError

if TYPE_CHECKING:
    import typer


def _emitter(fmt: str) -> Any:
    """One line per judgement, flushed at once (a pipe to node-problem-detector or a log shipper)."""
    if fmt == "json":
        return lambda doc: print(json.dumps(doc, default=str), flush=True)
    if fmt == "npd":
        from gpuguard.plugins.outputs import npd_line

        return lambda doc: print(npd_line(doc)[1], flush=True)
    return lambda doc: print(f"{time.strftime('%H:%M:%S')} {doc['verdict']}: {doc['summary']}", flush=True)


def watch_node(
    *,
    config: str | None = None,
    json_: bool = False,
    fmt: str | None = None,
    poll: float = 0.25,
    nvml_interval: float = 60.0,
    max_judgements: int = 0,
    **sweep_kw: Any,
) -> int:
    """`gpu-doctor watch node` once its options are parsed: `sweep_kw` are `doctor_node.sweep_options`'s."""
    out_fmt = _format(json_, fmt)
    if out_fmt == "nagios":
        raise UsageError("--format nagios is for one check; watch node prints human, json or npd lines")
    if not 0.01 <= poll <= 60:
        raise UsageError("--poll must be between 0.01 and 60 seconds")
    if not 1 <= nvml_interval <= 86400:
        raise UsageError("--nvml-interval must be between 1 and 86400 seconds")
    from gpuguard.diagnostics import node_thresholds
    from gpuguard.doctor.watcher import Watcher, WatchOptions

    options = sweep_options(**sweep_kw)
    thresholds = node_thresholds.load(config)
    watch = WatchOptions(options, poll_s=poll, nvml_interval_s=nvml_interval, max_judgements=max_judgements)
    return Watcher(watch, thresholds, emit=_emitter(out_fmt), warn=_warn).run()


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add `watch node` to the gpu-doctor app."""
    import typer

    opt = sweep_option

    def _watch_node(
        kernel_log: str | None = typer.Option(
            None,
            "--kernel-log",
            metavar="PATH|-",
            help="Follow this file, FIFO, terminal or - (stdin) instead of /dev/kmsg (else journalctl -k -f).",
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
        json_: bool = typer.Option(False, "--json", help="One gpuguard.node/1 document per line."),
        fmt: str | None = typer.Option(None, "--format", metavar="human|json|npd", help="Line format."),
        poll: float = typer.Option(0.25, "--poll", metavar="S", help="How often a regular file is looked at."),
        nvml_interval: float = typer.Option(
            60.0, "--nvml-interval", metavar="S", help="NVML probed at least this often (at once on an NVML event)."
        ),
        nvml_timeout: float = opt("nvml_timeout"),
        timeout: float = opt("timeout"),
        max_judgements: int = typer.Option(0, "--max-judgements", metavar="N", help="Stop after N (0: never)."),
    ) -> int:
        """Watch this node: re-judge within a second of new kernel-log or NVML evidence (the sweep as a daemon)."""
        return watch_node(**locals())

    watch.command("node")(_watch_node)
