"""`gpu-doctor diagnose job`, `gpu-doctor watch job` and `gpu-doctor plan checkpoint|layout|collective`.

Thin shell: `doctor.job_diagnosis` reads the per-rank step records and the process table and runs the
vote (`diagnostics.vote`); this module parses options and renders. Never imports torch.

Exit codes (diagnose/watch): 0 all healthy, 1 some rank slow, 2 some rank dead or hung, 3 unknown (no
records); 64 usage, 65 bad config, 66 job directory missing. Plans: 0, or 64 on bad arguments.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from gpuguard.cli._app import emit_json, job_dir_option, safe_line, safe_text, stdout_is_terminal
from gpuguard.cli._text import NARROW, columns, echo, echo_lines, lines_for
from gpuguard.foundation.errors import EXIT_OK, EXIT_UNKNOWN, NoInputError

_COLOR = {"healthy": "green", "slow": "yellow", "hung": "red", "dead": "bold red", "unknown": "magenta"}
_BARS = "▁▂▃▄▅▆▇█"


def assess(job_dir: str | Path, **kw: Any) -> tuple[Any, dict[str, Any], Any]:
    """(JobVerdict, gpuguard.job/1 document, JobRecords): `doctor.job_diagnosis.assess`, keywords as there."""
    from gpuguard.doctor.job_diagnosis import assess as diagnose

    result = diagnose(job_dir, **kw)
    return result.verdict, result.document, result.records


def sparkline(values: list[float], top: float) -> str:
    if not values:
        return ""
    top = top or max(values) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1)))] for v in values)


def render(doc: dict[str, Any], width: int | None = None):  # -> rich renderable
    """The verdict and a table of ranks at `NARROW` columns and more; below, the plain lines broken
    between words (`plain_lines`): a table squeezed to 80 columns folds its cells mid-number."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if width is not None and width < NARROW:
        lines = lines_for(plain_lines(doc), width)
        head = Text(lines[0], no_wrap=True)
        head.stylize(_COLOR.get(doc["verdict"], ""), 4, 4 + len(doc["verdict"]))
        return Group(head, *(Text(line, no_wrap=True) for line in lines[1:]))

    per = doc["cohort_step_s"]["period"]
    comp = doc["cohort_step_s"]["compute"]
    head = Text.assemble(
        ("job ", "bold"),
        (doc["verdict"].upper(), _COLOR.get(doc["verdict"], "")),
        f"  {safe_text(doc['reason'])}\n",
        f"cohort step period: n={per['n']} p50={per['p50']:.3f}s p90={per['p90']:.3f}s p99={per['p99']:.3f}s "
        f"p99.9={per['p999']:.3f}s   own compute p50={comp['p50']:.3f}s p99={comp['p99']:.3f}s"
        f"{_approximate(per, comp)}",
    )
    for extra in (_impact_line(doc), _post_mortem_line(doc)):
        if extra:
            head.append(f"\n{safe_text(extra)}")
    table = Table(show_edge=False, pad_edge=False)
    for col in ("rank", "verdict", "phase", "age", "own p50/p99", "compute", "last steps", "why"):
        table.add_column(col, overflow="fold" if col == "why" else "ellipsis", no_wrap=col != "why")
    top = per["p99"] * 1.5 or 1.0
    shown, hidden = _rows_to_show(doc["ranks"])
    for r in shown:
        own = r.get("own_step_s", {})
        phase = r.get("phase", "-")
        if phase == "collective":
            phase = f"coll {r.get('collective_seq')}"
        elif r.get("step", -1) >= 0:
            phase = f"{phase} {r['step']}"
        mark = _mark(r)
        table.add_row(
            str(r["rank"]),
            Text(r["verdict"] + mark, _COLOR.get(r["verdict"], "")),
            phase,
            f"{r.get('phase_age_s', 0):.1f}s",
            f"{own.get('p50', 0):.3f}/{own.get('p99', 0):.3f}",
            f"{r.get('own_compute_recent_s', 0):.3f}",
            sparkline(r.get("recent_periods_s", [])[-30:], top),
            safe_text(r["reason"]),
        )
    if hidden:
        table.add_row("…", Text("healthy", "green"), "", "", "", "", "", f"{hidden} more healthy rank(s) not shown")
    steps = Text(safe_text("next: " + "\n      ".join(doc["next_steps"])))
    old = [Text(safe_text(line)) for line in _superseded_lines(doc)]
    return Group(head, table, *old, steps)


MAX_HEALTHY_ROWS = 32


def _superseded_lines(doc: dict[str, Any], limit: int = 16) -> list[str]:
    """Earlier generations' incarnations, apart from the job's ranks (one line each, a screenful)."""
    old = doc.get("superseded") or []
    lines = [f"earlier generation: rank {r['rank']} {r['verdict']}: {r['reason']}" for r in old[:limit]]
    if len(old) > limit:
        lines.append(f"earlier generation: ... {len(old) - limit} more (--json lists them)")
    return lines


def _mark(rank: dict[str, Any]) -> str:
    """' (culprit)', ' (victim of rank 3)' or nothing: who is to blame, next to the verdict."""
    if rank.get("culprit"):
        return " (culprit)"
    if rank.get("blocked_by"):
        return f" (victim of rank {', '.join(str(b) for b in rank['blocked_by'][:4])})"
    return ""


def _post_mortem_line(doc: dict[str, Any]) -> str:
    """When ranks were read from logs: the time they were judged as of (the logs' newest line)."""
    pm = doc.get("post_mortem")
    if not pm:
        return ""
    if pm.get("as_of") is None:
        return "post-mortem: the logs carry no timestamps: ages are the files' ages"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pm["as_of"]))
    return f"post-mortem: ranks {_span(tuple(pm['ranks']))} judged from their logs as of {when}, the last line"


def _impact_line(doc: dict[str, Any]) -> str:
    """'impact: job step ...' when the document has one that the reason does not already say."""
    line = (doc.get("impact") or {}).get("line", "")
    return f"impact: {line}" if line and line not in doc["reason"] else ""


def _rows_to_show(ranks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Every rank that is not healthy, and healthy ones up to a screenful (10,000 rows help nobody)."""
    bad = [r for r in ranks if r["verdict"] != "healthy"]
    good = [r for r in ranks if r["verdict"] == "healthy"]
    keep = good[:MAX_HEALTHY_ROWS]
    shown = sorted(bad + keep, key=lambda r: r["rank"])
    return shown, len(good) - len(keep)


def _approximate(*dists: dict[str, Any]) -> str:
    """' (quantiles within 1 %)' when the cohort had more step values than are kept exactly, else ''."""
    errors = [d.get("relative_error", 0.0) for d in dists if d.get("exact") is False]
    return f" (quantiles within {max(errors):.0%})" if errors else ""


def plain_lines(doc: dict[str, Any]) -> list[str]:
    """The verdict as plain lines: one per rank shown (control characters escaped; not yet wrapped)."""
    per, comp = doc["cohort_step_s"]["period"], doc["cohort_step_s"]["compute"]
    lines = [safe_line(f"job {doc['verdict'].upper()}: {doc['reason']}")]
    lines.append(
        f"cohort step period n={per['n']} p50={per['p50']:.4f}s p90={per['p90']:.4f}s p99={per['p99']:.4f}s "
        f"p99.9={per['p999']:.4f}s; own compute p50={comp['p50']:.4f}s p99={comp['p99']:.4f}s"
        f"{_approximate(per, comp)}"
    )
    lines += [safe_line(extra) for extra in (_impact_line(doc), _post_mortem_line(doc)) if extra]
    top = per["p99"] * 1.5 or 1.0
    shown, hidden = _rows_to_show(doc["ranks"])
    for r in shown:
        lines.append(
            safe_line(
                f"rank {r['rank']}: {r['verdict']}{_mark(r)} [{r.get('phase', '-')} step {r.get('step', -1)}, "
                f"{r.get('phase_age_s', 0):.1f}s, process {r.get('process', '?')}] "
                f"{sparkline(r.get('recent_periods_s', [])[-30:], top)} {r['reason']}"
            )
        )
    if hidden:
        lines.append(f"... {hidden} more healthy rank(s) not shown (--json lists every rank)")
    lines += [safe_line(line) for line in _superseded_lines(doc)]
    lines += [safe_line(f"next: {step}") for step in doc["next_steps"]]
    return lines


def _print_human(doc: dict[str, Any]) -> None:
    """A table on a wide terminal; plain lines (one per rank, broken between words to the width) otherwise."""
    width = columns()
    if stdout_is_terminal() and (width is None or width >= NARROW):
        from gpuguard.cli._app import console

        console().print(render(doc, width))
        return
    echo_lines(plain_lines(doc))


def diagnose_job(
    job_dir: str = job_dir_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the gpuguard.job/1 document."),
    config: Path | None = typer.Option(
        None, "--config", metavar="YAML", help="Vote thresholds YAML (default: built in)."
    ),
    window: int = typer.Option(20, "--window", min=1, metavar="N", help="Recent steps for the cohort comparison."),
    log: list[Path] = typer.Option(
        [],
        "--log",
        metavar="FILE",
        help="Training log(s): communication errors by "
        "rank ([rank3]: prefixes), and step times with --log-spec/--log-regex.",
    ),
    log_spec: Path | None = typer.Option(
        None,
        "--log-spec",
        metavar="YAML",
        help="YAML: step_log: {pattern: REGEX} with named groups step, step_s|step_ms|ts, rank.",
    ),
    log_regex: str | None = typer.Option(None, "--log-regex", metavar="REGEX", help="The same regex inline."),
    node_report: list[Path] = typer.Option(
        [],
        "--node-report",
        metavar="JSON",
        help="gpuguard.node/1 JSON from `gpu-doctor diagnose node --json` on a rank's host (GPU = LOCAL_RANK).",
    ),
    torchrun_log: list[Path] = typer.Option(
        [],
        "--torchrun-log",
        metavar="FILE",
        help="torchrun's own output: exit codes and signals of workers that are gone.",
    ),
    interval: float | None = typer.Option(
        None,
        "--interval",
        min=0.05,
        metavar="S",
        help="Seconds between your checks when a script runs this repeatedly: a hang is confirmed over "
        "(confirm_checks - 1) of them (default: check_interval_s of the thresholds).",
    ),
) -> int:
    """Dead, hung, slow or healthy: one verdict per rank, with its evidence and what to do next."""
    spec = _log_spec(log, log_spec, log_regex)
    from gpuguard.cli._progress import ProgressBar

    with ProgressBar() as bar:

        def read(done: int, total: int) -> None:
            if total >= PROGRESS_MIN_RANKS:  # 100,000 ranks take a while; 8 do not
                bar.update("reading step logs", done, total)

        job, doc, _ = assess(
            job_dir,
            config=config,
            window=window,
            logs=tuple(log),
            log_spec=spec,
            node_reports=tuple(node_report),
            launcher_logs=tuple(torchrun_log),
            interval_s=interval,
            on_progress=read,
        )
    if as_json:
        emit_json(doc)
    else:
        _print_human(doc)
    return job.exit_code


PROGRESS_MIN_RANKS = 2000  # step logs to read before a progress bar is worth drawing


def watch_job(
    job_dir: str = job_dir_option(),
    interval: float = typer.Option(1.0, "--interval", min=0.05, metavar="S", help="Seconds between checks."),
    as_json: bool = typer.Option(False, "--json", help="One gpuguard.job/1 document per check (JSON lines)."),
    config: Path | None = typer.Option(None, "--config", metavar="YAML", help="Vote thresholds YAML."),
    count: int = typer.Option(0, "--count", min=0, metavar="N", help="Stop after N checks (0: until Ctrl-C)."),
    torchrun_log: list[Path] = typer.Option(
        [],
        "--torchrun-log",
        metavar="FILE",
        help="torchrun's own output, re-read at every check: how workers that are gone ended (the one that "
        "failed first, the ones torchrun terminated).",
    ),
) -> int:
    """The same vote, live, until Ctrl-C (two-dimension deaths are confirmed across checks)."""
    import json as _json

    from gpuguard.doctor.job_diagnosis import watch

    code = EXIT_UNKNOWN
    live = None
    try:
        if stdout_is_terminal() and not as_json:
            from rich.live import Live

            from gpuguard.cli._app import console

            live = Live(console=console(), refresh_per_second=4, transient=False)
            live.start()
        for check in watch(job_dir, interval=interval, config=config, launcher_logs=tuple(torchrun_log), count=count):
            doc, code = check.document, check.verdict.exit_code
            if as_json:
                print(_json.dumps(doc, default=str), flush=True)
            elif live is not None:
                from rich.console import Group
                from rich.text import Text

                refreshed = Text(f"refreshed {time.strftime('%H:%M:%S')}, every {interval:g} s (Ctrl-C ends)")
                live.update(Group(render(doc, columns()), refreshed))
            else:
                echo(f"{time.strftime('%H:%M:%S')} {_watch_summary(doc)}")
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return code


def _watch_summary(doc: dict[str, Any]) -> str:
    """One line per check when piped: the verdict and the ranks that are not healthy, or finished."""
    if doc.get("finished"):  # the reason says so ("finished: all N ranks closed ...")
        return safe_line(doc["reason"])
    bad = ", ".join(f"{r['rank']}:{r['verdict']}" for r in doc["ranks"] if r["verdict"] != "healthy")
    return safe_line(f"{doc['verdict']} {bad or 'all healthy'}")


def plan_checkpoint(
    cost: float = typer.Option(..., "--cost", help="Seconds one checkpoint costs (write time)."),
    failures_per_hour: float | None = typer.Option(None, "--failures-per-hour", help="Job failure rate λ."),
    mtbf_hours: float | None = typer.Option(None, "--mtbf-hours", help="Per-GPU MTBF in hours (with --gpus)."),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs in the job (with --mtbf-hours)."),
    async_blocking: float | None = typer.Option(
        None, "--async-blocking", help="Async checkpointing: seconds of the cost that block training."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> int:
    """Young/Daly checkpoint interval Δt* ≈ √(2c/λ) and the overhead at the optimum."""
    from gpuguard.diagnostics.planners import checkpoint_plan, failure_rate_per_hour

    if failures_per_hour is not None and (mtbf_hours is not None or gpus is not None):
        from gpuguard.foundation.errors import UsageError

        raise UsageError("give either --failures-per-hour or --mtbf-hours with --gpus, not both")
    lam = failure_rate_per_hour(failures_per_hour, mtbf_hours, gpus)
    p = checkpoint_plan(cost, lam, async_blocking)
    if as_json:
        emit_json(p.to_json())
        return EXIT_OK
    mode = "sync" if p.background_s == 0 else f"async ({p.blocking_s:g} s blocking, {p.background_s:g} s background)"
    echo(f"checkpoint every {p.interval_s:.0f} s ({p.interval_s / 60:.1f} min)  [{mode}]")
    echo(f"  failure rate {p.failures_per_hour:.4g}/h (job MTBF {p.job_mtbf_hours * 60:.1f} min), cost {p.cost_s:g} s")
    echo(
        f"  expected overhead at the optimum: {p.overhead_fraction * 100:.1f} % "
        f"(checkpointing {p.checkpoint_overhead_fraction * 100:.1f} % + rework {p.rework_fraction * 100:.1f} %)"
    )
    echo(f"  Daly's refinement: {p.interval_daly_s:.0f} s")
    for note in p.notes:
        echo(f"  note: {note}")
    return EXIT_OK


def plan_layout(
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel size."),
    pp: int = typer.Option(..., "--pp", help="Pipeline-parallel size."),
    dp: int = typer.Option(..., "--dp", help="Data-parallel size."),
    failed_rank: int = typer.Option(..., "--failed-rank", help="The rank that failed."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Global batch size (samples)."),
    as_json: bool = typer.Option(False, "--json"),
) -> int:
    """Rank R's TP/PP/DP groups; hot spare vs shrink (TP/PP cannot shrink: a whole DP replica goes)."""
    from gpuguard.diagnostics.planners import layout_plan

    p = layout_plan(tp, pp, dp, failed_rank, global_batch)
    if as_json:
        emit_json(p.to_json())
        return EXIT_OK
    c = p.coords
    echo(f"{p.world} = {dp} (dp) × {pp} (pp) × {tp} (tp); {p.order}")
    echo(f"rank {failed_rank}: tp index {c['tp']}, pp stage {c['pp']}, dp replica {c['dp']}")
    echo(f"  TP group ({tp}): {_span(p.tp_group)}")
    echo(f"  PP group ({pp}): {_span(p.pp_group)}")
    echo(f"  DP group ({dp}): {_span(p.dp_group)}")
    echo(f"  DP replica ({len(p.replica)} ranks): {_span(p.replica)}")
    h, s = p.hot_spare, p.shrink
    echo(f"hot spare: 1 GPU restores {h['restores']}; state from {h['state_from']}; batch and LR unchanged")
    if s["possible"]:
        echo(
            f"shrink: lose the whole replica ({s['gpus_lost']} GPUs, {s['healthy_gpus_idled']} of them healthy): "
            f"world {p.world} → {s['world_after']}, dp {dp} → {s['dp_after']}, throughput {s['throughput_after']}"
        )
    else:
        echo("shrink: impossible (dp = 1: there is no other replica)")
    echo(f"  why: {s['why_not_tp_or_pp']}")
    batch = s["batch"]
    if isinstance(batch, dict):
        for k, v in batch.items():
            echo(f"  batch ({k.replace('_', ' ')}): {v}")
    else:
        echo(f"  batch: {batch}")
    for note in p.notes:
        echo(f"  note: {note}")
    return EXIT_OK


def plan_collective(
    ranks: int = typer.Option(..., "--ranks", help="Ranks in the collective (N)."),
    nbytes: str = typer.Option(..., "--bytes", help="Message size S (e.g. 1e9, 256MB, 4GiB)."),
    bandwidth: str = typer.Option(..., "--bandwidth", help="Per-link bandwidth (bytes/s: 100GB/s, 25e9, 200Gb/s)."),
    latency: float = typer.Option(5e-6, "--latency", help="Per-step latency α in seconds."),
    as_json: bool = typer.Option(False, "--json"),
) -> int:
    """All-reduce time: ring 2(N−1)/N · S/BW + 2(N−1)α vs tree 2·S/BW + 2⌈log2 N⌉α."""
    from gpuguard.diagnostics.planners import collective_plan, parse_quantity

    p = collective_plan(
        ranks, parse_quantity(nbytes, what="--bytes"), parse_quantity(bandwidth, what="--bandwidth"), latency
    )
    if as_json:
        emit_json(p.to_json())
        return EXIT_OK
    echo(f"all-reduce of {p.nbytes:.4g} B over {p.ranks} ranks at {p.bandwidth_bytes_s:.4g} B/s, α = {p.latency_s:g} s")
    echo(
        f"  ring: {p.ring_s * 1e3:.3f} ms (bandwidth {p.ring_bandwidth_term_s * 1e3:.3f} ms + "
        f"latency {p.ring_latency_term_s * 1e3:.3f} ms)"
    )
    echo(f"  tree: {p.tree_s * 1e3:.3f} ms")
    echo(f"  best: {p.best}; ring wins above {p.crossover_bytes:.4g} B")
    return EXIT_OK


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add this module's commands to the gpu-doctor app."""
    diagnose.command("job")(diagnose_job)
    watch.command("job")(watch_job)
    plan.command("checkpoint")(plan_checkpoint)
    plan.command("layout")(plan_layout)
    plan.command("collective")(plan_collective)


def _log_spec(logs: list[Path], spec_file: Path | None, regex: str | None) -> Any:
    from gpuguard.foundation.errors import UsageError

    if spec_file is not None and regex is not None:
        raise UsageError("give --log-spec or --log-regex, not both")
    if (spec_file is not None or regex is not None) and not logs:
        raise UsageError("--log-spec and --log-regex need --log")
    for p in logs:
        if not p.is_file():
            raise NoInputError(f"{p}: no such log file")
    if spec_file is None and regex is None:
        return None  # the logs only feed the communication-error dimension
    from gpuguard.collectors.log_steps import LogStepSpec

    return (
        LogStepSpec.from_yaml(spec_file)
        if spec_file is not None
        else LogStepSpec.compile(regex or "", where="--log-regex")
    )


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "")
    return ", ".join(map(str, ranks))
